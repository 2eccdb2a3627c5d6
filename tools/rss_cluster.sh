#!/usr/bin/env bash
# Resident memory of each process of a local cluster running on the CPU, and how much of it the
# CUDA libraries (cudart, cuBLAS, cuBLASLt) account for. Starts router + one worker of each kind
# from BUILD_DIR on free loopback ports, sends one image request so every process has done real
# work, prints one line per process, stops the cluster.
#
# Usage: tools/rss_cluster.sh BUILD_DIR [MODEL_DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:?usage: tools/rss_cluster.sh BUILD_DIR [MODEL_DIR]}
model=${2:-$root/models/prism-tiny-llava}
port=$((20000 + RANDOM % 20000))
ctl="tcp://127.0.0.1:$((port + 1))"
pids=() names=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
start() { names+=("$1"); shift; "$@" --log-level warn >/dev/null 2>&1 & pids+=($!); }
start router "$build/router/router" --model-path "$model" --port "$port" --control-endpoint "$ctl"
start encoder_worker "$build/encoder_worker/encoder_worker" --model-path "$model" --router "$ctl" --device cpu
start prefill_worker "$build/prefill_worker/prefill_worker" --model-path "$model" --router "$ctl" --device cpu
start decode_worker "$build/decode_worker/decode_worker" --model-path "$model" --router "$ctl" --device cpu
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$port/ready" >/dev/null 2>&1 && break
  sleep 0.1
done
img=$(base64 -w0 "$root/tests/data/e2e/circle_red_640x480.jpg")
curl -sf "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,'"$img"'"}},
    {"type": "text", "text": "What is in the image?"}]}], "max_tokens": 8}' >/dev/null
printf '%-16s %10s %18s\n' process rss_mib cuda_libs_rss_mib
for i in "${!pids[@]}"; do
  p=${pids[$i]}
  rss=$(awk '/^VmRSS:/ {printf "%.1f", $2 / 1024}' "/proc/$p/status")
  cuda=$(awk '/^[0-9a-f]+-[0-9a-f]+ / {lib = ($6 ~ /lib(cudart|cublas|cublasLt|cuda)[.]so/)} \
              /^Rss:/ && lib {kb += $2} END {printf "%.1f", kb / 1024}' "/proc/$p/smaps")
  printf '%-16s %10s %18s\n' "${names[$i]}" "$rss" "$cuda"
done
