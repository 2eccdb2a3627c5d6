#!/usr/bin/env python3
"""The encoder's image path against libjpeg-turbo's own decoder and Pillow, and its memory.

  python3 tests/bench/bench_image.py speed --build-dir build [--reps 15] [--size 4096] [--out f.json]
        [--previous-whole BIN]
  python3 tests/bench/bench_image.py rss   --build-dir build [--requests 6] [--out f.json]

speed: one photo-like JPEG (prism_imgtool --photo, q90 4:2:0), all tools taking turns in every
repetition so that a busy machine slows them alike; medians of wall time:
  - djpeg:       `djpeg -outfile /dev/null FILE` (Debian libjpeg-turbo-progs), a process: minus the
                 same process on a 16x16 JPEG ("djpeg_net"), so start-up does not count against it;
  - exact:       prism_bench_image "exact": streaming decode + CLIP preprocessing to 336x336,
                 identical to transformers, on one thread;
  - exact_relay: the same with preprocessing on a helper thread (encoder default; its CPU time
                 is the decoding thread's);
  - decode:      the streaming decode alone (rows dropped);
  - dct:         DCT-scaled decode + preprocessing (--jpeg-dct-scaling always);
  - pillow_draft: Pillow Image.open + draft("RGB", (336, 336)) + convert("RGB") + load, in-process
                 (needs Pillow; skipped otherwise). Preprocessing is not included for Pillow;
  - whole:       decode the whole image, then preprocess it (prism_bench_image_whole);
  - previous:    the same program built against an older tree (--previous-whole, see
                 tests/bench/bench_image_whole.c), to time the code before streaming in the same run.
rss: encoder peak resident memory (VmHWM) after serving images of 512x512 ... 4096x4096 pixels,
one request at a time (one file in flight), a fresh cluster per size, embedding cache off:
photo-like JPEGs (file bytes grow with pixels), flat PNGs (a few KB at any size), and progressive
JPEGs (whose coefficients, 3 bytes per pixel at 4:2:0, are whole-image state by nature).
"""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
import cluster as cl  # noqa: E402


def bench_bin():
    return os.path.join(cl.BUILD, "tests", "unit", "image", "prism_bench_image")


def run_ms(argv, cpu=None):
    """Wall milliseconds of a process; its user + system CPU milliseconds appended to cpu."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t = (time.perf_counter() - t0) * 1e3
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if cpu is not None:
        cpu.append((r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) * 1e3)
    return t


def speed(args):
    tmp = tempfile.mkdtemp(prefix="prism-bench-img-")
    img = cl.make_image(os.path.join(tmp, "photo.jpg"), width=args.size, height=args.size, photo=True, seed=3,
                        quality=90)
    tiny = cl.make_image(os.path.join(tmp, "tiny.jpg"), width=16, height=16, photo=True, seed=3)
    djpeg = shutil.which("djpeg")
    try:
        from PIL import Image  # noqa: F401
        have_pil = True
    except ImportError:
        have_pil = False
    t = {k: [] for k in ("djpeg", "djpeg_start", "exact", "exact_relay", "decode", "dct", "pillow_draft", "whole",
                         "previous")}
    whole = os.path.join(cl.BUILD, "tests", "unit", "image", "prism_bench_image_whole")
    cpu = {k: [] for k in ("exact", "exact_relay", "decode", "dct", "djpeg", "djpeg_start")}
    for r in range(args.reps):
        if djpeg:
            t["djpeg"].append(run_ms([djpeg, "-outfile", os.devnull, img], cpu["djpeg"]))
            t["djpeg_start"].append(run_ms([djpeg, "-outfile", os.devnull, tiny], cpu["djpeg_start"]))
        out = subprocess.run([bench_bin(), img, "1", "336"], check=True, capture_output=True, text=True).stdout
        for line in out.splitlines():
            d = json.loads(line)
            t[d["mode"]].append(d["median_ms"])
            cpu[d["mode"]].append(d["cpu_median_ms"])
        for key, b in (("whole", whole), ("previous", args.previous_whole)):
            if b:
                out = subprocess.run([b, img, "1", "336"], check=True, capture_output=True, text=True).stdout
                t[key].append(json.loads(out)["median_ms"])
        if have_pil:
            code = ("import time,sys\nfrom PIL import Image\nt=time.perf_counter()\nim=Image.open(sys.argv[1])\n"
                    "im.draft('RGB',(336,336))\nim=im.convert('RGB')\nim.load()\n"
                    "print((time.perf_counter()-t)*1e3)")
            p = subprocess.run([sys.executable, "-c", code, img], check=True, capture_output=True, text=True)
            t["pillow_draft"].append(float(p.stdout))
    med = {k: statistics.median(v) for k, v in t.items() if v}
    best = {k: min(v) for k, v in t.items() if v}
    if "djpeg" in med:
        med["djpeg_net"] = med["djpeg"] - med["djpeg_start"]
    res = {"file": os.path.basename(img), "pixels": "%dx%d" % (args.size, args.size),
           "file_bytes": os.path.getsize(img), "reps": args.reps, "median_ms": med, "min_ms": best,
           "cpu_median_ms": {k: statistics.median(v) for k, v in cpu.items() if v}, "samples_ms": t}
    if "djpeg_net" in med:
        res["exact_over_djpeg"] = med["exact"] / med["djpeg_net"]
        res["exact_relay_over_djpeg"] = med["exact_relay"] / med["djpeg_net"]
        if "previous" in med:
            res["previous_over_djpeg"] = med["previous"] / med["djpeg_net"]
    if "pillow_draft" in med:
        res["dct_over_pillow_draft"] = med["dct"] / med["pillow_draft"]
    cmed = res["cpu_median_ms"]
    if "djpeg" in cmed:
        # CPU time moves far less than wall time on a shared machine; for the relay it is the
        # decoding thread's (the critical path when the helper keeps up on another core)
        cnet = cmed["djpeg"] - cmed["djpeg_start"]
        res["cpu_exact_over_djpeg"] = cmed["exact"] / cnet
        res["cpu_exact_relay_thread_over_djpeg"] = cmed["exact_relay"] / cnet
    if "djpeg" in best:
        # the quietest moment of each: on a shared machine the closest to what a quiet one shows
        net = best["djpeg"] - best["djpeg_start"]
        res["min_exact_over_djpeg"] = best["exact"] / net
        res["min_exact_relay_over_djpeg"] = best["exact_relay"] / net
    print(json.dumps({k: v for k, v in res.items() if k != "samples_ms"}, indent=1))
    return res


def vmhwm(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def rss(args):
    tmp = tempfile.mkdtemp(prefix="prism-bench-rss-")
    rows = []
    for kind in ("jpeg", "png", "progressive jpeg"):
        for side in (512, 1024, 2048, 4096):
            if kind == "jpeg":
                img = cl.make_image(os.path.join(tmp, "p%d.jpg" % side), width=side, height=side, photo=True, seed=1)
            elif kind == "progressive jpeg":
                img = cl.make_image(os.path.join(tmp, "q%d.jpg" % side), width=side, height=side, photo=True, seed=1,
                                    progressive=True)
            else:
                img = cl.make_image(os.path.join(tmp, "s%d.png" % side), width=side, height=side, shape="circle",
                                    color="green")
            with cl.Cluster(worker_args={"encoder_worker": ["--embedding-cache-bytes", "0"] + args.encoder_args}) as c:
                c.wait_ready()
                for i in range(args.requests):
                    s, r = c.post_json("/v1/chat/completions",
                                       cl.chat_body("Picture %d: what is in it?" % i, [img], max_tokens=2))
                    assert s == 200, (s, r)
                row = {"kind": kind, "pixels": side * side, "side": side, "file_bytes": os.path.getsize(img),
                       "encoder_vmhwm_mib": round(vmhwm(c.procs["encoder-0"].pid) / 2**20, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return {"rows": rows}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["speed", "rss"])
    ap.add_argument("--build-dir", default=os.path.join(cl.ROOT, "build"))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--encoder-arg", dest="encoder_args", action="append", default=[])
    ap.add_argument("--previous-whole", help="prism_bench_image_whole built against an older tree")
    ap.add_argument("--out")
    args = ap.parse_args()
    cl.BUILD = os.path.abspath(args.build_dir)
    res = speed(args) if args.what == "speed" else rss(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
