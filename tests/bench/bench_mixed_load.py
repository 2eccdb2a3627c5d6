#!/usr/bin/env python3
"""Mixed load (issue 28 item 3): does a text request wait behind image uploads and encodes?

Starts a local cluster of the bundled model (router + one worker of each kind, the encoder's
embedding cache off so every image is decoded and encoded), then, back to back for --rounds
rounds: 16 streaming text requests at once (text alone), and 16 text requests with 16 requests of
one distinct 4096x4096 photo-like JPEG each, all at once (mixed). Reports the text requests' time
to first token (client side: request sent to first content chunk) p50 / p99 in both phases and
the ratio of the p50s (the issue's bar: mixed within 1.5x of alone), the image requests' TTFT,
and where requests' time went in each phase (means of prism:request_stage_seconds' stages over
the phase; in the mixed phase text and image requests together), and the latency of GET /health
sent again and again during each phase (answered on the router's loop at once: the loop's latency).

  nice -n 10 python3 tests/bench/bench_mixed_load.py --build-dir build [--rounds 3] [--text 16] [--images 16]
  # another router binary (one built from an older commit), to compare; --whole: where text's time went
  nice -n 10 python3 tests/bench/bench_mixed_load.py --router-bin OLD/router [--whole]
"""
import argparse
import concurrent.futures
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
sys.path.insert(0, os.path.dirname(__file__))
import cluster as cl  # noqa: E402
import bench_serving as bs  # noqa: E402


def text_whole(port, question, timeout):
    """--whole: one non-streaming text request of one token; its client time is its TTFT, and the
    router's x-prism-timing says where it went (upload_ms, ttft_ms from the last body byte, stages)."""
    body = json.dumps({"model": bs.MODEL_NAME, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
                       "messages": [{"role": "user", "content": question}]}).encode()
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        out = {"status": r.status, "ttft": time.perf_counter() - t0}
        for kv in (r.getheader("x-prism-timing") or "").split():
            k, v = kv.split("=", 1)
            if k == "stages_ms":
                out.update({"st_" + a: float(b) for a, b in (x.split(":") for x in v.split(","))})
            elif k.endswith("_ms"):
                out[k] = float(v)
        return out
    except (OSError, http.client.HTTPException) as e:
        return {"status": 0, "message": "connection: %s" % e}
    finally:
        conn.close()


def probe(port, stop, out):
    """GET /health on one kept-alive connection, again and again until stop is set: the router's loop
    answers it at once, so its latency is the loop's (a turn busy with uploads shows here)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    while not stop.is_set():
        t0 = time.perf_counter()
        conn.request("GET", "/health")
        conn.getresponse().read()
        out.append(time.perf_counter() - t0)
        time.sleep(0.002)
    conn.close()


def phase(c, text, image_bodies, max_tokens, timeout, whole, loop_lat=None):
    """Sends len(text) text requests and the image requests' bodies (made before) at once; returns
    (text results, image results, stage breakdown over the phase). loop_lat: /health latencies
    while the phase runs are appended there."""
    before = bs.stage_sums(c)
    stop = threading.Event()
    prober = threading.Thread(target=probe, args=(c.port, stop, loop_lat if loop_lat is not None else []))
    prober.start()
    jobs = [(None, bs.request_body(None, max_tokens, t), t) for t in text] + [(b, b, None) for b in image_bodies]

    def one(j):
        if whole and j[0] is None:
            return text_whole(c.port, j[2], timeout)
        return bs.one_request(c.port, None, max_tokens, timeout, body=j[1])
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
        res = list(ex.map(one, jobs))
    stop.set()
    prober.join()
    return res[:len(text)], res[len(text):], bs.stage_breakdown(before, bs.stage_sums(c))


def text_breakdown(results):
    """--whole: the text requests' medians of the router's timing fields (ms)."""
    ok = [r for r in results if r["status"] == 200]
    keys = sorted({k for r in ok for k in r if k.endswith("_ms") or k.startswith("st_")})
    out = {k: statistics.median(r.get(k, 0) for r in ok) for k in keys}
    # the client's time to its answer less the router's (last body byte to first token): the HTTP
    # layer (connection, headers, body, response) and the client
    out["outside_router_ms"] = statistics.median(1e3 * r["ttft"] - r.get("ttft_ms", 0) - r.get("upload_ms", 0) for r in ok)
    out["client_ms"] = statistics.median(1e3 * r["ttft"] for r in ok)
    return out


def summary(results):
    ok = [r["ttft"] for r in results if r["status"] == 200]
    return {"ok": len(ok), "of": len(results), "ttft_p50_s": bs.pct(ok, 50), "ttft_p99_s": bs.pct(ok, 99),
            "statuses": sorted({r["status"] for r in results})}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build-dir", default=os.path.join(cl.ROOT, "build"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--text", type=int, default=16)
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--router-bin", default="", help="run this router binary instead of the build's (to compare)")
    ap.add_argument("--whole", action="store_true", help="text requests of one token, not streamed, with the "
                    "router's x-prism-timing: where a text request's time went (diagnosis)")
    args = ap.parse_args()
    cl.BUILD = os.path.abspath(args.build_dir)
    if args.router_bin:
        build_binary = cl.binary
        cl.binary = lambda name: os.path.abspath(args.router_bin) if name == "router" else build_binary(name)
    tmp = tempfile.mkdtemp(prefix="prism-mixed-")
    t0 = time.time()
    urls = [cl.image_url(cl.make_image(os.path.join(tmp, "photo_%d.jpg" % i), width=args.size, height=args.size,
                                       photo=True, quality=92, seed=100 + i)) for i in range(args.images)]
    print("%d distinct %dx%d JPEGs, %.1f MiB of data URLs on average (made in %.0fs)" % (
        args.images, args.size, args.size, statistics.mean(len(u) for u in urls) / 2**20, time.time() - t0), flush=True)
    text = ["Tell me something about the number %d." % i for i in range(args.text)]
    bodies = [bs.request_body(u, args.max_tokens) for u in urls]
    with cl.Cluster(router_args=["--timing-header"] if args.whole else [],
                    worker_args={"encoder_worker": ["--embedding-cache-bytes", "0"]}) as c:
        c.wait_ready()
        for _ in range(2):   # warm up
            bs.one_request(c.port, None, 4, args.timeout, body=bs.request_body(None, 4, "Warm up."))
        alone, mixed, images, stages = [], [], [], {"alone": [], "mixed": []}
        lat_alone, lat_mixed = [], []
        for rnd in range(args.rounds):
            a, _, st_a = phase(c, text, [], args.max_tokens, args.timeout, args.whole, lat_alone)
            m, im, st_m = phase(c, text, bodies, args.max_tokens, args.timeout, args.whole, lat_mixed)
            if args.whole:
                for name, rs in (("alone", a), ("mixed", m)):
                    print("  text %s, medians (ms): %s" % (name, ", ".join(
                        "%s %.1f" % (k, v) for k, v in text_breakdown(rs).items() if v >= 0.5)), flush=True)
            alone += a
            mixed += m
            images += im
            stages["alone"].append(st_a)
            stages["mixed"].append(st_m)
            print("round %d: text alone p50 %.3fs, text mixed p50 %.3fs, images p50 %.3fs (load %.1f)" % (
                rnd + 1, summary(a)["ttft_p50_s"] or -1, summary(m)["ttft_p50_s"] or -1,
                summary(im)["ttft_p50_s"] or -1, os.getloadavg()[0]), flush=True)
        out = {"command": " ".join(sys.argv), "cores": os.cpu_count(), "rounds": args.rounds,
               "text_alone": summary(alone), "text_mixed": summary(mixed), "images_mixed": summary(images),
               "stages": stages, "alive": c.alive(),
               "health_ms_alone": [1e3 * bs.pct(lat_alone, p) for p in (50, 99)],
               "health_ms_mixed": [1e3 * bs.pct(lat_mixed, p) for p in (50, 99)]}
    ra, rm = out["text_alone"], out["text_mixed"]
    ratio = rm["ttft_p50_s"] / ra["ttft_p50_s"] if ra["ttft_p50_s"] and rm["ttft_p50_s"] else None
    out["p50_ratio"] = ratio
    print("| phase | requests ok | text TTFT p50 (s) | text TTFT p99 (s) |")
    print("|---|---|---|---|")
    print("| %d text alone | %d/%d | %.3f | %.3f |" % (args.text, ra["ok"], ra["of"], ra["ttft_p50_s"], ra["ttft_p99_s"]))
    print("| %d text + %d images | %d/%d | %.3f | %.3f |" % (args.text, args.images, rm["ok"], rm["of"],
                                                          rm["ttft_p50_s"], rm["ttft_p99_s"]))
    print("text TTFT p50 mixed / alone: %.2fx (bar: 1.5x); image TTFT p50 %.3fs p99 %.3fs" % (
        ratio or -1, out["images_mixed"]["ttft_p50_s"] or -1, out["images_mixed"]["ttft_p99_s"] or -1))
    print("GET /health during the phases (the loop's latency), p50 / p99: alone %.2f / %.2f ms, mixed %.2f / %.2f ms" % (
        *out["health_ms_alone"], *out["health_ms_mixed"]))
    for name in ("alone", "mixed"):
        means = {}
        for st in stages[name]:
            for k, v in st["stage_means_ms"].items():
                means.setdefault(k, []).append(v)
        print("stage means (ms), %s: %s" % (name, ", ".join("%s %.0f" % (k, statistics.mean(v))
                                                           for k, v in sorted(means.items()) if statistics.mean(v) >= 1)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(out["alive"].values()) and ra["ok"] == ra["of"] and rm["ok"] == rm["of"] else 1


if __name__ == "__main__":
    sys.exit(main())
