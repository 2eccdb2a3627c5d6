#!/usr/bin/env python3
"""Threads before and after issue 33, side by side in one run: requests/s and TTFT p50/p99 of the
seed's image matrix (photo-like JPEGs of 512, 2048 and 4096 px x concurrency 1, 8, 32).

Two local clusters of the bundled model (router + one worker of each kind), started together and
measured cell by cell in turn, so the load other users put on a shared machine falls on both alike:

  before  every worker at --threads 1: the old default of deploy/launch.sh; the encoder decodes
          one image at a time (one image thread, its rows resampled on a relay thread)
  after   what deploy/launch.sh's --threads auto gives a one-box cluster of one worker per tier on
          C cores (those this process may run on, or --cores): every worker's kernels at
          --threads max(1, C / 3), the encoder's --image-threads C (C images of a batch at once)

In each cell `concurrency` streaming chat requests (16 tokens, ignore_eos), every one written at
once (bench_router_memory.py's clients: bodies built first, a barrier, then the write), each with
an image of its own: the same picture with a distinct JPEG comment, so no request is answered from
the embedding cache or waits for a twin's encode, and every decode does the full work.

  python3 tests/bench/bench_encoder_pool.py --build-dir build --out docs/bench
  python3 tests/bench/bench_encoder_pool.py --sizes 4096 --concurrency 8    # one cell
  # `after` (--overlap-decode on, the default: the next batch's images decode during the tower)
  # against `sync` (the same with --overlap-decode off: one batch at a time)
  nice -n 10 python3 tests/bench/bench_encoder_pool.py --overlap --skip before --sizes 2048,4096 \
      --concurrency 8,32 --repeat 2

Only the standard library is needed.
"""
import argparse
import base64
import os
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
sys.path.insert(0, os.path.dirname(__file__))
import cluster as cl  # noqa: E402
from bench_router_memory import one_client, pct, request_bytes, write_result  # noqa: E402


def unique_jpegs(path, n, first):
    """n data URLs of the JPEG at path, each with a COM segment of its own (distinct bytes, the same
    pixels)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:2] == b"\xff\xd8", path
    out = []
    for i in range(n):
        text = b"prism bench image %d" % (first + i)
        seg = b"\xff\xfe" + (len(text) + 2).to_bytes(2, "big") + text
        out.append("data:image/jpeg;base64," + base64.b64encode(data[:2] + seg + data[2:]).decode())
    return out


def run_cell(c, urls, max_tokens, timeout):
    n = len(urls)
    out = [None] * n
    barrier = threading.Barrier(n)
    datas = [request_bytes(c.port, u, max_tokens) for u in urls]
    threads = [threading.Thread(target=one_client, args=(c.port, datas[i], barrier, timeout, out, i))
               for i in range(n)]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in out if r["status"] == 200]
    return {"requests": n, "ok": len(ok), "failed": n - len(ok), "wall_s": wall, "ttfts": [r["ttft"] for r in ok],
            "load_avg_1m": [load0, os.getloadavg()[0]],
            "errors": sorted({"%s %s" % (r["status"], r.get("message", "")[:80]) for r in out if r["status"] != 200})}


def pooled(runs):
    """The runs of one mode in one cell as one: requests/s over their summed wall time, TTFT
    percentiles over all their requests."""
    ok, wall = sum(r["ok"] for r in runs), sum(r["wall_s"] for r in runs)
    ttfts = [t for r in runs for t in r["ttfts"]]
    return {"runs": runs, "requests": sum(r["requests"] for r in runs), "ok": ok,
            "failed": sum(r["failed"] for r in runs), "requests_per_s": ok / wall,
            "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build-dir", default=os.path.join(cl.ROOT, "build"))
    ap.add_argument("--out", default="", help="directory for bench_encoder_pool[_TAG].json (none: no file)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--sizes", default="512,2048,4096")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--quality", type=int, default=93, help="JPEG quality (93: the 4096x4096 photo is 7.6 MB)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each cell per mode, the modes in turn")
    ap.add_argument("--mode", action="append", default=[],
                    help="one more cluster: NAME:ENC_THREADS:PREFILL_THREADS:DECODE_THREADS[:ENCODER FLAGS] (a variant)")
    ap.add_argument("--overlap", action="store_true",
                    help="one more cluster, `sync`: `after` with --overlap-decode off (one batch at a time; `after` "
                         "decodes the next batch's images while the vision tower runs this one's)")
    ap.add_argument("--skip", default="", help="modes left out, comma-separated (e.g. before)")
    args = ap.parse_args()
    cl.BUILD = os.path.abspath(args.build_dir)
    tmp = tempfile.mkdtemp(prefix="prism-poolbench-")
    sizes = [int(x) for x in args.sizes.split(",") if x]
    concs = [int(x) for x in args.concurrency.split(",") if x]
    photos = {s: cl.make_image(os.path.join(tmp, "photo_%d.jpg" % s), width=s, height=s, photo=True,
                               quality=args.quality, seed=s) for s in sizes}
    kern = str(max(1, args.cores // 3))
    modes = {"before": {w: ["--threads", "1"] for w in ("encoder_worker", "prefill_worker", "decode_worker")},
             "after": {w: ["--threads", kern] for w in ("encoder_worker", "prefill_worker", "decode_worker")}}
    modes["after"]["encoder_worker"] += ["--image-threads", str(args.cores)]
    if args.overlap:
        modes["sync"] = {w: list(a) for w, a in modes["after"].items()}
        modes["sync"]["encoder_worker"] += ["--overlap-decode", "off"]
    for m in args.skip.split(","):
        modes.pop(m, None)
    for spec in args.mode:
        f = spec.split(":")
        modes[f[0]] = {"encoder_worker": ["--threads", f[1]] + (f[4].split() if len(f) > 4 else []),
                       "prefill_worker": ["--threads", f[2]], "decode_worker": ["--threads", f[3]]}
    clusters = {}
    res = {"command": " ".join(sys.argv), "cores": len(os.sched_getaffinity(0)), "modes": modes, "cells": []}
    try:
        for m, wa in modes.items():
            clusters[m] = cl.Cluster(worker_args=wa)
            clusters[m].__enter__()
        for c in clusters.values():
            c.wait_ready()
        print("image  conc  | MODE req/s TTFT p50 p99 ...")
        serial = 0
        for s in sizes:
            for n in concs:
                row = {"size": s, "concurrency": n}
                runs = {m: [] for m in clusters}
                for _ in range(args.repeat):
                    for m, c in clusters.items():
                        # fresh images for every run: no cache hit from an earlier one
                        runs[m].append(run_cell(c, unique_jpegs(photos[s], n, serial), args.max_tokens, args.timeout))
                        serial += n
                for m in clusters:
                    row[m] = pooled(runs[m])
                res["cells"].append(row)
                print("%-6s %-5d" % ("%dpx" % s, n) + "".join(
                    " | %s %7.2f %6.2fs %6.2fs%s" % (m, row[m]["requests_per_s"], row[m]["ttft_p50_s"] or -1,
                                                     row[m]["ttft_p99_s"] or -1,
                                                     " FAILED %d" % row[m]["failed"] if row[m]["failed"] else "")
                    for m in modes), flush=True)
        time.sleep(2.5)   # a heartbeat after the last cell (every second by default)
        res["peak_decodes"] = {m: c.metric("prism:worker_image_decodes_peak", worker="encoder-0")
                               for m, c in clusters.items()}
        print("most images decoded at once: %s" % res["peak_decodes"])
        if args.out:
            write_result(args.out, "bench_encoder_pool", args.tag, res)
    finally:
        for c in clusters.values():
            c.__exit__(None, None, None)
    return 1 if any(r[m]["failed"] for r in res["cells"] for m in modes) else 0


if __name__ == "__main__":
    sys.exit(main())
