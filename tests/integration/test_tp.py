"""Tensor-parallel decode groups over HTTP on the bundled model (8 query heads, 4 KV heads), on CPU:

- a decode group of T = 2 ranks (2 KV heads each) and of T = 8 ranks (4 KV heads on 8 ranks: each
  head replicated on two ranks) answers distinct requests, streamed and not, with exactly the tokens
  of the T = 1 reference (tools/prism_generate), and the logprobs (chosen and top 3) of a T = 1
  cluster within 1e-4;
- SIGKILL of one non-leader rank while a request streams: the request ends promptly with an error
  (no hang), the leader and the other ranks exit, the router drops the group; a new group started
  under the same id forms and serves again; a killed leader takes its ranks down too;
- batched prefill in a prefill group: plans of several prompts at once, answers as T = 1;
- aborts in groups (only the leader hears of them; the shards never drop anything between layers):
  a prefill group stops a long prompt whose client left between two chunks and frees its blocks; a
  decode group with --overlap-steps on answers exactly, and a stream left by its client frees its
  sequence while the next step is already under way; every rank stays in the group;
- deploy/launch.sh --decode-tp 4 --prefill-tp 2: the groups run under the supervisor, answers equal
  T = 1; a rank SIGKILLed brings the whole group down and back (every member under a new pid), it
  registers again and serves the same answer; Ctrl-C leaves no process.

Run: python3 tests/integration/test_tp.py [test names]   (PRISM_BINARY_DIR=build dir)
"""
import concurrent.futures
import http.client
import json
import os
import re
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from cluster import (Cluster, assert_abort_stopped_decode, check_answer, chat_body, distinct_requests,  # noqa: E402
                     free_port, free_port_range, fresh_heartbeats, run_tests, wait_for, work_counters)

TMP = tempfile.mkdtemp(prefix="prism-tp-")
_ALL = distinct_requests(TMP, max_tokens=12)
REQS = _ALL[:3] + _ALL[-1:]   # two pictures and a text-only prompt are enough to tell answers apart


LP_BODY = dict(REQS[0][0], max_tokens=8, logprobs=True, top_logprobs=3, ignore_eos=True)
_lp_ref = []


def logprobs_of(c):
    status, r = c.post_json("/v1/chat/completions", LP_BODY)
    assert status == 200, (status, r)
    return [(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
            for e in r["choices"][0]["logprobs"]["content"]]


def logprobs_t1():
    """The logprobs of LP_BODY from a cluster of T = 1 (taken once)."""
    if not _lp_ref:
        with Cluster() as c:
            c.wait_ready(timeout=300)
            _lp_ref.append(logprobs_of(c))
    return _lp_ref[0]


def check_logprobs(c, where):
    """Same tokens and top-3 alternatives as T = 1, every logprob within 1e-4."""
    ref, got = logprobs_t1(), logprobs_of(c)
    assert len(got) == len(ref) == 8, (where, len(got), len(ref))
    for (tok, lp, top), (rtok, rlp, rtop) in zip(got, ref):
        assert tok == rtok and [t for t, _ in top] == [t for t, _ in rtop], (where, got, ref)
        assert abs(lp - rlp) < 1e-4 and all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(top, rtop)), (where, got, ref)


def start_group(c, name, size, kind="decode_worker", extra=()):
    """Starts group `name` of `size` ranks: the leader as a worker of cluster c, the other ranks
    with the same model and keys and no router (every rank gets the extra flags)."""
    leader = "tcp://127.0.0.1:%d" % free_port()
    tp = ["--tp-size", str(size), "--tp-leader", leader, *extra]
    c.start_worker(name, kind, extra=tp + ["--tp-rank", "0"])
    for r in range(1, size):
        c._start("%s.r%d" % (name, r), kind,
                 ["--model-path", c.model, "--worker-id", "%s.r%d" % (name, r), *c.sec, *tp, "--tp-rank", str(r)])
    c.expected[kind.split("_")[0] + "s"] = 1


def answer(c, body, ref, stream, where):
    if stream:
        status, events, done = c.stream("/v1/chat/completions", dict(body, stream=True,
                                                                       stream_options={"include_usage": True}))
        assert status == 200 and done, (where, status, events[-1:])
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        r = {"choices": [{"message": {"content": text}}], "usage": events[-1]["usage"]}
    else:
        status, r = c.post_json("/v1/chat/completions", body)
    check_answer(status, r, ref, where)


def check_group_equals_t1(size, prefill_size=1):
    traced = size <= 2 and prefill_size <= 2   # debug lines: the trace test below (small groups only)
    debug = ("--log-level", "debug") if traced else ()
    with Cluster(decodes=0, prefills=0 if prefill_size > 1 else 1) as c:
        start_group(c, "decode-0", size, extra=debug)
        if prefill_size > 1:
            start_group(c, "prefill-0", prefill_size, "prefill_worker", extra=debug)
        c.wait_ready(timeout=300)
        for name, n in (("decode-0", size), ("prefill-0", prefill_size)):
            if n > 1:
                log = c.wait_log(name, "group capacity", timeout=60)
                assert "rank 0 of %d" % n in log, log[-2000:]
        check_logprobs(c, "P=%d T=%d" % (prefill_size, size))
        # again: the prefill (group) reads the prompt's full blocks from its prefix cache
        check_logprobs(c, "P=%d T=%d, prefix cached" % (prefill_size, size))
        wait_for(lambda: (c.metric("vllm:prefix_cache_hits_total") or 0) > 0, 10, "a prefix-cache hit")
        # n = 2 (greedy): the choices share the prompt's KV blocks, scattered to the ranks once
        body, ref = REQS[0]
        status, r = c.post_json("/v1/chat/completions", dict(body, n=2))
        assert status == 200 and len(r["choices"]) == 2, (status, r)
        for ch in r["choices"]:
            assert ch["message"]["content"] == ref["text"], ("n=2 T=%d" % size, ch, ref["text"])
        assert r["usage"]["completion_tokens"] == 2 * len(ref["token_ids"]), r["usage"]
        jobs = [(i, s) for i in range(len(REQS)) for s in (False, True)]
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda j: answer(c, REQS[j[0]][0], REQS[j[0]][1], j[1],
                                         "P=%d T=%d item %d stream %s" % (prefill_size, size, j[0], j[1])), jobs))
        for r in range(1, size):
            assert c.procs["decode-0.r%d" % r].poll() is None, c.log("decode-0.r%d" % r)
        forwards = 0
        if prefill_size > 1:   # the leader's forwards: batched prefill packs prompts, so fewer than prompts
            fresh_heartbeats(c, "prefill-0")
            forwards = c.metric("prism:worker_prefill_forwards_total", worker="prefill-0")
            assert forwards >= 1, forwards
        if traced:   # a request's trace id reaches each group's leader (issue 32), on its lines about it
            trace = "%032x" % int.from_bytes(os.urandom(16), "big")
            status, _, _ = c.request("POST", "/v1/chat/completions", REQS[0][0],
                                     headers={"traceparent": "00-%s-00f067aa0ba902b7-01" % trace})
            assert status == 200, status
            for name in ("decode-0", "prefill-0") if prefill_size > 1 else ("decode-0",):
                wait_for(lambda: "trace=%s" % trace in c.log(name, tail=0), 10, "the trace in %s's log" % name)
    # every rank ran the steps with the leader (12 tokens: 11 decode steps per request at least). The
    # cluster stops every process at once, so a rank may see the leader's link close before its own
    # SIGTERM: "the group failed" is a clean end too, once the requests are done.
    left = r"leaves the group after (\d+) steps \((?:stopped|the group failed)\)"
    for r in range(1, size):
        log = c.log("decode-0.r%d" % r)
        m = re.search(left, log)
        assert m and int(m.group(1)) >= 11, log[-2000:]
    for r in range(1, prefill_size):   # every forward the leader ran (a forward may carry several prompts)
        log = c.log("prefill-0.r%d" % r)
        m = re.search(left, log)
        assert m and int(m.group(1)) >= forwards, (forwards, log[-2000:])


def test_tp2_equals_tp1():
    check_group_equals_t1(2)


def test_tp8_kv_heads_replicated():
    """4 KV heads on 8 ranks: the GQA layout where sglang and vLLM corrupted outputs."""
    check_group_equals_t1(8)


def test_prefill_tp2_decode_tp1():
    """Prefill group of 2 (its leader gathers the ranks' KV heads) into a whole-model decode."""
    check_group_equals_t1(1, prefill_size=2)


def test_prefill_tp2_decode_tp4():
    """KV heads split 2 ways at prefill, 4 ways at decode (P != T)."""
    check_group_equals_t1(4, prefill_size=2)


def test_bf16_transfer_between_groups():
    """KV on the wire in bf16 (issue 33, --kv-transfer-dtype bf16 on the prefill) between a prefill
    group of 2 (its leader narrows the heads it gathered) and a decode group of 2 (its leader widens
    each piece, then scatters fp32 heads): the logprobs of the same bf16 transfer between workers of
    T = 1, within 1e-4 (as every group equals T = 1)."""
    bf16 = ["--kv-transfer-dtype", "bf16"]
    with Cluster(worker_args={"prefill_worker": bf16}) as c:
        c.wait_ready(timeout=300)
        ref = logprobs_of(c)
    with Cluster(decodes=0, prefills=0) as c:
        start_group(c, "decode-0", 2)
        start_group(c, "prefill-0", 2, "prefill_worker", extra=bf16)
        c.wait_ready(timeout=300)
        got = logprobs_of(c)
        assert "KV transfers go out in bf16" in c.log("prefill-0", tail=0)
        fresh_heartbeats(c, "prefill-0")
        sent = c.metric("prism:worker_kv_sent_bytes_total", worker="prefill-0")
    assert len(got) == len(ref) == 8, (got, ref)
    for (tok, lp, top), (rtok, rlp, rtop) in zip(got, ref):
        assert tok == rtok and [t for t, _ in top] == [t for t, _ in rtop], (got, ref)
        assert abs(lp - rlp) < 1e-4 and all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(top, rtop)), (got, ref)
    assert sent and sent % (65536 // 2) == 0, sent   # whole bf16 blocks of the bundled model


def test_prefill_group_batches():
    """Batched prefill in a group of P = 2: the leader sends its ranks plans of several prompts
    (their chunks side by side, a block table each). The leader pauses between forwards (test hook
    PRISM_TEST_PREFILL_FORWARD_GAP_S, the leader's clock: the ranks follow its plans) so that the
    requests sent at once meet in a forward; every answer is the T = 1 reference and forwards
    carried several prompts."""
    with Cluster(decodes=1, prefills=0, common_worker_args=["--heartbeat-interval", "0.1"],
                 worker_env={"prefill_worker": {"PRISM_TEST_PREFILL_FORWARD_GAP_S": "0.3"}}) as c:
        start_group(c, "prefill-0", 2, "prefill_worker")
        c.wait_ready(timeout=300)
        jobs = [(i, s) for i in range(len(REQS)) for s in (False, True)]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
            list(ex.map(lambda j: answer(c, REQS[j[0]][0], REQS[j[0]][1], j[1], "P=2 batched item %d stream %s" % j),
                        jobs))
        wait_for(lambda: (c.metric("prism:worker_prefill_forward_prompts_total", worker="prefill-0") or 0) >
                 (c.metric("prism:worker_prefill_forwards_total", worker="prefill-0") or 0), 10,
                 "a forward of the group carrying two prompts")
        assert c.procs["prefill-0.r1"].poll() is None, c.log("prefill-0.r1")


def test_rank_killed_fails_cleanly_and_group_reforms():
    # without migration (test_faults.py covers it; here the streams would wait for the group to re-form)
    with Cluster(decodes=0, router_args=["--worker-timeout", "2", "--max-migrations", "0"],
                 common_worker_args=["--heartbeat-interval", "0.2"]) as c:
        start_group(c, "decode-0", 2)
        c.wait_ready(timeout=300)
        body, ref = REQS[-1]
        answer(c, body, ref, False, "before the kill")
        # under load: four long streams decoding together when a rank dies
        long_body = chat_body("Tell me a long story", max_tokens=1500, temperature=0, ignore_eos=True)
        streams = [c.open_stream("/v1/chat/completions", dict(long_body, stream=True)) for _ in range(4)]
        for s in streams:
            first = s.next_event()
            assert first is not None and first != "[DONE]", first
        t0 = time.time()
        c.kill("decode-0.r1")
        for s in streams:
            events = []
            while True:
                e = s.next_event()
                if e is None or e == "[DONE]":
                    break
                events.append(e)
            s.close()
            assert any("error" in e for e in events if isinstance(e, dict)), events[-3:]
        took = time.time() - t0
        assert took < 30, "the streams took %.1fs to end after the rank died" % took
        # the leader exits (the supervisor restarts groups whole); the router drops it
        wait_for(lambda: c.procs["decode-0"].poll() is not None, 30, "the leader to exit")
        assert c.procs["decode-0"].returncode == 75, c.procs["decode-0"].returncode   # PRISM_EXIT_PEER_LOST
        assert "lost a rank" in c.log("decode-0") or "rank is gone" in c.log("decode-0"), c.log("decode-0")
        wait_for(lambda: json.loads(c.request("GET", "/ready")[2]).get("decodes", 0) == 0, 30,
                 "the router to drop the group")
        # a restarted group forms and serves
        c.procs.pop("decode-0")
        start_group(c, "decode-0", 2)
        c.wait_ready(timeout=300)
        answer(c, body, ref, True, "after the group re-formed")
        # the leader killed: its ranks see the link go and exit (no rank is left waiting)
        c.kill("decode-0")
        wait_for(lambda: c.procs["decode-0.r1"].poll() is not None, 30, "rank 1 to exit after its leader died")
        assert c.procs["decode-0.r1"].returncode == 75, c.log("decode-0.r1")


def test_prefill_rank_killed():
    """A prefill group's rank dies: its leader exits 75 at once (it holds requests only briefly; the
    liveness check finds the dead rank while idle), the router drops it, and the answer a client gets
    meanwhile is a clean 503 or 500, never a hang."""
    with Cluster(prefills=0, router_args=["--worker-timeout", "2", "--max-queue-wait", "5"],
                 common_worker_args=["--heartbeat-interval", "0.2"]) as c:
        start_group(c, "prefill-0", 2, "prefill_worker")
        c.wait_ready(timeout=300)
        body, ref = REQS[-1]
        answer(c, body, ref, False, "prefill group before the kill")
        c.kill("prefill-0.r1")
        wait_for(lambda: c.procs["prefill-0"].poll() is not None, 30, "the prefill leader to exit")
        assert c.procs["prefill-0"].returncode == 75, c.log("prefill-0")
        status, r = c.post_json("/v1/chat/completions", body, timeout=60)
        assert status in (500, 503), (status, r)


def worker_gauge(c, name, tier, worker):
    return c.metric(name, tier=tier, worker=worker)


def test_aborts_and_overlap_in_groups():
    with Cluster(decodes=0, prefills=0, common_worker_args=["--heartbeat-interval", "0.2"]) as c:
        start_group(c, "decode-0", 2, extra=["--overlap-steps", "on"])
        start_group(c, "prefill-0", 2, "prefill_worker", extra=["--chunked-prefill-size", "1"])
        c.wait_ready(timeout=300)
        wait_for(lambda: worker_gauge(c, "prism:worker_kv_free_blocks", "prefill", "prefill-0"), 30,
                 "the prefill group's first heartbeat")
        pkv0 = worker_gauge(c, "prism:worker_kv_free_blocks", "prefill", "prefill-0")
        dkv0 = worker_gauge(c, "prism:worker_kv_free_blocks", "decode", "decode-0")
        # overlapped decode steps in a group: exact
        jobs = [(i, s) for i in range(len(REQS)) for s in (False, True)]
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda j: answer(c, REQS[j[0]][0], REQS[j[0]][1], j[1], "overlap item %d stream %s" % j),
                        jobs))

        # a long prompt (1800 one-token chunks) whose client leaves while the group runs it
        p0 = c.metric("prism:worker_progress_total", worker="prefill-0") or 0
        pa0 = c.metric("prism:worker_prompts_aborted_total", worker="prefill-0") or 0
        conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                     body=json.dumps(chat_body("tell me " * 900, max_tokens=4)).encode())
        wait_for(lambda: (c.metric("prism:worker_progress_total", worker="prefill-0") or 0) > p0 + 8, 60,
                 "the prefill group to start on the long prompt")
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        log = c.wait_log("prefill-0", "between chunks", timeout=60)
        m = re.search(r"after (\d+) of (\d+) prompt tokens \(tensor-parallel group: between chunks\)", log)
        assert m and 0 < int(m.group(1)) < int(m.group(2)), log[-2000:]
        print("  prefill group: the prompt stopped after %s of %s tokens" % m.groups(), flush=True)
        # ... and left it (counted), not only said so
        wait_for(lambda: (c.metric("prism:worker_prompts_aborted_total", worker="prefill-0") or 0) == pa0 + 1, 30,
                 "the prefill group to count the prompt it left")
        wait_for(lambda: worker_gauge(c, "prism:worker_kv_free_blocks", "prefill", "prefill-0") == pkv0, 30,
                 "the prefill group to free the aborted prompt's blocks")

        # a stream left while the next step is already begun: the sequence leaves, the KV comes back
        long_body = chat_body("Tell me a long story", max_tokens=1500, temperature=0, ignore_eos=True)
        s = c.open_stream("/v1/chat/completions", dict(long_body, stream=True))
        for _ in range(5):
            e = s.next_event()
            assert e is not None and e != "[DONE]", e
        before = work_counters(c)
        s.close()
        wait_for(lambda: worker_gauge(c, "prism:worker_running", "decode", "decode-0") == 0 and
                 worker_gauge(c, "prism:worker_kv_free_blocks", "decode", "decode-0") == dkv0, 30,
                 "the decode group to free the aborted sequence")
        assert_abort_stopped_decode(c, before, 1500, timeout=30)
        body, ref = REQS[0]
        answer(c, body, ref, True, "after the aborts")
        for n in ("decode-0.r1", "prefill-0.r1"):
            assert c.procs[n].poll() is None, c.log(n)
    # the ranks left with the leader's stop, not because the group broke
    for n in ("decode-0.r1", "prefill-0.r1"):
        assert re.search(r"leaves the group after \d+ steps \(stopped\)", c.log(n)), c.log(n)[-2000:]


def test_preemption_in_a_group():
    """A decode group of 2 with overlapped steps and 12 KV blocks (a 128-token context): four answers
    without max_tokens (greedy and seeded) outgrow the pool, sequences are preempted (dropped from the
    next plan, prefilled again from their tokens), and each answer is token for token its answer
    alone; every block comes back. The group is given a swap region, which it does not use (its ranks
    hold the other KV heads): every preemption is a recompute. An n = 2 seeded request runs beside
    them (each choice at most 6 blocks: admitted to grow): its choices can be neither swapped here nor
    recomputed, so the others are preempted around it (a choice with no victim waits for a block),
    and each choice answers as alone."""
    ctx = ["--context-length", "128"]
    with Cluster(decodes=0, router_args=ctx, worker_args={"prefill_worker": ctx},
                 common_worker_args=["--heartbeat-interval", "0.1"]) as c:
        start_group(c, "decode-0", 2, extra=["--overlap-steps", "on", "--kv-blocks", "12", "--kv-swap-bytes", "4M"] + ctx)
        c.wait_ready(timeout=300)
        bodies = [chat_body("Tell me a long story about %s" % w, temperature=t, seed=4, ignore_eos=True)
                  for w, t in (("cats", 0), ("ships", 0.8), ("rain", 0), ("bread", 1.0))]
        alone = [c.post_json("/v1/chat/completions", b)[1]["choices"][0]["message"]["content"] for b in bodies]
        two = chat_body("Tell me a long story about owls", n=2, temperature=0.9, seed=6, ignore_eos=True, priority=1)
        prompt = c.post_json("/v1/chat/completions", dict(two, max_tokens=1))[1]["usage"]["prompt_tokens"]
        two["max_tokens"] = 6 * 16 - prompt - 1

        def texts(r):
            return [ch["message"]["content"] for ch in sorted(r["choices"], key=lambda ch: ch["index"])]
        s, r = c.post_json("/v1/chat/completions", two)
        assert s == 200, (s, r)
        two_alone = texts(r)
        with concurrent.futures.ThreadPoolExecutor(len(bodies) + 1) as ex:
            late = ex.submit(c.post_json, "/v1/chat/completions", two)
            time.sleep(0.05)
            res = list(ex.map(lambda b: c.post_json("/v1/chat/completions", b), bodies))
            s, r = late.result()
        assert s == 200, (s, r)
        assert texts(r) == two_alone, "an n = 2 answer changed by preemption"
        assert [r["choices"][0]["message"]["content"] for _, r in res] == alone, "answers changed by preemption"
        assert c.metric("vllm:num_preemptions_total") > 0, "the pool never ran out: nothing was preempted"
        assert c.metric("prism:preemptions_total", how="swap") == 0, "a tensor-parallel group swapped"
        wait_for(lambda: worker_gauge(c, "prism:worker_kv_free_blocks", "decode", "decode-0") == 12, 30,
                 "the decode group to free every block")
        assert c.procs["decode-0.r1"].poll() is None, c.log("decode-0.r1")


def test_launcher_decode_tp4_prefill_tp2():
    from launched import Launched
    body, ref = REQS[0]
    c = Launched(args=["--decode-tp", "4", "--prefill-tp", "2", "--tp-port", str(free_port_range(2)), "--lb", "none"])
    try:
        try:
            c.wait_ready(timeout=300)
        except Exception:
            for n in ("decode-1", "prefill-1", "decode-1.r1"):
                print("---- %s ----\n%s" % (n, c.log(n)[-3000:]))
            raise
        group = ["decode-1"] + ["decode-1.r%d" % r for r in (1, 2, 3)]
        assert c.pid("prefill-1.r1"), c.launcher_output()[-3000:]
        answer(c, body, ref, False, "launch.sh --decode-tp 4 --prefill-tp 2")
        before = {n: c.pid(n) for n in group}
        assert all(before.values()), before
        regs = c.registrations("decode-1")
        os.kill(before["decode-1.r2"], 9)
        for n in group:
            c.wait_restarted(n, before[n], timeout=60)
        wait_for(lambda: c.registrations("decode-1") > regs, 120, "the re-formed group to register again")
        answer(c, body, ref, True, "launch.sh --decode-tp 4 after a rank was killed")
        assert "status 75" in c.launcher_output(), c.launcher_output()[-3000:]
    finally:
        rc = c.stop()
        left = c.leftovers()
        c.__exit__(None, None, None)
    assert rc == 0, c.launcher_output()[-3000:]
    assert not left, left


if __name__ == "__main__":
    sys.exit(run_tests([test_tp2_equals_tp1, test_tp8_kv_heads_replicated, test_prefill_tp2_decode_tp1,
                        test_prefill_tp2_decode_tp4, test_bf16_transfer_between_groups, test_prefill_group_batches,
                        test_rank_killed_fails_cleanly_and_group_reforms, test_prefill_rank_killed,
                        test_aborts_and_overlap_in_groups, test_preemption_in_a_group,
                        test_launcher_decode_tp4_prefill_tp2]))
