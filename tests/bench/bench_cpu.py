#!/usr/bin/env python3
"""CPU kernels against the BLAS roofline and HF transformers, side by side in one run.

  python3 tests/bench/bench_cpu.py --build-dir build [--threads 1,2] [--reps 3]
                                   [--baseline-build OLD_BUILD] [--skip-hf] [--only vit,llm,bf16,bundled]

For each thread count, on this machine, in one run:
  * the backend's matmul against OpenBLAS sgemm with its own threading, alternating, on the ViT's
    largest GEMM (577x4096x1024), the memcpy bandwidth (bytes read + written per second, 512 MiB
    buffers) and the read-only stream bandwidth (bytes read per second, widest vector loads);
  * CLIP-L/336 vision tower + LLaVA-1.5 projector per image (tests/bench/configs/llava-1.5-7b,
    random weights, the 23 layers LLaVA uses): Prism vs HF transformers (CLIPVisionModel with the
    same 23 layers + Linear/GELU/Linear, torch.set_num_threads), and Prism's GFLOP/s as a share of
    sgemm's;
  * a ~0.5B-parameter Llama (tests/bench/configs/llama-0.5b, random weights): prefill of 2,048
    tokens in one forward (last-token logits only, HF with logits_to_keep=1 and a KV cache), and
    batch-1 greedy decode tokens/s after a 128-token prompt, against the memory roofline (bytes of
    weights a step streams / copy bandwidth), against the same bytes over the read-only stream
    bandwidth at the same thread count (a decode step only reads; one core pulls far less than
    a copy moves), and HF;
  * bf16: the same Llama with its weights stored as bf16 (--weight-dtype bf16, fp32 arithmetic):
    prefill against fp32 weights; decode against the roofline of its own (halved) bytes, against
    the fp32 model's roofline, against fp32 weights and against HF (fp32);
  * the bundled model (models/prism-tiny-llava, its checkpoint): ViT + prefill of a 77-token
    prompt (the compute of a request's TTFT) and decode tokens/s, for --baseline-build too.
Every figure is the median of --reps timed runs after a warm-up; Prism's runs come from
prism_bench_model (tests/bench/bench_model.c). The machine may be shared: re-run on a quiet one
before quoting absolute numbers. "Ratio by CPU time" compares process CPU seconds instead of wall
time (for the roofline: threads x tokens per CPU-second), which a busy machine disturbs less; it
counts the pool's short spin-waits as work, so it slightly understates Prism.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
VIT_CFG = os.path.join(ROOT, "tests", "bench", "configs", "llava-1.5-7b")
LLM_CFG = os.path.join(ROOT, "tests", "bench", "configs", "llama-0.5b")
BUNDLED = os.path.join(ROOT, "models", "prism-tiny-llava")


def prism(build, *args):
    exe = os.path.join(build, "tests", "unit", "model", "prism_bench_model")
    out = subprocess.run([exe, *map(str, args)], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


HF_VIT = r"""
import json, statistics, sys, time, torch
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel
threads, reps, cfg_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(threads)
torch.manual_seed(0)
cfg = json.load(open(cfg_dir + "/config.json"))
vc = CLIPVisionConfig(**cfg["vision_config"])
fl = cfg.get("vision_feature_layer", -2)
vc.num_hidden_layers = vc.num_hidden_layers + 1 + fl if fl < 0 else fl   # the layers LLaVA uses
model = CLIPVisionModel(vc).eval()
H = cfg["text_config"]["hidden_size"]
proj = nn.Sequential(nn.Linear(vc.hidden_size, H), nn.GELU(), nn.Linear(H, H)).eval()
x = torch.randn(1, 3, vc.image_size, vc.image_size)
ms, cms = [], []
with torch.inference_mode():
    for r in range(reps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        h = model(pixel_values=x).last_hidden_state[:, 1:]
        proj(h)
        if r:
            ms.append((time.perf_counter() - t0) * 1e3)
            cms.append((time.process_time() - c0) * 1e3)
print(json.dumps({"ms_runs": ms, "ms": statistics.median(ms), "cpu_ms": statistics.median(cms),
                  "attn": model.config._attn_implementation, "torch": torch.__version__}))
"""

HF_MM = r"""
import json, statistics, sys, time, torch
threads, reps = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
a, b = torch.randn(577, 1024), torch.randn(4096, 1024)
g = []
for r in range(2 * reps + 1):
    t0 = time.perf_counter()
    a @ b.t()
    if r:
        g.append(2.0 * 577 * 4096 * 1024 / (time.perf_counter() - t0) / 1e9)
blas = "mkl" if torch.backends.mkl.is_available() else "other"
print(json.dumps({"gflops_runs": g, "gflops": statistics.median(g), "blas": blas, "torch": torch.__version__}))
"""

HF_LLM = r"""
import json, statistics, sys, time, torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
threads, reps, cfg_dir, tokens, prompt, dec = map(str, sys.argv[1:7])
threads, reps, tokens, prompt, dec = int(threads), int(reps), int(tokens), int(prompt), int(dec)
torch.set_num_threads(threads)
torch.manual_seed(0)
cfg = LlamaConfig(**json.load(open(cfg_dir + "/config.json")))
model = LlamaForCausalLM(cfg).eval()
ids = (torch.arange(max(tokens, prompt)) * 7919 + 17) % cfg.vocab_size
pms, tps, pcms, tcms = [], [], [], []
with torch.inference_mode():
    for r in range(reps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        model(input_ids=ids[None, :tokens], past_key_values=DynamicCache(config=cfg), use_cache=True,
              logits_to_keep=1)
        if r:
            pms.append((time.perf_counter() - t0) * 1e3)
            pcms.append((time.process_time() - c0) * 1e3)
    for r in range(reps + 1):
        cache = DynamicCache(config=cfg)
        out = model(input_ids=ids[None, :prompt], past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(dec):
            out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        if r:
            tps.append(dec / (time.perf_counter() - t0))
            tcms.append((time.process_time() - c0) * 1e3 / dec)
print(json.dumps({"prefill_ms_runs": pms, "prefill_ms": statistics.median(pms), "prefill_cpu_ms": statistics.median(pcms),
                  "decode_tok_s_runs": tps, "decode_tok_s": statistics.median(tps),
                  "decode_cpu_ms_per_token": statistics.median(tcms), "attn": model.config._attn_implementation,
                  "torch": torch.__version__}))
"""


def hf(script, *args):
    env = dict(os.environ, OMP_NUM_THREADS=str(args[0]), MKL_NUM_THREADS=str(args[0]),
               TOKENIZERS_PARALLELISM="false")
    out = subprocess.run([sys.executable, "-c", script, *map(str, args)], check=True, capture_output=True, text=True,
                         env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def load():
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    ap.add_argument("--baseline-build", help="an older build to compare the bundled model with (before/after)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--only", default="vit,llm,bf16,bundled")
    ap.add_argument("--json", help="also write every raw result here")
    args = ap.parse_args()
    build = os.path.abspath(args.build_dir)
    only = set(args.only.split(","))
    threads = [int(t) for t in args.threads.split(",")]
    raw = {"threads": {}}
    rows = []

    def row(*cells):
        rows.append("| " + " | ".join(str(c) for c in cells) + " |")
        print(rows[-1], flush=True)

    print("load average at start: %s; cpu: %s" % (load(), cpu_name()), flush=True)
    row("threads", "measurement", "Prism", "reference", "ratio", "ratio by CPU time")
    row("---", "---", "---", "---", "---", "---")
    for t in threads:
        r = raw["threads"][t] = {}
        r["copy"] = prism(build, "--mode", "copy", "--threads", t, "--reps", max(args.reps, 5))
        bw = r["copy"]["gbs"]
        r["matmul"] = mm = prism(build, "--mode", "matmul", "--threads", t, "--reps", max(args.reps, 5))
        row(t, "backend matmul 577x4096x1024 (GFLOP/s) vs OpenBLAS sgemm, alternating", "%.1f" % mm["gflops"],
            "%.1f" % mm["sgemm_gflops"], "%.0f%%" % (100 * mm["vs_sgemm"]), "")
        if not args.skip_hf:
            r["hf_mm"] = hm = hf(HF_MM, t, max(args.reps, 5))
            row(t, "OpenBLAS sgemm 577x4096x1024 (GFLOP/s) vs torch.matmul (%s), the GEMM under HF" % hm["blas"],
                "%.1f" % mm["sgemm_gflops"], "%.1f" % hm["gflops"], "%.0f%%" % (100 * mm["sgemm_gflops"] / hm["gflops"]), "")
        row(t, "memcpy bandwidth, read+write (GB/s)", "", "%.2f" % bw, "", "")
        row(t, "read-only stream bandwidth (GB/s)", "", "%.2f" % r["copy"]["read_gbs"], "", "")
        if "vit" in only:
            r["vit"] = p = prism(build, "--mode", "vit", "--threads", t, "--reps", args.reps, "--model-path", VIT_CFG)
            row(t, "CLIP-L/336 ViT+projector GFLOP/s vs sgemm (timed after each image)", "%.1f" % p["gflops"],
                "%.1f" % p["sgemm_gflops"], "%.0f%%" % (100 * p["vs_sgemm"]), "")
            if not args.skip_hf:
                r["hf_vit"] = h = hf(HF_VIT, t, args.reps, VIT_CFG)
                row(t, "CLIP-L/336 ViT+projector ms/image vs HF (%s)" % h["attn"], "%.0f" % p["ms"], "%.0f" % h["ms"],
                    "%.2fx" % (h["ms"] / p["ms"]), "%.2fx" % (h["cpu_ms"] / p["cpu_ms"]))
            else:
                row(t, "CLIP-L/336 ViT+projector ms/image", "%.0f" % p["ms"], "", "", "")
        if "llm" in only:
            r["llm"] = p = prism(build, "--mode", "llm", "--threads", t, "--reps", args.reps, "--model-path", LLM_CFG,
                                 "--tokens", 2048, "--prompt", 128, "--decode-tokens", 32)
            h = None
            if not args.skip_hf:
                r["hf_llm"] = h = hf(HF_LLM, t, args.reps, LLM_CFG, 2048, 128, 32)
            params = p["weight_bytes"] / 4 / 1e9
            row(t, "Llama %.2fB prefill 2048 tokens (ms) vs HF" % params, "%.0f" % p["prefill_ms"],
                "%.0f" % h["prefill_ms"] if h else "", "%.2fx" % (h["prefill_ms"] / p["prefill_ms"]) if h else "",
                "%.2fx" % (h["prefill_cpu_ms"] / p["prefill_cpu_ms"]) if h else "")
            roof = p["copy_gbs"] * 1e9 / p["decode_bytes_per_token"]
            row(t, "Llama decode batch 1 (tok/s) vs roofline: %.0f MB/token over copy bandwidth (timed after each run)"
                % (p["decode_bytes_per_token"] / 1e6), "%.2f" % p["decode_tok_s"], "%.2f" % roof,
                "%.0f%%" % (100 * p["vs_roofline"]),
                "%.0f%%" % (100 * t * 1000.0 / p["decode_cpu_ms_per_token"] / roof))
            rroof = p["read_gbs"] * 1e9 / p["decode_bytes_per_token"]
            row(t, "Llama decode batch 1 (tok/s) vs read-only roofline: the same bytes over read-only stream bandwidth",
                "%.2f" % p["decode_tok_s"], "%.2f" % rroof, "%.0f%%" % (100 * p["vs_read_roofline"]),
                "%.0f%%" % (100 * t * 1000.0 / p["decode_cpu_ms_per_token"] / rroof))
            if h:
                row(t, "Llama decode batch 1 (tok/s) vs HF", "%.2f" % p["decode_tok_s"], "%.2f" % h["decode_tok_s"],
                    "%.2fx" % (p["decode_tok_s"] / h["decode_tok_s"]),
                    "%.2fx" % (h["decode_cpu_ms_per_token"] / p["decode_cpu_ms_per_token"]))
        if "bf16" in only:
            # the same model with its weights stored as bf16 (--weight-dtype bf16): half the bytes a
            # decode step streams; fp32 arithmetic (widened in registers, or chunks widened for sgemm)
            r["llm_bf16"] = q = prism(build, "--mode", "llm", "--threads", t, "--reps", args.reps, "--model-path",
                                      LLM_CFG, "--tokens", 2048, "--prompt", 128, "--decode-tokens", 32, "--bf16-weights")
            f = r.get("llm")
            h = r.get("hf_llm")
            if f:
                row(t, "Llama prefill 2048 tokens (ms), bf16 weights vs fp32 weights", "%.0f" % q["prefill_ms"],
                    "%.0f" % f["prefill_ms"], "%.2fx" % (f["prefill_ms"] / q["prefill_ms"]),
                    "%.2fx" % (f["prefill_cpu_ms"] / q["prefill_cpu_ms"]))
            roof = q["copy_gbs"] * 1e9 / q["decode_bytes_per_token"]
            row(t, "Llama decode batch 1, bf16 weights (tok/s) vs roofline: %.0f MB/token over copy bandwidth"
                % (q["decode_bytes_per_token"] / 1e6), "%.2f" % q["decode_tok_s"], "%.2f" % roof,
                "%.0f%%" % (100 * q["vs_roofline"]), "%.0f%%" % (100 * t * 1000.0 / q["decode_cpu_ms_per_token"] / roof))
            rroof = q["read_gbs"] * 1e9 / q["decode_bytes_per_token"]
            row(t, "Llama decode batch 1, bf16 weights (tok/s) vs read-only roofline of the same bytes",
                "%.2f" % q["decode_tok_s"], "%.2f" % rroof, "%.0f%%" % (100 * q["vs_read_roofline"]),
                "%.0f%%" % (100 * t * 1000.0 / q["decode_cpu_ms_per_token"] / rroof))
            if f:
                froof = q["copy_gbs"] * 1e9 / f["decode_bytes_per_token"]
                row(t, "Llama decode batch 1, bf16 weights (tok/s) vs the fp32 model's roofline (%.0f MB/token over "
                    "copy bandwidth)" % (f["decode_bytes_per_token"] / 1e6), "%.2f" % q["decode_tok_s"],
                    "%.2f" % froof, "%.0f%%" % (100 * q["decode_tok_s"] / froof), "")
                row(t, "Llama decode batch 1 (tok/s), bf16 weights vs fp32 weights", "%.2f" % q["decode_tok_s"],
                    "%.2f" % f["decode_tok_s"], "%.2fx" % (q["decode_tok_s"] / f["decode_tok_s"]),
                    "%.2fx" % (f["decode_cpu_ms_per_token"] / q["decode_cpu_ms_per_token"]))
            if h:
                row(t, "Llama decode batch 1 (tok/s), bf16 weights vs HF (fp32)", "%.2f" % q["decode_tok_s"],
                    "%.2f" % h["decode_tok_s"], "%.2fx" % (q["decode_tok_s"] / h["decode_tok_s"]),
                    "%.2fx" % (h["decode_cpu_ms_per_token"] / q["decode_cpu_ms_per_token"]))
        if "bundled" in only:
            builds = [("after", build)] + ([("before", os.path.abspath(args.baseline_build))] if args.baseline_build else [])
            res = {}
            for name, b in builds:
                v = prism(b, "--mode", "vit", "--threads", t, "--reps", max(args.reps, 5), "--model-path", BUNDLED,
                          "--checkpoint")
                l = prism(b, "--mode", "llm", "--threads", t, "--reps", max(args.reps, 5), "--model-path", BUNDLED,
                          "--checkpoint", "--tokens", 77, "--prompt", 77, "--decode-tokens", 32)
                res[name] = (v["ms"] + l["prefill_ms"], l["decode_tok_s"])
                r["bundled_" + name] = {"vit": v, "llm": l}
            a = res["after"]
            bef = res.get("before")
            row(t, "bundled model: ViT + 77-token prefill (ms), after vs before", "%.2f" % a[0],
                "%.2f" % bef[0] if bef else "", "%.2fx" % (bef[0] / a[0]) if bef else "", "")
            row(t, "bundled model: decode tok/s, after vs before", "%.0f" % a[1], "%.0f" % bef[1] if bef else "",
                "%.2fx" % (a[1] / bef[1]) if bef else "", "")
    print("load average at end: %s" % load())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
    return 0


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + ", %d cpus" % os.cpu_count()
    except OSError:
        pass
    return "?"


if __name__ == "__main__":
    sys.exit(main())
