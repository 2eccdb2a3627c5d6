#!/usr/bin/env python3
"""No request lost to a worker that dies before the request's first token (issue 9).

- A hung (SIGSTOP) encoder or prefill worker holding requests: once the router drops it (missed
  heartbeats), every request it held is sent to the other worker of its tier under a new id and
  answered exactly as an undisturbed run answers it; prism:requests_retried_total counts them.
- A stage that overruns --stage-timeout (a worker alive but making no progress) is retried on
  another worker, and answered 504 naming the stage when none is left.
- A worker that dies is dropped as soon as its connection closes, not after --worker-timeout.
- A tier left with no worker at all: requests wait in the router's queue for a restarted worker
  (bounded by --max-queue-wait; test_admission covers the bound) instead of failing at once.
- 100 streams hung up mid-generation free every pool on every tier: the router's requests, the
  decode worker's running set and KV blocks, the prefill worker's slots and receive pool.
- SIGTERM drains a router: no new connections, /ready-style refusals for keep-alive clients, the
  open stream ends complete, then the router exits 0.
"""
import socket
import os
import json
import signal
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import (Cluster, check_answer, chat_body, distinct_requests, make_image, reference, run_tests,  # noqa: E402
                     wait_for)

TMP = tempfile.mkdtemp(prefix="prism-faults-")
FAST_HB = ["--heartbeat-interval", "0.1"]
ROUTER = ["--worker-timeout", "2"]
_REQS = []


def requests():
    """Four image requests with distinct answers and their references (made once)."""
    if not _REQS:
        _REQS.extend(distinct_requests(TMP, max_tokens=8, text_only=())[:4])
    return _REQS


def post_all(c, bodies):
    """Posts every body at once; returns [(status, json)] in order."""
    out = [None] * len(bodies)

    def one(i):
        out[i] = c.post_json("/v1/chat/completions", bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a request never came back"
    return out


def hung_worker_requests_retried(tier):
    reqs = requests()
    with Cluster(encoders=2 if tier == "encoder" else 1, prefills=2 if tier == "prefill" else 1,
                 router_args=ROUTER, common_worker_args=FAST_HB) as c:
        c.wait_ready()
        before = c.metric("prism:requests_retried_total") or 0
        victim = c.procs[tier + "-0"]
        victim.send_signal(signal.SIGSTOP)  # alive to the kernel, silent to the router
        try:
            results = post_all(c, [body for body, _ in reqs])
        finally:
            c.kill(tier + "-0")
        for (status, r), (_, ref) in zip(results, reqs):
            check_answer(status, r, ref, "after the %s hung" % tier)
        # the router picks the least loaded worker: some requests were sent to the hung one
        assert (c.metric("prism:requests_retried_total") or 0) > before, "no request was retried"
        assert "retried as" in c.log("router", tail=0)


def test_hung_encoder_requests_retried():
    hung_worker_requests_retried("encoder")


def test_hung_prefill_requests_retried():
    hung_worker_requests_retried("prefill")


def test_stage_timeout_retries_then_504():
    """An encoder that is alive to the router (its silence shorter than --worker-timeout) but makes no
    progress: after --stage-timeout the request goes to the other encoder; with no other, 504."""
    (body, ref), = requests()[:1]
    for encoders, retries in ((2, 2), (1, 0)):
        with Cluster(encoders=encoders, router_args=["--worker-timeout", "120", "--stage-timeout", "1",
                                                     "--max-retries", str(retries)], common_worker_args=FAST_HB) as c:
            c.wait_ready()
            c.procs["encoder-0"].send_signal(signal.SIGSTOP)
            try:
                # two at once: the least-loaded pick sends one of them to the stopped encoder
                results = post_all(c, [body, body] if encoders == 2 else [body])
            finally:
                c.kill("encoder-0")
            assert (c.metric("prism:request_stage_timeouts_total") or 0) >= 1
            if encoders == 2:
                for status, r in results:
                    check_answer(status, r, ref, "after the stage timeout")
            else:
                status, r = results[0]
                assert status == 504 and "encode stage" in r["error"]["message"], (status, r)


def test_killed_worker_noticed_at_once():
    """A worker that dies closes its connection: the router drops it at once (not after
    --worker-timeout, 120 s here), /ready says so, and its requests go elsewhere."""
    reqs = requests()
    with Cluster(encoders=2, router_args=["--worker-timeout", "120"], common_worker_args=FAST_HB) as c:
        c.wait_ready()
        t0 = time.time()
        c.kill("encoder-0")
        wait_for(lambda: c.request("GET", "/ready")[1] is not None and
                 json.loads(c.request("GET", "/ready")[2])["encoders"] == 1, 10, "the router to drop encoder-0")
        assert time.time() - t0 < 10
        assert c.metric("prism:workers_disconnected_total") == 1
        for (status, r), (_, ref) in zip(post_all(c, [b for b, _ in reqs]), reqs):
            check_answer(status, r, ref, "after encoder-0 died")
        c.kill("decode-0")
        wait_for(lambda: c.request("GET", "/ready")[0] == 503, 10, "/ready 503 with no decode worker")
        assert c.metric("prism:workers_disconnected_total") == 2


def test_empty_tier_waits_for_restarted_worker():
    body, ref = chat_body("Hello there", max_tokens=8, temperature=0), reference([], "Hello there", 8)
    with Cluster(router_args=ROUTER, common_worker_args=FAST_HB) as c:
        c.wait_ready()
        c.kill("decode-0")
        wait_for(lambda: c.request("GET", "/ready")[0] == 503, 60, "the router to drop the dead decode worker")
        res = {}
        t = threading.Thread(target=lambda: res.update(r=c.post_json("/v1/chat/completions", body)))
        t.start()
        wait_for(lambda: c.metric("prism:router_requests_in_flight") == 1, 60, "the request held by the router")
        assert t.is_alive(), ("answered while no decode worker exists", res)
        c.start_worker("decode-0", "decode_worker")
        t.join(300)
        assert not t.is_alive(), "the waiting request was never served"
        check_answer(*res["r"], ref, "after the decode worker came back")


def pool_state(c):
    """What every tier holds, as the router's /metrics reports it (from the workers' heartbeats)."""
    return {"router_requests": c.metric("prism:router_requests_in_flight"),
            "decode_running": c.metric("prism:worker_running", tier="decode"),
            "decode_waiting": c.metric("prism:worker_waiting", tier="decode"),
            "decode_kv_free": c.metric("prism:worker_kv_free_blocks", tier="decode"),
            "prefill_running": c.metric("prism:worker_running", tier="prefill"),
            "prefill_waiting": c.metric("prism:worker_waiting", tier="prefill"),
            "prefill_pool_free": c.metric("prism:worker_pool_free", tier="prefill"),
            "encoder_running": c.metric("prism:worker_running", tier="encoder"),
            "encoder_waiting": c.metric("prism:worker_waiting", tier="encoder")}


def test_hundred_hung_up_streams_free_every_pool():
    n = 100
    jpg = make_image(os.path.join(TMP, "cancel.jpg"), width=320, height=240, shape="circle", color="red")
    with Cluster(common_worker_args=FAST_HB, router_args=["--max-running-requests", "256"]) as c:
        c.wait_ready()
        beats = c.metric("prism:worker_heartbeats_total", tier="decode")
        wait_for(lambda: c.metric("prism:worker_heartbeats_total", tier="decode") > beats + 1, 30, "fresh heartbeats")
        idle = pool_state(c)
        assert idle["router_requests"] == 0 and idle["decode_running"] == 0, idle
        socks = []
        for i in range(n):  # every other request carries an image: encode jobs and embedding slots too
            body = json.dumps(chat_body("Tell me a long story %d" % i, [jpg] if i % 2 else [], max_tokens=1500,
                                        temperature=0, ignore_eos=True, stream=True)).encode()
            s = socket.create_connection(("127.0.0.1", c.port), timeout=30)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            socks.append(s)
        # all held, every tier busy
        wait_for(lambda: c.metric("prism:router_requests_in_flight") == n, 120, "all requests held by the router")
        # (the decode worker reserves each request's KV for its whole max_tokens: about 10 fit; the
        # rest wait on the prefill worker, holding its slots and embedding pool)
        wait_for(lambda: (c.metric("prism:worker_running", tier="decode") or 0) >= 8 and
                 (c.metric("prism:worker_running", tier="prefill") or 0) >= 10, 120, "every tier busy")
        busy = pool_state(c)
        assert busy["decode_kv_free"] < idle["decode_kv_free"], (busy, idle)
        for s in socks:  # the clients hang up mid-stream
            s.close()
        wait_for(lambda: c.metric("prism:router_requests_in_flight") == 0, 60, "the router to forget every request")
        beats = c.metric("prism:worker_heartbeats_total")
        wait_for(lambda: pool_state(c) == idle and c.metric("prism:worker_heartbeats_total") > beats + 3, 60,
                 "every pool back to its idle value (idle %s, now %s)" % (idle, pool_state(c)))
        # and the cluster still serves
        status, r = c.post_json("/v1/chat/completions", chat_body("Hi", max_tokens=4))
        assert status == 200, (status, r)


def connect_refused(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return False
    except ConnectionRefusedError:
        return True


def test_router_sigterm_drains_open_stream():
    n = 200
    with Cluster(router_args=["--drain-timeout", "120"]) as c:
        c.wait_ready()
        s = c.open_stream("/v1/chat/completions", chat_body("Hi", max_tokens=n, temperature=0, ignore_eos=True,
                                                              stream=True, stream_options={"include_usage": True}))
        events = []
        while not any(isinstance(e, dict) and e.get("choices") and e["choices"][0]["delta"].get("content")
                      for e in events):
            events.append(s.next_event())
        router = c.procs["router"]
        router.send_signal(signal.SIGTERM)
        wait_for(lambda: connect_refused(c.port), 30, "the router to stop accepting connections")
        assert router.poll() is None, "the router exited with a stream open"
        while True:
            ev = s.next_event()
            if ev is None:
                break
            events.append(ev)
        assert events[-1] == "[DONE]", events[-3:]
        usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
        assert usage and usage[-1]["completion_tokens"] == n, usage
        finish = [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict) and e.get("choices")]
        assert finish[-1] == "length", finish[-3:]
        assert router.wait(60) == 0, "the router did not exit cleanly after draining"
        assert "drained: every request finished" in c.log("router", tail=0)


if __name__ == "__main__":
    run_tests([test_hung_encoder_requests_retried, test_hung_prefill_requests_retried,
               test_stage_timeout_retries_then_504, test_killed_worker_noticed_at_once, test_empty_tier_waits_for_restarted_worker, test_hundred_hung_up_streams_free_every_pool,
               test_router_sigterm_drains_open_stream])
