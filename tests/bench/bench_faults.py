#!/usr/bin/env python3
"""Fault matrix (issue 9): a cluster started by deploy/launch.sh (processes supervised and restarted)
(two routers behind nginx, as deployed) under a steady image load, one fault at a time; what the
clients saw.

For each topology (--per-tier 2 and 1 workers of every tier) and each tier in turn: SIGKILL worker
<tier>-1 (the supervisor restarts it), or SIGSTOP it for longer than the router's --worker-timeout
and SIGCONT it. Reported per fault: requests answered 200 / total among those in flight at the fault
or started until the worker served again, the extra latency of those requests over the undisturbed
median (p50 / p99), and the seconds until the restarted worker registered again. A final phase
restarts every process one at a time (SIGTERM, as a rolling upgrade does) and counts what was lost.

  python3 tests/bench/bench_faults.py --build-dir build [--clients 4] [--max-tokens 96]
                                      [--worker-timeout 2] [--json docs/bench/faults.json]
"""
import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
import cluster as cl  # noqa: E402
import launched as la  # noqa: E402


class Load:
    """Client threads sending image requests back to back; every request's (start, end, status)."""

    def __init__(self, c, bodies, clients):
        self.c, self.bodies, self.done, self.stop = c, bodies, [], False
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def run(self, i):
        k = i
        while not self.stop:
            t0 = time.time()
            try:
                status, _, _ = self.c.request("POST", "/v1/chat/completions", self.bodies[k % len(self.bodies)],
                                              timeout=300)
            except Exception as e:  # a connection reset is a lost request too
                status = repr(e)[:60]
            with self.lock:
                self.done.append((t0, time.time(), status))
            k += len(self.threads)
            if status != 200:
                time.sleep(0.2)  # as a client would back off (and not flood the count)

    def finish(self):
        self.stop = True
        for t in self.threads:
            t.join(400)
        return self.done


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else 0.0


def fault(c, load, name, kind, worker_timeout, settle):
    """One fault on worker `name`; returns its row."""
    time.sleep(settle)
    with load.lock:
        base = [e - s for s, e, st in load.done if st == 200]
    median = statistics.median(base) if base else 0.0
    regs = c.registrations(name)
    pid = c.pid(name)
    t_fault = time.time()
    if kind == "SIGKILL":
        os.kill(pid, signal.SIGKILL)
        c.wait_restarted(name, pid, timeout=120)
    elif kind == "SIGSTOP":
        os.kill(pid, signal.SIGSTOP)
        time.sleep(worker_timeout + 2)
        os.kill(pid, signal.SIGCONT)
    la.wait_for("%s to register again" % name, lambda: c.registrations(name) > regs, 120)
    t_back = time.time()
    time.sleep(settle)
    with load.lock:
        hit = [(s, e, st) for s, e, st in load.done if e >= t_fault and s <= t_back]
    ok = sum(1 for _, _, st in hit if st == 200)
    extra = [max(0.0, (e - s) - median) for s, e, st in hit if st == 200]
    bad = sorted({str(st) for _, _, st in hit if st != 200})
    return {"fault": "%s %s" % (kind, name), "affected": len(hit), "ok": ok,
            "extra_p50_s": round(pct(extra, 0.5), 3), "extra_p99_s": round(pct(extra, 0.99), 3),
            "back_after_s": round(t_back - t_fault, 2), "errors": bad}


def ready(port):
    try:
        return la.at_port(port).request("GET", "/ready", timeout=5)[0] == 200
    except OSError:
        return False


NGINX_FAIL_TIMEOUT_S = 2.0


def rolling(c, load, names, settle):
    """SIGTERM each process in turn (the supervisor restarts it) and waits until it serves again."""
    t0 = time.time()
    for name in names:
        pid = c.pid(name)
        regs = c.registrations(name) if not name.startswith("router") else 0
        os.kill(pid, signal.SIGTERM)
        c.wait_restarted(name, pid, timeout=120)
        if name.startswith("router"):
            port = c.router_ports[int(name.split("-")[1]) - 1]
            la.wait_for("%s ready" % name, lambda: ready(port), 120)
            # nginx (open source) checks its upstreams passively: the router refused connections
            # while it restarted, so nginx keeps it marked failed for fail_timeout (2 s in
            # deploy/nginx/prism.conf) and would find no live router if the next one stopped now.
            # An operator's rolling restart waits that long too (or uses an active health check).
            time.sleep(NGINX_FAIL_TIMEOUT_S)
        else:
            la.wait_for("%s to register again" % name, lambda: c.registrations(name) > regs, 120)
        time.sleep(1)
    time.sleep(settle)
    with load.lock:
        hit = [(s, e, st) for s, e, st in load.done if e >= t0]
    return {"fault": "rolling SIGTERM of %s" % ", ".join(names), "affected": len(hit),
            "ok": sum(1 for _, _, st in hit if st == 200), "extra_p50_s": None, "extra_p99_s": None,
            "back_after_s": round(time.time() - t0, 1), "errors": sorted({str(st) for _, _, st in hit if st != 200})}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default=os.path.join(cl.ROOT, "build"))
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--worker-timeout", type=float, default=2.0)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--per-tier", type=int, nargs="*", default=[2, 1])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cl.BUILD = la.BUILD = os.path.abspath(args.build_dir)
    la.SUPERVISOR = os.path.join(cl.BUILD, "deploy", "prism_supervisor")
    tmp = tempfile.mkdtemp(prefix="prism-faults-")
    bodies = [cl.chat_body("Describe the picture.", [cl.make_image(os.path.join(tmp, "p%d.jpg" % i), width=640,
                                                                    height=480, photo=True, seed=i)],
                           max_tokens=args.max_tokens, temperature=0, ignore_eos=True) for i in range(8)]
    rows = []
    for n in args.per_tier:
        # two routers behind nginx, as deployed: a router restart is a rolling upgrade's step too
        with la.Launched(routers=2, encoders=n, prefills=n, decodes=n, lb="nginx",
                         args=["--router-arg", "--worker-timeout=%g" % args.worker_timeout,
                               "--worker-arg", "--heartbeat-interval=0.2"]) as c:
            c.wait_ready()
            load = Load(c, bodies, args.clients)
            for kind in ("SIGKILL", "SIGSTOP"):
                for tier in ("encoder", "prefill", "decode"):
                    row = fault(c, load, "%s-1" % tier, kind, args.worker_timeout, args.settle)
                    row["per_tier"] = n
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            row = rolling(c, load, ["encoder-1", "prefill-1", "decode-1", "router-1", "router-2"], args.settle)
            row["per_tier"] = n
            rows.append(row)
            print(json.dumps(row), flush=True)
            done = load.finish()
            rows.append({"per_tier": n, "fault": "whole run", "affected": len(done),
                         "ok": sum(1 for _, _, st in done if st == 200), "extra_p50_s": None, "extra_p99_s": None,
                         "back_after_s": None, "errors": sorted({str(st) for _, _, st in done if st != 200})})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| workers per tier | fault | answered 200 / affected | extra latency p50 / p99 (s) | serving again after (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        lat = "-" if r["extra_p50_s"] is None else "%.2f / %.2f" % (r["extra_p50_s"], r["extra_p99_s"])
        back = "-" if r["back_after_s"] is None else "%.1f" % r["back_after_s"]
        print("| %d | %s | %d / %d | %s | %s |" % (r["per_tier"], r["fault"], r["ok"], r["affected"], lat, back))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
