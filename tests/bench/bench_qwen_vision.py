#!/usr/bin/env python3
"""The Qwen2.5-VL vision tower at full width (Qwen2.5-VL-7B-Instruct's published config.json,
random weights, fp32) on one synthetic image, on the CPU: Prism (tests/bench/bench_qwen_vision.c)
against HF transformers' Qwen2_5_VisionTransformerPretrainedModel with sdpa attention, on the same
number of threads. Each implementation runs in its own process (peak RSS is the process's), one
after the other; each figure is the median of --reps timed runs after one warm-up, the tower alone
(the processor runs once, outside the timing, in both).

    python3 tests/bench/bench_qwen_vision.py --build-dir build --threads 2 --reps 3 --out docs/bench

HF needs torch + transformers (not a CI dependency: the script is not run in CI). --prism-only
skips HF. The two towers get different random weights (each its own initializer): the time and
memory of a forward do not depend on the values.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
CONFIG = os.path.join(HERE, "configs", "qwen2.5-vl-7b")

HF_SCRIPT = r'''
import json, resource, sys, time
import numpy as np, torch
sys.path.insert(0, %(tools)r)
from gen_llama4_goldens import synth_image
from PIL import Image
from transformers import AutoImageProcessor, Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
torch.set_num_threads(%(threads)d)
torch.manual_seed(0)
cfg = Qwen2_5_VLConfig.from_pretrained(%(model)r).vision_config
cfg._attn_implementation = "sdpa"
t0 = time.time()
with torch.device("cpu"):
    model = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg, torch_dtype=torch.float32).eval()
load = time.time() - t0
proc = AutoImageProcessor.from_pretrained(%(model)r)
img = Image.fromarray(synth_image(%(w)d, %(h)d, %(seed)d), "RGB")
enc = proc(images=[img], return_tensors="pt")
pv, grid = enc["pixel_values"], enc["image_grid_thw"]
runs = []
with torch.inference_mode():
    for r in range(%(reps)d + 1):
        c0, t0 = time.process_time(), time.time()
        out = model(pv, grid_thw=grid).pooler_output
        dt = time.time() - t0
        if r:
            runs.append((dt, time.process_time() - c0))
walls = sorted(d for d, _ in runs)
mid = len(walls) // 2   # the median as prism_bench_qwen_vision takes it (even counts: the two middle ones' mean)
median = walls[mid] if len(walls) %% 2 else (walls[mid - 1] + walls[mid]) / 2
print(json.dumps({"impl": "hf-sdpa", "transformers": __import__("transformers").__version__, "torch": torch.__version__,
                  "grid": grid[0, 1:].tolist(), "patches": int(pv.shape[0]), "tokens": int(out.shape[0]),
                  "threads": torch.get_num_threads(), "seconds": median, "runs": walls,
                  "cpu_per_wall": sum(c for _, c in runs) / sum(d for d, _ in runs), "load_seconds": load,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
'''


def load_average():
    try:
        return os.getloadavg()
    except OSError:
        return (0, 0, 0)


def run_prism(args):
    exe = os.path.join(args.build_dir, "tests", "unit", "model", "prism_bench_qwen_vision")
    cmd = [exe, "--model-path", args.model_path, "--width", str(args.width), "--height", str(args.height),
           "--threads", str(args.threads), "--reps", str(args.reps), "--weight-dtype", args.weight_dtype]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        sys.exit("prism_bench_qwen_vision failed:\n" + r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_hf(args):
    code = HF_SCRIPT % {"tools": os.path.join(ROOT, "tools"), "threads": args.threads, "model": args.model_path,
                        "w": args.width, "h": args.height, "seed": 1, "reps": args.reps}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=args.timeout, env=env)
    if r.returncode != 0:
        sys.exit("HF run failed:\n" + r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    ap.add_argument("--model-path", default=CONFIG, help="config.json + preprocessor_config.json (random weights)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--weight-dtype", default="f32", choices=("f32", "bf16"), help="Prism's weight storage")
    ap.add_argument("--prism-only", action="store_true")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--out", help="directory for qwen_vision_<w>x<h>_t<threads>.json")
    args = ap.parse_args()
    res = {"load_before": load_average(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    res["prism"] = run_prism(args)
    if not args.prism_only:
        res["hf"] = run_hf(args)
    res["load_after"] = load_average()
    p = res["prism"]
    print("image %dx%d -> %dx%d patches, %d LM tokens, %d threads (load %.1f / %.1f before / after)" % (
        args.width, args.height, p["grid"][0], p["grid"][1], p["tokens"], args.threads, res["load_before"][0],
        res["load_after"][0]))
    print("%-10s %10s %12s %14s" % ("impl", "seconds", "cpu/wall", "peak RSS MiB"))
    for k in ("prism", "hf"):
        if k in res:
            x = res[k]
            print("%-10s %10.2f %12.2f %14.0f" % (x["impl"], x["seconds"], x["cpu_per_wall"], x["peak_rss_bytes"] / 2**20))
    if "hf" in res:
        print("prism / hf time: %.2f, peak RSS: %.2f" % (p["seconds"] / res["hf"]["seconds"],
                                                           p["peak_rss_bytes"] / res["hf"]["peak_rss_bytes"]))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        fn = os.path.join(args.out, "qwen_vision_%dx%d_t%d.json" % (args.width, args.height, args.threads))
        with open(fn, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
        print("wrote", fn)


if __name__ == "__main__":
    main()
