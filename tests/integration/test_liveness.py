"""Busy is not dead: workers stay responsive while they compute (real processes on loopback).

An encoder with a CLIP-L/336-shaped vision tower (width 1024, 16 heads, MLP 4096, 577 tokens per
image; --random-weights, fewer layers than the real 24 to keep the test short) takes seconds per
image on one CPU thread — at least twice the --worker-timeout the router is given here:

- requests are served while others queue, and no heartbeat is missed (no worker is dropped);
- a request cancelled in the middle of a batch leaves it between two layers: the encoder logs how
  long after the abort arrived its image was dropped, which must be within one layer's time, and
  the other image of the batch completes;
- SIGSTOP on a worker (no heartbeats at all) is still detected as dead, and it rejoins after SIGCONT;
- a compute thread that stops making progress while its I/O thread heartbeats (the compiled-in
  test hook PRISM_TEST_STALL_AFTER_LAYERS) is detected as stuck: its request fails with a 503 that
  says so, prism:workers_lost_total{reason="stuck"} counts it, and the process is left alone.
"""
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from cluster import Cluster, binary, chat_body, make_image, reference, run_tests, MODEL  # noqa: E402

TMP = tempfile.mkdtemp(prefix="prism-liveness-")
# The CLIP-L cluster's tower must be slow enough that a batch of two images outlasts the worker
# timeout twice (busy_encoder_is_not_dead fails if it ever does not). Release: 24 layers take ~5 s per
# image, against a 1 s timeout. Under the sanitizers the matmul kernels are built at -O2 (the packed
# AVX-512 tiles), so a layer costs little more than in release: 16 layers took 7.2 s for two images,
# under the 10 s the 5 s timeout needs (CI failed so); 32 take ~14 s.
SANITIZED = bool(os.environ.get("ASAN_OPTIONS"))
VISION_LAYERS = int(os.environ.get("PRISM_TEST_CLIP_LAYERS", "32" if SANITIZED else "24"))
# router --worker-timeout in the CLIP-L cluster. Under the sanitizers a worker's I/O thread, one more
# instrumented thread on a loaded machine, can be off the CPU for over a second; the images there
# take tens of seconds, so a longer timeout keeps the premise (an image outlasts it twice).
WORKER_TIMEOUT = float(os.environ.get("PRISM_TEST_WORKER_TIMEOUT", "5" if SANITIZED else "1"))
HEARTBEAT = "0.1"         # workers --heartbeat-interval
RANDOM = ["--random-weights", "--heartbeat-interval", HEARTBEAT]


def clip_l_model():
    """The tiny LLaVA's text side and tokenizer with a CLIP-L/336-shaped vision tower."""
    d = os.path.join(TMP, "clip-l-336")
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(MODEL):
        if f != "model.safetensors":
            shutil.copy(os.path.join(MODEL, f), d)
    with open(os.path.join(MODEL, "config.json")) as f:
        cfg = json.load(f)
    cfg["vision_config"].update(hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                                num_hidden_layers=VISION_LAYERS, image_size=336, patch_size=14, projection_dim=768)
    cfg["image_seq_length"] = 576
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(MODEL, "preprocessor_config.json")) as f:
        pre = json.load(f)
    pre["crop_size"] = {"height": 336, "width": 336}
    pre["size"] = {"shortest_edge": 336}
    with open(os.path.join(d, "preprocessor_config.json"), "w") as f:
        json.dump(pre, f, indent=2)
    return d


def full_log(c, name):
    with open(os.path.join(c.log_dir, name + ".log"), "rb") as f:
        return f.read().decode("utf-8", "replace")


def metrics(c):
    status, _, data = c.request("GET", "/metrics")
    assert status == 200
    out = {}
    for line in data.decode().splitlines():
        m = re.match(r'(prism:[a-z_]+)\{([^}]*)\} (\S+)$', line)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def worker_metric(c, name, worker):
    return metrics(c).get((name, 'tier="encoder",worker="%s"' % worker))


def idle_pool_free(c, worker):
    """The encoder's free slots when idle, from heartbeats sent after it was idle: a heartbeat from
    before the last request ended still counts its job (a stale free0 failed checks in CI)."""
    hb = worker_metric(c, "prism:worker_heartbeats_total", worker)
    wait_until(lambda: worker_metric(c, "prism:worker_heartbeats_total", worker) >= hb + 2 and
               worker_metric(c, "prism:worker_running", worker) == 0 and
               worker_metric(c, "prism:worker_waiting", worker) == 0, 60, "an idle encoder's heartbeats")
    hb = worker_metric(c, "prism:worker_heartbeats_total", worker)
    wait_until(lambda: worker_metric(c, "prism:worker_heartbeats_total", worker) >= hb + 1, 60, "one more heartbeat")
    return worker_metric(c, "prism:worker_pool_free", worker)


def wait_pool_back(c, worker, free0, timeout=10):
    """Every slot of the encoder free again (its idle value free0); names both values if not."""
    deadline = time.time() + timeout
    while (now := worker_metric(c, "prism:worker_pool_free", worker)) != free0:
        assert time.time() < deadline, ("the encoder's slots did not all come back", "idle", free0, "now", now)
        time.sleep(0.02)


def lost(c, reason):
    return metrics(c)[("prism:workers_lost_total", 'reason="%s"' % reason)]


def wait_until(cond, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError("timed out after %.0fs waiting for %s" % (timeout, what))


class Background:
    """One chat request on its own connection and thread; close() hangs up like a client that left."""

    def __init__(self, c, body):
        self.conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=600)
        self.conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json"})
        self.t0 = time.time()
        self.status = self.data = self.error = None
        self.t1 = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            r = self.conn.getresponse()
            self.status, self.data = r.status, r.read()
        except (OSError, http.client.HTTPException) as e:   # the client hung up itself
            self.error = e
        self.t1 = time.time()

    def close(self):
        self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()

    def result(self, timeout=600):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "no answer after %ss" % timeout
        return self.status, self.data


def images(prefix, n, seed0):
    """Distinct images (the embedding cache would answer a repeated one without any work)."""
    return [make_image(os.path.join(TMP, "%s%d.jpg" % (prefix, i)), width=400, height=360, photo=True,
                       seed=seed0 + i) for i in range(n)]


def run_clip_l_cluster():
    model = clip_l_model()
    enc = RANDOM + ["--max-batch-images", "2", "--max-batch-seconds", "0"]
    # a loaded machine may take minutes per queued image: only the liveness timeouts are short
    # (and stuck is judged only in its own cluster below: a layer may take minutes here)
    router = ["--worker-timeout", str(WORKER_TIMEOUT), "--served-model-name", "prism-tiny-llava",
              "--max-queue-wait", "3000", "--request-timeout", "3600", "--worker-stuck-timeout", "3600",
              "--stage-timeout", "3600",
              "--max-retries", "0"]  # SIGSTOP: the dead encoder's request fails (no other encoder to retry on)
    with Cluster(model=model, router_args=router,
                 worker_args={"encoder_worker": enc, "prefill_worker": RANDOM, "decode_worker": RANDOM}) as c:
        c.wait_ready(timeout=300)

        def busy_encoder_is_not_dead():
            """Three images in two batches (one and two, or two and one: the encoder forms its next
            batch while the tower runs): the longer batch takes >= 2x the worker timeout, and every
            request is served with no worker dropped."""
            imgs = images("busy", 3, 10)
            reqs = [Background(c, chat_body("What is in the image?", [p], max_tokens=2)) for p in imgs]
            for q in reqs:
                status, data = q.result()
                assert status == 200, (status, data[:300])
            done = sorted(q.t1 - q.t0 for q in reqs)
            longest = max(done[0], done[-1] - done[0])   # the first batch's time, and the second's
            print("  3 requests, first answered after %.1fs, last after %.1fs: the longer batch %.1fs (worker timeout %.1fs)"
                  % (done[0], done[-1], longest, WORKER_TIMEOUT), flush=True)
            assert longest >= 2 * WORKER_TIMEOUT, "the encoder is too fast for this test: raise PRISM_TEST_CLIP_LAYERS"
            assert lost(c, "dead") == 0 and lost(c, "stuck") == 0
            assert "missed heartbeats" not in full_log(c, "router")
            assert all(c.alive().values())

        def cancel_inside_batch_frees_its_slot_within_a_layer():
            """Two images in one batch; the client of the first leaves after a layer or two: its image
            is dropped between two layers and its slot freed, the other completes."""
            blocker, a, b = images("cancel", 3, 20)
            free0 = idle_pool_free(c, "encoder-0")
            # a one-image batch runs while a and b queue, so that the next batch holds both
            qx = Background(c, chat_body("What is in the image?", [blocker], max_tokens=2))
            wait_until(lambda: worker_metric(c, "prism:worker_running", "encoder-0") == 1, 600,
                       "the first batch to start")
            qa = Background(c, chat_body("What is in the image?", [a], max_tokens=2))
            qb = Background(c, chat_body("What is in the image?", [b], max_tokens=2))
            status, data = qx.result()
            assert status == 200, (status, data[:300])
            hb0 = worker_metric(c, "prism:worker_heartbeats_total", "encoder-0")   # numbers from after qx
            wait_until(lambda: worker_metric(c, "prism:worker_heartbeats_total", "encoder-0") >= hb0 + 2, 60,
                       "two fresh heartbeats")
            # running is published as the ViT starts on the batch (after the images are decoded). The
            # client leaves at once: under the sanitizers the tower runs two layers of a minute or more
            # each, and waiting for the first to finish left the abort to land in the last one.
            wait_until(lambda: worker_metric(c, "prism:worker_running", "encoder-0") == 2, 600,
                       "the batch of two to start")
            free = worker_metric(c, "prism:worker_pool_free", "encoder-0")
            assert free == free0 - 2, (free, free0)
            qa.close()
            status, data = qb.result()
            assert status == 200, (status, data[:300])
            line = wait_until(lambda: re.search(r"image 0: cancelled ([0-9.]+)s after its abort arrived, after layer "
                                                r"(\d+) of (\d+) \(([0-9.]+)s per layer\): dropped from the batch, "
                                                r"1 image\(s\) go on", full_log(c, "encoder-0")), 30, "the cancel log line")
            waited, layer, layers, per_layer = float(line[1]), int(line[2]), int(line[3]), float(line[4])
            print("  cancelled %.3fs after the abort arrived, after layer %d of %d (%.3fs per layer)"
                  % (waited, layer, layers, per_layer), flush=True)
            assert layer < layers, "the image was not dropped inside the batch"
            assert waited <= per_layer * 1.5 + 0.1, "the slot was not freed within one layer"
            wait_pool_back(c, "encoder-0", free0)

        def sigstop_is_dead_and_sigcont_rejoins():
            enc = c.procs["encoder-0"]
            img, = images("stop", 1, 30)
            p0 = worker_metric(c, "prism:worker_progress_total", "encoder-0")
            q = Background(c, chat_body("What is in the image?", [img], max_tokens=2))
            wait_until(lambda: (worker_metric(c, "prism:worker_progress_total", "encoder-0") or 0) > p0, 300,
                       "the encoder to start on the image")
            os.kill(enc.pid, signal.SIGSTOP)
            t0 = time.time()
            try:
                status, data = q.result(60)
                t = time.time() - t0
                assert status == 503, (status, data[:300])
                assert "stopped responding" in json.loads(data)["error"]["message"]
                assert t < 2 * WORKER_TIMEOUT + 5, t
                assert lost(c, "dead") == 1 and lost(c, "stuck") == 0
                assert "encoder worker encoder-0 missed heartbeats" in full_log(c, "router")
                print("  SIGSTOP: the request failed %.1fs later (worker timeout %.1fs)" % (t, WORKER_TIMEOUT),
                      flush=True)
            finally:
                os.kill(enc.pid, signal.SIGCONT)
            wait_until(lambda: c.request("GET", "/ready")[0] == 200, 60, "the encoder to register again")

        return run_tests([busy_encoder_is_not_dead, cancel_inside_batch_frees_its_slot_within_a_layer,
                          sigstop_is_dead_and_sigcont_rejoins])


def run_stall_cluster():
    # no retry (the only encoder is the stuck one) and a short wait for a tier with no usable worker
    router = ["--worker-timeout", "2", "--worker-stuck-timeout", "1", "--max-retries", "0", "--max-queue-wait", "3"]
    with Cluster(encoders=0, router_args=router, worker_args={"prefill_worker": ["--heartbeat-interval", HEARTBEAT],
                                                              "decode_worker": ["--heartbeat-interval", HEARTBEAT]}) as c:
        env = dict(os.environ, PRISM_TEST_STALL_AFTER_LAYERS="2")
        log = open(os.path.join(c.log_dir, "encoder-0.log"), "wb")
        c.procs["encoder-0"] = subprocess.Popen(
            [binary("encoder_worker"), "--model-path", MODEL, "--router", c.ctl, "--worker-id", "encoder-0", *c.sec,
             "--heartbeat-interval", HEARTBEAT], stdout=log, stderr=subprocess.STDOUT, env=env)
        c.wait_ready()

        def stalled_compute_thread_is_stuck():
            img, = images("stall", 1, 40)
            t0 = time.time()
            status, r = c.post_json("/v1/chat/completions", chat_body("What is in the image?", [img], max_tokens=2))
            t = time.time() - t0
            assert status == 503, (status, r)
            assert "stopped making progress" in r["error"]["message"], r
            assert t < 10, t
            assert lost(c, "stuck") == 1 and lost(c, "dead") == 0
            assert worker_metric(c, "prism:worker_stuck", "encoder-0") == 1
            assert worker_metric(c, "prism:worker_busy", "encoder-0") == 1
            assert "encoder worker encoder-0 is stuck" in full_log(c, "router")
            # still heartbeating: registered, not dropped, alive; but not given work (not ready). The
            # router hears 25 more of its heartbeats (2.5 s at 0.1 s, past the 2 s worker timeout)
            hb = worker_metric(c, "prism:worker_heartbeats_total", "encoder-0")
            wait_until(lambda: worker_metric(c, "prism:worker_heartbeats_total", "encoder-0") >= hb + 25, 60,
                       "25 heartbeats from the stuck encoder")
            assert lost(c, "dead") == 0
            assert c.procs["encoder-0"].poll() is None
            status, _, data = c.request("GET", "/ready")
            assert status == 503 and json.loads(data)["encoders"] == 0, data
            s, r = c.post_json("/v1/chat/completions", chat_body("What is in the image?", [img], max_tokens=2))
            assert s == 503, (s, r)
            print("  stuck detected, request failed after %.1fs" % t, flush=True)

        return run_tests([stalled_compute_thread_is_stuck])


def run_late_first_token_cluster():
    """The prefill sends the first token to the router through its I/O thread and pushes the KV to the
    decode worker itself, so the decode's tokens can reach the router before the first one (two
    processes, two connections). The test hook PRISM_TEST_DELAY_REPLIES_S holds every prefill reply
    for 1.5 s, so the decode's always come first: the router must still answer the tokens in order,
    streamed or not (seen failing without the router holding them: the first token came last)."""
    hb = ["--heartbeat-interval", HEARTBEAT]
    with Cluster(worker_args={"prefill_worker": hb, "decode_worker": hb},
                 worker_env={"prefill_worker": {"PRISM_TEST_DELAY_REPLIES_S": "1.5"}}) as c:
        c.wait_ready()
        question = "Tell me a story."
        ref = reference([], question, 12)

        def decode_tokens_wait_for_the_first_token():
            assert "PRISM_TEST_DELAY_REPLIES_S=1.5 is set" in full_log(c, "prefill-0")
            s, r = c.post_json("/v1/chat/completions", chat_body(question, max_tokens=12, temperature=0))
            assert s == 200, (s, r)
            assert r["choices"][0]["message"]["content"] == ref["text"], (r, ref["text"])
            assert r["usage"]["completion_tokens"] == len(ref["token_ids"]), r
            body = dict(chat_body(question, max_tokens=12, temperature=0, logprobs=True), stream=True)
            s, events, done = c.stream("/v1/chat/completions", body)
            assert s == 200 and done, (s, events[-1:])
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
            assert text == ref["text"], (text, ref["text"])
            toks = [t["token"] for e in events if e.get("choices") and (e["choices"][0].get("logprobs") or {})
                    for t in e["choices"][0]["logprobs"]["content"]]
            assert len(toks) == len(ref["token_ids"]), (toks, ref)

        def a_long_answer_runs_far_ahead_of_its_first_token():
            # While the first token waits its 1.5 s, the decode runs hundreds of steps (the tiny model:
            # ~1 ms each): every one is held and the answer comes whole. A fixed bound of 256 held
            # messages failed such answers with a 500 in CI (a loaded machine delays the prefill's I/O
            # thread the same way); the bound is what the request may be sent, n x max_tokens.
            n = 600
            body = chat_body(question, max_tokens=n, temperature=0, ignore_eos=True)
            t0 = time.time()
            s, r = c.post_json("/v1/chat/completions", body)
            took = time.time() - t0
            assert s == 200, (s, r)
            assert r["usage"]["completion_tokens"] == n and r["choices"][0]["finish_reason"] == "length", r["usage"]
            assert r["choices"][0]["message"]["content"].startswith(ref["text"]), (r, ref["text"])
            # not asserted (a slow sanitizer build holds fewer): seen 1.9 s in release, so ~400 held
            print("%d tokens in %.2f s with the first one held 1.5 s" % (n, took))

        return run_tests([decode_tokens_wait_for_the_first_token, a_long_answer_runs_far_ahead_of_its_first_token])


def run_overlap_cluster():
    """The pipelines that overlap host work with the device (on by default with CUDA), forced on for
    the CPU: decode enqueues step n+1 before sending step n's tokens, prefill begins every chunk but
    the last without waiting for logits. Tokens equal the single-process reference, sequences join
    and leave, and an abort that arrives while the next step is already enqueued frees everything."""
    hb = ["--heartbeat-interval", HEARTBEAT]
    # the encoder's time bound is a microsecond: once an image's cost is measured, batches hold one
    enc = hb + ["--max-batch-seconds", "0.000001", "--log-level", "debug"]
    with Cluster(worker_args={"decode_worker": hb + ["--overlap-steps", "on"],
                              "prefill_worker": hb + ["--chunked-prefill-size", "16"], "encoder_worker": enc}) as c:
        c.wait_ready()

        def overlapped_decode_steps_are_exact():
            img = make_image(os.path.join(TMP, "overlap.jpg"), width=320, height=240, shape="square", color="blue")
            ref = reference([img], "What is in the image?", 24)
            kv0 = metrics(c)[("prism:worker_kv_free_blocks", 'tier="decode",worker="decode-0"')]
            # a long stream that the client leaves while the others run
            long = Background(c, dict(chat_body("Describe the image.", [img], max_tokens=1500, temperature=0,
                                                ignore_eos=True), stream=True))
            reqs = [Background(c, chat_body("What is in the image?", [img], max_tokens=n, temperature=0))
                    for n in (24, 3, 11, 24, 1, 17)]
            for q in reqs:
                status, data = q.result()
                assert status == 200, (status, data[:300])
                r = json.loads(data)
                n = r["usage"]["completion_tokens"]
                text = r["choices"][0]["message"]["content"]
                assert n <= len(ref["token_ids"]) and ref["text"].startswith(text), (text, ref["text"])
                if n == len(ref["token_ids"]):
                    assert text == ref["text"], (text, ref["text"])
            long.close()
            wait_until(lambda: metrics(c)[("prism:worker_running", 'tier="decode",worker="decode-0"')] == 0 and
                       metrics(c)[("prism:worker_kv_free_blocks", 'tier="decode",worker="decode-0"')] == kv0,
                       30, "the decode worker to free the aborted sequence")
            s, r = c.post_json("/v1/chat/completions", chat_body("What is in the image?", [img], max_tokens=24,
                                                                 temperature=0))
            assert s == 200 and r["choices"][0]["message"]["content"] == ref["text"], (s, r)

        def encoder_batches_respect_the_time_bound():
            imgs = images("bound", 8, 60)
            reqs = [Background(c, chat_body("What is in the image?", [p], max_tokens=1)) for p in imgs]
            for q in reqs:
                status, data = q.result()
                assert status == 200, (status, data[:300])
            sizes = [int(n) for n in re.findall(r"vision batch of (\d+) image", full_log(c, "encoder-0"))]
            allowed = [int(n) for n in re.findall(r"time bound allows (\d+) at", full_log(c, "encoder-0"))]
            assert len(sizes) >= 8 and max(sizes) == 1, sizes
            assert set(allowed) == {1}, allowed

        return run_tests([overlapped_decode_steps_are_exact, encoder_batches_respect_the_time_bound])


if __name__ == "__main__":
    rc = run_stall_cluster()
    rc |= run_late_first_token_cluster()
    rc |= run_overlap_cluster()
    rc |= run_clip_l_cluster()
    sys.exit(rc)
