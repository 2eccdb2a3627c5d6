#!/usr/bin/env python3
"""No request lost to a worker that dies before the request's first token (issue 9).

- A hung (SIGSTOP) encoder or prefill worker holding requests: once the router drops it (missed
  heartbeats), every request it held is sent to the other worker of its tier under a new id and
  answered exactly as an undisturbed run answers it; prism:requests_retried_total counts them.
- A tier left with no worker at all: requests wait in the router's queue for a restarted worker
  (bounded by --max-queue-wait; test_admission covers the bound) instead of failing at once.
"""
import os
import signal
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster, check_answer, chat_body, distinct_requests, reference, run_tests, wait_for  # noqa: E402

TMP = tempfile.mkdtemp(prefix="prism-retry-")
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


if __name__ == "__main__":
    run_tests([test_hung_encoder_requests_retried, test_hung_prefill_requests_retried,
               test_empty_tier_waits_for_restarted_worker])
