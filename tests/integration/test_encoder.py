"""The encoder worker end to end on CPU: streaming decode, its memory, and its embedding cache.

- no heap allocation on the image path, for every image kind (baseline, progressive, CMYK and
  grayscale JPEG; RGBA, interlaced, 16-bit, palette PNG): each worker's allocation counter is
  present, counts, and stays flat while serving; waits for the encoder's heartbeat that counted
  the images, not for a fixed time;
- decode memory: with little whole-image memory the encoder still serves a 4096x4096 JPEG and a
  2048x2048 PNG (they stream in rows) and refuses a progressive JPEG whose coefficients do not
  fit, with a 400 that says so;
- the embedding cache never answers a request from another image: a hit and a miss in one batch,
  with room for one entry, each keep their own embeddings.

Run: python3 tests/integration/test_encoder.py   (PRISM_BINARY_DIR=build dir)
"""
import concurrent.futures
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from cluster import Cluster, ROOT, chat_body, make_image, run_tests, MODEL  # noqa: E402

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


def encoder_lookups(c):
    m = metrics(c)
    return (m.get(("prism:worker_embedding_cache_hits_total", "encoder-0"), 0) +
            m.get(("prism:worker_embedding_cache_misses_total", "encoder-0"), 0))


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

        serve(0)   # warm-up: first use of every code path
        before = metrics(c)
        serve(1)
        serve(2)
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
    with Cluster(worker_args={"encoder_worker": ["--embedding-cache-bytes", str(emb + 64),
                                                 "--max-batch-images", "2"]}) as c:
        c.wait_ready()
        for rnd in range(6):
            ask(c, [a])            # a is the one cached entry
            got = ask(c, [a, b])   # a: hit, b: miss in the same batch
            assert [t for t, _ in got] == [t for t, _ in ref], ("round %d answered from another image" % rnd, got, ref)
            for (_, x), (_, y) in zip(got, ref):
                assert abs(x - y) < 1e-3, ("round %d: logprobs moved" % rnd, got, ref)


if __name__ == "__main__":
    sys.exit(run_tests([test_no_heap_allocations_for_any_image_kind, test_streaming_decode_memory,
                        test_cache_hit_keeps_its_own_embeddings]))
