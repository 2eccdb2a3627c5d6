#!/usr/bin/env python3
"""Per-request time split of the bundled model on this machine: seconds from launch to ready, then
sequential requests (one at a time, so nothing queues) per image kind, reporting the medians of the
x-prism-timing header the router adds to non-streaming responses: image decode, ViT, prefill queue,
prefill, time to first token, decode tokens/s, end to end.

  python3 tests/bench/bench_latency.py --build-dir build [--requests 20] [--max-tokens 32]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
import cluster as cl  # noqa: E402


def parse_timing(h):
    out = {}
    for kv in h.split():
        k, v = kv.split("=")
        out[k] = float(v)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default=os.path.join(cl.ROOT, "build"))
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--router-bin", default="", help="run this router binary instead of the build's (to compare)")
    args = ap.parse_args()
    cl.BUILD = os.path.abspath(args.build_dir)
    if args.router_bin:
        build_binary = cl.binary
        cl.binary = lambda name: os.path.abspath(args.router_bin) if name == "router" else build_binary(name)
    tmp = tempfile.mkdtemp(prefix="prism-lat-")
    kinds = [
        ("text only", None),
        ("JPEG 640x480", cl.make_image(os.path.join(tmp, "a.jpg"), width=640, height=480, photo=True, seed=1)),
        ("PNG 1024x768", cl.make_image(os.path.join(tmp, "b.png"), width=1024, height=768, photo=True, seed=2)),
        ("JPEG 4096x4096", cl.make_image(os.path.join(tmp, "c.jpg"), width=4096, height=4096, photo=True, seed=3)),
    ]
    readies = []
    for _ in range(3):
        c = cl.Cluster(router_args=["--timing-header"])
        readies.append(c.wait_ready())
        c.stop()
    print("launch to ready: median %.2fs over 3 launches (%s)" % (statistics.median(readies),
                                                                   ", ".join("%.2f" % x for x in readies)))
    # router_ms: last body byte -> work handed to ZeroMQ (routers before it was added print nan)
    keys = ["router_ms", "image_decode_ms", "vit_ms", "queue_ms", "prefill_ms", "ttft_ms", "decode_tok_s", "e2e_ms"]
    print("| request | prompt tokens | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    with cl.Cluster(router_args=["--timing-header"], worker_args={"encoder_worker": ["--embedding-cache-bytes", "0"]}) as c:
        c.wait_ready()
        for name, img in kinds:
            rows, prompt = [], 0
            for i in range(args.requests + 2):
                body = cl.chat_body("What is in the image?", [img] if img else [], max_tokens=args.max_tokens,
                                    temperature=0, ignore_eos=True)
                status, headers, data = c.request("POST", "/v1/chat/completions", body)
                assert status == 200, (status, data[:200])
                if i >= 2:  # warm-up
                    rows.append(parse_timing(headers["x-prism-timing"]))
                import json
                prompt = json.loads(data)["usage"]["prompt_tokens"]
            med = {k: statistics.median(r.get(k, float("nan")) for r in rows) for k in keys}
            print("| %s | %d | " % (name, prompt) + " | ".join("%.1f" % med[k] for k in keys) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
