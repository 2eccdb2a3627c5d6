#!/usr/bin/env python3
"""The cost of a change to the request path, side by side: router requests/s and decode tokens/s of
two source trees, each built, in alternating rounds on the same machine.

Each tree serves the bundled model with its own tests/integration/cluster.py and build (one worker
per tier, default flags). Per round and tree: `--requests` one-token text requests at concurrency
`--concurrency` (requests/s: the router's and the workers' per-request work), then `--streams`
requests at once generating `--tokens` tokens each with ignore_eos (decode tokens/s). Rounds
alternate the trees (A B B A A B ...) so drift in the machine's load falls on both.

  python3 tests/bench/bench_overhead.py --before TREE_A --after TREE_B --rounds 6
  (each TREE has build/ with router and the three workers built)

Only the standard library is needed.
"""
import argparse
import concurrent.futures
import http.client
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r'''
import concurrent.futures, http.client, json, os, sys, time
sys.path.insert(0, os.path.join(sys.argv[1], "tests", "integration"))
import cluster as cl
n_req, conc, streams, tokens = (int(x) for x in sys.argv[2:6])
c = cl.Cluster()
try:
    c.wait_ready()
    def post(body):
        conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=300)
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = json.loads(r.read())
        conn.close()
        assert r.status == 200, data
        return data["usage"]["completion_tokens"]
    short = {"prompt": "Once upon a time", "max_tokens": 1}
    long = {"prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
    for _ in range(8):
        post(short)   # warm
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(conc) as ex:
        list(ex.map(lambda _: post(short), range(n_req)))
    rps = n_req / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as ex:
        out = sum(ex.map(lambda _: post(long), range(streams)))
    tps = out / (time.perf_counter() - t0)
    print(json.dumps({"requests_per_s": rps, "tokens_per_s": tps}))
finally:
    c.stop()
'''


def one(tree, args):
    env = dict(os.environ, PRISM_SOURCE_DIR=tree, PRISM_BINARY_DIR=os.path.join(tree, "build"))
    out = subprocess.run([sys.executable, "-c", CHILD, tree, str(args.requests), str(args.concurrency),
                          str(args.streams), str(args.tokens)], env=env, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit("%s failed:\n%s" % (tree, out.stderr[-3000:]))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="source tree A (with build/)")
    ap.add_argument("--after", required=True, help="source tree B (with build/)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", default="", help="JSON file for the figures")
    args = ap.parse_args()
    runs = {"before": [], "after": []}
    for i in range(args.rounds):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for name in order:
            r = one(os.path.abspath(getattr(args, name)), args)
            runs[name].append(r)
            print("round %d %-6s %7.1f requests/s %8.1f tokens/s  load %.1f" % (
                i, name, r["requests_per_s"], r["tokens_per_s"], os.getloadavg()[0]), flush=True)
    res = {"command": " ".join(sys.argv), "cores": os.cpu_count(), "runs": runs}
    for k in ("requests_per_s", "tokens_per_s"):
        b = statistics.median(r[k] for r in runs["before"])
        a = statistics.median(r[k] for r in runs["after"])
        res[k] = {"before_median": b, "after_median": a, "after_over_before": a / b}
        print("%s: before %.1f, after %.1f (medians): %.3fx" % (k, b, a, a / b))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
