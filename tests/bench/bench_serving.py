#!/usr/bin/env python3
"""Serving benchmark: the image matrix that made single-process servers die with OOM.

Starts a local Prism cluster (router + one worker of each kind, each with --mem-budget), then for
image sizes 512, 2048, 4096 (photo-like JPEGs of realistic file size) x concurrency 1, 4, 8, 16, 64,
128 sends streaming OpenAI chat requests with one image and a question, and records per cell:
requests ok / refused (429, 503; with the reason the router counted in prism:requests_refused_total
and the messages clients got) / failed (anything else), TTFT p50/p99, time per output token,
throughput, and the peak RSS of every process during the cell (VmHWM, reset per cell through
/proc/PID/clear_refs), and where the requests' time went (the means of prism:request_stage_seconds'
stages over the cell, their sum against the router's end-to-end mean, the upload before it). Writes
JSON and, when matplotlib is installed, a PNG plot.

  python3 tests/bench/bench_serving.py --build-dir build --out docs/bench
  python3 tests/bench/bench_serving.py --overload 512     # far above capacity: only 200/429/503
  # the same matrix with another router binary (e.g. one built from an older commit), to compare
  python3 tests/bench/bench_serving.py --router-bin OLD/router --tag before --sizes 4096
  python3 tests/bench/bench_serving.py --llama4-scaled --out docs/bench   # Llama-4 tiles (see --help)

--llama4-scaled serves tests/bench/llama4/serving (Llama-4 shaped: 336-px tiles of 14-px patches,
up to 16 local tiles + the global one, pixel shuffle to 144 tokens per tile, MoE text model with
chunked attention; narrow and shallow so that a CPU can run the matrix) with --random-weights and
the tiny Llama-4 tokenizer, the encoder's embedding cache off (every request decodes and encodes
its image: a 2048 or 4096 px image is 17 tiles, about 2,470 prompt tokens).

Only the standard library is needed for the measurements.
"""
import argparse
import concurrent.futures
import http.client
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
import cluster as cl  # noqa: E402

QUESTION = "What is in the image?"


def rss_peak_kb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def reset_peak(pid):
    try:
        with open("/proc/%d/clear_refs" % pid, "w") as f:
            f.write("5")
    except OSError:
        pass


MODEL_NAME = "prism-tiny-llava"


def request_body(url, max_tokens, question=None):
    """A streaming chat request with the image at url (None: text only) and question (None: QUESTION)."""
    content = ([{"type": "image_url", "image_url": {"url": url}}] if url else []) + \
        [{"type": "text", "text": question or QUESTION}]
    return json.dumps({"model": MODEL_NAME, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "messages": [{"role": "user", "content": content}]}).encode()


def one_request(port, url, max_tokens, timeout, body=None):
    """One request (request_body(url, max_tokens), or body made before: building a 10 MB body holds
    Python's lock for tens of ms, which other threads' timings would count): its status,
    client-side TTFT and end to end (bench_mixed_load.py too)."""
    body = body or request_body(url, max_tokens)
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            data = r.read()
            try:
                msg = json.loads(data)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = data[:120].decode("utf-8", "replace")
            return {"status": r.status, "message": msg}
        ttft, n_chunks, buf, err = None, 0, b"", False
        while True:
            chunk = r.read1(65536)
            if not chunk:
                break
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                payload = ev[6:]
                if payload == b"[DONE]":
                    continue
                obj = json.loads(payload)
                if "error" in obj:
                    err = True
                    continue
                if obj.get("choices") and obj["choices"][0]["delta"].get("content"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    n_chunks += 1
        t1 = time.perf_counter()
        if err:
            return {"status": 599}
        return {"status": 200, "ttft": ttft if ttft is not None else t1 - t0, "e2e": t1 - t0, "chunks": n_chunks}
    except (OSError, http.client.HTTPException) as e:
        return {"status": 0, "message": "connection: %s" % e}
    finally:
        conn.close()


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))]


def refusal_counts(c):
    return {lb["reason"]: v for name, lb, v in c.metrics() if name == "prism:requests_refused_total"}


def stage_sums(c):
    """{stage: [sum, count]} of prism:request_stage_seconds, plus "e2e": vllm:e2e_request_latency_seconds'."""
    got = {}
    for name, lb, v in c.metrics():
        if name.startswith("prism:request_stage_seconds_") and name.endswith(("_sum", "_count")):
            got.setdefault(lb["stage"], [0.0, 0.0])[name.endswith("_count")] += v
        elif name in ("vllm:e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_count"):
            got.setdefault("e2e", [0.0, 0.0])[name.endswith("_count")] += v
        elif name in ("prism:request_upload_seconds_sum", "prism:request_upload_seconds_count"):
            got.setdefault("upload", [0.0, 0.0])[name.endswith("_count")] += v
    return got


def stage_breakdown(before, after):
    """Over a cell: each stage's mean (ms), the e2e mean, and the stage means' sum over the e2e mean."""
    d = {k: (v[0] - before.get(k, [0, 0])[0], v[1] - before.get(k, [0, 0])[1]) for k, v in after.items()}
    means = {k: 1e3 * s / n for k, (s, n) in d.items() if n > 0}
    e2e = means.pop("e2e", None)
    upload = means.pop("upload", None)
    return {"stage_means_ms": means, "e2e_mean_ms": e2e, "upload_mean_ms": upload,
            "stage_counts": {k: n for k, (s, n) in d.items()},
            "stage_sum_over_e2e": sum(means.values()) / e2e if e2e else None}


def run_cell(c, url, concurrency, n_requests, max_tokens, timeout):
    pids = {name: p.pid for name, p in c.procs.items()}
    for pid in pids.values():
        reset_peak(pid)
    refused_before = refusal_counts(c)
    stages_before = stage_sums(c)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as ex:
        results = list(ex.map(lambda _: one_request(c.port, url, max_tokens, timeout), range(n_requests)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] in (429, 503)]
    failed = [r for r in results if r["status"] not in (200, 429, 503)]
    # why: the router's own count per reason over this cell, and what the clients were told
    refused_after = refusal_counts(c)
    by_reason = {k: v - refused_before.get(k, 0) for k, v in refused_after.items() if v != refused_before.get(k, 0)}
    messages = {}
    for r in results:
        if r["status"] != 200:
            key = "%s %s" % (r["status"], r.get("message", "")[:80])
            messages[key] = messages.get(key, 0) + 1
    ttfts = [r["ttft"] for r in ok]
    tpots = [(r["e2e"] - r["ttft"]) / max(1, max_tokens - 1) for r in ok]
    return {
        "concurrency": concurrency, "requests": n_requests, "ok": len(ok), "refused": len(refused),
        "failed": len(failed), "failed_statuses": sorted({r["status"] for r in failed}),
        "refused_by_reason": by_reason, "non_200_messages": messages,
        "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99),
        "tpot_mean_s": statistics.mean(tpots) if tpots else None,
        "throughput_req_s": len(ok) / wall, "throughput_tok_s": len(ok) * max_tokens / wall, "wall_s": wall,
        "peak_rss_mib": {name: rss_peak_kb(pid) / 1024.0 for name, pid in pids.items()},
        "worker_heap_peak_mib": {w: (c.metric("prism:worker_memory_peak_bytes", worker=w) or 0) / 2**20
                                 for w in ("encoder-0", "prefill-0", "decode-0")},
        "load_avg_1m": [load0, os.getloadavg()[0]],
        "alive": c.alive(),
        "stages": stage_breakdown(stages_before, stage_sums(c)),
        "client_e2e_mean_ms": 1e3 * statistics.mean(r["e2e"] for r in ok) if ok else None,
    }


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for size, cells in results["cells"].items():
        conc = [x["concurrency"] for x in cells]
        axes[0].plot(conc, [x["ttft_p50_s"] or 0 for x in cells], marker="o", label="%spx" % size)
        axes[1].plot(conc, [x["throughput_tok_s"] for x in cells], marker="o", label="%spx" % size)
        for proc in ("encoder-0", "prefill-0", "decode-0"):
            axes[2].plot(conc, [x["peak_rss_mib"].get(proc, 0) for x in cells], marker=".",
                         label="%s %spx" % (proc.split("-")[0], size))
    for ax, t in zip(axes, ("TTFT p50 (s)", "output tokens/s", "peak RSS per process (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(t)
        ax.grid(alpha=0.3)
    axes[0].legend()
    axes[2].legend(fontsize=6, ncol=2)
    failed = sum(x["failed"] for cells in results["cells"].values() for x in cells)
    refused = sum(x["refused"] for cells in results["cells"].values() for x in cells)
    fig.suptitle("Prism, %s on CPU, --mem-budget %s per worker: image size x concurrency "
                 "(%d failed, %d refused)" % (results.get("model", "bundled model"), results["mem_budget"], failed,
                                              refused))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build-dir", default=os.path.join(cl.ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(cl.ROOT, "docs", "bench"))
    ap.add_argument("--sizes", default="512,2048,4096")
    ap.add_argument("--concurrency", default="1,4,8,16,64,128")
    ap.add_argument("--requests-per-cell", type=int, default=0, help="default: max(8, F x concurrency)")
    ap.add_argument("--requests-factor", type=int, default=2, help="F above")
    ap.add_argument("--llama4-scaled", action="store_true", help="serve the scaled Llama-4 model (see above)")
    ap.add_argument("--encoder-args", default="", help="extra encoder_worker flags (space separated)")
    ap.add_argument("--router-args", default="", help="extra router flags (space separated)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--mem-budget", default="512M", help="--mem-budget of every worker")
    ap.add_argument("--overload", type=int, default=0, help="only run an overload burst of N concurrent 4096px requests")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--router-bin", default="", help="run this router binary instead of the build's")
    ap.add_argument("--tag", default="", help="suffix of the output files (bench_serving_TAG.json)")
    args = ap.parse_args()
    cl.BUILD = os.path.abspath(args.build_dir)
    if args.router_bin:
        build_binary = cl.binary
        cl.binary = lambda name: os.path.abspath(args.router_bin) if name == "router" else build_binary(name)
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="prism-bench-")
    urls = {}
    for s in [int(x) for x in args.sizes.split(",")]:
        path = cl.make_image(os.path.join(tmp, "photo_%d.jpg" % s), width=s, height=s, photo=True, quality=92, seed=s)
        urls[s] = cl.image_url(path)
        print("image %dx%d: %.1f KiB JPEG" % (s, s, os.path.getsize(path) / 1024), flush=True)
    budget = ["--mem-budget", args.mem_budget]
    model, extra, name = cl.MODEL, [], "bench_serving"
    enc_extra = args.encoder_args.split()
    if args.llama4_scaled:
        global MODEL_NAME
        model = os.path.join(tmp, "llama4_scaled")
        os.makedirs(model)
        for f in ("config.json", "preprocessor_config.json", "processor_config.json"):
            shutil.copy(os.path.join(cl.ROOT, "tests", "bench", "llama4", "serving", f), model)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(cl.ROOT, "tests", "data", "model", "llama4_tiny", f), model)
        MODEL_NAME, extra, name = "llama4_scaled", ["--random-weights"], "bench_serving_llama4"
        enc_extra = ["--embedding-cache-bytes", "0"] + enc_extra
    c = cl.Cluster(model=model, router_args=args.router_args.split(), worker_args={"encoder_worker": budget + extra + enc_extra,
                                             "prefill_worker": budget + extra, "decode_worker": budget + extra})
    try:
        ready = c.wait_ready()
        print("cluster ready in %.2fs" % ready, flush=True)
        idle = rss_peak_kb(c.procs["router"].pid) / 1024.0
        results = {"machine": os.uname().nodename and "%d cores" % os.cpu_count(), "ready_s": ready,
                   "mem_budget": args.mem_budget, "max_tokens": args.max_tokens, "cells": {},
                   "router_bin": args.router_bin or cl.binary("router"), "router_args": args.router_args,
                   "router_idle_peak_rss_mib": idle, "model": MODEL_NAME, "encoder_args": enc_extra,
                   "command": " ".join(sys.argv)}
        print("router peak RSS after start-up: %.0f MiB" % idle, flush=True)
        if args.overload:
            size = max(urls)
            cell = run_cell(c, urls[size], args.overload, args.overload, args.max_tokens, args.timeout)
            after = run_cell(c, urls[min(urls)], 1, 2, args.max_tokens, args.timeout)
            results["overload"] = {"size": size, "burst": cell, "after": after}
            print(json.dumps(results["overload"], indent=1))
            name = "overload" + ("_" + args.tag if args.tag else "")
        else:
            for s, url in urls.items():
                results["cells"][s] = []
                for conc in [int(x) for x in args.concurrency.split(",")]:
                    n = args.requests_per_cell or max(8, args.requests_factor * conc)
                    cell = run_cell(c, url, conc, n, args.max_tokens, args.timeout)
                    results["cells"][s].append(cell)
                    print("%5dpx c=%-4d ok=%-4d refused=%-3d failed=%-3d ttft p50=%.3fs p99=%.3fs tpot=%.4fs "
                          "%.1f tok/s  peak MiB router=%.0f enc=%.0f pre=%.0f dec=%.0f  refusals %s  load %.1f  stages/e2e %.4f" % (
                              s, conc, cell["ok"], cell["refused"], cell["failed"], cell["ttft_p50_s"] or -1,
                              cell["ttft_p99_s"] or -1, cell["tpot_mean_s"] or -1, cell["throughput_tok_s"],
                              cell["peak_rss_mib"]["router"], cell["peak_rss_mib"]["encoder-0"],
                              cell["peak_rss_mib"]["prefill-0"], cell["peak_rss_mib"]["decode-0"],
                              cell["refused_by_reason"] or "-", cell["load_avg_1m"][1],
                              cell["stages"]["stage_sum_over_e2e"] or -1), flush=True)
            if args.tag:
                name += "_" + args.tag
            else:
                plot(results, os.path.join(args.out, name + ".png"))
        status, _, metrics = c.request("GET", "/metrics")
        results["metrics_excerpt"] = [l for l in metrics.decode().splitlines()
                                      if l.startswith(("prism:worker_memory", "prism:requests_refused"))]
        with open(os.path.join(args.out, name + ".json"), "w") as f:
            json.dump(results, f, indent=1)
        bad = [n for n, a in c.alive().items() if not a]
        if bad:
            print("processes died: %s" % bad)
            return 1
        return 0
    finally:
        c.stop()


if __name__ == "__main__":
    sys.exit(main())
