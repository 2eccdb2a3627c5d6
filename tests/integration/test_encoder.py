"""The encoder worker end to end on CPU: streaming decode, its memory, and its embedding cache.

- no heap allocation on the image path, for every image kind (baseline, progressive, CMYK and
  grayscale JPEG; RGBA, interlaced, 16-bit, palette PNG): each worker's allocation counter is
  present, counts, and stays flat while serving; waits for the encoder's heartbeat that counted
  the images, not for a fixed time;
- decode memory: with little whole-image memory the encoder still serves a 4096x4096 JPEG and a
  2048x2048 PNG (they stream in rows) and refuses a progressive JPEG whose coefficients do not
  fit, with a 400 that says so;
- the embedding cache never answers a request from another image: a hit and a miss in one batch,
  with room for one entry, each keep their own embeddings;
- early encode: an image whose bytes are in goes to the encoder while the rest of its body is still
  being uploaded; the request then takes its embeddings from the cache, and its answer is the same;
- the image pool (issue 33): with two image threads two images of a batch decode at once (the
  heartbeat's peak of decodes in flight), and a small image is answered before a queue of large ones;
- an encoder's stage timings (`prism:worker_stage_seconds`) count every image once, also when its
  EncodeDone comes after the answer ended (test hook PRISM_TEST_DELAY_REPLIES_S), early jobs or not;
- `priority` (issue 28): a priority -10 image overtakes the encoder's queue, a priority -10 prompt the
  prefill worker's;
- `--overlap-decode` (issue 33): the next batch's images decode into a second pixel buffer while the
  tower reads this one's: every answer equals the one-batch-at-a-time cluster's; requests aborted
  while their images decode in the next batch are dropped, everything is freed, and the heap stays
  flat.

Run: python3 tests/integration/test_encoder.py   (PRISM_BINARY_DIR=build dir)
"""
import concurrent.futures
import json
import os
import re
import signal
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from cluster import (Cluster, ROOT, chat_body, check_answer, distinct_requests, make_image, read_response,  # noqa: E402
                     run_tests, MODEL)

TMP = tempfile.mkdtemp(prefix="prism-encoder-")
FIX = os.path.join(ROOT, "tests", "data", "image")
KINDS = [os.path.join(FIX, f) for f in (
    "jpeg_base_640x480.jpg", "jpeg_prog_800x600.jpg", "jpeg_cmyk_200x150.jpg", "jpeg_gray_300x500.jpg",
    "png_rgba_256x384.png", "png_rgba_interlaced_97x61.png", "png_rgb16_100x80.png", "png_palette_trns_200x200.png",
    "png_gray_trns_120x120.png")]
HB = ["--heartbeat-interval", "0.1"]
WORKERS = ("encoder-0", "prefill-0", "decode-0")


def metrics(c):
    status, _, data = c.request("GET", "/metrics")
    assert status == 200
    out = {}
    for line in data.decode().splitlines():
        m = re.match(r'(prism:worker_[a-z_]+)\{tier="(\w+)",worker="([^"]+)"\} (\S+)', line)
        if m:
            out[(m.group(1), m.group(3))] = float(m.group(4))
    return out


def wait_for(what, pred, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError("timed out waiting for " + what)


def fresh_heartbeats(c, worker="encoder-0", n=2):
    """Waits until worker has sent n more heartbeats: its numbers read afterwards were taken after
    everything that happened before this call (a state, not a fixed sleep)."""
    start = c.metric("prism:worker_heartbeats_total", worker=worker)
    assert start is not None, "prism:worker_heartbeats_total is missing for %s" % worker
    wait_for("%d fresh heartbeats from %s" % (n, worker),
             lambda: c.metric("prism:worker_heartbeats_total", worker=worker) >= start + n)


def encoder_lookups(c):
    m = metrics(c)
    return (m.get(("prism:worker_embedding_cache_hits_total", "encoder-0"), 0) +
            m.get(("prism:worker_embedding_cache_misses_total", "encoder-0"), 0))


def misses_hits(c):
    m = metrics(c)
    return (m.get(("prism:worker_embedding_cache_misses_total", "encoder-0")),
            m.get(("prism:worker_embedding_cache_hits_total", "encoder-0")))


def idle(c):
    m = metrics(c)
    return all(m.get(("prism:worker_running", w)) == 0 and m.get(("prism:worker_waiting", w)) == 0 for w in WORKERS)


def test_no_heap_allocations_for_any_image_kind():
    # cache off: every request decodes its image
    with Cluster(worker_args={"encoder_worker": HB + ["--embedding-cache-bytes", "0"], "prefill_worker": HB,
                              "decode_worker": HB}) as c:
        c.wait_ready()
        sent = [0]

        def serve(rnd):
            bodies = [chat_body("Round %d, image %d: what is in it?" % (rnd, i), [f], max_tokens=3)
                      for i, f in enumerate(KINDS)]
            with concurrent.futures.ThreadPoolExecutor(4) as ex:
                res = list(ex.map(lambda b: c.post_json("/v1/chat/completions", b), bodies))
            assert all(s == 200 for s, _ in res), [(s, r) for s, r in res if s != 200][:2]
            sent[0] += len(bodies)
            # the encoder's heartbeat after its last batch, then every worker done
            wait_for("encoder heartbeat", lambda: encoder_lookups(c) >= sent[0])
            wait_for("idle workers", lambda: idle(c))

        # warm-up: first use of every code path. Two rounds: how 4 concurrent requests batch varies
        # from round to round, and one round did not always reach every path (a single allocation
        # in the measured rounds, in prefill or decode, about every other run on a 2-core machine)
        serve(0)
        serve(1)
        before = metrics(c)
        serve(2)
        serve(3)
        after = metrics(c)
        for w in WORKERS:
            key = ("prism:worker_heap_allocations_total", w)
            # the counter must exist and count (start-up allocates), or this test proves nothing
            assert key in before and key in after, ("allocation metric missing", w, sorted(after)[:5])
            assert before[key] > 0, (w, before[key])
            assert after[key] == before[key], ("heap allocations on the request path", w, before[key], after[key])


def test_streaming_decode_memory():
    big_jpg = make_image(os.path.join(TMP, "big.jpg"), width=4096, height=4096, photo=True, seed=5)
    big_png = make_image(os.path.join(TMP, "big.png"), width=2048, height=2048, shape="square", color="blue")
    prog = make_image(os.path.join(TMP, "prog.jpg"), width=2048, height=2048, photo=True, progressive=True)
    # 1M pixels of whole-image memory: 3 MiB, far less than a 2048x2048 progressive JPEG's coefficients
    with Cluster(worker_args={"encoder_worker": ["--max-decode-pixels", "1000000"]}) as c:
        c.wait_ready()
        for img in (big_jpg, big_png):
            s, r = c.post_json("/v1/chat/completions", chat_body("What is in the image?", [img], max_tokens=4))
            assert s == 200, (img, s, r)
        s, r = c.post_json("/v1/chat/completions", chat_body("What is in the image?", [prog], max_tokens=4))
        assert s == 400, (s, r)
        msg = r["error"]["message"]
        assert "progressive JPEG needs" in msg and "decode memory" in msg, msg
        assert all(c.alive().values())
        s, r = c.post_json("/v1/chat/completions", chat_body("What is in the image?", [KINDS[0]], max_tokens=4))
        assert s == 200, (s, r)


def test_cache_hit_keeps_its_own_embeddings():
    """Audit finding: with one cache entry, a request whose first image is a hit and second a miss
    (one batch) got the miss's embeddings for both: the miss evicted and overwrote the entry the
    hit still pointed at. Each answer must equal the answer computed without the cache."""
    with open(os.path.join(MODEL, "config.json")) as f:
        cfg = json.load(f)
    emb = cfg["image_seq_length"] * cfg["text_config"]["hidden_size"] * 4
    a = make_image(os.path.join(TMP, "a.jpg"), width=320, height=240, shape="circle", color="red")
    b = make_image(os.path.join(TMP, "b.png"), width=300, height=200, shape="triangle", color="blue",
                   background="black")

    def ask(c, imgs):
        body = chat_body("Describe both images.", imgs, max_tokens=4, temperature=0, ignore_eos=True,
                         logprobs=True)
        s, r = c.post_json("/v1/chat/completions", body)
        assert s == 200, (s, r)
        return [(e["token"], e["logprob"]) for e in r["choices"][0]["logprobs"]["content"]]

    with Cluster(worker_args={"encoder_worker": ["--embedding-cache-bytes", "0"]}) as c:
        c.wait_ready()
        ref = ask(c, [a, b])
        alias = ask(c, [b, b])   # what the bug answers
    assert [t for t, _ in ref] != [t for t, _ in alias] or any(
        abs(x - y) > 1e-3 for (_, x), (_, y) in zip(ref, alias)), "images too alike to tell"
    # without early encodes: they would cache b before its request's batch (then a hit too), and the
    # hit-and-miss batch this guards would never form; and with the hit held until the batch's tower
    # has run (test hook PRISM_TEST_HOLD_READY, as when the prefill's pool is full): a hit is sent
    # before the tower runs otherwise, and a miss's put could not reach it in time
    with Cluster(router_args=["--no-early-encode"], worker_env={"encoder_worker": {"PRISM_TEST_HOLD_READY": "1"}},
                 worker_args={"encoder_worker": ["--embedding-cache-bytes", str(emb + 64),
                                                 "--max-batch-images", "2"]}) as c:
        c.wait_ready()
        for rnd in range(6):
            ask(c, [a])            # a is the one cached entry
            got = ask(c, [a, b])   # a: hit, b: miss in the same batch
            assert [t for t, _ in got] == [t for t, _ in ref], ("round %d answered from another image" % rnd, got, ref)
            for (_, x), (_, y) in zip(got, ref):
                assert abs(x - y) < 1e-3, ("round %d: logprobs moved" % rnd, got, ref)


def test_image_encoded_before_the_body_ends():
    """A client uploads an image request and stops right after the image's data URL: the image is
    encoded meanwhile (the router sent it to the encoder's cache as soon as its bytes were in; the
    request itself does not exist yet, and the early job's encoder slot is free again). Once the rest
    of the body arrives, the request is answered from the cache, with the answer it gets otherwise.
    A request whose early job is still held takes it over: its image is encoded once. The early job
    carries its request's trace id."""
    body, ref = distinct_requests(TMP, max_tokens=8)[1]
    raw = json.dumps(body).encode()
    url = body["messages"][0]["content"][0]["image_url"]["url"].encode()
    cut = raw.index(url) + len(url) + 1   # just past the data URL's closing quote
    with Cluster(router_args=["--timing-header", "--worker-timeout", "60"],
                 worker_args={"encoder_worker": HB + ["--log-level", "debug"]}) as c:
        c.wait_ready()
        lookups = encoder_lookups(c)
        s = socket.create_connection(("127.0.0.1", c.port), timeout=60)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(raw) + raw[:cut])
        wait_for("the early encode", lambda: c.metric("prism:router_early_encodes_total") == 1)
        wait_for("the encoder to encode it", lambda: encoder_lookups(c) == lookups + 1)

        def encoder_free():
            st, _, data = c.request("GET", "/status")
            enc = [w for w in json.loads(data)["workers"] if w["tier"] == "encoder"]
            return st == 200 and enc and enc[0]["inflight"] == 0
        wait_for("the early job's encoder slot back", encoder_free)
        assert c.metric("prism:router_requests_in_flight") == 0   # the request is not there yet
        s.sendall(raw[cut:])
        status, headers, data = read_response(s)
        s.close()
        check_answer(status, json.loads(data), ref, "early-encoded request")
        assert "cache_hits=1" in headers["x-prism-timing"], headers["x-prism-timing"]
        # the early job carried the trace its request got (the client sent none: the router made it),
        # so the encoder's lines about the job are found by the request's trace id
        trace = headers["traceparent"].split("-")[1]
        early_lines = [l for l in c.log("encoder-0", tail=0).splitlines() if l.endswith("an early job")]
        assert early_lines and all("trace=%s " % trace in l for l in early_lines), (trace, early_lines)
        fresh_heartbeats(c)
        # encoded once: the early job's miss; the request found that result, which is no repeat (not a hit)
        assert misses_hits(c) == (1, 0), misses_hits(c)
        assert c.metric("prism:router_early_encodes_failed_total") == 0
        # a body sent whole: the request comes while its early job is still held (the encoder is
        # stopped meanwhile): the request takes the job over; the image is encoded once
        body2, ref2 = distinct_requests(TMP, max_tokens=8)[2]
        enc = c.procs["encoder-0"]
        enc.send_signal(signal.SIGSTOP)
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as ex:
                fut = ex.submit(c.post_json, "/v1/chat/completions", body2)
                wait_for("its dispatch", lambda: c.metric("prism:router_early_encodes_adopted_total") == 1)
                enc.send_signal(signal.SIGCONT)
                status, r = fut.result()
        finally:
            enc.send_signal(signal.SIGCONT)
        check_answer(status, r, ref2, "whole body")
        assert c.metric("prism:router_early_encodes_total") == 2
        wait_for("its lookup", lambda: encoder_lookups(c) >= lookups + 2)
        fresh_heartbeats(c)   # numbers taken after its end: no second lookup came
        # taken over while queued, or found done: encoded once either way, no hit counted
        assert misses_hits(c) == (2, 0), misses_hits(c)
        assert c.metric("prism:router_early_encodes_failed_total") == 0


def test_early_job_of_a_hung_encoder_is_let_go():
    """An early job whose encoder hangs (SIGSTOP) holds its slot only until --stage-timeout: then the
    router aborts and forgets it (counted as failed), and the slot is back; the request, once its body
    is whole, is encoded as usual when the encoder moves again. An encoder without a cache gets no
    early jobs."""
    body, ref = distinct_requests(TMP, max_tokens=8)[3]
    raw = json.dumps(body).encode()
    url = body["messages"][0]["content"][0]["image_url"]["url"].encode()
    cut = raw.index(url) + len(url) + 1
    with Cluster(router_args=["--stage-timeout", "2", "--worker-timeout", "60"], worker_args={"encoder_worker": HB}) as c:
        c.wait_ready()
        enc = c.procs["encoder-0"]
        enc.send_signal(signal.SIGSTOP)
        try:
            s = socket.create_connection(("127.0.0.1", c.port), timeout=60)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(raw) + raw[:cut])
            wait_for("the early encode", lambda: c.metric("prism:router_early_encodes_total") == 1)
            wait_for("the early job let go", lambda: c.metric("prism:router_early_encodes_failed_total") == 1, 30)
            st, _, data = c.request("GET", "/status")
            assert [w["inflight"] for w in json.loads(data)["workers"] if w["tier"] == "encoder"] == [0]
        finally:
            enc.send_signal(signal.SIGCONT)
        s.sendall(raw[cut:])
        status, _, data = read_response(s)
        s.close()
        check_answer(status, json.loads(data), ref, "after the hung early job")
    with Cluster(worker_args={"encoder_worker": ["--embedding-cache-bytes", "0"]}) as c:
        c.wait_ready()
        status, r = c.post_json("/v1/chat/completions", body)
        check_answer(status, r, ref, "encoder without a cache")
        assert c.metric("prism:router_early_encodes_total") == 0


def early_images(n, size=256, first=0):
    """n distinct photo-like JPEGs (distinct bytes: distinct cache keys), seeds first.. first + n - 1."""
    return [make_image(os.path.join(TMP, "early%d_%d.jpg" % (size, first + i)), width=size, height=size, photo=True,
                       seed=1000 + first + i) for i in range(n)]


def cut_body(images, **kw):
    """A chat body with these images, and the offset just past the last image's data URL."""
    body = chat_body("What is this?", images, max_tokens=1, temperature=0, **kw)
    raw = json.dumps(body).encode()
    url = body["messages"][0]["content"][len(images) - 1]["image_url"]["url"].encode()
    return raw, raw.index(url) + len(url) + 1


def send_part(c, raw, upto):
    s = socket.create_connection(("127.0.0.1", c.port), timeout=60)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(raw) + raw[:upto])
    return s


def encoder_inflight(c, tier="encoder"):
    st, _, data = c.request("GET", "/status")
    return [w["inflight"] for w in json.loads(data)["workers"] if w["tier"] == tier][0]


def test_early_jobs_of_bodies_that_never_become_requests_are_aborted():
    """Issue 26 finding 5: early encodes ran for bodies that never became requests, and nothing
    aborted them when the client hung up (8 abandoned bodies cost 16 encodes). Now a body whose
    client leaves, whose request is refused (by the router or by the HTTP server), aborts its early
    jobs at once: the encoder's slots come back without waiting for --stage-timeout. One connection
    holds at most 4 unanswered early jobs (its further images wait for their request)."""
    imgs = early_images(15)   # each used once: an image sent to the encoder lately goes there no more
    with Cluster(router_args=["--worker-timeout", "60", "--stage-timeout", "60"],
                 worker_args={"encoder_worker": HB}) as c:
        c.wait_ready()
        enc = c.procs["encoder-0"]
        enc.send_signal(signal.SIGSTOP)   # nothing is answered: only an abort frees the slots
        try:
            early = lambda: c.metric("prism:router_early_encodes_total")
            gone = lambda: c.metric("prism:router_early_encodes_abandoned_total")
            # the client hangs up after two images
            raw, cut = cut_body(imgs[:2])
            s = send_part(c, raw, cut)
            wait_for("two early encodes", lambda: early() == 2 and encoder_inflight(c) == 2)
            s.close()
            wait_for("their slots back after the hang-up", lambda: encoder_inflight(c) == 0, 10)
            assert gone() == 2
            # the router refuses the request (an unknown model) once its body is in
            raw, _ = cut_body(imgs[2:4], model="no-such-model")
            status, _, data = c.request("POST", "/v1/chat/completions", raw)
            assert status == 404, data
            wait_for("the refused request's early jobs aborted", lambda: gone() == 4 and encoder_inflight(c) == 0, 10)
            assert early() == 4
            # the HTTP server refuses the body (a third image's bad base64) after two were told
            bad = chat_body("What is this?", imgs[4:6], max_tokens=1)
            bad["messages"][0]["content"].insert(2, {"type": "image_url",
                                                     "image_url": {"url": "data:image/jpeg;base64,QU!D"}})
            status, _, data = c.request("POST", "/v1/chat/completions", bad)
            assert status == 400 and b"base64" in data, data
            assert early() > 4   # the images before the refused one (told as they passed)
            wait_for("the refused body's early jobs aborted", lambda: gone() == early() and encoder_inflight(c) == 0, 10)
            sent = early()
            # one connection: four unanswered early jobs at most; another connection has its own share
            raw, cut = cut_body(imgs[6:12])
            s1 = send_part(c, raw, cut)
            raw2, cut2 = cut_body(imgs[12:14])
            wait_for("the first connection's share", lambda: early() == sent + 4)
            s2 = send_part(c, raw2, cut2)
            wait_for("the second connection's", lambda: early() == sent + 6)
            time.sleep(0.3)
            assert early() == sent + 6 and encoder_inflight(c) == 6, (early() - sent, encoder_inflight(c))
            s1.close()
            s2.close()
            wait_for("every slot back", lambda: encoder_inflight(c) == 0, 10)
            assert gone() == early()
        finally:
            enc.send_signal(signal.SIGCONT)
        body = chat_body("What is this?", imgs[14:15], max_tokens=2, temperature=0)
        status, r = c.post_json("/v1/chat/completions", body)
        assert status == 200, r


def test_requests_come_before_early_jobs():
    """Issue 26 finding 5: a real request waited 28 s behind early jobs of abandoned bodies. Now
    (1) a request that finds every encoder slot held takes one from a running early job (the router
    aborts it: prism:router_early_encodes_preempted_total) instead of waiting in the router's queue,
    and (2) an encoder runs a request's image before any early job queued ahead of it."""
    imgs = early_images(4, first=100)
    mine = early_images(1, first=200)
    with Cluster(router_args=["--worker-timeout", "60", "--stage-timeout", "60"],
                 worker_args={"encoder_worker": HB + ["--max-queued-images", "4", "--max-batch-images", "4"]}) as c:
        c.wait_ready()
        enc = c.procs["encoder-0"]
        enc.send_signal(signal.SIGSTOP)
        try:
            raw, cut = cut_body(imgs)
            s = send_part(c, raw, cut)
            wait_for("four early jobs filling the encoder", lambda: encoder_inflight(c) == 4)
            with concurrent.futures.ThreadPoolExecutor(1) as ex:
                fut = ex.submit(c.post_json, "/v1/chat/completions", chat_body("Hi", mine, max_tokens=1))
                wait_for("the request sent to the encoder, not queued",
                         lambda: c.metric("prism:router_early_encodes_preempted_total") == 1, 20)
                st, _, data = c.request("GET", "/status")
                assert json.loads(data)["requests_queued"] == 0 and encoder_inflight(c) == 4
                enc.send_signal(signal.SIGCONT)
                status, r = fut.result(60)
            assert status == 200, r
            s.close()
        finally:
            enc.send_signal(signal.SIGCONT)
    # (2) sixteen early jobs queued on the encoder, then a request: its image is encoded first
    imgs = early_images(16, size=1024, first=300)
    with Cluster(router_args=["--worker-timeout", "60", "--stage-timeout", "60"],
                 worker_args={"encoder_worker": HB + ["--max-batch-images", "1"]}) as c:
        c.wait_ready()
        enc = c.procs["encoder-0"]
        enc.send_signal(signal.SIGSTOP)
        socks = []
        try:
            for k in range(4):
                raw, cut = cut_body(imgs[4 * k:4 * k + 4])
                socks.append(send_part(c, raw, cut))
            wait_for("sixteen early jobs", lambda: encoder_inflight(c) == 16)
            with concurrent.futures.ThreadPoolExecutor(1) as ex:
                fut = ex.submit(c.post_json, "/v1/chat/completions", chat_body("Hi", mine, max_tokens=1))
                wait_for("the request sent to the encoder", lambda: encoder_inflight(c) == 17)
                t0 = time.time()
                enc.send_signal(signal.SIGCONT)
                status, r = fut.result(60)
                took, left = time.time() - t0, encoder_inflight(c)
            assert status == 200, r
            wait_for("the early jobs done", lambda: encoder_inflight(c) == 0, 60)
            all_s = time.time() - t0
            print("  a request behind 16 early jobs answered in %.2f s, %d early jobs still to encode (all done "
                  "in %.2f s)" % (took, left, all_s))
            assert left >= 4, "the request's image waited for %d early jobs" % (16 - left)
        finally:
            enc.send_signal(signal.SIGCONT)
            for s in socks:
                s.close()


def post_timed(c, body):
    status, r = c.post_json("/v1/chat/completions", body)
    return status, r, time.perf_counter()


def post_staged(c, body):
    """post_timed, with the answer's stages (x-prism-timing's stages_ms: the router's --timing-header)
    in place of the answer."""
    status, headers, _ = c.request("POST", "/v1/chat/completions", body)
    t = dict(kv.split("=") for kv in {k.lower(): v for k, v in headers.items()}.get("x-prism-timing", "").split())
    return status, dict((k, float(v)) for k, v in (x.split(":") for x in t["stages_ms"].split(","))), time.perf_counter()


def queue_on_stopped_encoder(c, groups, tier="encoder", post=post_timed):
    """Sends each group of chat bodies while the encoder (or the prefill worker: tier) is stopped,
    waiting after each group until the router has handed them to it (so they queue there in that
    order), then lets it go: [(status, answer, finish time)] per group."""
    enc = c.procs[tier + "-0"]
    enc.send_signal(signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(sum(len(g) for g in groups)) as ex:
            futs, n = [], 0
            for g in groups:
                futs.append([ex.submit(post, c, b) for b in g])
                n += len(g)
                wait_for("%d requests at the %s" % (n, tier), lambda: encoder_inflight(c, tier) == n, 30)
            enc.send_signal(signal.SIGCONT)
            return [[f.result(60) for f in fs] for fs in futs]
    finally:
        enc.send_signal(signal.SIGCONT)


def test_images_decode_at_once():
    """Two image threads: the images of a batch decode at once, not one after another (the peak of
    decodes in flight, from the encoder's heartbeat, is 2; one thread at a time would make it 1)."""
    imgs = early_images(6, size=1536, first=500)
    with Cluster(worker_args={"encoder_worker": HB + ["--image-threads", "2", "--max-batch-seconds", "0",
                                                      "--embedding-cache-bytes", "0"]}) as c:
        c.wait_ready()
        assert c.metric("prism:worker_image_decodes_peak", worker="encoder-0") == 0
        res = queue_on_stopped_encoder(c, [[chat_body("What is this?", [p], max_tokens=1) for p in imgs]])[0]
        assert all(s == 200 for s, _, _ in res), [r for s, r, _ in res if s != 200][:2]
        fresh_heartbeats(c)
        peak = c.metric("prism:worker_image_decodes_peak", worker="encoder-0")
        print("  most images decoded at once: %s" % peak)
        assert peak == 2, "decodes ran one at a time (peak %s)" % peak


def test_small_image_not_behind_large_ones():
    """Six 2048 px images queued on the encoder, then a 512 px one: one image per batch and one
    image thread, so only the order decides; the small one goes before the large ones still queued
    (they were first in arrival order). The queue's waits are timed (the encoder_queue stage)."""
    large = early_images(6, size=2048, first=600)
    small = early_images(1, size=512, first=700)
    with Cluster(worker_args={"encoder_worker": HB + ["--image-threads", "1", "--max-batch-images", "1",
                                                      "--embedding-cache-bytes", "0"]}) as c:
        c.wait_ready()
        big, little = queue_on_stopped_encoder(c, [[chat_body("What is this?", [p], max_tokens=1) for p in large],
                                                   [chat_body("And this?", small, max_tokens=1)]])
        assert all(s == 200 for s, _, _ in big + little), [r for s, r, _ in big + little if s != 200][:2]
        after = sum(t > little[0][2] for _, _, t in big)
        print("  large images answered after the small one: %d of %d" % (after, len(big)))
        assert after >= 3, "the small image waited for %d of the %d large ones queued before it" % (6 - after, 6)
        # their waits in the encoder's queue are timed (EncodeDone.queue_ms): served one at a time, the
        # images waited in all about three times their decodes (k-th waits for the k-1 before it)
        stage = lambda name: c.metric("prism:worker_stage_seconds_sum", worker="encoder-0", stage=name)
        assert c.metric("prism:worker_stage_seconds_count", worker="encoder-0", stage="encoder_queue") == 7
        assert stage("encoder_queue") >= stage("image_decode") > 0, (stage("encoder_queue"), stage("image_decode"))
        assert c.metric("prism:request_stage_seconds_sum", stage="encoder_queue") >= stage("image_decode")


def test_encoder_timed_when_its_answer_comes_after_the_request():
    """The encoder sends EncodeDone once the prefill worker has the image's embeddings, so a short
    answer can end before the router hears it (CI once saw 6 of 7 encoder_queue observations in
    test_small_image_not_behind_large_ones). Test hook PRISM_TEST_DELAY_REPLIES_S=2 on the encoder
    holds each EncodeDone 2 s: every one-token answer ends first (its x-prism-timing shows no vision
    tower time: the router had not heard the encoder), yet the encoder's encoder_queue count rises by
    exactly the number of images: the late answers are still timed, each once (the router remembers
    the images it let go unanswered: router_sched_encode_let_go)."""
    imgs = early_images(3, size=256, first=1000)
    with Cluster(router_args=["--timing-header", "--no-early-encode", "--worker-timeout", "30"],
                 worker_env={"encoder_worker": {"PRISM_TEST_DELAY_REPLIES_S": "2"}},
                 worker_args={"encoder_worker": HB + ["--embedding-cache-bytes", "0"]}) as c:
        c.wait_ready()
        count = lambda: c.metric("prism:worker_stage_seconds_count", worker="encoder-0", stage="encoder_queue") or 0
        assert count() == 0

        def post(body):
            status, headers, data = c.request("POST", "/v1/chat/completions", body)
            assert status == 200, (status, data[:200])
            t = dict(kv.split("=") for kv in {k.lower(): v for k, v in headers.items()}["x-prism-timing"].split())
            return float(t["vit_ms"])

        with concurrent.futures.ThreadPoolExecutor(len(imgs)) as ex:
            vit = list(ex.map(post, [chat_body("What is this?", [p], max_tokens=1) for p in imgs]))
        late = sum(v == 0 for v in vit)
        print("  answers that ended before their EncodeDone came: %d of %d (vit_ms %s)" % (late, len(imgs), vit))
        assert late >= 1, "every EncodeDone came before its answer ended: the test proves nothing (%s)" % vit
        wait_for("%d encoder_queue observations" % len(imgs), lambda: count() >= len(imgs), 30)
        fresh_heartbeats(c)   # nothing more comes: each image timed once
        assert count() == len(imgs), count()
        assert c.metric("prism:worker_stage_seconds_count", worker="encoder-0", stage="vit") == len(imgs)
        assert c.metric("prism:worker_stage_seconds_sum", worker="encoder-0", stage="vit") > 0


def test_early_encoded_image_timed_once():
    """The same with early encode on (and the embedding cache): each image goes to the encoder first
    as an early job (its own id), then with its request, which takes the job over or finds its result
    in the cache. Both answers are held 2 s; the early job's is not the request's and is never timed,
    the request's is timed once, however late: the encoder_queue count rises by exactly the number of
    images (early jobs counted too would make it twice that)."""
    imgs = early_images(2, size=256, first=1010)
    with Cluster(router_args=["--worker-timeout", "30"],
                 worker_env={"encoder_worker": {"PRISM_TEST_DELAY_REPLIES_S": "2"}},
                 worker_args={"encoder_worker": HB}) as c:
        c.wait_ready()
        count = lambda: c.metric("prism:worker_stage_seconds_count", worker="encoder-0", stage="encoder_queue") or 0
        with concurrent.futures.ThreadPoolExecutor(len(imgs)) as ex:
            res = list(ex.map(lambda p: c.post_json("/v1/chat/completions", chat_body("What is this?", [p], max_tokens=1)),
                              imgs))
        assert all(st == 200 for st, _ in res), res
        assert c.metric("prism:router_early_encodes_total") == len(imgs)
        wait_for("%d encoder_queue observations" % len(imgs), lambda: count() >= len(imgs), 30)
        fresh_heartbeats(c)   # the encoder's replies all forwarded (its I/O thread heartbeats after them)
        assert count() == len(imgs), count()


def test_priority_first_in_encoder_and_prefill_queues():
    """Issue 28: `priority` orders the workers' own queues, not only the router's. Five images of
    priority 0 queued on the stopped encoder (one image per batch, one image thread: only the order
    decides), then one of priority -10: it waits in the encoder's queue (its encoder_queue stage) less
    than most of them. Then the same on the stopped prefill worker with six long text prompts (its
    prefill_queue stage). (Up to two may go before it: the worker may start the first its I/O thread
    hands it before the rest are in, and the encoder decodes the next batch during the tower
    (--overlap-decode), so a second may start at once too. The five are 1024 px images, a few
    milliseconds of decode each, so that the I/O thread has handed over the rest by then: with 384 px
    ones a loaded machine let the worker take two before the last message was in.)"""
    imgs = early_images(5, size=1024, first=800) + early_images(1, size=384, first=805)
    with Cluster(router_args=["--timing-header"],
                 worker_args={"encoder_worker": HB + ["--image-threads", "1", "--max-batch-images", "1",
                                                      "--embedding-cache-bytes", "0"]}) as c:
        c.wait_ready()
        # prefill: distinct long prompts (no shared prefix to cache), each a few milliseconds of prefill
        text = lambda k: "Story %d. " % k + " ".join("word%d" % (k * 1000 + i) for i in range(150))
        for tier, stage, low, high in (
                ("encoder", "encoder_queue", [chat_body("What is this?", [p], max_tokens=1) for p in imgs[:5]],
                 chat_body("And this?", imgs[5:], max_tokens=1, priority=-10)),
                ("prefill", "prefill_queue", [chat_body(text(k), max_tokens=1) for k in range(5)],
                 chat_body(text(9), max_tokens=1, priority=-10))):
            low, high = queue_on_stopped_encoder(c, [low, [high]], tier=tier, post=post_staged)
            assert all(s == 200 for s, _, _ in low + high)
            waits = [st[stage] for _, st, _ in low]
            after = sum(w > high[0][1][stage] for w in waits)
            print("  %s: %s ms for the priority -10 request, %s for the five of priority 0 queued before it"
                  % (stage, high[0][1][stage], waits))
            assert after >= 3, "the %s took %d of the 5 priority 0 requests before the priority -10 one" % (tier, 5 - after)


def overlap_images():
    """Six images that answer differently (shapes and colours), of the size class that batches
    together, and two large photos (a decode long enough to run during the tower)."""
    shapes = [("circle", "red"), ("square", "blue"), ("triangle", "green"), ("circle", "yellow"),
              ("square", "white"), ("triangle", "red")]
    imgs = [make_image(os.path.join(TMP, "ov%d.png" % i), width=400 + 16 * i, height=300, shape=sh, color=co,
                       background="black" if i % 2 else "white") for i, (sh, co) in enumerate(shapes)]
    return imgs + early_images(2, size=1536, first=900)


def ask_logprobs(c, body):
    s, r = c.post_json("/v1/chat/completions", body)
    assert s == 200, (s, r)
    return [(e["token"], e["logprob"]) for e in r["choices"][0]["logprobs"]["content"]]


def test_overlap_keeps_every_batch_its_own_pixels():
    """--overlap-decode on: eight images queued on the stopped encoder, one image per batch, so every
    batch's tower runs while the next one's image decodes into the other pixel buffer. Every answer
    (tokens and logprobs) equals the one the same images get one batch at a time (--overlap-decode
    off, asked one by one): a batch that encoded another batch's pixels, or pixels being overwritten,
    answers differently."""
    imgs = overlap_images()
    bodies = [chat_body("Describe the image.", [p], max_tokens=4, temperature=0, ignore_eos=True, logprobs=True)
              for p in imgs]
    common = HB + ["--embedding-cache-bytes", "0", "--max-batch-images", "1", "--image-threads", "2"]
    with Cluster(router_args=["--no-early-encode"],
                 worker_args={"encoder_worker": common + ["--overlap-decode", "off"]}) as c:
        c.wait_ready()
        ref = [ask_logprobs(c, b) for b in bodies]
    assert len({tuple(t for t, _ in r) for r in ref}) >= 3, ("images too alike to tell apart", ref)
    with Cluster(router_args=["--no-early-encode"],
                 worker_args={"encoder_worker": common + ["--overlap-decode", "on"]}) as c:
        c.wait_ready()
        for rnd in range(2):
            with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
                enc = c.procs["encoder-0"]
                enc.send_signal(signal.SIGSTOP)
                try:
                    futs = [ex.submit(ask_logprobs, c, b) for b in bodies]
                    wait_for("%d requests at the encoder" % len(bodies), lambda: encoder_inflight(c) == len(bodies), 30)
                finally:
                    enc.send_signal(signal.SIGCONT)
                got = [f.result(120) for f in futs]
            for i, (g, r) in enumerate(zip(got, ref)):
                assert [t for t, _ in g] == [t for t, _ in r], ("round %d image %d answered from other pixels" % (rnd, i), g, r)
                for (_, x), (_, y) in zip(g, r):
                    assert abs(x - y) < 1e-3, ("round %d image %d: logprobs moved" % (rnd, i), g, r)


def test_overlap_abort_frees_everything():
    """--overlap-decode on: eight 2048 px photos queued on the stopped encoder (one image per batch).
    Once its heartbeat shows a batch running (the first image decoded, in the tower, the second
    decoding in the next batch), every other client hangs up: the aborted images are dropped (the
    one in the next batch at least: its log says so), the others answered, the encoder ends idle
    with every job freed, the heap flat, and it serves again."""
    imgs = early_images(8, size=2048, first=950)
    with Cluster(router_args=["--no-early-encode"],
                 worker_args={"encoder_worker": HB + ["--embedding-cache-bytes", "0", "--max-batch-images", "1",
                                                      "--image-threads", "2", "--overlap-decode", "on"]}) as c:
        c.wait_ready()
        for p in imgs[:2]:   # first use of each path (two batches: the overlap's too)
            ask_logprobs(c, chat_body("Warm up.", [p], max_tokens=2, logprobs=True))
        wait_for("idle workers", lambda: idle(c))
        fresh_heartbeats(c)
        heap0 = c.metric("prism:worker_heap_allocations_total", worker="encoder-0")
        dropped0 = c.log("encoder-0", tail=0).count("dropped from the batch")
        enc = c.procs["encoder-0"]
        enc.send_signal(signal.SIGSTOP)
        socks = []
        try:
            for i, p in enumerate(imgs):
                raw = json.dumps(chat_body("Image %d?" % i, [p], max_tokens=2)).encode()
                socks.append(send_part(c, raw, len(raw)))
            wait_for("%d requests at the encoder" % len(imgs), lambda: encoder_inflight(c) == len(imgs), 30)
        finally:
            enc.send_signal(signal.SIGCONT)
        wait_for("a batch in the tower", lambda: c.metric("prism:worker_running", worker="encoder-0") >= 1, 30)
        for s in socks[1::2]:
            s.close()   # the router aborts them at the encoder: queued, or in a batch
        answered = 0
        for s in socks[0::2]:
            s.settimeout(120)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            answered += data.startswith(b"HTTP/1.1 200")
            s.close()
        assert answered == len(socks[0::2]), answered
        wait_for("idle workers", lambda: idle(c))
        wait_for("encoder empty", lambda: encoder_inflight(c) == 0)
        # aborts that reached an image in a batch (decoding in the next one, or in the tower), not only queued ones
        dropped = c.log("encoder-0", tail=0).count("dropped from the batch") - dropped0
        print("  aborted images dropped from a batch: %d of %d" % (dropped, len(socks[1::2])))
        assert dropped >= 1, "no abort reached an image in a batch: the test did not test the overlap"
        fresh_heartbeats(c)
        assert c.metric("prism:worker_heap_allocations_total", worker="encoder-0") == heap0
        ask_logprobs(c, chat_body("Again?", [imgs[3]], max_tokens=2, logprobs=True))


if __name__ == "__main__":
    sys.exit(run_tests([test_no_heap_allocations_for_any_image_kind, test_streaming_decode_memory,
                        test_cache_hit_keeps_its_own_embeddings, test_image_encoded_before_the_body_ends,
                        test_early_job_of_a_hung_encoder_is_let_go,
                        test_early_jobs_of_bodies_that_never_become_requests_are_aborted,
                        test_requests_come_before_early_jobs, test_images_decode_at_once,
                        test_small_image_not_behind_large_ones,
                        test_encoder_timed_when_its_answer_comes_after_the_request, test_early_encoded_image_timed_once,
                        test_priority_first_in_encoder_and_prefill_queues,
                        test_overlap_keeps_every_batch_its_own_pixels, test_overlap_abort_frees_everything]))
