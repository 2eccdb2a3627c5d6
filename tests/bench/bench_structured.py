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
Wall time per step is at the mercy of a shared machine's scheduler; the decode worker's own CPU
time per generated token (utime + stime from /proc over each mode's requests) is reported beside
it and moves much less with the machine's load.
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
    ap.add_argument("--requests", type=int, default=12, help="rounds per concurrency (each runs every mode once)")
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
    results, cpu_ms = {}, {}
    with cluster.Cluster(router_args=["--tool-call-parser", "hermes"]) as c:
        c.wait_ready()

        dec_pid = c.procs["decode-0"].pid
        clk = os.sysconf("SC_CLK_TCK")

        def cpu_s():
            with open("/proc/%d/stat" % dec_pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / clk      # utime + stime

        def one(i, extra):
            body = {"model": "prism-tiny-llava", "messages": [{"role": "user", "content": "Describe a red circle."}],
                    "max_tokens": a.tokens, "temperature": 0.8, "seed": i}
            body.update(extra)
            status, headers, data = c.request("POST", "/v1/chat/completions", body)
            assert status == 200, (status, data[:300])
            timing = headers.get("x-prism-timing", "")
            tps = float(re.search(r"decode_tok_s=(\S+)", timing).group(1))
            toks = int(re.search(r"decode_tokens=(\S+)", timing).group(1))
            ntok[0] += toks + 1
            return 1000.0 / tps if tps > 0 and toks >= 20 else None

        ntok = [0]

        for _ in range(3):   # warm caches (grammar states, allocator, page cache)
            for extra in modes.values():
                one(99, extra)
        # Rounds interleave the modes, so a change of machine load hits them alike; medians over rounds.
        for conc in (1, a.concurrency):
            samples = {name: [] for name in modes}
            cpu = {name: [0.0, 0] for name in modes}
            for rnd in range(a.requests):
                for name, extra in modes.items():
                    t0, ntok[0] = cpu_s(), 0
                    with concurrent.futures.ThreadPoolExecutor(conc) as ex:
                        samples[name] += [x for x in ex.map(lambda i: one(rnd * 100 + i, extra), range(conc))
                                          if x is not None]
                    cpu[name][0] += cpu_s() - t0
                    cpu[name][1] += ntok[0]
            for name in modes:
                results[(name, conc)] = statistics.median(samples[name]) if samples[name] else float("nan")
                cpu_ms[(name, conc)] = 1000.0 * cpu[name][0] / max(cpu[name][1], 1)
        log_dir = c.log_dir
    # the decode worker logs its masks' own cost when it stops
    with open(os.path.join(log_dir, "decode-0.log")) as f:
        m = re.search(r"grammar masks: (\d+) computed, ([0-9.]+) us each", f.read())
    mask_us = float(m.group(2)) if m else float("nan")
    print("decode worker: %s grammar masks, %.1f us each on average (inline, on the step's critical path)"
          % (m.group(1) if m else "?", mask_us))
    print("| mode | wall ms per step, 1 request | overhead | decode CPU ms per token | overhead | "
          "wall ms per step, %d at once | overhead | decode CPU ms per token | overhead |" % a.concurrency)
    print("|---|---|---|---|---|---|---|---|---|")
    for name in modes:
        row = []
        for conc in (1, a.concurrency):
            w, wb = results[(name, conc)], results[("none", conc)]
            cm, cb = cpu_ms[(name, conc)], cpu_ms[("none", conc)]
            row += ["%.3f" % w, "%+.1f%%" % ((w / wb - 1) * 100), "%.3f" % cm, "%+.1f%%" % ((cm / cb - 1) * 100)]
        print("| %s | %s |" % (name, " | ".join(row)))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"wall_ms_per_step": {"%s@%d" % k: v for k, v in results.items()},
                       "decode_cpu_ms_per_token": {"%s@%d" % k: v for k, v in cpu_ms.items()}, "mask_us": mask_us},
                      f, indent=1)


if __name__ == "__main__":
    main()
