"""Memory isolation and admission control, end to end on CPU.

- a worker whose --mem-budget cannot hold its plan refuses to start, naming the numbers;
- an overload burst of large images gets only 200 / 429 / 503, no process dies, every worker
  stays within its budget, and the cluster serves normally right after;
- backpressure: a prefill worker with a one-image receive pool makes the encoder wait, and every
  request still completes;
- no heap allocation on the request path: each worker's allocation counter is flat while serving;
- decompression bombs are refused from their header, without decoding.
"""
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from cluster import Cluster, binary, chat_body, make_image, run_tests, MODEL  # noqa: E402

TMP = tempfile.mkdtemp(prefix="prism-limits-")
BIG = make_image(os.path.join(TMP, "big.jpg"), width=4096, height=4096, photo=True, quality=90, seed=5)
SMALL = make_image(os.path.join(TMP, "small.png"), width=200, height=120, shape="triangle", color="green")
BUDGET = 512 << 20


def metrics(c):
    status, _, data = c.request("GET", "/metrics")
    assert status == 200
    out = {}
    for line in data.decode().splitlines():
        m = re.match(r'(prism:worker_[a-z_]+)\{tier="(\w+)",worker="([^"]+)"\} (\S+)', line)
        if m:
            out[(m.group(1), m.group(3))] = float(m.group(4))
    return out


def test_budget_too_small_refuses_to_start():
    for kind in ("decode_worker", "prefill_worker", "encoder_worker"):
        p = subprocess.run([binary(kind), "--model-path", MODEL, "--router", "tcp://127.0.0.1:1", "--mem-budget", "8M"],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode != 0, (kind, p.returncode)
        assert "memory plan needs" in p.stderr or "cannot hold" in p.stderr, (kind, p.stderr[-800:])
        assert "8.00 MiB" in p.stderr, (kind, p.stderr[-800:])


def test_overload_burst_and_recovery():
    budget = ["--mem-budget", str(BUDGET)]
    with Cluster(router_args=["--max-running-requests", "48", "--max-image-bytes-in-flight", "64M",
                              "--max-body-bytes-in-flight", "256M"],
                 worker_args={"encoder_worker": budget, "prefill_worker": budget, "decode_worker": budget}) as c:
        c.wait_ready()
        body = chat_body("What is in the image?", [BIG], max_tokens=4, temperature=0)

        def one(_):
            s, _, _ = c.request("POST", "/v1/chat/completions", body, timeout=600)
            return s

        with concurrent.futures.ThreadPoolExecutor(200) as ex:
            statuses = list(ex.map(one, range(300)))
        counts = {s: statuses.count(s) for s in set(statuses)}
        print("burst statuses:", counts, flush=True)
        assert set(statuses) <= {200, 429, 503}, counts
        assert counts.get(200, 0) > 0, counts
        assert all(c.alive().values()), c.alive()
        m = metrics(c)
        for (name, worker), v in m.items():
            if name == "prism:worker_memory_peak_bytes":
                assert v <= BUDGET, (worker, v, BUDGET)
        for name, p in c.procs.items():  # resident memory too, not only our own heap
            with open("/proc/%d/status" % p.pid) as f:
                hwm = [int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:")][0]
            # the router holds at most 256 MiB of bodies + 64 MiB of images (+ its runtime)
            assert hwm <= (BUDGET if name != "router" else 768 << 20), (name, hwm)
        # serves normally right after
        for _ in range(3):
            s, r = c.post_json("/v1/chat/completions", chat_body("Describe the image.", [SMALL], max_tokens=4))
            assert s == 200, (s, r)
        status, _, data = c.request("GET", "/metrics")
        assert 'prism:requests_refused_total{reason="queue_full"}' in data.decode()


def test_backpressure_and_flat_allocations():
    pre = ["--embed-pool-images", "1", "--max-pending-requests", "64"]
    with Cluster(worker_args={"prefill_worker": pre}) as c:
        c.wait_ready()
        imgs = [make_image(os.path.join(TMP, "bp%d.jpg" % i), width=640 + 16 * i, height=480, shape="circle",
                           color="red", seed=i) for i in range(24)]

        def one(i):
            return c.post_json("/v1/chat/completions", chat_body("What is in the image?", [imgs[i % 24]], max_tokens=6))

        with concurrent.futures.ThreadPoolExecutor(24) as ex:
            res = list(ex.map(one, range(24)))  # warm-up and the backpressure case itself
        assert all(s == 200 for s, _ in res), [s for s, _ in res]
        time.sleep(1.5)  # one heartbeat
        before = metrics(c)
        with concurrent.futures.ThreadPoolExecutor(24) as ex:
            res = list(ex.map(one, range(24, 48)))
        assert all(s == 200 for s, _ in res), [s for s, _ in res]
        time.sleep(1.5)
        after = metrics(c)
        for (name, worker), v in after.items():
            if name == "prism:worker_heap_allocations_total":
                assert v == before[(name, worker)], ("heap allocations on the request path", worker,
                                                     before[(name, worker)], v)


def test_decode_admission_waits_for_kv():
    """16 KV blocks of 16 tokens: room for two requests at a time; the rest wait, none fails, and
    waiting does not change a single token."""
    ctx = ["--context-length", "256"]
    with Cluster(router_args=ctx, worker_args={"prefill_worker": ctx,
                                               "decode_worker": ctx + ["--kv-blocks", "16"]}) as c:
        c.wait_ready()
        body = chat_body("What is in the image?", [SMALL], max_tokens=8, temperature=0, ignore_eos=True)
        s, ref = c.post_json("/v1/chat/completions", body)
        assert s == 200, (s, ref)
        with concurrent.futures.ThreadPoolExecutor(12) as ex:
            res = list(ex.map(lambda _: c.post_json("/v1/chat/completions", body), range(12)))
        for s, r in res:
            assert s == 200, (s, r)
            assert r["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
        # more than the whole KV pool can hold is refused up front, not hung
        s, r = c.post_json("/v1/chat/completions", chat_body("hi", [SMALL], max_tokens=400))
        assert s == 400, (s, r)


def test_worker_failure_fails_requests_cleanly():
    """A decode worker killed mid-generation: its requests end with a clean error (never a hang), the
    router stays up, and a replacement worker that registers serves the next request."""
    with Cluster(router_args=["--worker-timeout", "1.5"]) as c:
        c.wait_ready()
        body = chat_body("What is in the image?", [SMALL], max_tokens=1500, temperature=0, ignore_eos=True)
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            fut = ex.submit(c.request, "POST", "/v1/chat/completions", body)
            time.sleep(0.5)
            dead = c.procs.pop("decode-0")
            dead.kill()
            dead.wait()
            t0 = time.time()
            status, _, data = fut.result(timeout=30)
        assert status == 503, (status, data[:300])
        assert "stopped responding" in json.loads(data)["error"]["message"]
        assert time.time() - t0 < 10
        assert c.procs["router"].poll() is None
        status, _, _ = c.request("GET", "/ready")
        assert status == 503  # no decode worker left
        c._start("decode-1", "decode_worker", ["--model-path", MODEL, "--router", c.ctl, "--worker-id", "decode-1"])
        c.wait_ready()
        s, r = c.post_json("/v1/chat/completions", chat_body("Describe the image.", [SMALL], max_tokens=4))
        assert s == 200, (s, r)


def test_router_queues_when_workers_are_full():
    """Workers with room for 2 requests each: 20 concurrent requests wait in the router's queue
    instead of being refused, and all complete."""
    two = ["--max-pending-requests", "2"]
    with Cluster(worker_args={"prefill_worker": two, "encoder_worker": ["--max-queued-images", "2",
                                                                        "--max-batch-images", "2"],
                              "decode_worker": ["--max-running-requests", "2"]}) as c:
        c.wait_ready()
        body = chat_body("What is in the image?", [SMALL], max_tokens=6, temperature=0)
        with concurrent.futures.ThreadPoolExecutor(20) as ex:
            res = list(ex.map(lambda _: c.post_json("/v1/chat/completions", body), range(20)))
        assert all(s == 200 for s, _ in res), [(s, r) for s, r in res if s != 200][:3]
        texts = {r["choices"][0]["message"]["content"] for _, r in res}
        assert len(texts) == 1, texts


if __name__ == "__main__":
    sys.exit(run_tests([test_budget_too_small_refuses_to_start, test_backpressure_and_flat_allocations,
                        test_decode_admission_waits_for_kv, test_worker_failure_fails_requests_cleanly,
                        test_router_queues_when_workers_are_full,
                        test_overload_burst_and_recovery]))
