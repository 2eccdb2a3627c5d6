#!/usr/bin/env python3
"""What structured output costs per decode step, end to end through a local cluster.

Runs the same kind of request with and without an output constraint and reads each request's
decode speed from the router's x-prism-timing header (decode_tok_s: tokens after the first over
the decode time), so the figure is the decode worker's step time with the sampler's logits
processors (grammar mask computed inline, applied to a copy of the logits) on the critical path.

Modes: none (ignore_eos), regex (a long [a-z ]{N} string), json_schema (an object with a long
string and an array of integers), tool_required (a forced hermes call), and the same with
`--concurrency` requests at once (every sequence of a batch pays its own mask).

    python3 tests/bench/bench_structured.py --build build --requests 12 --concurrency 8
Prints a table (median ms per decode step and overhead against "none") and writes JSON with --out.
"""
import argparse
import concurrent.futures
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.environ.get("PRISM_BINARY_DIR", "build"))
    ap.add_argument("--requests", type=int, default=12, help="requests per mode and concurrency (median taken)")
    ap.add_argument("--tokens", type=int, default=160, help="max_tokens per request")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args()
    os.environ["PRISM_BINARY_DIR"] = os.path.abspath(a.build)
    import cluster
    cluster.BUILD = os.path.abspath(a.build)
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["query"]}}}]
    long_text = "[a-z ]+"       # unbounded: max_tokens ends every mode alike
    modes = {
        "none": {"ignore_eos": True},
        "regex": {"guided_regex": long_text},
        "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"text": {"type": "string", "pattern": "^" + long_text + "$"},
                                             "ids": {"type": "array", "items": {"type": "integer"}}},
            "required": ["text", "ids"]}}}},
        "tool_required": {"tools": tools, "tool_choice": "required", "parallel_tool_calls": False},
    }
    results = {}
    with cluster.Cluster(router_args=["--tool-call-parser", "hermes"]) as c:
        c.wait_ready()

        def one(i, extra):
            body = {"model": "prism-tiny-llava", "messages": [{"role": "user", "content": "Describe a red circle."}],
                    "max_tokens": a.tokens, "temperature": 0.8, "seed": i}
            body.update(extra)
            status, headers, data = c.request("POST", "/v1/chat/completions", body)
            assert status == 200, (status, data[:300])
            timing = headers.get("x-prism-timing", "")
            tps = float(re.search(r"decode_tok_s=(\S+)", timing).group(1))
            toks = int(re.search(r"decode_tokens=(\S+)", timing).group(1))
            return 1000.0 / tps if tps > 0 and toks >= 20 else None

        for _ in range(3):   # warm caches (grammar states, allocator, page cache)
            for extra in modes.values():
                one(99, extra)
        for conc in (1, a.concurrency):
            for name, extra in modes.items():
                with concurrent.futures.ThreadPoolExecutor(conc) as ex:
                    ms = [x for x in ex.map(lambda i: one(i, extra), range(a.requests * (conc if conc > 1 else 1)))
                          if x is not None]
                results[(name, conc)] = statistics.median(ms) if ms else float("nan")
    print("| mode | ms per decode step, 1 request | overhead | ms per step, %d at once | overhead |" % a.concurrency)
    print("|---|---|---|---|---|")
    for name in modes:
        b1, bc = results[("none", 1)], results[("none", a.concurrency)]
        m1, mc = results[(name, 1)], results[(name, a.concurrency)]
        print("| %s | %.3f | %+.1f%% | %.3f | %+.1f%% |" % (name, m1, (m1 / b1 - 1) * 100, mc, (mc / bc - 1) * 100))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"%s@%d" % k: v for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
