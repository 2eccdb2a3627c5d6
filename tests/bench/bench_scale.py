#!/usr/bin/env python3
"""Throughput vs number of encoders, scaled live: 4096x4096 photo-like JPEGs.

One cluster (router, one prefill, one decode, encoders added by hand while the load runs): client
threads send chat requests with one 4096x4096 JPEG each (distinct images, embedding cache off, so
every request decodes and encodes its image) and max_tokens 1, so the encoders are the bottleneck.
After each encoder is added and has taken work, the images per second over the next --requests
completions are recorded, with the machine's load average (the development machine is shared).

  python3 tests/bench/bench_scale.py --build-dir build --encoders 3 --runs 3

Prints one line per step and per run, then the medians, and writes JSON to --out (optional).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
import cluster as cl  # noqa: E402


def one_run(args, imgs):
    c = cl.Cluster(encoders=1, prefills=1, decodes=1, router_args=["--request-timeout", "900"],
                   worker_args={"encoder_worker": ["--embedding-cache-bytes", "0", "--threads", str(args.threads)],
                                "prefill_worker": ["--threads", "1"], "decode_worker": ["--threads", "1"]})
    done, lock, stop = [], threading.Lock(), [False]

    def client(k):
        i = k
        while not stop[0]:
            body = cl.chat_body("What is in the image?", [imgs[i % len(imgs)]], max_tokens=1, temperature=0)
            i += args.clients
            try:
                st, r = c.post_json("/v1/chat/completions", body, timeout=900)
            except OSError:
                if stop[0]:
                    return  # the cluster is stopping under us: not a result
                st = -1
            with lock:
                done.append((time.time(), st))

    steps = []
    try:
        c.wait_ready(120)
        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
        for t in threads:
            t.start()
        for n in range(1, args.encoders + 1):
            if n > 1:
                name = "encoder-%d" % (n - 1)
                c.start_worker(name, "encoder_worker")
                cl.wait_for(lambda: any(w["id"] == name and w["completed"] > 0
                                        for w in json.loads(c.request("GET", "/status")[2])["workers"]),
                            300, name + " took work", interval=0.1)
            with lock:
                start = len(done)
            cl.wait_for(lambda: len(done) >= start + 1, 600, "a completion")   # start the window at one
            with lock:
                t0, k0 = done[-1][0], len(done)
            load0 = os.getloadavg()[0]
            cl.wait_for(lambda: len(done) >= k0 + args.requests, 1800, "the window", interval=0.05)
            with lock:
                window = done[k0:k0 + args.requests]
            t1 = window[-1][0]
            ok = sum(1 for _, st in window if st == 200)
            steps.append({"encoders": n, "images_per_s": args.requests / (t1 - t0), "ok": ok,
                          "requests": args.requests, "seconds": t1 - t0,
                          "loadavg_1m": [round(load0, 1), round(os.getloadavg()[0], 1)]})
            print("  encoders %d: %.3f images/s (%d/%d ok, %.1f s, load average %.1f -> %.1f)"
                  % (n, steps[-1]["images_per_s"], ok, args.requests, t1 - t0, *steps[-1]["loadavg_1m"]), flush=True)
    finally:
        stop[0] = True
        c.stop()
    return steps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default=os.path.join(cl.ROOT, "build"))
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--encoders", type=int, default=3)
    ap.add_argument("--clients", type=int, default=6, help="concurrent requests (keep above the encoder count)")
    ap.add_argument("--requests", type=int, default=8, help="completions per measured window")
    ap.add_argument("--threads", type=int, default=1, help="--threads of each encoder")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args()
    cl.BUILD = os.path.abspath(args.build_dir)
    tmp = tempfile.mkdtemp(prefix="prism-bench-scale-")
    imgs = [cl.make_image(os.path.join(tmp, "photo%d.jpg" % i), width=args.size, height=args.size, photo=True,
                          quality=92, seed=100 + i) for i in range(args.clients * 2)]
    print("%dx%d photo JPEGs, %.1f MB each; %d clients, max_tokens 1, %d cores, load average now %.1f"
          % (args.size, args.size, os.path.getsize(imgs[0]) / 1e6, args.clients, os.cpu_count(), os.getloadavg()[0]))
    runs = []
    for r in range(args.runs):
        print("run %d" % (r + 1), flush=True)
        runs.append(one_run(args, imgs))
    med = [{"encoders": n + 1, "images_per_s_median": statistics.median(run[n]["images_per_s"] for run in runs)}
           for n in range(args.encoders)]
    for m in med:
        print("median: encoders %d: %.3f images/s" % (m["encoders"], m["images_per_s_median"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"size": args.size, "clients": args.clients, "cores": os.cpu_count(), "runs": runs,
                       "median": med}, f, indent=1)


if __name__ == "__main__":
    main()
