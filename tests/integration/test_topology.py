"""Cluster shapes beyond one process per tier, each checked request by request against its own
reference (tools/prism_generate, the same model code in one process), with distinct pictures and
questions sent concurrently so that an answer delivered to the wrong request cannot pass:

- one worker per tier, 27 concurrent requests (9 distinct, half of them streamed);
- two workers per tier: every worker registered; the router spreads sequences over decode workers
  by their capacity;
- two routers sharing one set of workers (every worker connects to both): both serve at once;
- --chunked-prefill-size 16, far below the ~80-token prompts (image spans cross chunk boundaries);
- workers at capacity (2 slots each): requests queue in the router and still get their own answers.

Run: python3 tests/integration/test_topology.py [test names]   (PRISM_BINARY_DIR=build dir)
"""
import concurrent.futures
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from cluster import Cluster, chat_body, check_answer, distinct_requests, run_tests, wait_for  # noqa: E402

TMP = tempfile.mkdtemp(prefix="prism-topology-")
REQS = distinct_requests(TMP)


def burst(c, rounds=3, routers=1, stream_every=2, threads=27):
    """Sends every distinct request `rounds` times, shuffled, all at once, spread over the routers;
    every answer must equal its own reference."""
    jobs = [(i, k) for i in range(len(REQS)) for k in range(rounds)]
    random.Random(7).shuffle(jobs)

    def one(n):
        i, _ = jobs[n]
        body, ref = REQS[i]
        router = n % routers
        if n % stream_every == 0:
            status, events, done = c.stream("/v1/chat/completions", dict(body, stream=True,
                                                                           stream_options={"include_usage": True}),
                                            router=router)
            assert status == 200 and done, (status, events[-1:])
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
            usage = events[-1]["usage"]
            r = {"choices": [{"message": {"content": text}}], "usage": usage}
        else:
            status, r = c.post_json("/v1/chat/completions", body, router=router)
        check_answer(status, r, ref, "request %d (item %d, router %d)" % (n, i, router))

    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, range(len(jobs))))


def test_concurrent_distinct_requests():
    with Cluster() as c:
        c.wait_ready()
        burst(c)


def test_two_workers_per_tier():
    """Every answer right with two workers of each kind; and the router spreads by capacity: with
    room for 2 sequences per decode worker, 4 long requests held open run 2 and 2."""
    with Cluster(encoders=2, prefills=2, decodes=2, worker_args={"decode_worker": ["--max-running-requests", "2"]},
                 common_worker_args=["--heartbeat-interval", "0.1"]) as c:
        c.wait_ready()
        for tier in ("encoder", "prefill", "decode"):
            workers = {lb["worker"] for n, lb, v in c.metrics()
                       if n == "prism:worker_heartbeats_total" and lb["tier"] == tier}
            assert workers == {"%s-0" % tier, "%s-1" % tier}, (tier, workers)
        burst(c)
        held = [c.open_stream("/v1/chat/completions", chat_body("Hi", max_tokens=1800, temperature=0,
                                                                ignore_eos=True, stream=True)) for _ in range(4)]
        try:
            for s in held:
                while True:  # until it streams: it is running on a decode worker
                    ev = s.next_event()
                    assert isinstance(ev, dict) and "error" not in ev, ev
                    if ev["choices"] and ev["choices"][0]["delta"].get("content"):
                        break
            wait_for(lambda: all(c.metric("prism:worker_running", worker=w) == 2 for w in ("decode-0", "decode-1")),
                     10, "2 sequences running on each decode worker")
        finally:
            for s in held:
                s.close()


def test_two_routers_share_workers():
    with Cluster(routers=2) as c:
        c.wait_ready()
        for r in (0, 1):  # every worker registered with both routers
            for tier in ("encoder", "prefill", "decode"):
                assert c.metric("prism:worker_memory_planned_bytes", router=r, tier=tier), (r, tier)
        burst(c, routers=2)
        # each router answered its own share
        for r in (0, 1):
            ok = sum(c.metric("vllm:request_success_total", router=r, finished_reason=f) or 0
                     for f in ("stop", "length"))
            assert ok >= 10, (r, ok)


def test_chunked_prefill_below_prompt_length():
    with Cluster(worker_args={"prefill_worker": ["--chunked-prefill-size", "16"]}) as c:
        c.wait_ready()
        burst(c, rounds=2)


def test_router_queue_keeps_answers_apart():
    """Workers with room for 2 requests each: the rest wait in the router's queue and every one
    still gets its own answer."""
    two = ["--max-pending-requests", "2"]
    with Cluster(worker_args={"prefill_worker": two, "encoder_worker": ["--max-queued-images", "2",
                                                                        "--max-batch-images", "2"],
                              "decode_worker": ["--max-running-requests", "2"]}) as c:
        c.wait_ready()
        burst(c, rounds=2)


if __name__ == "__main__":
    sys.exit(run_tests([test_concurrent_distinct_requests, test_two_workers_per_tier, test_two_routers_share_workers,
                        test_chunked_prefill_below_prompt_length, test_router_queue_keeps_answers_apart]))
