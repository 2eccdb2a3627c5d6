#!/usr/bin/env python3
"""KV admission (issue 28): the same burst of chat requests without max_tokens against one decode
worker with a small KV pool, under --kv-admission reserve and optimistic, each in its own cluster.
Greedy requests, eos ignored, each ending at its stop string (four of them in turn, so the answers'
lengths are mixed; one that never meets its string runs to the end of the context). Reported per
mode: requests answered, output tokens and tokens/s, the most sequences the decode worker ran at
once (sampled every 50 ms from /metrics), preemptions; and whether every answer is the same in both.

  python3 tests/bench/bench_kv_admission.py --build-dir build [--requests 32] [--kv-blocks 256]
"""
import argparse
import concurrent.futures
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
cl = None   # the cluster helpers, imported once PRISM_BINARY_DIR names the build

STOPS = ["black background", "simple s", "in an image", "its colours colour"]


def run(mode, n, kv_blocks):
    with cl.Cluster(common_worker_args=["--heartbeat-interval", "0.1"],
                    worker_args={"decode_worker": ["--kv-blocks", str(kv_blocks), "--kv-admission", mode]}) as c:
        c.wait_ready()
        bodies = [cl.chat_body("Tell me a long story about the number %d." % i, temperature=0, ignore_eos=True,
                               stop=[STOPS[i % len(STOPS)]]) for i in range(n)]
        peak, done = [0], [False]

        def watch():
            while not done[0]:
                peak[0] = max(peak[0], c.metric("prism:worker_running", tier="decode") or 0)
                time.sleep(0.05)

        w = threading.Thread(target=watch)
        w.start()
        t0 = time.time()
        with concurrent.futures.ThreadPoolExecutor(n) as ex:
            res = list(ex.map(lambda b: c.post_json("/v1/chat/completions", b, timeout=1800), bodies))
        dt = time.time() - t0
        done[0] = True
        w.join()
        ok = [r for s, r in res if s == 200]
        toks = sum(r["usage"]["completion_tokens"] for r in ok)
        print("%-10s %d/%d answered, %d tokens in %.1f s = %.1f tokens/s, at most %d running, %d preemptions" % (
            mode, len(ok), n, toks, dt, toks / dt, peak[0], c.metric("vllm:num_preemptions_total")), flush=True)
        return [r["choices"][0]["message"]["content"] if s == 200 else None for s, r in res]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--kv-blocks", type=int, default=256)
    a = ap.parse_args()
    os.environ["PRISM_BINARY_DIR"] = os.path.abspath(a.build_dir)
    global cl
    import cluster as cl  # noqa: E402
    outs = [run(m, a.requests, a.kv_blocks) for m in ("reserve", "optimistic")]
    print("answers identical in both modes:", outs[0] == outs[1])
    return 0 if outs[0] == outs[1] and None not in outs[1] else 1


if __name__ == "__main__":
    sys.exit(main())
