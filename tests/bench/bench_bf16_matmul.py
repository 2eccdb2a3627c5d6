#!/usr/bin/env python3
"""The CPU backend's matmul per dtype on the bundled model's shapes (issue 33): fp32 weights, bf16
weights with fp32 arithmetic (--weight-dtype bf16) and bf16 dot products (--compute-dtype bf16) on
[N][K] weights and on the packed ones the model loader makes under --compute-dtype bf16, and bf16
weights packed under the default fp32 compute (matmul_f32p, AVX-512), GFLOP/s,
best of --reps, one thread. Drives prism_bench_model --mode mmdtype; prints a markdown
table (docs/PERFORMANCE.md, "bf16 dot products").

  nice -n 10 python3 tests/bench/bench_bf16_matmul.py --build-dir build
"""
import argparse
import json
import os
import subprocess
import sys

# prism-tiny-llava: LM hidden 256, intermediate 688, kv dim 128, vocab 4096; vision hidden 128,
# intermediate 512. (N, K) = (output features, inputs).
SHAPES = [("lm q / o", 256, 256), ("lm k / v", 128, 256), ("lm gate / up", 688, 256), ("lm down", 256, 688),
          ("lm head", 4096, 256), ("vit qkv", 384, 128), ("vit fc1", 512, 128), ("vit fc2", 128, 512)]
ROWS = [1, 4, 16, 64, 256, 1024, 4096]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="M values, comma-separated")
    args = ap.parse_args()
    exe = os.path.join(args.build_dir, "tests", "unit", "model", "prism_bench_model")
    rows = [int(m) for m in args.rows.split(",")]
    print("| shape | N x K | M | f32 GFLOP/s | bf16 weights | bf16 compute | bf16 compute / f32 | bf16 packed |"
          " packed / unpacked | f32 packed | f32 packed / bf16 weights |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, n, k in SHAPES:
        for m in rows:
            out = subprocess.run([exe, "--mode", "mmdtype", "--threads", str(args.threads), "--reps", str(args.reps),
                                  "--m", str(m), "--n", str(n), "--k", str(k)], capture_output=True, text=True,
                                 check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print("| %s | %d x %d | %d | %.0f | %.0f | %.0f | %.2fx | %.0f | %.2fx | %.0f | %.2fx |" % (
                name, n, k, m, r["f32_gflops"], r["bf16_weights_gflops"], r["bf16_compute_gflops"],
                r["bf16_compute_vs_f32"], r["bf16_packed_gflops"], r["bf16_packed_vs_compute"],
                r["f32_packed_gflops"], r["f32_packed_vs_bf16_weights"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
