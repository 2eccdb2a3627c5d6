#!/usr/bin/env python3
"""KV admission (issue 28): the same burst of chat requests without max_tokens against one decode
worker with a small KV pool, under --kv-admission reserve, optimistic (preemption by recompute: on
the CPU the swap region is off by default) and optimistic with a swap region (--kv-swap-bytes,
preemption by swap while the victim fits), each in its own cluster.
Greedy requests, eos ignored, each ending at its stop string (four of them in turn, so the answers'
lengths are mixed; one that never meets its string runs to the end of the context). Reported per
mode: requests answered, output tokens and tokens/s, the most sequences the decode worker ran at
once (sampled every 50 ms from /metrics), preemptions (by recompute and by swap); and whether every
answer is the same in all three.

With --image-size N every request is an image chat: it carries a JPEG of its own (N x N, photo-like,
made once per run), as the issue's bar asks (64 concurrent image chats without max_tokens).

  python3 tests/bench/bench_kv_admission.py --build-dir build [--requests 32] [--kv-blocks 256] [--swap-bytes 64M]
                                            [--image-size 336]
"""
import argparse
import concurrent.futures
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
cl = None   # the cluster helpers, imported once PRISM_BINARY_DIR names the build

STOPS = ["black background", "simple s", "in an image", "its colours colour"]


def run(label, n, kv_blocks, swap_bytes, images):
    mode = "reserve" if label == "reserve" else "optimistic"
    swap = ["--kv-swap-bytes", swap_bytes if label == "swap" else "0"]
    with cl.Cluster(common_worker_args=["--heartbeat-interval", "0.1"],
                    worker_args={"decode_worker": ["--kv-blocks", str(kv_blocks), "--kv-admission", mode, *swap]}) as c:
        c.wait_ready()
        bodies = [cl.chat_body("Tell me a long story about the number %d." % i, images[i:i + 1], temperature=0,
                               ignore_eos=True, stop=[STOPS[i % len(STOPS)]]) for i in range(n)]
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
        print("%-10s %d/%d answered, %d tokens in %.1f s = %.1f tokens/s, at most %d running, %d preemptions "
              "(%d recompute, %d swap)" % (
                  label, len(ok), n, toks, dt, toks / dt, peak[0], c.metric("vllm:num_preemptions_total"),
                  c.metric("prism:preemptions_total", how="recompute"), c.metric("prism:preemptions_total", how="swap")),
              flush=True)
        return [r["choices"][0]["message"]["content"] if s == 200 else None for s, r in res]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--kv-blocks", type=int, default=256)
    ap.add_argument("--swap-bytes", default="64M", help="the swap row's --kv-swap-bytes")
    ap.add_argument("--image-size", type=int, default=0, help="each request an image chat with a JPEG this size (0: text)")
    a = ap.parse_args()
    os.environ["PRISM_BINARY_DIR"] = os.path.abspath(a.build_dir)
    global cl
    import cluster as cl  # noqa: E402
    images = []
    if a.image_size:
        tmp = tempfile.mkdtemp(prefix="prism-kv-admission-")
        images = [cl.make_image(os.path.join(tmp, "%d.jpg" % i), width=a.image_size, height=a.image_size, photo=True,
                                seed=100 + i) for i in range(a.requests)]
    outs = [run(m, a.requests, a.kv_blocks, a.swap_bytes, images) for m in ("reserve", "optimistic", "swap")]
    same = outs[0] == outs[1] == outs[2]
    print("answers identical in all modes:", same)
    return 0 if same and None not in outs[1] and None not in outs[2] else 1


if __name__ == "__main__":
    sys.exit(main())
