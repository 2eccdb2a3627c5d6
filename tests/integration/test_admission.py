"""The router's admission limits and timeouts, each driven into its state deterministically (a request
held open, a body half sent, a worker slot taken), then checked the way a client sees it: status,
OpenAI error body, Retry-After on every 429/503, the refusal counted under its reason in /metrics,
and normal service once the cause is gone.

  --api-key                      401 without / with a wrong key; the API works with it; /health is open
  --max-running-requests         429 when that many requests are in flight
  --max-image-bytes-in-flight    an image upload beyond it waits (reading paused); text requests go on;
                                 503 after --max-queue-wait
  --max-body-bytes-in-flight     a body beyond it waits (reading paused); 503 after --max-queue-wait
  --http-min-body-rate           uploads the router paused longer than the grace are not 408s
  --max-queue-wait               503 for a request that waited that long for a free worker
  --request-timeout              a request still running then ends (SSE error when streaming), and
                                 the decode worker is told to stop
  no worker of a tier            503 (and /ready 503)
  prefill --orphan-timeout       embeddings whose request never arrives are dropped (default 120 s),
                                 freeing the receive-pool slot that held requests back
  prefill --embed-pool-images    a prompt whose images need more than the whole pool: 400 at once,
                                 naming the flag; a pool full of prompts that each wait for images
                                 that cannot come (beside an orphan, or two two-image prompts each
                                 holding one): the youngest gets a 503 after a second (no hang)

Run: python3 tests/integration/test_admission.py [test names]   (PRISM_BINARY_DIR=build dir)
"""
import concurrent.futures
import json
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from cluster import (Cluster, assert_abort_stopped_decode, binary, chat_body, check_answer, make_image,  # noqa: E402
                     reference, run_tests, run_tool, wait_for, work_counters, MODEL)

TMP = tempfile.mkdtemp(prefix="prism-admission-")
JPG = make_image(os.path.join(TMP, "red_circle.jpg"), width=640, height=480, shape="circle", color="red")
PNG = make_image(os.path.join(TMP, "blue_square.png"), width=300, height=200, shape="square", color="blue",
                 background="gray")
GREEN = make_image(os.path.join(TMP, "green_circle.jpg"), width=320, height=240, shape="circle", color="green")
FAST_HB = ["--heartbeat-interval", "0.1"]
with open(os.path.join(MODEL, "config.json")) as f:
    CFG = json.load(f)


def long_stream_body(images=()):
    """A request that generates for seconds: ignore_eos up to most of the context."""
    return chat_body("Hi" if not images else "What is in the image?", list(images), max_tokens=1800,
                     temperature=0, ignore_eos=True, stream=True)


def hold_stream(c, images=()):
    """Starts a long streaming request and returns it once tokens flow (it holds its slot)."""
    s = c.open_stream("/v1/chat/completions", long_stream_body(images))
    while True:
        ev = s.next_event()
        assert isinstance(ev, dict) and "error" not in ev, ev
        if ev["choices"] and ev["choices"][0]["delta"].get("content"):
            return s


def refused(c, reason):
    return c.metric("prism:requests_refused_total", reason=reason) or 0


def expect_refusal(c, status_want, text, reason, body, **kw):
    """Sends body, expects status_want with an OpenAI error containing text and Retry-After, and the
    refusal counted under reason."""
    before = refused(c, reason)
    status, headers, data = c.request("POST", "/v1/chat/completions", body, **kw)
    assert status == status_want, (status, data[:300])
    err = json.loads(data)["error"]
    assert text in err["message"] and err["type"], err
    hdrs = {k.lower(): v for k, v in headers.items()}
    assert hdrs.get("retry-after", "").isdigit(), ("no Retry-After on a %d" % status, headers)
    assert refused(c, reason) == before + 1, (reason, before, refused(c, reason))
    return err


def test_api_key():
    with Cluster(router_args=["--api-key", "sekret-0123456789"]) as c:
        c.wait_ready()
        body = chat_body("Hi", max_tokens=2)
        # wrong, absent, another scheme, and the key's prefixes and extensions: the whole key, its
        # length too (an empty or partial token must not pass a comparison that stops early)
        k = "sekret-0123456789"
        for hdr in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": k},
                    {"Authorization": "Bearer " + k + "2"}, {"Authorization": "Basic " + k},
                    {"Authorization": "Bearer "}, {"Authorization": "Bearer"}, {"Authorization": "Bearer " + k[:-1]},
                    {"Authorization": "Bearer s"}, {"Authorization": "Bearer " + k + k},
                    {"Authorization": "Bearer " + k + " "}, {"Authorization": "Bearer  " + k}):
            for method, path, b in (("POST", "/v1/chat/completions", body), ("GET", "/v1/models", None),
                                    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                                    ("POST", "/tokenize", {"prompt": "Hi"}), ("POST", "/detokenize", {"tokens": [1]}),
                                    ("GET", "/v1/models/prism-tiny-llava", None), ("GET", "/status", None),
                                    ("GET", "/metrics", None)):
                status, _, data = c.request(method, path, b, headers=hdr)
                assert status == 401, (hdr, path, status, data[:200])
                err = json.loads(data)["error"]
                assert err["type"] == "AuthenticationError" and err["message"], err
        ok = {"Authorization": "Bearer sekret-0123456789"}
        status, _, data = c.request("POST", "/v1/chat/completions", body, headers=ok)
        assert status == 200, (status, data[:200])
        status, events, done = c.stream("/v1/chat/completions", dict(body, stream=True), headers=ok)
        assert status == 200 and done, (status, events[-1:])
        assert c.request("GET", "/v1/models", headers=ok)[0] == 200
        assert c.request("GET", "/metrics", headers=ok)[0] == 200
        assert c.request("GET", "/health")[0] == 200  # liveness probes carry no key
        assert c.request("GET", "/ready")[0] == 200


def test_requests_in_flight_429():
    with Cluster(router_args=["--max-running-requests", "2"]) as c:
        c.wait_ready()
        held = [hold_stream(c), hold_stream(c)]
        assert c.metric("prism:router_requests_in_flight") == 2
        expect_refusal(c, 429, "at capacity", "queue_full", chat_body("Hi", max_tokens=2))
        for s in held:
            s.close()
        wait_for(lambda: c.metric("prism:router_requests_in_flight") == 0, 30, "the held requests to go")
        status, r = c.post_json("/v1/chat/completions", chat_body("Hi", max_tokens=2))
        assert status == 200, (status, r)


def hold_image_frozen(c):
    """An image request that holds its image bytes in the router for as long as the test wants: it
    streams, and once its first token came, its decode worker is stopped (SIGSTOP) mid-generation.
    Returns (stream, the stopped worker's process); SIGCONT it to let the request end."""
    def running():
        return [lb["worker"] for name, lb, v in c.metrics()
                if name == "prism:worker_running" and lb.get("tier") == "decode" and v >= 1]
    wait_for(lambda: not running(), 20, "the decode workers idle (an earlier request's heartbeat gone)")
    s = hold_stream(c, [JPG])
    wid = wait_for(lambda: len(running()) == 1 and running()[0], 20, "the decode worker running the held request")
    p = c.procs[wid]
    p.send_signal(signal.SIGSTOP)
    return s, p


def test_image_bytes_in_flight_wait():
    """Image bytes held at --max-image-bytes-in-flight: a new image upload is not refused, the router
    stops reading it (counted in prism:router_uploads_paused_total) while text requests go on, and
    serves it once the held image is gone; one that waits longer than --max-queue-wait gets 503 +
    Retry-After, counted under queue_wait."""
    size = os.path.getsize(JPG)
    wait_s = 4
    # two decode workers: one is stopped holding the image request, the other serves the rest; the
    # stopped one must not be given up on meanwhile (its request would migrate and end)
    with Cluster(decodes=2, router_args=["--max-image-bytes-in-flight", str(size), "--max-queue-wait", str(wait_s),
                                         "--worker-timeout", "60"], common_worker_args=FAST_HB) as c:
        c.wait_ready()
        image_body = chat_body("What is in the image?", [JPG], max_tokens=2)
        s, frozen = hold_image_frozen(c)
        try:
            assert c.metric("prism:router_image_bytes_in_flight") == size
            paused0 = c.metric("prism:router_uploads_paused_total")
            out = {}
            t = threading.Thread(target=lambda: out.update(r=c.post_json("/v1/chat/completions", image_body)))
            t.start()
            wait_for(lambda: c.metric("prism:router_uploads_paused_total") > paused0, 10, "the image upload paused")
            status, r = c.post_json("/v1/chat/completions", chat_body("Hi", max_tokens=2))  # no image: goes on
            assert status == 200, (status, r)
            assert t.is_alive(), ("the image request was answered while the image bytes were spent", out)
            assert c.metric("prism:router_image_bytes_in_flight") == size  # nothing of it taken yet
        finally:
            frozen.send_signal(signal.SIGCONT)
        s.close()
        t.join(60)
        assert out["r"][0] == 200, out["r"]
        # waiting past --max-queue-wait: 503 + Retry-After, counted; the held request is not hurt
        wait_for(lambda: c.metric("prism:router_image_bytes_in_flight") == 0, 30, "image bytes released")
        s, frozen = hold_image_frozen(c)
        try:
            assert c.metric("prism:router_image_bytes_in_flight") == size
            t0 = time.time()
            expect_refusal(c, 503, "waited too long", "queue_wait", image_body, timeout=120)
            assert time.time() - t0 >= wait_s - 1, time.time() - t0
        finally:
            frozen.send_signal(signal.SIGCONT)
        ev = s.next_event()
        assert isinstance(ev, dict) and "error" not in ev, ev
        s.close()
        wait_for(lambda: c.metric("prism:router_image_bytes_in_flight") == 0, 30, "image bytes released")
        status, r = c.post_json("/v1/chat/completions", image_body)
        assert status == 200, (status, r)


def test_body_bytes_in_flight_pause():
    """A body beyond --max-body-bytes-in-flight is not refused: the router stops reading it (TCP
    backpressure) and serves it once the held body is gone; one paused longer than --max-queue-wait
    gets 503 + Retry-After after its upload, counted under body_bytes_inflight."""
    limit = 1 << 20
    wait_s = 8
    with Cluster(router_args=["--max-body-bytes-in-flight", str(limit), "--max-queue-wait", str(wait_s)]) as c:
        c.wait_ready()
        # a: a valid request padded with JSON whitespace to exactly the budget, sent but for its last
        # 50 KB; bodies are charged as their bytes arrive (their buffer, which by then covers the
        # declared length), so wait until the router holds the whole budget
        body = json.dumps(chat_body("Hi", max_tokens=2)).encode()
        body += b" " * (limit - len(body))
        small = json.dumps(chat_body("Hi", max_tokens=2)).encode()
        small += b" " * (200_000 - len(small))

        def hold():
            a = socket.create_connection(("127.0.0.1", c.port), timeout=60)
            a.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body))
            a.sendall(body[:limit - 50_000])
            wait_for(lambda: (c.metric("prism:router_body_bytes_in_flight") or 0) >= limit, 30, "the budget held")
            return a

        def finish(a):
            a.sendall(body[limit - 50_000:])
            resp = b""
            while b"\r\n\r\n" not in resp:
                resp += a.recv(65536)
            assert resp.startswith(b"HTTP/1.1 200"), resp[:200]
            a.close()

        # b waits while a holds the budget, then is served: 200 for both, nothing refused
        before = refused(c, "body_bytes_inflight")
        a = hold()
        out = {}
        t = threading.Thread(target=lambda: out.update(b=c.request("POST", "/v1/chat/completions", small, timeout=120)))
        t.start()
        t.join(1.0)
        assert t.is_alive(), ("b was answered while the budget was spent", out)
        finish(a)
        t.join(120)
        assert out["b"][0] == 200, (out["b"][0], out["b"][2][:200])
        assert refused(c, "body_bytes_inflight") == before
        # b paused longer than --max-queue-wait: 503 + Retry-After, counted; a is still served
        a = hold()
        t0 = time.time()
        expect_refusal(c, 503, "in flight", "body_bytes_inflight", small, timeout=120)
        assert time.time() - t0 >= wait_s - 1, time.time() - t0
        finish(a)
        status, _, data = c.request("POST", "/v1/chat/completions", small)
        assert status == 200, (status, data[:200])


def test_paused_uploads_are_not_slow_clients():
    """A burst of image uploads that the router pauses longer than the body-rate grace (10 s) is
    answered 200, never 408: the time the router does not read, and the client's way back after it
    (a TCP sender whose window was closed for seconds probes it again only after a back-off), are
    not the client's slowness. Each client here lags 5 s before its image starts (inside the grace),
    is paused ~12 s (the image bytes are held by a stopped request), and comes back 7 s after the
    router resumes reading: the router judged the body from its headers with the pause taken out,
    so the 5 s + 7 s counted against a 10 s grace (408); a pause now starts a new grace."""
    size = os.path.getsize(JPG)
    n, lag_s, pause_s, back_s = 6, 5.0, 12.0, 7.0
    with Cluster(decodes=2, router_args=["--max-image-bytes-in-flight", str(size), "--max-queue-wait", "100",
                                         "--http-min-body-rate", "1M", "--worker-timeout", "100"],
                 common_worker_args=FAST_HB) as c:
        c.wait_ready()
        body = json.dumps(chat_body("What is in the image?", [JPG], max_tokens=2, temperature=0)).encode()
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body))
        at = body.index(b'{"type": "image_url"')       # chat_body: the image parts come first
        cut = body.index(b"base64,") + 200             # into the image: the lifter has seen it
        resumed = threading.Event()
        out = [None] * n

        def client(i):
            s = socket.create_connection(("127.0.0.1", c.port), timeout=120)
            try:
                s.sendall(head + body[:at])
                time.sleep(lag_s)                      # slow, but inside the grace
                s.sendall(body[at:cut])                # the image starts: paused (its bytes are held)
                resumed.wait(120)
                time.sleep(back_s)                     # back after the pause, later than the grace left
                s.sendall(body[cut:])
                resp = b""
                while b"\r\n\r\n" not in resp:
                    d = s.recv(65536)
                    if not d:
                        break
                    resp += d
                out[i] = resp[:200]
            except OSError as e:                       # a 408 closes the connection under the upload
                out[i] = b"connection: %r" % e
            finally:
                s.close()

        s, frozen = hold_image_frozen(c)
        try:
            paused0 = c.metric("prism:router_uploads_paused_total")
            threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
            t0 = time.time()
            for t in threads:
                t.start()
            wait_for(lambda: c.metric("prism:router_uploads_paused_total") >= paused0 + n, 30, "every upload paused")
            time.sleep(max(0.0, t0 + lag_s + pause_s - time.time()))
        finally:
            frozen.send_signal(signal.SIGCONT)
        s.close()
        wait_for(lambda: c.metric("prism:router_image_bytes_in_flight") == 0, 30, "the held image released")
        resumed.set()
        for t in threads:
            t.join(120)
        statuses = [o[9:12] if o and o.startswith(b"HTTP/1.1") else o for o in out]
        assert all(st == b"200" for st in statuses), statuses
        assert (c.metric("prism:requests_refused_total", reason="body_bytes_inflight") or 0) == 0


def test_max_queue_wait_503():
    # --worker-timeout: the stopped decode worker stays registered (its missed heartbeats would drop
    # it after the default 10 s, and a request wrongly sent to it would then fail another way)
    with Cluster(router_args=["--max-queue-wait", "1", "--worker-timeout", "60"],
                 worker_args={"decode_worker": ["--max-running-requests", "1"]}) as c:
        c.wait_ready()
        s = hold_stream(c)  # the only decode slot
        # ... held for as long as the test needs, however fast this machine decodes: decode-0 stopped.
        # Left running, the held answer (not read here) ends within a second either way: done on a
        # fast machine, or its client dropped by --max-stream-pending-bytes once the router queued
        # 100 KiB of it (0.85 s on a 2-core machine), and the waiting request went (200, not 503).
        dec = c.procs["decode-0"]
        dec.send_signal(signal.SIGSTOP)
        try:
            t0 = time.time()
            # a bounded wait: a request let through to the stopped worker would hang (its slot miscounted)
            expect_refusal(c, 503, "waited too long", "queue_wait", chat_body("Hi", max_tokens=2), timeout=20)
            waited = time.time() - t0
        finally:
            dec.send_signal(signal.SIGCONT)
        assert 0.9 <= waited < 15, waited  # upper bound: the wait ended (slack for sanitizer builds on a loaded CI)
        s.close()
        status, r = c.post_json("/v1/chat/completions", chat_body("Hi", max_tokens=2))
        assert status == 200, (status, r)


def test_request_timeout_ends_stream_and_aborts():
    # 1800 tokens of the bundled model take at least 3.6 s with the decode's steps 2 ms apart (test
    # hook; unpaced a faster decode once finished them inside the deadline): a deadline well inside
    # that (the router checks deadlines every 250 ms)
    with Cluster(router_args=["--request-timeout", "0.4"], common_worker_args=FAST_HB,
                 worker_args={"decode_worker": ["--log-level", "debug"]},
                 worker_env={"decode_worker": {"PRISM_TEST_DECODE_STEP_GAP_S": "0.002"}}) as c:
        c.wait_ready()
        t0 = time.time()
        before = work_counters(c)
        s = c.open_stream("/v1/chat/completions", long_stream_body())
        n_tokens, events = 0, []
        while True:
            ev = s.next_event()
            if ev is None:
                break
            events.append(ev)
            if isinstance(ev, dict) and ev.get("choices") and ev["choices"][0]["delta"].get("content"):
                n_tokens += 1
        elapsed = time.time() - t0
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert errors and "timed out" in errors[0]["error"]["message"], events[-3:]
        assert events[-1] == "[DONE]", events[-2:]
        # a decode that ignored the abort would sample the 1800 - n_tokens left: more than a quarter
        assert n_tokens < 1800 * 3 // 4, "the request ran nearly to its end before its deadline: no abort to check"
        assert 0.3 <= elapsed < 15, elapsed
        # the decode worker was told to stop, and stopped. The tokens the client got were sampled
        # before the abort: only those after it count (taken whole, they passed the quarter of 1800 on
        # a machine that samples ~1200 a second: 460-760 in 0.4 s, failing 4 runs of 4)
        c.wait_log("decode-0", "aborted", timeout=30)
        assert_abort_stopped_decode(c, dict(before, tokens=before["tokens"] + n_tokens), 1800, timeout=30)
        # non-streaming: a clean 503
        status, _, data = c.request("POST", "/v1/chat/completions", dict(long_stream_body(), stream=False))
        assert status == 503 and "timed out" in json.loads(data)["error"]["message"], (status, data[:200])


def test_no_worker_of_a_tier_503():
    # a request waits for a worker of the empty tier (a restarted one registers within seconds;
    # test_faults); after --max-queue-wait it gets 503 naming the tier
    with Cluster(router_args=["--worker-timeout", "1", "--max-queue-wait", "1"], common_worker_args=FAST_HB) as c:
        c.wait_ready()
        c.kill("decode-0")
        wait_for(lambda: c.request("GET", "/ready")[0] == 503, 30, "/ready to say 503")
        status, headers, _ = c.request("GET", "/ready")
        assert {k.lower(): v for k, v in headers.items()}.get("retry-after"), headers
        expect_refusal(c, 503, "No decode worker", "no_workers", chat_body("Hi", max_tokens=2))


def test_orphan_embeddings_dropped():
    """Embeddings for a request the prefill worker never gets (an encoder result whose request was
    refused or aborted) take a receive-pool slot: --orphan-timeout frees it, and before that new
    embeddings push the oldest orphan out once orphans fill half the pool (here: the only slot), so
    an orphan never holds an image request back."""
    with Cluster(common_worker_args=FAST_HB,
                 worker_args={"prefill_worker": ["--embed-pool-images", "1", "--orphan-timeout", "2"]}) as c:
        c.wait_ready()
        log = c.wait_log("prefill-0", "ready in")
        endpoint = re.search(r"data (tcp://[^,\s]+)", log).group(1)
        wait_for(lambda: c.metric("prism:worker_pool_free", tier="prefill") == 1, 30, "a heartbeat with the pool")
        tc = CFG["text_config"]

        def orphan(rid):
            run_tool([binary("prism_wire"), "--endpoint", endpoint, "--request-id", str(rid), "--router-id",
                      "no-such-router", "--n-tokens", str(CFG["image_seq_length"]), "--hidden", str(tc["hidden_size"]),
                      *c.sec], timeout=30)
            wait_for(lambda: c.metric("prism:worker_pool_free", tier="prefill") == 0, 30, "the orphan in the pool")

        orphan(999998)
        wait_for(lambda: c.metric("prism:worker_pool_free", tier="prefill") == 1, 30, "the orphan timed out")
        assert "dropping embeddings of request 999998: no prefill request came" in c.log("prefill-0", tail=0)
        orphan(999999)
        t0 = time.time()
        try:
            status, r = c.post_json("/v1/chat/completions", chat_body("What is in the image?", [JPG], max_tokens=4),
                                    timeout=30)
        except OSError as e:
            raise AssertionError("the image request never completed: the orphan kept the only pool slot (%r)" % e)
        assert status == 200, (status, r)
        assert "dropping embeddings of request 999999" in c.log("prefill-0", tail=0)
        assert time.time() - t0 < 30, time.time() - t0
        wait_for(lambda: c.metric("prism:worker_pool_free", tier="prefill") == 1, 30, "the pool slot free")


def post_in_time(c, body, limit=30):
    """A request that must be answered well before the router's --request-timeout (a hang fails)."""
    t0 = time.time()
    try:
        status, r = c.post_json("/v1/chat/completions", body, timeout=limit)
    except OSError as e:
        raise AssertionError("no answer in %d s: the request hangs (%r)" % (limit, e))
    return status, r, time.time() - t0


def test_prompt_larger_than_pool_refused():
    """A two-image prompt on a prefill whose pool holds one image (--embed-pool-images 1) can never
    be served (its first image would wait for room its own holds): a 400 at once naming the flag,
    not a wait until --request-timeout; the pool is free again and a one-image request is served."""
    with Cluster(common_worker_args=FAST_HB, worker_args={"prefill_worker": ["--embed-pool-images", "1"]}) as c:
        c.wait_ready()
        status, r, took = post_in_time(c, chat_body("What is in the images?", [JPG, PNG], max_tokens=4, temperature=0))
        assert status == 400, (status, r)
        assert "--embed-pool-images 1" in r["error"]["message"], r
        assert took < 10, took
        ref = reference([JPG], "What is in the image?", 4)
        status, r, _ = post_in_time(c, chat_body("What is in the image?", [JPG], max_tokens=4, temperature=0))
        check_answer(status, r, ref, "one image after the refusal")
        wait_for(lambda: c.metric("prism:worker_pool_free", tier="prefill") == 1, 30, "the pool free again")


def test_full_pool_stall_broken():
    """A pool of three images, one held by embeddings whose Prefill has not come (an orphan: under
    half the pool, so not pushed out), and a three-image prompt beside a one-image one: the
    three-image prompt fits the pool alone, but with the orphan its first two images fill it and
    nothing can go on (the data socket is not read: its third image never comes). Before, it waited
    for --orphan-timeout (here 600 s: the router's timeout first); now the stalled prompt gets a 503
    about a second later, the one-image prompt is answered as prism_generate, and so is one after."""
    pre = ["--embed-pool-images", "3", "--orphan-timeout", "600"]
    with Cluster(common_worker_args=FAST_HB, worker_args={"prefill_worker": pre}) as c:
        c.wait_ready()
        log = c.wait_log("prefill-0", "ready in")
        endpoint = re.search(r"data (tcp://[^,\s]+)", log).group(1)
        wait_for(lambda: c.metric("prism:worker_pool_free", tier="prefill") == 3, 30, "a heartbeat with the pool")
        run_tool([binary("prism_wire"), "--endpoint", endpoint, "--request-id", "999997", "--router-id",
                  "no-such-router", "--n-tokens", str(CFG["image_seq_length"]), "--hidden",
                  str(CFG["text_config"]["hidden_size"]), *c.sec], timeout=30)
        wait_for(lambda: c.metric("prism:worker_pool_free", tier="prefill") == 2, 30, "the orphan in the pool")
        assert c.metric("prism:worker_prefill_pool_breaks_total", tier="prefill") == 0
        ref = reference([PNG], "What is in the image?", 4)
        three = chat_body("What is in the images?", [JPG, PNG, GREEN], max_tokens=4, temperature=0)
        one = chat_body("What is in the image?", [PNG], max_tokens=4, temperature=0)
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            f3 = ex.submit(post_in_time, c, three)
            time.sleep(0.2)
            f1 = ex.submit(post_in_time, c, one)
            (s3, r3, took), (s1, r1, _) = f3.result(), f1.result()
        assert s3 == 503 and "embedding pool is full" in r3["error"]["message"], (s3, r3)
        assert took < 15, took
        check_answer(s1, r1, ref, "the one-image prompt beside the stalled one")
        assert "the youngest gives its pages back" in c.log("prefill-0", tail=0)
        # counted where it is exported: the router's /metrics, from the prefill's heartbeat
        wait_for(lambda: c.metric("prism:worker_prefill_pool_breaks_total", tier="prefill") == 1, 30,
                 "the stall broken once in the prefill's counter")
        status, r, _ = post_in_time(c, one)
        check_answer(status, r, ref, "after the stall")


def inflight(c, tier):
    st, _, data = c.request("GET", "/status")
    return [w["inflight"] for w in json.loads(data)["workers"] if w["tier"] == tier][0]


def test_two_prompts_each_holding_one_image():
    """Two two-image prompts on a prefill pool of two images: each fits alone, but with the encoder
    sending A's first image, then B's, the pool is full with one image of each and neither can go on
    (the data socket is not read, so their second images never come). The order is made so: both
    queued on the stopped encoder (one image a batch, one image thread, no cache), each a small
    image (<= 1 MP) then a large one, and the encoder takes small images before large (job_rank).
    Before, both waited until --request-timeout; now B (the younger) gets a 503 about a second
    later and A is answered as prism_generate; B sent again is served. (The encoder may take A's
    large image before B's small one is in its table: then nothing stalls and the pair is sent
    again, under a new cache_salt, up to three times.)"""
    big_a = make_image(os.path.join(TMP, "big_a.jpg"), width=1400, height=1000, shape="circle", color="yellow")
    big_b = make_image(os.path.join(TMP, "big_b.jpg"), width=1400, height=1000, shape="square", color="white")
    a_imgs, b_imgs = [JPG, big_a], [PNG, big_b]
    with Cluster(common_worker_args=FAST_HB, router_args=["--no-early-encode"],
                 worker_args={"prefill_worker": ["--embed-pool-images", "2"],
                              "encoder_worker": ["--image-threads", "1", "--max-batch-images", "1",
                                                 "--embedding-cache-bytes", "0"]}) as c:
        c.wait_ready()
        ref_a = reference(a_imgs, "What is in the images?", 4)
        body = lambda imgs, salt: chat_body("What is in the images?", imgs, max_tokens=4, cache_salt=salt, temperature=0)
        broken = lambda: c.log("prefill-0", tail=0).count("the youngest gives its pages back")
        enc = c.procs["encoder-0"]
        for attempt in range(3):
            salt = "stall-%d" % attempt
            enc.send_signal(signal.SIGSTOP)
            try:
                with concurrent.futures.ThreadPoolExecutor(2) as ex:
                    fa = ex.submit(post_in_time, c, body(a_imgs, salt))
                    wait_for(lambda: inflight(c, "encoder") == 2, 30, "A's images at the encoder")
                    fb = ex.submit(post_in_time, c, body(b_imgs, salt))
                    wait_for(lambda: inflight(c, "encoder") == 4, 30, "B's images at the encoder")
                    enc.send_signal(signal.SIGCONT)
                    (sa, ra, _), (sb, rb, took) = fa.result(), fb.result()
            finally:
                enc.send_signal(signal.SIGCONT)
            check_answer(sa, ra, ref_a, "A, the older prompt")
            if broken() == 0:
                assert sb == 200, ("no stall, yet B failed", sb, rb)
                print("  attempt %d: the encoder sent A's images first, nothing stalled" % attempt)
                continue
            assert broken() == 1, broken()
            assert sb == 503 and "embedding pool is full" in rb["error"]["message"], (sb, rb)
            assert took < 15, took
            break
        else:
            raise AssertionError("no stall in three attempts: the test proved nothing")
        # B again: served, and answered as prism_generate. (Every body here is greedy: with the API's
        # default temperature of 1 the answers were sampled, and once in a while differed from the
        # greedy reference, in CI too; that was the "answered differently" once taken for a bug.)
        status, r, _ = post_in_time(c, body(b_imgs, "again"))
        check_answer(status, r, reference(b_imgs, "What is in the images?", 4), "B sent again")

if __name__ == "__main__":
    sys.exit(run_tests([test_api_key, test_requests_in_flight_429, test_image_bytes_in_flight_wait,
                        test_body_bytes_in_flight_pause, test_paused_uploads_are_not_slow_clients,
                        test_max_queue_wait_503,
                        test_request_timeout_ends_stream_and_aborts, test_no_worker_of_a_tier_503,
                        test_orphan_embeddings_dropped, test_prompt_larger_than_pool_refused,
                        test_full_pool_stall_broken, test_two_prompts_each_holding_one_image]))
