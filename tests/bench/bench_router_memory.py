#!/usr/bin/env python3
"""The memory bar: every process of a cluster within its --mem-budget under the image matrix and a burst.

Starts a local cluster (router + one worker of each kind) with every process at its default
--mem-budget (512 MiB, the router's included) and default flags, then:

  the matrix   image sizes 512, 2048, 4096 (photo-like JPEGs; the 4096x4096 one ~7.6 MB) x concurrency
               1, 2, 4, 8, 16, 32, 64, 128: in each cell `concurrency` streaming chat requests, every
               one sent at once (the bodies are built before the cell, each client thread waits at a
               barrier, then writes its whole request)
  the burst    --burst N (384) such 4096x4096 uploads at once, then two small requests (service after)

and records per cell the answers by status (and the refusals' messages), TTFT, and the peak RSS
(VmHWM, reset per cell through /proc/PID/clear_refs) of every process against its budget, plus
the router's own memory plan from /metrics (prism:router_memory_plan_bytes). Exit status 0 when the
bar holds: no answer outside 200/429/503 and every process's peak within its budget.

  python3 tests/bench/bench_router_memory.py --build-dir build --out docs/bench
  python3 tests/bench/bench_router_memory.py --sizes 4096 --concurrency 8,64 --burst 96   # a reduced run

Only the standard library is needed.
"""
import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
import cluster as cl  # noqa: E402

QUESTION = "What is in the image?"
MIB = 1 << 20


def vm_hwm(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_hwm(pid):
    try:
        with open("/proc/%d/clear_refs" % pid, "w") as f:
            f.write("5")
    except OSError:
        pass


def request_bytes(port, url, max_tokens, model="prism-tiny-llava"):
    body = json.dumps({"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True,
                       "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                                 {"type": "text", "text": QUESTION}]}]}).encode()
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
            "Content-Length: %d\r\nConnection: close\r\n\r\n" % (port, len(body))).encode()
    return head + body


def read_answer(sock, t0):
    """Reads a whole HTTP answer (Connection: close): (status, message, ttft)."""
    buf, ttft = b"", None
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        if ttft is None and b'"content":"' in chunk and b'"content":""' not in chunk:
            ttft = time.perf_counter() - t0
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0, "no HTTP answer (%d bytes)" % len(buf), None
    msg = ""
    if status != 200:
        try:
            msg = json.loads(body[body.find(b"{"):body.rfind(b"}") + 1])["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = body[:120].decode("utf-8", "replace")
    elif b'"error"' in body:
        status, msg = 599, "SSE error event"
    return status, msg, ttft


def one_client(port, data, barrier, timeout, out, i):
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    except OSError as e:
        barrier.wait()
        out[i] = {"status": 0, "message": "connect: %s" % e}
        return
    try:
        barrier.wait()
        t0 = time.perf_counter()
        try:
            s.sendall(data)
        except OSError as e:   # the router answered early (refusal) and closed: read what it said
            pass
        status, msg, ttft = read_answer(s, t0)
        out[i] = {"status": status, "message": msg, "ttft": ttft, "e2e": time.perf_counter() - t0}
    except OSError as e:
        out[i] = {"status": 0, "message": "connection: %s" % e}
    finally:
        s.close()


def pct(xs, p):
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))] if xs else None


def budgets(c):
    """{process: budget bytes}: the router's from its plan, the workers' from their registrations."""
    out = {"router": c.metric("prism:router_memory_budget_bytes") or 0}
    for name in c.procs:
        if name != "router":
            out[name] = c.metric("prism:worker_memory_budget_bytes", worker=name) or 0
    return out


def write_result(out, name, tag, res):
    """The run's figures as out/NAME[_TAG].json."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "%s%s.json" % (name, "_" + tag if tag else ""))
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote %s" % path)


def run_cell(c, data, n, timeout):
    pids = {name: p.pid for name, p in c.procs.items()}
    for pid in pids.values():
        reset_hwm(pid)
    load0 = os.getloadavg()[0]
    out = [None] * n
    barrier = threading.Barrier(n)
    threads = [threading.Thread(target=one_client, args=(c.port, data, barrier, timeout, out, i)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    by_status, messages = {}, {}
    for r in out:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
        if r["status"] != 200:
            key = "%s %s" % (r["status"], r.get("message", "")[:90])
            messages[key] = messages.get(key, 0) + 1
    ok = [r for r in out if r["status"] == 200]
    return {
        "requests": n, "by_status": by_status, "non_200_messages": messages,
        "outside_bar": sum(v for k, v in by_status.items() if k not in (200, 429, 503)),
        "ttft_p50_s": pct([r["ttft"] for r in ok], 50), "ttft_p99_s": pct([r["ttft"] for r in ok], 99),
        "wall_s": wall, "peak_rss_bytes": {name: vm_hwm(pid) for name, pid in pids.items()},
        "load_avg_1m": [load0, os.getloadavg()[0]], "alive": c.alive(),
    }


def line(tag, cell, budget):
    peaks = cell["peak_rss_bytes"]
    over = [p for p in peaks if budget.get(p) and peaks[p] > budget[p]]
    return ("%-14s n=%-4d %s  ttft p50=%s  peak MiB router=%.0f enc=%.0f pre=%.0f dec=%.0f%s  wall %.1fs load %.1f" % (
        tag, cell["requests"], " ".join("%s:%d" % kv for kv in sorted(cell["by_status"].items())),
        "%.2fs" % cell["ttft_p50_s"] if cell["ttft_p50_s"] is not None else "-",
        peaks.get("router", 0) / MIB, peaks.get("encoder-0", 0) / MIB, peaks.get("prefill-0", 0) / MIB,
        peaks.get("decode-0", 0) / MIB, "  OVER BUDGET: %s" % over if over else "", cell["wall_s"],
        cell["load_avg_1m"][1]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build-dir", default=os.path.join(cl.ROOT, "build"))
    ap.add_argument("--out", default="", help="directory for bench_router_memory[_TAG].json (none: no file)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--sizes", default="512,2048,4096")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--burst", type=int, default=384, help="4096x4096 uploads at once after the matrix (0: none)")
    ap.add_argument("--quality", type=int, default=93, help="JPEG quality (93: the 4096x4096 photo is 7.6 MB)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--router-args", default="", help="extra router flags (space separated)")
    ap.add_argument("--worker-args", default="--mem-budget 512M", help="flags of every worker (space separated)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--router-bin", default="", help="run this router binary instead of the build's (a variant)")
    args = ap.parse_args()
    cl.BUILD = os.path.abspath(args.build_dir)
    if args.router_bin:
        build_binary = cl.binary
        cl.binary = lambda name: os.path.abspath(args.router_bin) if name == "router" else build_binary(name)
    tmp = tempfile.mkdtemp(prefix="prism-membench-")
    sizes = [int(x) for x in args.sizes.split(",") if x]
    if args.burst and 4096 not in sizes:
        sizes.append(4096)
    urls = {}
    for s in sizes:
        path = cl.make_image(os.path.join(tmp, "photo_%d.jpg" % s), width=s, height=s, photo=True,
                             quality=args.quality, seed=s)
        urls[s] = cl.image_url(path)
        print("image %dx%d: %.2f MB JPEG, %.2f MB as a data URL" % (s, s, os.path.getsize(path) / 1e6,
                                                                  len(urls[s]) / 1e6), flush=True)
    wa = args.worker_args.split()
    c = cl.Cluster(router_args=args.router_args.split(),
                   worker_args={"encoder_worker": wa, "prefill_worker": wa, "decode_worker": wa})
    failed = False
    try:
        c.wait_ready()
        budget = budgets(c)
        plan = {lb.get("region"): v for n, lb, v in c.metrics() if n == "prism:router_memory_plan_bytes"}
        res = {"command": " ".join(sys.argv), "cores": os.cpu_count(), "budgets": budget, "router_plan": plan,
               "router_idle_rss_bytes": vm_hwm(c.procs["router"].pid), "matrix": {}, "burst": None}
        print("budgets MiB: %s" % {k: round(v / MIB) for k, v in budget.items()}, flush=True)
        print("router plan MiB: %s" % {k: round(v / MIB, 1) for k, v in plan.items()}, flush=True)
        cells = []
        for s in [x for x in sizes if str(x) in args.sizes.split(",")]:
            res["matrix"][s] = []
            for conc in [int(x) for x in args.concurrency.split(",") if x]:
                cell = run_cell(c, request_bytes(c.port, urls[s], args.max_tokens), conc, args.timeout)
                cell["concurrency"] = conc
                res["matrix"][s].append(cell)
                cells.append(cell)
                print(line("%dpx c=%d" % (s, conc), cell, budget), flush=True)
        if args.burst:
            cell = run_cell(c, request_bytes(c.port, urls[4096], args.max_tokens), args.burst, args.timeout)
            after = run_cell(c, request_bytes(c.port, urls[min(urls)], args.max_tokens), 2, args.timeout)
            res["burst"] = {"burst": cell, "after": after}
            cells += [cell, after]
            print(line("burst %d" % args.burst, cell, budget), flush=True)
            print(line("after", after, budget), flush=True)
            failed |= after["by_status"] != {200: 2}
        res["metrics_end"] = [l for l in c.request("GET", "/metrics")[2].decode().splitlines()
                              if l.startswith(("prism:router_memory", "prism:requests_refused", "prism:worker_memory",
                                               "prism:router_uploads_paused"))]
        outside = sum(x["outside_bar"] for x in cells)
        over = sorted({p for x in cells for p, v in x["peak_rss_bytes"].items() if budget.get(p) and v > budget[p]})
        worst = {p: max(x["peak_rss_bytes"].get(p, 0) for x in cells) for p in budget}
        dead = [n for n, a in c.alive().items() if not a]
        res["verdict"] = {"answers_outside_200_429_503": outside, "over_budget": over, "dead": dead,
                          "peak_rss_bytes": worst}
        print("peak MiB over the run: %s (budgets %s)" % ({k: round(v / MIB) for k, v in worst.items()},
                                                          {k: round(v / MIB) for k, v in budget.items()}))
        print("answers outside 200/429/503: %d; over budget: %s; dead: %s" % (outside, over or "none", dead or "none"))
        failed |= bool(outside or over or dead)
        if args.out:
            write_result(args.out, "bench_router_memory", args.tag, res)
    finally:
        c.stop()
    print("BAR %s" % ("FAILED" if failed else "HOLDS"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
