#!/usr/bin/env python3
"""The seed's scenario on a scaled Qwen2.5-VL: 0 failed, every worker within --mem-budget, decode's
memory independent of image size, a burst beyond capacity waits or is refused (429/503), no crash.

Starts a local cluster (router + one worker of each kind, as tests/integration/test_qwen.py does)
serving the scaled Qwen2.5-VL checkpoint tests/data/model/qwen25vl_tiny, every worker at
--worker-args (default --mem-budget 512M), then:

  the matrix   a small photo-like JPEG (--small px) and the 4096x4096 one (~7.6 MB) x concurrency
               1, 8, 32, 64: in each cell `concurrency` streaming chat requests, every one written at
               once (bench_router_memory.py's clients: bodies built first, a barrier, then the write)
  the burst    --burst N (256) 4096x4096 uploads at once, then two small requests (service after)

and records per cell the answers by status, TTFT, each process's peak RSS (VmHWM, reset per cell)
and each worker's own accounting (prism:worker_memory_peak_bytes / _used_bytes, cumulative peaks)
against its budget. Decode's memory for the small against the 4096 image is the same columns for
the two rows of the matrix.

--max-pixels N runs a copy of the checkpoint whose preprocessor_config.json takes images up to N
pixels (the checkpoint's own is 50,176: a 4096 photo becomes 64 LM tokens; Qwen2.5-VL's default
12,845,056 makes it 16,384) and whose max_position_embeddings is raised to hold that many tokens
(the weights do not depend on it). The image then grows into the encoder's and prefill's work,
which is what their budgets must contain, while decode should still not care.

  python3 tests/bench/bench_qwen_seed.py --build-dir build --out docs/bench
  python3 tests/bench/bench_qwen_seed.py --max-pixels 1048576 --concurrency 1,8 --burst 64 --tag mp1m

Exit status 0 when the bar holds. Only the standard library is needed.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
sys.path.insert(0, os.path.dirname(__file__))
import cluster as cl  # noqa: E402
from bench_router_memory import MIB, budgets, request_bytes, run_cell, write_result  # noqa: E402

QWEN = os.path.join(cl.ROOT, "tests", "data", "model", "qwen25vl_tiny")
QUESTION = "What is in the image?"
WORKERS = ("encoder-0", "prefill-0", "decode-0")


def variant(src, max_pixels, tmp):
    """A copy of the checkpoint taking images up to max_pixels (and the context to hold them)."""
    dst = os.path.join(tmp, os.path.basename(src))
    shutil.copytree(src, dst)
    pp = os.path.join(dst, "preprocessor_config.json")
    with open(pp) as f:
        p = json.load(f)
    p["max_pixels"] = max_pixels
    with open(pp, "w") as f:
        json.dump(p, f, indent=1)
    cf = os.path.join(dst, "config.json")
    with open(cf) as f:
        c = json.load(f)
    unit = (p["patch_size"] * p["merge_size"]) ** 2
    need = max_pixels // unit + 1024
    tc = c.get("text_config", c)
    tc["max_position_embeddings"] = max(tc.get("max_position_embeddings", 0), 1 << (need - 1).bit_length())
    with open(cf, "w") as f:
        json.dump(c, f, indent=1)
    return dst


def worker_accounting(c):
    """{worker: {peak, used, planned, budget}} from the router's /metrics (the workers' own counters)."""
    out = {w: {} for w in WORKERS}
    for n, lb, v in c.metrics():
        w = lb.get("worker")
        if w in out and n.startswith("prism:worker_memory_"):
            out[w][n[len("prism:worker_memory_"):].replace("_bytes", "")] = v
    return out


def line(tag, cell):
    peaks, acc = cell["peak_rss_bytes"], cell["worker_memory"]
    return ("%-16s n=%-4d %s  ttft p50=%s  VmHWM MiB router=%.0f enc=%.0f pre=%.0f dec=%.0f  "
            "own peak MiB enc=%.0f pre=%.0f dec=%.0f  wall %.1fs load %.1f" % (
                tag, cell["requests"], " ".join("%s:%d" % kv for kv in sorted(cell["by_status"].items())),
                "%.2fs" % cell["ttft_p50_s"] if cell["ttft_p50_s"] is not None else "-",
                peaks.get("router", 0) / MIB, peaks.get("encoder-0", 0) / MIB, peaks.get("prefill-0", 0) / MIB,
                peaks.get("decode-0", 0) / MIB, *(acc[w].get("peak", 0) / MIB for w in WORKERS),
                cell["wall_s"], cell["load_avg_1m"][1]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build-dir", default=os.path.join(cl.ROOT, "build"))
    ap.add_argument("--model", default=QWEN, help="the scaled Qwen2.5-VL checkpoint")
    ap.add_argument("--max-pixels", type=int, default=0, help="serve a copy taking images up to this (0: as is)")
    ap.add_argument("--out", default="", help="directory for bench_qwen_seed[_TAG].json (none: no file)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--small", type=int, default=448, help="the small image's side, px")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--burst", type=int, default=256, help="4096x4096 uploads at once after the matrix (0: none)")
    ap.add_argument("--quality", type=int, default=93, help="JPEG quality (93: the 4096x4096 photo is 7.6 MB)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--router-args", default="", help="extra router flags (space separated)")
    ap.add_argument("--worker-args", default="--mem-budget 512M", help="flags of every worker (space separated)")
    for kind in ("encoder", "prefill", "decode"):
        ap.add_argument("--%s-args" % kind, default="", help="flags of the %s only, after --worker-args" % kind)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    cl.BUILD = os.path.abspath(args.build_dir)
    tmp = tempfile.mkdtemp(prefix="prism-qwenseed-")
    model = variant(args.model, args.max_pixels, tmp) if args.max_pixels else args.model
    name = os.path.basename(model)
    urls = {}
    for s in (args.small, 4096):
        path = cl.make_image(os.path.join(tmp, "photo_%d.jpg" % s), width=s, height=s, photo=True,
                             quality=args.quality, seed=s)
        urls[s] = cl.image_url(path)
        print("image %dx%d: %.2f MB JPEG" % (s, s, os.path.getsize(path) / 1e6), flush=True)
    wa = args.worker_args.split()
    c = cl.Cluster(model=model, router_args=args.router_args.split(),
                   worker_args={k + "_worker": wa + getattr(args, k + "_args").split()
                                for k in ("encoder", "prefill", "decode")})
    failed = False
    try:
        c.wait_ready()
        budget = budgets(c)
        res = {"command": " ".join(sys.argv), "cores": os.cpu_count(), "model": name,
               "max_pixels": args.max_pixels or None, "budgets": budget, "matrix": {}, "burst": None,
               "worker_memory_idle": worker_accounting(c)}
        print("budgets MiB: %s" % {k: round(v / MIB) for k, v in budget.items()}, flush=True)
        cells = []
        for conc in [int(x) for x in args.concurrency.split(",") if x]:
            for s in (args.small, 4096):
                cell = run_cell(c, request_bytes(c.port, urls[s], args.max_tokens, name), conc, args.timeout)
                cell["concurrency"], cell["size"] = conc, s
                cell["worker_memory"] = worker_accounting(c)
                res["matrix"].setdefault(s, []).append(cell)
                cells.append(cell)
                print(line("%dpx c=%d" % (s, conc), cell), flush=True)
                for m, n in cell["non_200_messages"].items():
                    print("    %dx %s" % (n, m), flush=True)
        if args.burst:
            cell = run_cell(c, request_bytes(c.port, urls[4096], args.max_tokens, name), args.burst, args.timeout)
            cell["worker_memory"] = worker_accounting(c)
            after = run_cell(c, request_bytes(c.port, urls[args.small], args.max_tokens, name), 2, args.timeout)
            after["worker_memory"] = worker_accounting(c)
            res["burst"] = {"burst": cell, "after": after}
            cells += [cell, after]
            print(line("burst %d" % args.burst, cell), flush=True)
            print(line("after", after), flush=True)
            failed |= after["by_status"] != {200: 2}
        outside = sum(x["outside_bar"] for x in cells)
        matrix_failed = sum(x["requests"] - x["by_status"].get(200, 0) for s in res["matrix"] for x in res["matrix"][s])
        over = sorted({p for x in cells for p, v in x["peak_rss_bytes"].items() if budget.get(p) and v > budget[p]})
        over_own = sorted({w for x in cells for w in WORKERS
                           if budget.get(w) and x["worker_memory"][w].get("peak", 0) > budget[w]})
        worst = {p: max(x["peak_rss_bytes"].get(p, 0) for x in cells) for p in budget}
        dec = {s: max(x["peak_rss_bytes"].get("decode-0", 0) for x in res["matrix"][s]) for s in res["matrix"]}
        dec_own = {s: max(x["worker_memory"]["decode-0"].get("peak", 0) for x in res["matrix"][s]) for s in res["matrix"]}
        dead = [n for n, a in c.alive().items() if not a]
        res["verdict"] = {"matrix_not_200": matrix_failed, "answers_outside_200_429_503": outside,
                          "over_budget_rss": over, "over_budget_own": over_own, "dead": dead,
                          "peak_rss_bytes": worst, "decode_peak_rss_by_size": dec, "decode_own_peak_by_size": dec_own}
        print("peak MiB over the run: %s (budgets %s)" % ({k: round(v / MIB) for k, v in worst.items()},
                                                          {k: round(v / MIB) for k, v in budget.items()}))
        print("decode peak MiB by image size: VmHWM %s, own %s" % ({k: round(v / MIB, 1) for k, v in dec.items()},
                                                                   {k: round(v / MIB, 1) for k, v in dec_own.items()}))
        print("matrix answers not 200: %d; answers outside 200/429/503: %d; over budget: %s / %s; dead: %s" % (
            matrix_failed, outside, over or "none", over_own or "none", dead or "none"))
        failed |= bool(matrix_failed or outside or over or over_own or dead)
        if args.out:
            write_result(args.out, "bench_qwen_seed", args.tag, res)
    finally:
        c.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print("BAR %s" % ("FAILED" if failed else "HOLDS"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
