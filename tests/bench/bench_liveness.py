#!/usr/bin/env python3
"""Liveness under full load: heartbeat jitter and abort latency with a CLIP-L/336-shaped encoder.

Every worker is kept busy at once (encoder: back-to-back vision batches of CLIP-L/336 shape with
--random-weights; prefill: long prompts; decode: long generations) for --seconds, on a machine with
fewer cores than processes. Then:

- heartbeat jitter: every interval between two heartbeats of a worker, as the router received them
  (its debug log), per tier: median, p99 and max, divided by the nominal --heartbeat-interval;
- abort latency: requests whose client hangs up while their image is inside a vision batch; the
  encoder logs how long after the abort reached its I/O thread the image left the batch, and how
  long a layer takes. Reported: median and max latency, and latency / layer time.

  python3 tests/bench/bench_liveness.py --build-dir build [--layers 24] [--seconds 60] [--aborts 5]
"""
import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
import cluster as cl  # noqa: E402
import test_liveness as tl  # noqa: E402


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default=os.path.join(cl.ROOT, "build"))
    ap.add_argument("--layers", type=int, default=24, help="CLIP layers (24 = CLIP-L/336)")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--heartbeat", type=float, default=1.0, help="workers' --heartbeat-interval")
    ap.add_argument("--aborts", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    cl.BUILD = os.path.abspath(args.build_dir)
    tl.VISION_LAYERS = args.layers
    model = tl.clip_l_model()
    hb = ["--random-weights", "--heartbeat-interval", str(args.heartbeat)]
    router = ["--log-level", "debug", "--served-model-name", "prism-tiny-llava", "--max-queue-wait", "36000",
              "--request-timeout", "36000"]   # nothing fails for waiting: the load is the point
    with cl.Cluster(model=model, router_args=router,
                    worker_args={"encoder_worker": hb + ["--max-batch-images", "2", "--max-batch-seconds", "0"],
                                 "prefill_worker": hb, "decode_worker": hb}) as c:
        c.wait_ready(timeout=600)
        stop, stop_images = threading.Event(), threading.Event()

        def text_client(_):
            while not stop.is_set():
                body = cl.chat_body("tell me a long story " * 120, [], max_tokens=256, ignore_eos=True)
                c.request("POST", "/v1/chat/completions", body, timeout=3600)

        # the embedding cache keys on image bytes: fresh images keep the vision tower busy
        def fresh_image_client(i):
            k = 0
            while not stop_images.is_set():
                p = cl.make_image(os.path.join(tl.TMP, "fresh%d_%d.jpg" % (i, k)), width=400, height=360,
                                  photo=True, seed=1000 * i + k)
                k += 1
                c.request("POST", "/v1/chat/completions",
                          cl.chat_body("What is in the image?", [p], max_tokens=4), timeout=3600)

        threads = [threading.Thread(target=fresh_image_client, args=(i,), daemon=True) for i in range(2)]
        threads += [threading.Thread(target=text_client, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        t0 = time.time()
        while time.time() - t0 < args.seconds:
            time.sleep(1)
        elapsed = time.time() - t0
        with open(os.path.join(c.log_dir, "router.log")) as f:
            router_log = f.read()   # the heartbeats of the full-load window
        # Aborts: image clients stop (text load goes on); each aborted image is alone in its batch,
        # and its client leaves a random number of layers into it.
        stop_images.set()
        if args.aborts:
            tl.wait_until(lambda: tl.worker_metric(c, "prism:worker_running", "encoder-0") == 0, 3600,
                          "the encoder to finish its queue")
        for k in range(args.aborts):
            p = cl.make_image(os.path.join(tl.TMP, "abort%d.jpg" % k), width=400, height=360, photo=True,
                              seed=5000 + k)
            q = tl.Background(c, cl.chat_body("What is in the image?", [p], max_tokens=4))
            tl.wait_until(lambda: tl.worker_metric(c, "prism:worker_running", "encoder-0") == 1, 600, "the batch")
            p0 = tl.worker_metric(c, "prism:worker_progress_total", "encoder-0")
            n = random.randint(1, max(1, args.layers - 3))
            tl.wait_until(lambda: tl.worker_metric(c, "prism:worker_progress_total", "encoder-0") >= p0 + n, 3600,
                          "layer %d of the batch" % n)
            time.sleep(random.uniform(0, 0.5))
            q.close()
            tl.wait_until(lambda: tl.worker_metric(c, "prism:worker_running", "encoder-0") == 0, 3600,
                          "the batch to end")
        stop.set()
        with open(os.path.join(c.log_dir, "encoder-0.log")) as f:
            enc_log = f.read()
    res = {"layers": args.layers, "seconds": elapsed, "heartbeat_interval": args.heartbeat, "jitter": {}, "aborts": {}}
    print("heartbeat jitter under full load (%d CLIP layers, %.0fs, nominal %.2fs, %d cores):"
          % (args.layers, elapsed, args.heartbeat, os.cpu_count()))
    print("| tier | heartbeats | median / nominal | p99 / nominal | max / nominal |")
    print("|---|---|---|---|---|")
    for tier in ("encoder", "prefill", "decode"):
        xs = [float(m) for m in re.findall(r"heartbeat from %s worker \S+ after ([0-9.]+)s" % tier, router_log)][1:]
        if not xs:
            continue
        r = {"n": len(xs), "median": statistics.median(xs) / args.heartbeat, "p99": pct(xs, 99) / args.heartbeat,
             "max": max(xs) / args.heartbeat}
        res["jitter"][tier] = r
        print("| %s | %d | %.3f | %.3f | %.3f |" % (tier, r["n"], r["median"], r["p99"], r["max"]))
    lines = re.findall(r"cancelled ([0-9.]+)s after its abort arrived, after layer (\d+) of (\d+) \(([0-9.]+)s per "
                       r"layer\)", enc_log)
    if lines:
        lat = [float(x[0]) for x in lines]
        per = [float(x[3]) for x in lines]
        ratio = [a / b for a, b in zip(lat, per) if b > 0]
        res["aborts"] = {"n": len(lat), "latency_median_s": statistics.median(lat), "latency_max_s": max(lat),
                         "layer_median_s": statistics.median(per), "latency_over_layer_max": max(ratio) if ratio else None}
        print("\nabort latency inside a batch: %d aborts, median %.3fs, max %.3fs; a layer takes %.3fs (median); "
              "max latency / layer time %.2f" % (len(lat), statistics.median(lat), max(lat), statistics.median(per),
                                                 max(ratio) if ratio else float("nan")))
    else:
        print("\nno abort landed inside a batch (raise --aborts or --seconds)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
