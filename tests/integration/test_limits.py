"""Memory isolation and admission control, end to end on CPU.

- a worker whose --mem-budget cannot hold its plan refuses to start, naming the numbers;
- an overload burst of large images gets only 200 / 429 / 503 (and some refusals do happen; no
  connection is reset: bodies beyond the router's budget wait, their reading paused), every
  refusal is counted under its reason in /metrics, no process dies, every worker stays within its
  budget, and the cluster serves normally right after;
- backpressure: a prefill worker with a one-image receive pool makes the encoder wait, and every
  request still completes;
- no heap allocation on the request path: each worker's allocation counter is flat while serving;
- decompression bombs are refused from their header, without decoding;
- the router's memory is one budget: a burst of uploads under a small --mem-budget keeps its peak
  resident set within it, and a budget that cannot hold its plan (or its explicit flags) refuses
  to start, naming the numbers.
"""
import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from cluster import Cluster, binary, chat_body, make_image, run_tests, sanitized, wait_for, MODEL  # noqa: E402

TMP = tempfile.mkdtemp(prefix="prism-limits-")
BIG = make_image(os.path.join(TMP, "big.jpg"), width=4096, height=4096, photo=True, quality=90, seed=5)
SMALL = make_image(os.path.join(TMP, "small.png"), width=200, height=120, shape="triangle", color="green")
BUDGET = 512 << 20
PLAN_HEAP_MARGIN = 256 << 10   # what start-up may hold beyond the regions for a moment (a file read, a log line)


def metrics(c):
    status, _, data = c.request("GET", "/metrics")
    assert status == 200
    out = {}
    for line in data.decode().splitlines():
        m = re.match(r'(prism:worker_[a-z_]+)\{tier="(\w+)",worker="([^"]+)"\} (\S+)', line)
        if m:
            out[(m.group(1), m.group(3))] = float(m.group(4))
    return out


FAST_HB = ["--heartbeat-interval", "0.1"]  # worker state in /metrics is at most ~0.1 s old


def wait_heartbeats(c, n=2):
    """Waits until every worker has sent n more heartbeats than now: numbers read afterwards were
    taken after everything that happened before this call (no fixed sleep, no stale reading)."""
    def counts():
        return {lb["worker"]: v for name, lb, v in c.metrics() if name == "prism:worker_heartbeats_total"}
    start = counts()
    assert start, "prism:worker_heartbeats_total is missing from /metrics"
    wait_for(lambda: all(counts().get(w, -1) >= v + n for w, v in start.items()), 20,
             "%d fresh heartbeats from %s" % (n, sorted(start)))


def test_budget_too_small_refuses_to_start():
    for kind in ("decode_worker", "prefill_worker", "encoder_worker"):
        p = subprocess.run([binary(kind), "--model-path", MODEL, "--router", "tcp://127.0.0.1:1", "--mem-budget", "8M",
                            "--insecure-no-curve"],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode != 0, (kind, p.returncode)
        assert "memory plan needs" in p.stderr or "cannot hold" in p.stderr, (kind, p.stderr[-800:])
        assert "8.00 MiB" in p.stderr, (kind, p.stderr[-800:])
    # the router too: a budget below its fixed rows, and explicit bounds its budget cannot hold
    for extra, names in ((["--mem-budget", "8M"], ["8.00 MiB", "requests"]),
                         (["--max-body-bytes-in-flight", "1G"], ["512.00 MiB", "--max-body-bytes-in-flight"])):
        p = subprocess.run([binary("router"), "--model-path", MODEL, "--port", "0", "--control-endpoint",
                            "tcp://127.0.0.1:0", "--insecure-no-curve", *extra], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, (extra, p.returncode, p.stderr[-800:])
        assert "memory plan needs" in p.stderr and all(n in p.stderr for n in names), (extra, p.stderr[-800:])


def start_outcome(kind, budget, extra=()):
    """Starts a worker of kind (no router to reach) with --mem-budget budget and reads its log until
    it refuses (exit, 'memory plan needs') or is past start-up ('pools and libraries'): ('refused' |
    'started', the plan's total in bytes)."""
    p = subprocess.Popen([binary(kind), "--model-path", MODEL, "--router", "tcp://127.0.0.1:1", "--insecure-no-curve",
                          "--mem-budget", str(budget), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    total, outcome = None, None
    try:
        for line in p.stdout:
            m = re.search(r"memory plan: total\s+.*\((\d+) bytes\)", line)
            if m:
                total = int(m.group(1))
            if "memory plan needs" in line:
                outcome = "refused"
                break
            if "memory plan: pools and libraries" in line:
                outcome = "started"
                break
    finally:
        p.kill()
        p.wait()
    return outcome, total


def test_budget_is_checked_against_the_whole_plan():
    """A worker's budget is held against its plan's total, to the byte: 4 MiB below the total it
    refuses to start, 4 MiB above it starts (whether the total counts everything the worker holds is
    test_every_worker_within_its_plan_under_load's question)."""
    for kind, extra in (("encoder_worker", ()), ("prefill_worker", ()), ("decode_worker", ("--kv-blocks", "256"))):
        outcome, total = start_outcome(kind, 1 << 30, extra)
        assert outcome == "started" and total, (kind, outcome, total)
        margin = (16 if sanitized() else 4) << 20   # the measured runtime row moves more under ASan
        assert start_outcome(kind, total + margin, extra)[0] == "started", (kind, total)
        outcome, seen = start_outcome(kind, total - margin, extra)
        assert outcome == "refused", ("%s started under a budget %d bytes below its plan (%d): the plan checked "
                                      "lacks what it holds" % (kind, margin, total), seen)


# What each refusal says, and the reason it is counted under in prism:requests_refused_total.
REFUSALS = {
    "Too many request bytes in flight": (503, "body_bytes_inflight"),
    "The server is at capacity": (429, "queue_full"),
    "waited too long": (503, "queue_wait"),
}


def refused_counts(c):
    return {lb["reason"]: v for name, lb, v in c.metrics() if name == "prism:requests_refused_total"}


def test_overload_burst_and_recovery():
    budget = ["--mem-budget", str(BUDGET)]
    # default --worker-timeout: workers heartbeat from their I/O thread however long their batches
    # the router's bounds given explicitly (its plan holds them in 1 GiB; the small-budget burst
    # below leaves them to the plan)
    with Cluster(router_args=["--max-running-requests", "48", "--max-image-bytes-in-flight", "64M",
                              "--max-body-bytes-in-flight", "256M", "--mem-budget", "1G"],
                 worker_args={"encoder_worker": budget, "prefill_worker": budget, "decode_worker": budget}) as c:
        c.wait_ready()
        body = json.dumps(chat_body("What is in the image?", [BIG], max_tokens=4, temperature=0)).encode()
        before = refused_counts(c)
        paused0 = c.metric("prism:router_uploads_paused_total")

        def one(_):
            """(status, error message). No connection may drop: a body the router has no room for waits
            (it stops reading) instead of being refused while the client uploads."""
            s, _, data = c.request("POST", "/v1/chat/completions", body, timeout=600)
            return s, (json.loads(data)["error"]["message"] if s != 200 else "")

        # Under the sanitizers each body costs the router's instrumented base64 and JSON scans and an
        # image prefill (minutes for 300 on 2 cores, most of this file's time there): 120 bodies, all sent
        # at once, still overload every bound below (1.1 GB against 256 MiB of bodies, 64 MiB of images,
        # 48 requests), which the paused-uploads assertion checks.
        burst = 120 if sanitized() else 300
        with concurrent.futures.ThreadPoolExecutor(200) as ex:
            results = list(ex.map(one, range(burst)))
        counts = {}
        for s, _ in results:
            counts[s] = counts.get(s, 0) + 1
        print("burst statuses:", counts, flush=True)
        assert set(counts) <= {200, 429, 503}, counts
        assert counts.get(200, 0) > 0, counts
        # Overload really happened: 300 (120) bodies of 9.3 MB against 256 MiB of bodies, 64 MiB of
        # images and 48 requests in flight cannot all be admitted at once; uploads waited for room
        # (the router stopped reading them) rather than being refused.
        paused = c.metric("prism:router_uploads_paused_total") - paused0
        print("uploads paused:", paused, flush=True)
        assert paused > 0, "%d concurrent 4096x4096 requests were all admitted at once: the limits did not bite" % burst
        refused = [(s, m) for s, m in results if s != 200]
        # ... and every refusal says why and is counted under that reason.
        by_reason = {}
        for s, m in refused:
            hit = [(st, why) for k, (st, why) in REFUSALS.items() if k in m]
            assert hit and hit[0][0] == s, ("refusal with an unexpected status or message", s, m)
            why = hit[0][1]
            by_reason[why] = by_reason.get(why, 0) + 1
        after = refused_counts(c)
        delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        print("refusals by reason:", by_reason, "metrics delta:", delta, flush=True)
        assert delta == by_reason, (delta, by_reason)
        assert all(c.alive().values()), c.alive()
        m = metrics(c)
        for (name, worker), v in m.items():
            if name == "prism:worker_memory_peak_bytes":
                assert v <= BUDGET, (worker, v, BUDGET)
        for name, p in c.procs.items():  # resident memory too, not only our own heap
            with open("/proc/%d/status" % p.pid) as f:
                hwm = [int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:")][0]
            with open("/proc/%d/maps" % p.pid) as f:
                # AddressSanitizer's shadow (1/8 of what is touched) and its quarantine of freed
                # blocks (256 MiB by default) are resident too: not the product's memory
                asan = "libasan" in f.read()
            # the router within its plan: 256 MiB of bodies + 64 MiB of images (+ start-up, connections...)
            limit = BUDGET if name != "router" else c.metric("prism:router_memory_planned_bytes")
            assert hwm <= (limit * 9 // 8 + (256 << 20) if asan else limit), (name, hwm, asan)
        # serves normally right after
        for _ in range(3):
            s, r = c.post_json("/v1/chat/completions", chat_body("Describe the image.", [SMALL], max_tokens=4))
            assert s == 200, (s, r)


def upload_burst(port, data, n, timeout=600):
    """n clients that each write a whole request (data) at the same moment (a barrier), then read
    the answer to its end: [(status, message)]."""
    import threading
    out, barrier = [None] * n, threading.Barrier(n)

    def one(i):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        except OSError as e:
            barrier.wait()
            out[i] = (0, "connect: %s" % e)
            return
        try:
            barrier.wait()
            try:
                s.sendall(data)
            except OSError:   # answered early and closed: read what it said
                pass
            buf = b""
            while True:
                d = s.recv(65536)
                if not d:
                    break
                buf += d
            head, _, body = buf.partition(b"\r\n\r\n")
            st = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
            msg = ""
            if st != 200:
                try:
                    msg = json.loads(body[body.find(b"{"):body.rfind(b"}") + 1])["error"]["message"]
                except (ValueError, KeyError):
                    msg = body[:200].decode("utf-8", "replace")
            out[i] = (st, msg)
        except OSError as e:
            out[i] = (0, "connection: %s" % e)
        finally:
            s.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def vm_hwm(pid):
    with open("/proc/%d/status" % pid) as f:
        return [int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:")][0]


def under_asan(pid):
    with open("/proc/%d/maps" % pid) as f:
        return "libasan" in f.read()


def check_parse_bound(c, bound):
    """The plan's parsing row holds: a body whose parsed tree would cost more than the parse bound is
    refused before it is parsed (400), on the generation path and on /tokenize, and one of half the
    bound is served. A text prompt costs about its bytes once parsed."""
    bound = int(bound)
    assert (1 << 20) <= bound <= (96 << 20), bound
    over, under = "ab " * (bound // 3 + 4096), "ab " * (bound // 6)
    for path, extra in (("/tokenize", {}), ("/v1/completions", {"max_tokens": 1})):
        st, _, data = c.request("POST", path, dict({"model": "prism-tiny-llava", "prompt": over}, **extra))
        assert st == 400 and b"too large to parse" in data, (path, bound, st, data[:300])
    st, _, data = c.request("POST", "/tokenize", {"model": "prism-tiny-llava", "prompt": under})
    assert st == 200, (bound, st, data[:300])


def test_router_within_its_budget_under_a_burst():
    """The router's memory is one budget: with --mem-budget 128M and every bound left to its plan, a
    burst of 96 photo uploads sent at once (2.4 MB bodies: 230 MB in all, far more than the plan's
    bodies and images) is answered 200 / 429 / 503 only, and the router's peak resident set stays
    within 128 MiB (before the plan it held every body at once: 250+ MiB here); the plan is in
    /metrics, rows adding up to its total within the budget, its parse bound enforced
    (check_parse_bound); every worker within its own."""
    img = make_image(os.path.join(TMP, "burst.jpg"), width=2048, height=2048, photo=True, quality=93, seed=11)
    # under ASan the router's start-up alone is tens of MiB (shadow): the same burst, a budget that fits
    budget = (384 if sanitized() else 128) << 20
    with Cluster(router_args=["--mem-budget", str(budget), "--max-running-requests", "32", "--prep-threads", "2"],
                 worker_args={k: ["--mem-budget", str(BUDGET)] for k in ("encoder_worker", "prefill_worker",
                                                                         "decode_worker")}) as c:
        c.wait_ready()
        plan = {lb["region"]: v for n, lb, v in c.metrics() if n == "prism:router_memory_plan_bytes"}
        total = c.metric("prism:router_memory_planned_bytes")
        assert c.metric("prism:router_memory_budget_bytes") == budget
        assert abs(sum(plan.values()) - total) < 1 and total <= budget, (plan, total)
        for region in ("start-up", "connections", "bodies in flight", "images held", "requests", "parsing",
                       "URL fetches", "prefix index"):
            assert region in plan, (region, plan)
        check_parse_bound(c, plan["parsing"] / (2 * 4))   # --prep-threads 2, ROUTER_PARSE_FACTOR 4
        body = json.dumps(chat_body("What is in the image?", [img], max_tokens=4, temperature=0, stream=True)).encode()
        data = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
        paused0 = c.metric("prism:router_uploads_paused_total")
        res = upload_burst(c.port, data, 96)
        counts = {}
        for st, _ in res:
            counts[st] = counts.get(st, 0) + 1
        print("burst statuses:", counts, "messages:", sorted({m for st, m in res if st != 200})[:4], flush=True)
        assert set(counts) <= {200, 429, 503} and counts.get(200, 0) > 0, (counts, res[:3])
        assert c.metric("prism:router_uploads_paused_total") > paused0, "the burst never waited: the bounds did not bite"
        peak = c.metric("prism:router_memory_resident_peak_bytes")
        assert peak == vm_hwm(c.procs["router"].pid) or peak > 0
        router_pid = c.procs["router"].pid
        if not under_asan(router_pid):   # ASan's shadow and quarantine are not the router's memory
            assert vm_hwm(router_pid) <= budget, ("router peak resident set over its budget", vm_hwm(router_pid), plan)
        for name, p in c.procs.items():
            if name != "router" and not under_asan(p.pid):
                assert vm_hwm(p.pid) <= BUDGET, (name, vm_hwm(p.pid))
        status, r = c.post_json("/v1/chat/completions", chat_body("Describe the image.", [SMALL], max_tokens=4))
        assert status == 200, (status, r)


def test_every_worker_within_its_plan_under_load():
    """Every worker's memory against its own plan after a mixed load (48 requests, 24 at once: images
    of eight sizes, text, n up to 3, long and short generations): the heap's peak (the counting allocator's,
    prism:worker_memory_peak_bytes) within the plan's heap regions (pools and libraries, as the
    budget check saw them), and the resident peak (VmHWM) within the plan's total, which
    counts the runtime and headroom too. A region left out of a plan (the prefill's KV cache), or
    memory taken while serving that no region holds, fails here."""
    imgs = [make_image(os.path.join(TMP, "plan%d.jpg" % i), width=640 + 256 * i, height=480 + 128 * i, photo=True,
                       seed=i) for i in range(8)]
    with Cluster(common_worker_args=FAST_HB + ["--mem-budget", str(BUDGET)]) as c:
        c.wait_ready()

        def one(i):
            body = chat_body("Tell me a story %d" % i, [imgs[i % 8]] if i % 3 else [], max_tokens=160 if i % 2 else 24,
                             temperature=0.7, seed=i, ignore_eos=True, n=1 + i % 3)
            return c.post_json("/v1/chat/completions", body, timeout=300)[0]

        with concurrent.futures.ThreadPoolExecutor(24) as ex:
            statuses = list(ex.map(one, range(48)))
        assert set(statuses) == {200}, statuses
        c.check_memory_plan()   # and what each held once started
        wait_heartbeats(c)
        for w in ("encoder-0", "prefill-0", "decode-0"):
            planned = c.metric("prism:worker_memory_planned_bytes", worker=w)
            peak = c.metric("prism:worker_memory_peak_bytes", worker=w)
            regions = c.plan_regions(w)   # as the budget check saw them
            heap_regions = sum(b for _, kind, b in regions if kind != "outside")
            assert regions and sum(b for _, _, b in regions) == planned, (w, planned, regions)
            print("  %s: heap peak %d, the plan's heap regions %d (%+d); resident peak %d of a plan of %d" % (
                w, peak, heap_regions, peak - heap_regions, vm_hwm(c.procs[w].pid), planned), flush=True)
            assert peak <= heap_regions + PLAN_HEAP_MARGIN, (
                "%s: its heap peaked %d bytes above its plan's pools and libraries" % (w, peak - heap_regions))
            assert planned <= BUDGET, (w, planned)
            if not under_asan(c.procs[w].pid):
                assert vm_hwm(c.procs[w].pid) <= planned, (w, vm_hwm(c.procs[w].pid), planned)


def test_backpressure_and_flat_allocations():
    """A prefill worker with a one-image embedding pool, and 24 image requests at once: the pool
    fills and the encoder waits (the prefill stopped meanwhile, so its pool and the sockets' buffers
    are full for certain: counted in prism:worker_sends_waited_total), then every request completes;
    and no worker allocates on the request path, in either burst."""
    pre = ["--embed-pool-images", "1", "--max-pending-requests", "64"]
    with Cluster(worker_args={"prefill_worker": pre}, common_worker_args=FAST_HB,
                 router_args=["--worker-timeout", "60"]) as c:
        c.wait_ready()
        imgs = [make_image(os.path.join(TMP, "bp%d.jpg" % i), width=640 + 16 * i, height=480, shape="circle",
                           color="red", seed=i) for i in range(24)]

        def one(i):
            return c.post_json("/v1/chat/completions", chat_body("What is in the image?", [imgs[i % 24]], max_tokens=6))

        with concurrent.futures.ThreadPoolExecutor(24) as ex:
            res = list(ex.map(one, range(24)))  # warm-up and the backpressure case itself
        assert all(s == 200 for s, _ in res), [s for s, _ in res]
        wait_heartbeats(c)
        before = metrics(c)
        waited0 = c.metric("prism:worker_sends_waited_total", worker="encoder-0")
        assert waited0 is not None, "prism:worker_sends_waited_total is missing"
        prefill = c.procs["prefill-0"]
        prefill.send_signal(signal.SIGSTOP)   # its pool (one image) fills, then the sockets': the encoder must wait
        try:
            with concurrent.futures.ThreadPoolExecutor(24) as ex:
                futs = [ex.submit(one, i) for i in range(24, 48)]
                wait_for(lambda: c.metric("prism:worker_sends_waited_total", worker="encoder-0") > waited0, 60,
                         "the encoder to wait for the prefill's pool")
                prefill.send_signal(signal.SIGCONT)
                res = [f.result() for f in futs]
        finally:
            prefill.send_signal(signal.SIGCONT)
        assert all(s == 200 for s, _ in res), [s for s, _ in res]
        wait_heartbeats(c)
        after = metrics(c)
        # The counter must be there for every worker and live (start-up allocates), or this test
        # would assert nothing.
        counted = {w: v for (name, w), v in after.items() if name == "prism:worker_heap_allocations_total"}
        assert set(counted) == {"encoder-0", "prefill-0", "decode-0"}, ("allocation counter missing", counted)
        for worker, v in counted.items():
            assert v > 0, ("allocation counter reads 0: not live", worker)
            b = before.get(("prism:worker_heap_allocations_total", worker))
            assert b is not None, ("allocation counter missing before the burst", worker)
            assert v == b, ("heap allocations on the request path", worker, b, v)


def test_decode_admission_waits_for_kv():
    """--kv-admission reserve, 24 KV blocks of 16 tokens: room for two requests at a time; the rest
    wait (counted in /metrics), none fails, waiting does not change a single token, and nothing is
    preempted."""
    ctx = ["--context-length", "256"]
    with Cluster(router_args=ctx, worker_args={"prefill_worker": ctx,
                                               "decode_worker": ctx + ["--kv-blocks", "24", "--kv-admission", "reserve"]},
                 common_worker_args=FAST_HB) as c:
        c.wait_ready()
        # ~77 prompt tokens + 100 = 12 blocks each: two fit in 24 blocks, a third waits
        body = chat_body("What is in the image?", [SMALL], max_tokens=100, temperature=0, ignore_eos=True)
        s, ref = c.post_json("/v1/chat/completions", body)
        assert s == 200, (s, ref)
        assert ref["usage"]["prompt_tokens"] + 100 <= 12 * 16, ref["usage"]
        low = []

        def watch():
            while not done:
                low.append(c.metric("prism:worker_kv_free_blocks", tier="decode"))
                time.sleep(0.02)

        waits0 = c.metric("prism:worker_kv_waits_total", tier="decode")
        done = False
        with concurrent.futures.ThreadPoolExecutor(13) as ex:
            w = ex.submit(watch)
            res = list(ex.map(lambda _: c.post_json("/v1/chat/completions", body), range(12)))
            done = True
            w.result()
        for s, r in res:
            assert s == 200, (s, r)
            assert r["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
        # a counter, not a sampled gauge: every transfer that had to wait is counted once
        hb = c.metric("prism:worker_heartbeats_total", tier="decode")
        wait_for(lambda: c.metric("prism:worker_heartbeats_total", tier="decode") > hb, 10, "a fresh heartbeat")
        waits = c.metric("prism:worker_kv_waits_total", tier="decode") - waits0
        print("KV waits:", waits, "lowest free blocks:", min(v for v in low if v is not None))
        assert waits >= 1, ("no request ever waited for KV: the test did not load the pool", waits, low[:20])
        assert min(v for v in low if v is not None) < 12, low[:20]
        # reserve-not-preempt: vLLM's preemption counter is exported and stays 0
        assert c.metric("vllm:num_preemptions_total") == 0
        # more than the whole KV pool can hold is refused up front, not hung
        s, r = c.post_json("/v1/chat/completions", chat_body("hi", [SMALL], max_tokens=400))
        assert s == 400, (s, r)


def _tokens(r):
    """The token ids of a choice (return_tokens_as_token_ids) and how it ended."""
    ch = r["choices"][0]
    return [e["token"] for e in ch["logprobs"]["content"]], ch["finish_reason"]


def _choices(r):
    """Every choice's token ids and finish, by index (return_tokens_as_token_ids)."""
    return [([e["token"] for e in ch["logprobs"]["content"]], ch["finish_reason"])
            for ch in sorted(r["choices"], key=lambda ch: ch["index"])]


def _multi_bodies(c):
    """Requests with n > 1 for the 12-block pool of the preemption tests, with their answers alone
    (nothing else runs: nothing preempted). Each choice may reach at most 6 blocks (n = 2) or 4
    (n = 3), so that every choice of one of them can reach its end in the pool at once (the
    admission's condition for growing; past it n > 1 reserves). n = 2 seeded and n = 3 greedy, both of
    priority 1: the first victims while the swap region holds them."""
    s, r = c.post_json("/v1/chat/completions", chat_body("Tell me a long story about the colour white.", max_tokens=1))
    assert s == 200, (s, r)
    prompt = r["usage"]["prompt_tokens"]
    out = []
    for n, blocks, t in ((2, 6, 0.9), (3, 4, 0)):
        b = chat_body("Tell me a long story about the colour white.", n=n, temperature=t, seed=5, ignore_eos=True,
                      max_tokens=blocks * 16 - prompt - 1, priority=1, logprobs=True, return_tokens_as_token_ids=True)
        s, r = c.post_json("/v1/chat/completions", b)
        assert s == 200, (s, r)
        ch = _choices(r)
        assert len(ch) == n and all(f == "length" for _, f in ch), ch
        if t:
            assert ch[0][0] != ch[1][0], "the seeded choices are alike: they would not show a mixed-up RNG stream"
        out.append((b, ch))
    return out


def _all_at_once_multi(c, bodies, refs, multi, first=False):
    """bodies (n = 1) and the n > 1 requests of _multi_bodies at once: every choice's answer as alone.
    first: the n > 1 requests go first, of priority 0 (the router's queue would send those of
    priority 1 last), so they run while the others come in and outgrow the pool."""
    every = list(bodies) + [dict(b, priority=0) if first else b for b, _ in multi]
    with concurrent.futures.ThreadPoolExecutor(len(every)) as ex:
        late = [ex.submit(c.post_json, "/v1/chat/completions", b) for b in every[len(bodies):]] if first else []
        if first:
            time.sleep(0.05)
        res = list(ex.map(lambda b: c.post_json("/v1/chat/completions", b), every[:len(every) - len(late)]))
        res += [f.result() for f in late]
    for i, (s, r) in enumerate(res):
        assert s == 200, (i, s, r)
        if i < len(bodies):
            assert _tokens(r) == refs[i], ("answer changed by preemption", i)
        else:
            assert _choices(r) == multi[i - len(bodies)][1], ("an n > 1 answer changed by preemption", i)


def test_decode_preempts_by_recompute_or_swap_and_priority_overtakes():
    """--kv-admission optimistic (the default), 12 KV blocks of 16 tokens, a 128-token context: four
    requests without max_tokens run to the end of the context (8 blocks each), admitted on their
    prompts' blocks. The pool runs out mid-decode: sequences are preempted (dropped, prefilled again
    from their tokens), every request is answered, and each greedy or seeded answer is token for
    token the one it gives alone. Then a request with priority -1 sent after three of priority 0
    overtakes them in the router's queue. In between, the same pool with a swap region (_preempt_by_swap)."""
    ctx = ["--context-length", "128"]
    # the router at debug: the priority check below reads its 'sent to prefill worker' lines
    with Cluster(router_args=ctx + ["--log-level", "debug"], common_worker_args=FAST_HB,
                 worker_args={"prefill_worker": ctx + ["--max-pending-requests", "1"],
                              "decode_worker": ctx + ["--kv-blocks", "12", "--max-running-requests", "4",
                                                      "--log-level", "debug"]}) as c:
        c.wait_ready()
        bodies = [chat_body("Tell me a long story about the colour %s." % col, temperature=t, seed=7, ignore_eos=True,
                            logprobs=True, return_tokens_as_token_ids=True)
                  for col, t in (("red", 0), ("green", 0.8), ("blue", 0), ("yellow", 1.0))]
        refs = []
        for b in bodies:
            s, r = c.post_json("/v1/chat/completions", b)
            assert s == 200, (s, r)
            refs.append(_tokens(r))
            assert refs[-1][1] == "length" and r["usage"]["total_tokens"] == 128, r["usage"]
        assert c.metric("vllm:num_preemptions_total") == 0, "one at a time, nothing to preempt"
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
            res = list(ex.map(lambda b: c.post_json("/v1/chat/completions", b), bodies))
        for i, (s, r) in enumerate(res):
            assert s == 200, (i, s, r)
            assert _tokens(r) == refs[i], ("answer changed by preemption", i)
        preempted = c.metric("vllm:num_preemptions_total")
        print("preemptions:", preempted)
        assert preempted > 0, "the pool never ran out: the test did not preempt"
        assert c.metric("prism:preemptions_total", how="recompute") == preempted
        hb = c.metric("prism:worker_heartbeats_total", tier="decode")
        wait_for(lambda: c.metric("prism:worker_heartbeats_total", tier="decode") > hb + 1, 10, "a fresh heartbeat")
        assert c.metric("prism:worker_preemptions_total", tier="decode") == preempted
        assert c.metric("prism:worker_kv_free_blocks", tier="decode") == 12, "blocks leaked"
        # n > 1 beside them, no swap region: their choices can be neither recomputed nor migrated
        # (one decode worker): they wait for the blocks the n = 1 sequences preempted give back
        multi = _multi_bodies(c)
        rec0 = c.metric("prism:preemptions_total", how="recompute")
        log0 = len(c.log("decode-0", tail=0))
        _all_at_once_multi(c, bodies, refs, multi, first=True)
        assert c.metric("prism:preemptions_total", how="recompute") > rec0, "nothing was preempted"
        assert c.metric("prism:preemptions_total", how="swap") == 0
        # sequences were preempted while an n > 1 request ran (its choices grew in the pool then: a
        # recomputed choice would have failed its request, a 503 above)
        log = c.log("decode-0", tail=0)[log0:]
        multi_in = [m.start() for m in re.finditer(r"choice [12] admitted", log)]
        assert multi_in and re.search(r"(preempted|parked for migration) \(KV pool full\)", log[multi_in[0]:]), (
            "no preemption beside an n > 1 request")
        print("n > 1 choices that waited for a block:", len(re.findall(r"choice \d+ waits for a KV block", log)))
        assert _settled(c, "decode-0")[1] == 12, "blocks leaked"
        _preempt_by_swap(c, bodies, refs, multi)   # on decode workers started with a swap region

        # Priorities: the prefill worker takes one request at a time (--max-pending-requests 1) and is
        # stopped (SIGSTOP) while a first request holds it; three of priority 0 queue in the router,
        # then one of priority -1. Once the prefill worker goes on, the high one is sent next: its
        # first token comes before the others'. Each is sent once the one before is in the router's
        # queue (the prism:router_requests_queued gauge; "first" is dispatched to the stopped worker):
        # the router prepares requests on a thread pool, so requests sent 0.1 s apart by client threads
        # could be queued in another order under load (low1 before low0 was seen once).
        first, ids = {}, {}

        def one(name, prio):
            st = c.open_stream("/v1/chat/completions", chat_body("Say %s." % name, max_tokens=4, temperature=0,
                                                                 ignore_eos=True, stream=True, priority=prio))
            while True:
                ev = st.next_event()
                if ev is None or ev == "[DONE]":
                    break
                ids.setdefault(name, ev.get("id"))
                if any(ch.get("delta", {}).get("content") for ch in ev.get("choices", [])):
                    first.setdefault(name, time.time())

        pre = c.procs["prefill-0"]
        with concurrent.futures.ThreadPoolExecutor(5) as ex:
            pre.send_signal(signal.SIGSTOP)
            try:
                jobs = [ex.submit(one, "first", 0)]
                wait_for(lambda: [c.metric("prism:router_requests_" + g) for g in ("in_flight", "preparing", "queued")]
                         == [1, 0, 0], 10, "the first request dispatched (held, not preparing, not queued)")
                for k, (name, prio) in enumerate((("low0", 0), ("low1", 0), ("low2", 0), ("high", -1))):
                    jobs.append(ex.submit(one, name, prio))
                    wait_for(lambda: c.metric("prism:router_requests_queued") == k + 1, 10, name + " queued")
            finally:
                pre.send_signal(signal.SIGCONT)
            for f in jobs:
                f.result()
        # the order the router handed them to the (only) prefill worker, from its log (a debug line:
        # the router runs at --log-level debug above). Not the client's arrival times of the first
        # tokens, nor the order its threads first heard of each stream: a few ms apart, its threads read
        # them out of order on a loaded machine (low2 before low1, seen in CI). Every request must be
        # in the log: a router at info logs none of them, and sorting on a missing index fell back to
        # the client's order silently, which is how that flake survived a first fix.
        with open(os.path.join(c.log_dir, "router.log"), "rb") as f:
            sent = re.findall(r"\((chatcmpl-[0-9a-f]+)\): sent to prefill worker", f.read().decode("utf-8", "replace"))
        assert sorted(first) == sorted(ids) and len(ids) == 5, (first, ids)
        assert all(i in sent for i in ids.values()), ("a request's send to the prefill is not in the router's log "
                                                      "(is it at --log-level debug?)", ids, sent)
        order = sorted(ids, key=lambda n: sent.index(ids[n]))   # its first send (a retry keeps its id)
        print("sent to the prefill in order:", order, "first tokens seen in order:", sorted(first, key=first.get))
        assert order == ["first", "high", "low0", "low1", "low2"], ("the high-priority request did not overtake "
                                                                   "the queue", order)


def _restart_decode(c, old, new, extra):
    """Replaces decode worker `old` by `new`, started with `extra` flags; returns once it is serving."""
    c.kill(old)
    # dropped by the router first (its connection closed), or requests would still go to it and migrate
    wait_for(lambda: c.metric("prism:worker_heartbeats_total", worker=old) is None, 30, old + " dropped")
    c.start_worker(new, "decode_worker", extra)
    wait_for(lambda: c.metric("prism:worker_heartbeats_total", worker=new), 30, new + " registered")
    c.wait_ready()


def _all_at_once(c, bodies, refs):
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
        res = list(ex.map(lambda b: c.post_json("/v1/chat/completions", b), bodies))
    for i, (s, r) in enumerate(res):
        assert s == 200, (i, s, r)
        assert _tokens(r) == refs[i], ("answer changed by preemption", i)


def _leave_while_swapped(c, streams, log0, what):
    """Once a priority-1 sequence is swapped out on decode-1 (logged after log0), the client of
    streams[3] leaves while the worker is stopped (so the abort is what it hears next); the other
    three streams go on to the end. Returns the swapped request's id."""
    rid = wait_for(lambda: re.findall(r"request (\d+) swapped out \(KV pool full\): \d+ blocks, priority 1",
                                      c.log("decode-1", tail=0)[log0:]), 30, what)[0]
    dec = c.procs["decode-1"]
    dec.send_signal(signal.SIGSTOP)
    try:
        streams[3].close()
        time.sleep(0.3)
    finally:
        dec.send_signal(signal.SIGCONT)
    for st in streams[:3]:
        while st.next_event() not in ("[DONE]", None):
            pass
        assert st.done, "a stream ended early"
    return rid


def _settled(c, worker):
    """The decode worker's state once it is idle again: swap bytes in use, free blocks (fresh heartbeats)."""
    hb = c.metric("prism:worker_heartbeats_total", worker=worker)
    wait_for(lambda: c.metric("prism:worker_heartbeats_total", worker=worker) > hb + 1, 10, "a fresh heartbeat")
    wait_for(lambda: c.metric("prism:worker_running", worker=worker) == 0, 20, worker + " idle")
    return c.metric("prism:worker_kv_swap_bytes", worker=worker), c.metric("prism:worker_kv_free_blocks", worker=worker)


def _preempt_by_swap(c, bodies, refs, multi):
    """--kv-swap-bytes on the same 12-block pool (a block of the tiny model is 64 KiB). (1) 4 MiB holds
    every victim: sequences are swapped out and back in, none is recomputed, each answer is token for
    token its answer alone, the swap bytes come back to 0. (2) the same four streamed, the client of
    a swapped-out sequence gone: its swap slots are freed by the abort (the gauge back to 0), the
    others end normally. (3) a 64 KiB region
    holds no victim (each holds 2 blocks or more): every preemption is a recompute, answers unchanged."""
    swap_args = ["--kv-swap-bytes", "4M", "--log-level", "debug"]
    # a swapped-out sequence stays out 2 s at least (test hook), so that (2) and (2b) find it out
    # when its client leaves, however fast the machine brings it back
    env = c.worker_env.get("decode_worker")
    c.worker_env["decode_worker"] = dict(env or {}, PRISM_TEST_SWAP_HOLD_S="2")
    try:
        _restart_decode(c, "decode-0", "decode-1", swap_args)
    finally:
        if env is None:
            del c.worker_env["decode_worker"]
        else:
            c.worker_env["decode_worker"] = env
    rec0, swap0 = c.metric("prism:preemptions_total", how="recompute"), c.metric("prism:preemptions_total", how="swap")
    _all_at_once(c, bodies, refs)
    swaps = c.metric("prism:preemptions_total", how="swap") - swap0
    print("swaps:", swaps)
    assert swaps > 0, "nothing was swapped out: the test proved nothing"
    assert c.metric("prism:preemptions_total", how="recompute") == rec0, "a victim that fitted was recomputed"
    assert c.metric("vllm:num_preemptions_total") == rec0 + swap0 + swaps
    assert _settled(c, "decode-1") == (0, 12), "swap slots or blocks leaked"
    assert c.metric("prism:worker_swaps_total", worker="decode-1") == swaps

    # (1b) n > 1 (priority 1: the first victims) beside the four: their choices are swapped out and
    # back in one by one (the shared prompt blocks stay in the pool while a sibling holds them, each
    # comes back with its own copy), none is recomputed, every choice's answer as alone
    rec0, swap0 = c.metric("prism:preemptions_total", how="recompute"), c.metric("prism:preemptions_total", how="swap")
    log0 = len(c.log("decode-1", tail=0))
    _all_at_once_multi(c, bodies, refs, multi)
    multi_swaps = re.findall(r"request \d+ swapped out \(KV pool full\): \d+ blocks, priority 1",
                             c.log("decode-1", tail=0)[log0:])
    print("n > 1 choices swapped out:", len(multi_swaps))
    assert multi_swaps, "no choice of an n > 1 request was swapped out: the test proved nothing"
    assert c.metric("prism:preemptions_total", how="recompute") == rec0, "a victim that fitted was recomputed"
    assert _settled(c, "decode-1") == (0, 12), "swap slots or blocks leaked (n > 1)"

    # (2b) the client of an n = 2 request leaves while one of its choices is swapped out: its other
    # choice, its swap slots and its blocks (the shared ones once) are all freed
    log0 = len(c.log("decode-1", tail=0))
    streams = [c.open_stream("/v1/chat/completions", dict(b, stream=True)) for b in bodies[:3] + [multi[0][0]]]
    rid = _leave_while_swapped(c, streams, log0, "an n = 2 choice swapped out")
    assert _settled(c, "decode-1") == (0, 12), "an aborted n = 2 request's swap slots or blocks were not freed"
    events = re.findall(r"request %s (?:choice \d+ )?(swapped out|swapped in|aborted)" % rid,
                        c.log("decode-1", tail=0)[log0:])
    before = events[:events.index("aborted")] if "aborted" in events else []
    assert before.count("swapped out") > before.count("swapped in"), (
        "not aborted while a choice was swapped out: the test proved nothing", events)

    # (2) a client that leaves while its sequence is swapped out: the one of priority 1 is the victim
    # (the lowest priority goes first) and comes back last; the worker is stopped while the client
    # leaves, so its abort is what it hears next (checked in its log)
    log0 = len(c.log("decode-1", tail=0))
    streams = [c.open_stream("/v1/chat/completions", dict(b, stream=True, priority=int(i == 3)))
               for i, b in enumerate(bodies)]
    rid = _leave_while_swapped(c, streams, log0, "the low-priority sequence swapped out")
    assert _settled(c, "decode-1") == (0, 12), "an aborted sequence's swap slots (or blocks) were not freed"
    events = re.findall(r"request %s (swapped out|swapped in|aborted)" % rid, c.log("decode-1", tail=0)[log0:])
    assert events[-2:] == ["swapped out", "aborted"], ("not aborted while swapped out: the test proved nothing", events)

    # (3) a region too small for any victim
    _restart_decode(c, "decode-1", "decode-2", ["--kv-swap-bytes", "64K"])
    rec0, swap0 = c.metric("prism:preemptions_total", how="recompute"), c.metric("prism:preemptions_total", how="swap")
    _all_at_once_multi(c, bodies, refs, multi)
    assert c.metric("prism:preemptions_total", how="recompute") > rec0, "nothing was preempted"
    assert c.metric("prism:preemptions_total", how="swap") == swap0, "a victim was swapped into a 1-block region"
    assert _settled(c, "decode-2") == (0, 12), "blocks leaked"


def test_decode_preempts_by_migration_and_survives_the_target_dying():
    """Preemption by migration (issue 28): decode-0 has 12 KV blocks (a 128-token context), decode-1
    room for every sequence. Four requests without max_tokens are all placed on decode-0 (the prefill
    worker is stopped while they are dispatched and decode-1 starts only then): decode-0's pool runs
    out mid-decode, the sequences it preempts go on on decode-1 with their KV moved there (no
    prefill again), and each greedy or seeded answer is token for token its answer alone. Then the
    same with a decode-1 that dies as the first migrated KV reaches it (a target killed
    mid-migration): nothing is lost, the sequences are recomputed and the answers are unchanged. Then
    clients that leave while their sequences migrate: both decode workers free everything; and a source
    that dies while its migration is in flight: every answer unchanged."""
    ctx = ["--context-length", "128"]
    tiny = ctx + ["--kv-blocks", "12", "--max-running-requests", "4"]
    with Cluster(decodes=0, router_args=ctx, common_worker_args=FAST_HB,
                 worker_args={"prefill_worker": ctx, "decode_worker": ctx}) as c:
        c.start_worker("decode-0", "decode_worker", tiny)
        c.wait_ready()
        bodies = [chat_body("Tell me a long story about the colour %s." % col, temperature=t, seed=11,
                            ignore_eos=True, logprobs=True, return_tokens_as_token_ids=True)
                  for col, t in (("red", 0), ("green", 0.8), ("blue", 0), ("yellow", 1.0))]
        refs = []
        for b in bodies:
            s, r = c.post_json("/v1/chat/completions", b)
            assert s == 200, (s, r)
            refs.append(_tokens(r))
        assert c.metric("vllm:num_preemptions_total") == 0, "one at a time, nothing to preempt"

        multi = _multi_bodies(c)   # their answers alone, on decode-0

        def run_on_decode0_then(start_target, multi=()):
            """The four at once (and the n > 1 requests of multi), all dispatched to decode-0 (the
            only decode worker then) while the prefill worker is stopped; the target starts and
            registers before anything runs."""
            pre = c.procs["prefill-0"]
            every = list(bodies) + [b for b, _ in multi]
            with concurrent.futures.ThreadPoolExecutor(len(every)) as ex:
                pre.send_signal(signal.SIGSTOP)
                try:
                    jobs = [ex.submit(c.post_json, "/v1/chat/completions", b) for b in every]
                    wait_for(lambda: c.metric("prism:router_requests_in_flight") == len(every), 10,
                             "every request dispatched")
                    start_target()
                    wait_for(lambda: c.metric("prism:worker_heartbeats_total", worker="decode-1"), 30,
                             "decode-1 registered")
                    free1 = c.metric("prism:worker_kv_free_blocks", worker="decode-1")   # idle: its whole pool
                finally:
                    pre.send_signal(signal.SIGCONT)
                res = [f.result() for f in jobs]
            for i, (s, r) in enumerate(res):
                assert s == 200, (i, s, r)
                if i < len(bodies):
                    assert _tokens(r) == refs[i], ("answer changed by preemption", i)
                else:   # n > 1: its choices stay on decode-0 (they cannot move), the others migrate
                    assert _choices(r) == multi[i - len(bodies)][1], ("an n > 1 answer changed by preemption", i)
            return free1

        computed = c.metric("prism:prefill_tokens_computed_total")
        free1 = run_on_decode0_then(lambda: c.start_worker("decode-1", "decode_worker"), multi)
        moved = c.metric("prism:preemptions_total", how="migrate")
        print("preemptions: %s migrated, %s recomputed" % (moved, c.metric("prism:preemptions_total", how="recompute")))
        assert moved > 0, "no sequence migrated"
        assert c.metric("vllm:num_preemptions_total") == moved + c.metric("prism:preemptions_total", how="recompute")
        hb = c.metric("prism:worker_heartbeats_total", worker="decode-0")
        wait_for(lambda: c.metric("prism:worker_heartbeats_total", worker="decode-0") > hb + 1, 10, "a fresh heartbeat")
        assert c.metric("prism:worker_preemptions_migrated_total", worker="decode-0") >= moved
        assert c.metric("prism:worker_kv_free_blocks", worker="decode-0") == 12, "blocks leaked on the source"
        hb = c.metric("prism:worker_heartbeats_total", worker="decode-1")
        wait_for(lambda: c.metric("prism:worker_heartbeats_total", worker="decode-1") > hb + 1, 10, "a fresh heartbeat")
        assert c.metric("prism:worker_kv_free_blocks", worker="decode-1") == free1, "blocks leaked on the target"
        print("prompt tokens prefilled with migration:", c.metric("prism:prefill_tokens_computed_total") - computed)

        # The target dies as the first migrated KV reaches it: those sequences are recomputed.
        c.kill("decode-1")
        wait_for(lambda: not c.metric("prism:worker_heartbeats_total", worker="decode-1"), 10, "decode-1 dropped")
        c.worker_env["decode_worker"] = {"PRISM_TEST_DIE_ON_MIGRATED_KV": "1"}
        recomputed = c.metric("prism:preemptions_total", how="recompute")
        computed = c.metric("prism:prefill_tokens_computed_total")
        run_on_decode0_then(lambda: c.start_worker("decode-1", "decode_worker"))
        assert c.procs["decode-1"].wait(timeout=10) == 3, "the target did not die mid-migration"
        assert c.metric("prism:preemptions_total", how="migrate") == moved, "a migration completed on a dead target"
        print("recomputed after the target died: %s (prompt tokens prefilled: %s)" % (
            c.metric("prism:preemptions_total", how="recompute") - recomputed,
            c.metric("prism:prefill_tokens_computed_total") - computed))

        # Clients that leave while their sequences migrate: the target is stopped (SIGSTOP) once
        # registered, so the KV decode-0 sent it waits there unread and the router still holds the
        # request at both; every stream is closed then. Both workers end with nothing running and
        # every block free.
        del c.worker_env["decode_worker"]
        # The n > 1 requests too: their choices (which stay on decode-0) are freed there as well.
        pre, sent = c.procs["prefill-0"], c.metric("prism:worker_preemptions_migrated_total", worker="decode-0")
        every = list(bodies) + [b for b, _ in multi]
        with concurrent.futures.ThreadPoolExecutor(len(every)) as ex:
            pre.send_signal(signal.SIGSTOP)
            try:
                jobs = [ex.submit(c.open_stream, "/v1/chat/completions", dict(b, stream=True)) for b in every]
                wait_for(lambda: c.metric("prism:router_requests_in_flight") == len(every), 10, "every request dispatched")
                c.start_worker("decode-1", "decode_worker")
                wait_for(lambda: c.metric("prism:worker_heartbeats_total", worker="decode-1"), 30, "decode-1 registered")
                free1 = c.metric("prism:worker_kv_free_blocks", worker="decode-1")
                c.procs["decode-1"].send_signal(signal.SIGSTOP)
            finally:
                pre.send_signal(signal.SIGCONT)
            try:
                streams = [f.result() for f in jobs]
                wait_for(lambda: c.metric("prism:worker_preemptions_migrated_total", worker="decode-0") > sent, 10,
                         "a sequence sent to the stopped target")
                for st in streams:
                    st.close()
                wait_for(lambda: c.metric("prism:router_requests_in_flight") == 0, 10, "every request ended")
            finally:
                c.procs["decode-1"].send_signal(signal.SIGCONT)
        for w, free in (("decode-0", 12), ("decode-1", free1)):
            hb = c.metric("prism:worker_heartbeats_total", worker=w)
            wait_for(lambda: c.metric("prism:worker_heartbeats_total", worker=w) > hb + 1, 10, "a fresh heartbeat")
            wait_for(lambda: (c.metric("prism:worker_running", worker=w), c.metric("prism:worker_kv_free_blocks",
                                                                                   worker=w)) == (0, free), 10,
                     "%s: nothing running, every block free" % w)
        # the target was told before it read the KV (the abort table is filled as the abort is read, and
        # the router links are read before the data socket): it never decoded for those clients
        assert c.metric("prism:worker_tokens_generated_total", worker="decode-1") == 0, "the target decoded for nobody"

        # The source dies while a migration is in flight (the target stopped again, the KV sent to it
        # unread): the router's decode-death migration covers it, every answer unchanged.
        c.kill("decode-1")
        wait_for(lambda: not c.metric("prism:worker_heartbeats_total", worker="decode-1"), 10, "decode-1 dropped")
        sent = c.metric("prism:worker_preemptions_migrated_total", worker="decode-0")

        def stopped_target():
            c.start_worker("decode-1", "decode_worker")
            wait_for(lambda: c.metric("prism:worker_heartbeats_total", worker="decode-1"), 30, "decode-1 registered")
            c.procs["decode-1"].send_signal(signal.SIGSTOP)
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
            pre.send_signal(signal.SIGSTOP)
            try:
                jobs = [ex.submit(c.post_json, "/v1/chat/completions", b) for b in bodies]
                wait_for(lambda: c.metric("prism:router_requests_in_flight") == len(bodies), 10, "every request dispatched")
                stopped_target()
            finally:
                pre.send_signal(signal.SIGCONT)
            try:
                wait_for(lambda: c.metric("prism:worker_preemptions_migrated_total", worker="decode-0") > sent, 10,
                         "a sequence sent to the stopped target")
                c.kill("decode-0")
            finally:
                c.procs["decode-1"].send_signal(signal.SIGCONT)
            res = [f.result() for f in jobs]
        for i, (s, r) in enumerate(res):
            assert s == 200, (i, s, r)
            assert _tokens(r) == refs[i], ("answer changed by the source's death", i)


def test_migration_in_bf16():
    """Preemption by migration with --kv-transfer-dtype bf16 on the source (issue 33): as above, four
    requests fill decode-0's 12 blocks and the sequences it preempts move to decode-1 (which sends
    f32 itself) in bf16: decode-0 sent exactly the migrated blocks (its log) at half their fp32 bytes
    (prism:worker_kv_sent_bytes_total). Every answer runs to the context's end and agrees with its
    answer alone (logprobs within 0.05) up to a near tie the rounding may flip (3/4 of the tokens in
    all at least), both workers end with every block free."""
    ctx = ["--context-length", "128"]
    tiny = ctx + ["--kv-blocks", "12", "--max-running-requests", "4", "--kv-transfer-dtype", "bf16",
                  "--log-level", "debug"]
    with Cluster(decodes=0, router_args=ctx, common_worker_args=FAST_HB,
                 worker_args={"prefill_worker": ctx, "decode_worker": ctx}) as c:
        c.start_worker("decode-0", "decode_worker", tiny)
        c.wait_ready()
        bodies = [chat_body("Tell me a long story about the colour %s." % col, temperature=0, ignore_eos=True,
                            logprobs=True, return_tokens_as_token_ids=True) for col in ("red", "green", "blue", "grey")]
        refs = []
        for b in bodies:   # alone: nothing preempted, no KV rounded
            s, r = c.post_json("/v1/chat/completions", b)
            assert s == 200, (s, r)
            refs.append(r)
        pre = c.procs["prefill-0"]
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
            pre.send_signal(signal.SIGSTOP)
            try:
                jobs = [ex.submit(c.post_json, "/v1/chat/completions", b) for b in bodies]
                wait_for(lambda: c.metric("prism:router_requests_in_flight") == len(bodies), 10, "every request dispatched")
                c.start_worker("decode-1", "decode_worker")
                wait_for(lambda: c.metric("prism:worker_heartbeats_total", worker="decode-1"), 30, "decode-1 registered")
                free1 = c.metric("prism:worker_kv_free_blocks", worker="decode-1")
            finally:
                pre.send_signal(signal.SIGCONT)
            res = [f.result() for f in jobs]
        agree, total = 0, 0
        for i, (s, r) in enumerate(res):
            assert s == 200, (i, s, r)
            assert _tokens(r)[1] == "length", (i, r)
            a, b = _tokens(r)[0], _tokens(refs[i])[0]
            same = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
            lp = [[e["logprob"] for e in x["choices"][0]["logprobs"]["content"]][:same] for x in (r, refs[i])]
            diff = max([abs(x - y) for x, y in zip(*lp)] or [0])
            print("answer %d: %d of %d tokens as alone, logprobs within %.2g" % (i, same, len(a), diff))
            assert diff < 0.05, (i, diff)   # seen: 0.012
            agree, total = agree + same, total + len(a)
        # KV rounded to bf16 may flip a near tie (the answer's tail differs from there: seen once, 17
        # tokens before the end); KV that is noise after a move makes the answer differ from there
        assert agree >= 0.75 * total, (agree, total)
        moved = c.metric("prism:preemptions_total", how="migrate")
        assert moved > 0, "no sequence migrated"
        with open(os.path.join(MODEL, "config.json")) as f:
            tc = json.load(f)["text_config"]
        block = tc["num_hidden_layers"] * 2 * 16 * tc["num_key_value_heads"] * tc["head_dim"] * 4   # fp32
        for w, free in (("decode-0", 12), ("decode-1", free1)):
            hb = c.metric("prism:worker_heartbeats_total", worker=w)
            wait_for(lambda: c.metric("prism:worker_heartbeats_total", worker=w) > hb + 1, 10, "a fresh heartbeat")
            assert (c.metric("prism:worker_running", worker=w), c.metric("prism:worker_kv_free_blocks", worker=w)) == \
                (0, free), "%s: blocks leaked" % w
        blocks = [int(b) for b in re.findall(r"migrated: \d+ tokens, (\d+) blocks to", c.log("decode-0", tail=0))]
        print("migrated: %d sequences, %s blocks" % (moved, blocks))
        assert len(blocks) == moved, blocks
        assert c.metric("prism:worker_kv_sent_bytes_total", worker="decode-0") == sum(blocks) * block // 2
        assert c.metric("prism:worker_kv_sent_bytes_total", worker="decode-1") == 0
        assert "malformed" not in c.log("decode-1", tail=0)


def test_worker_failure_fails_requests_cleanly():
    """A decode worker killed mid-generation: its requests end with a clean error (never a hang), the
    router stays up, and a replacement worker that registers serves the next request. (Without
    migration: with it, the request would wait for the replacement; test_faults.py covers that.)"""
    with Cluster(router_args=["--worker-timeout", "1.5", "--max-migrations", "0"], common_worker_args=FAST_HB) as c:
        c.wait_ready()
        body = chat_body("What is in the image?", [SMALL], max_tokens=1500, temperature=0, ignore_eos=True)
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            fut = ex.submit(c.request, "POST", "/v1/chat/completions", body)
            # kill it while it generates (state, not a guess: the decode worker reports it running)
            wait_for(lambda: c.metric("prism:worker_running", tier="decode"), 20, "the decode worker running")
            c.kill("decode-0")
            t0 = time.time()
            status, _, data = fut.result(timeout=30)
        assert status == 503, (status, data[:300])
        assert "stopped responding" in json.loads(data)["error"]["message"]
        assert time.time() - t0 < 10
        assert c.procs["router"].poll() is None
        status, _, _ = c.request("GET", "/ready")
        assert status == 503  # no decode worker left
        c.start_worker("decode-1", "decode_worker")
        c.wait_ready()
        s, r = c.post_json("/v1/chat/completions", chat_body("Describe the image.", [SMALL], max_tokens=4))
        assert s == 200, (s, r)


def test_busy_encoder_keeps_heartbeating():
    """An encoder decoding one 8192x8192 JPEG (over half a second on one core, four times the
    4096x4096 image's ~150 ms) with --worker-timeout 0.3: alive and working, it must not be dropped."""
    huge = make_image(os.path.join(TMP, "huge.jpg"), width=8192, height=8192, photo=True, quality=85, seed=9)
    px = ["--max-image-pixels", str(8192 * 8192)]
    # the image is larger than the default --max-image-bytes (20 MiB) too; a 128 MiB body (and a 96 MiB
    # download, the URL fetcher's row) needs more than the router's default 512 MiB plan holds
    with Cluster(router_args=["--worker-timeout", "0.3", "--max-body-bytes", "128M", "--max-image-bytes", "96M",
                              "--mem-budget", "1G", *px],
                 common_worker_args=FAST_HB,
                 worker_args={"encoder_worker": ["--embedding-cache-bytes", "0", *px]}) as c:
        c.wait_ready()
        s, r = c.post_json("/v1/chat/completions", chat_body("What is in the image?", [huge], max_tokens=2))
        assert s == 200, ("the request failed while its encoder was busy", s, r)
        assert "dropped" not in c.log("router", tail=0), c.log("router")[-600:]


def refused(c, reason):
    status, _, data = c.request("GET", "/metrics")
    m = re.search(r'prism:requests_refused_total\{reason="%s"\} (\S+)' % reason, data.decode())
    return float(m.group(1)) if m else 0.0


def test_stream_client_that_stops_reading_is_dropped():
    # finding 15: a client that does not read its SSE stream used to make the router queue the whole
    # answer; above --max-stream-pending-bytes it is dropped (workers aborted) and nothing piles up
    with Cluster(encoders=0, router_args=["--max-stream-pending-bytes", "64K"]) as c:
        deadline = time.time() + 60
        while True:  # text only: no encoder needed, so /ready (which wants one) is not the signal
            try:
                r = json.loads(c.request("GET", "/ready")[2])
                if r["prefills"] == 1 and r["decodes"] == 1:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
            assert time.time() < deadline
        body = json.dumps({"prompt": "A red circle", "max_tokens": 1500, "ignore_eos": True, "stream": True,
                           "logprobs": 5, "temperature": 0}).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", c.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        # do not read; the router must notice and drop us
        deadline = time.time() + 90
        while refused(c, "slow_client") < 1:
            assert time.time() < deadline, "the router kept queueing for a client that does not read"
            time.sleep(0.2)
        got = b""
        s.settimeout(10)
        try:
            while True:
                d = s.recv(65536)
                if not d:
                    break
                got += d
        except (ConnectionResetError, socket.timeout):
            pass
        s.close()
        assert b"[DONE]" not in got, "the dropped stream still completed"
        mem = [float(m.group(1)) for m in re.finditer(r'prism:router_memory_bytes\{\} (\S+)',
                                                        c.request("GET", "/metrics")[2].decode())]
        assert mem and mem[0] < 64 << 20, mem
        status, r = c.post_json("/v1/completions", {"prompt": "A red", "max_tokens": 3})
        assert status == 200, (status, r)


if __name__ == "__main__":
    sys.exit(run_tests([test_stream_client_that_stops_reading_is_dropped,
                        test_budget_too_small_refuses_to_start, test_budget_is_checked_against_the_whole_plan,
                        test_backpressure_and_flat_allocations,
                        test_decode_admission_waits_for_kv, test_decode_preempts_by_recompute_or_swap_and_priority_overtakes,
                        test_decode_preempts_by_migration_and_survives_the_target_dying, test_migration_in_bf16,
                        test_worker_failure_fails_requests_cleanly,
                        test_busy_encoder_keeps_heartbeating,
                        test_overload_burst_and_recovery, test_router_within_its_budget_under_a_burst,
                        test_every_worker_within_its_plan_under_load]))
