#!/usr/bin/env bash
# One-shot GPU session script (device tool): builds tools/gpu with the machine's nvcc, runs the
# op/model consistency checks, the benchmark and the HF baseline, and leaves everything in $OUT:
#   summary.txt   the whole console log (build, checks, tables)
#   check.json    gpu_check results (one entry per check)
#   bench.json    gpu_bench measurements (JSON lines)
#   hf.json       hf_baseline measurements (JSON lines)
#   results.json  bench + hf merged with prism/HF ratios
# Budget: ~1.5 min build, ~1 min checks, ~3 min bench, ~2 min HF (< 8 min total). Skip stages
# with STAGES="build check bench hf" (default all), add SANITIZE=1 for a compute-sanitizer
# memcheck pass over the attention checks (adds ~1 min).
#   run: bash tools/gpu/run_on_h200.sh     (timeout_s 590)
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$ROOT/gpu-results}
BUILD=${BUILD:-/tmp/prism-gpu-build}
STAGES=${STAGES:-"build check bench hf"}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/summary.txt") 2>&1
T0=$(date +%s)
stamp() { echo "--- [$(( $(date +%s) - T0 ))s] $*"; }
has() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }

stamp "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1 | head -3
nvcc --version | tail -2
cmake --version | head -1
nproc

if has build; then
  stamp "build (tools/gpu, sm_90 + PTX)"
  GEN=""; command -v ninja >/dev/null && GEN="-G Ninja"
  cmake -S "$ROOT/tools/gpu" -B "$BUILD" $GEN -DCMAKE_BUILD_TYPE=Release >/dev/null || { echo "configure failed"; exit 1; }
  cmake --build "$BUILD" -j "$(nproc)" 2>&1 | grep -vE '^\[|^-- ' | tail -30
  [ -x "$BUILD/gpu_check" ] && [ -x "$BUILD/gpu_bench" ] || { echo "BUILD FAILED"; exit 1; }
  cuobjdump --list-elf "$BUILD/gpu_check" 2>/dev/null | head -3
fi

if has check; then
  stamp "gpu_check (CUDA vs CPU reference)"
  timeout 240 "$BUILD/gpu_check" --big --json "$OUT/check.json"
  echo "gpu_check exit: $?"
  if [ "${SANITIZE:-0}" = 1 ] && command -v compute-sanitizer >/dev/null; then
    for op in attn_paged attn_decode attn_dense sample kv; do
      stamp "compute-sanitizer memcheck --op $op"
      timeout 120 compute-sanitizer --tool memcheck --print-limit 5 "$BUILD/gpu_check" --op $op 2>&1 | tail -6
    done
  fi
fi

if has bench; then
  stamp "gpu_bench"
  timeout 300 "$BUILD/gpu_bench" --json "$OUT/bench.json"
  echo "gpu_bench exit: $?"
fi

if has hf; then
  stamp "hf_baseline (transformers, SDPA, bf16)"
  PYTHONUNBUFFERED=1 timeout 240 python3 "$ROOT/tools/gpu/hf_baseline.py" --json "$OUT/hf.json" 2>&1 \
    | grep -vE 'deprecated|FutureWarning|return forward_call'
  echo "hf_baseline exit: $?"
fi

stamp "merge"
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def lines(p):
    try:
        return [json.loads(l) for l in open(os.path.join(out, p)) if l.strip().startswith("{")]
    except OSError:
        return []
bench, hf = lines("bench.json"), lines("hf.json")
res = {"prism": bench, "hf": hf, "ratios": []}
def find(rows, kind, **kw):
    for r in rows:
        if r.get("bench") == kind and all(r.get(k) == v for k, v in kw.items()):
            return r
for r in bench:
    if r["bench"] == "decode":
        h = find(hf, "hf_decode", batch=r["batch"])
        if h: res["ratios"].append({"what": f"decode batch {r['batch']} tok/s prism/hf", "ratio": r["tok_s"] / h["tok_s"]})
    if r["bench"] == "prefill":
        h = find(hf, "hf_prefill")
        if h: res["ratios"].append({"what": f"prefill {r['tokens']} tok/s prism/hf", "ratio": r["tok_s"] / h["tok_s"]})
    if r["bench"] == "vit":
        h = find(hf, "hf_vit", batch=r["batch"])
        if h: res["ratios"].append({"what": f"vit batch {r['batch']} images/s prism/hf", "ratio": r["images_s"] / h["images_s"]})
json.dump(res, open(os.path.join(out, "results.json"), "w"), indent=1)
for x in res["ratios"]:
    print(f"{x['what']:40s} {x['ratio']:.2f}x")
PY
stamp "done"
sleep 1   # let tee flush summary.txt before the tool collects $OUT
