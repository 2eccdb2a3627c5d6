#!/usr/bin/env python3
"""Early encode: time from a request body's last byte to its answer, for bodies of several large
images uploaded at a given rate, with the router's early encode (default: each image goes to an
encoder as soon as its bytes are in) and without it (--no-early-encode: images go once the whole body
is in). One cluster per mode, the same images (fresh to each cluster, so no cache hit from an earlier
request), max_tokens 1: the answer comes right after the first token.

  python3 tests/bench/bench_early_encode.py --build-dir build [--images 2] [--size 4096]
                                            [--rate-mb-s 40] [--requests 5]
"""
import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
import cluster as cl  # noqa: E402


def upload(port, raw, rate):
    """Sends one request at `rate` bytes/s; returns seconds from its last byte to the whole answer."""
    s = socket.create_connection(("127.0.0.1", port), timeout=300)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(raw))
    t0, step = time.perf_counter(), 256 * 1024
    for at in range(0, len(raw), step):
        s.sendall(raw[at:at + step])
        ahead = t0 + (at + step) / rate - time.perf_counter()
        if ahead > 0:
            time.sleep(ahead)
    t_last = time.perf_counter()
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    n = int([l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0])
    while len(body) < n:
        body += s.recv(65536)
    t_end = time.perf_counter()
    s.close()
    assert head.startswith(b"HTTP/1.1 200"), head
    return t_end - t_last


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default=os.path.join(cl.ROOT, "build"))
    ap.add_argument("--images", type=int, default=2, help="images per request")
    ap.add_argument("--size", type=int, default=4096, help="image side in pixels (photo-like JPEG)")
    ap.add_argument("--rate-mb-s", type=float, default=40, help="upload rate of each body, MB/s")
    ap.add_argument("--requests", type=int, default=5, help="requests per mode, one after the other")
    args = ap.parse_args()
    cl.BUILD = os.path.abspath(args.build_dir)
    tmp = tempfile.mkdtemp(prefix="prism-early-")
    bodies = []
    for i in range(args.requests):
        imgs = [cl.make_image(os.path.join(tmp, "r%d_%d.jpg" % (i, k)), width=args.size, height=args.size, photo=True,
                              seed=1000 + i * args.images + k) for k in range(args.images)]
        bodies.append(json.dumps(cl.chat_body("Describe the images.", imgs, max_tokens=1, temperature=0)).encode())
    mb = len(bodies[0]) / 1e6
    print("%d requests of %d photo-like %dx%d JPEGs (%.1f MB of JSON each), uploaded at %.0f MB/s"
          % (args.requests, args.images, args.size, args.size, mb, args.rate_mb_s))
    results = {}
    for mode, flags in (("early encode", []), ("--no-early-encode", ["--no-early-encode"])):
        with cl.Cluster(router_args=flags) as c:
            c.wait_ready()
            upload(c.port, json.dumps(cl.chat_body("warm up", max_tokens=1)).encode(), 1e9)
            results[mode] = [upload(c.port, b, args.rate_mb_s * 1e6) for b in bodies]
            early = c.metric("prism:router_early_encodes_total")
        print("%-18s last body byte -> answer: median %.0f ms (%s); early encodes %d"
              % (mode, 1e3 * statistics.median(results[mode]), ", ".join("%.0f" % (1e3 * x) for x in results[mode]),
                 early))
    a, b = statistics.median(results["early encode"]), statistics.median(results["--no-early-encode"])
    print("ratio early / not early: %.2f" % (a / b))


if __name__ == "__main__":
    main()
