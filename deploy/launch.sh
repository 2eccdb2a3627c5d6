#!/usr/bin/env bash
# Starts a local Prism cluster in the foreground: one router and one worker of each kind on
# loopback. Ctrl-C (or SIGTERM) stops them all and leaves no process behind.
#
# Usage: deploy/launch.sh [--port N] [--model-path DIR] [--build-dir DIR] [--control-port N]
#                         [--encoders N] [--prefills N] [--decodes N] [--threads N]
#                         [--curve-keys DIR | --insecure-no-curve] [--run-dir DIR]
# Internal links use CURVE: without --curve-keys, a fresh key directory is made in the run directory
# (default: a new temporary one) with prism_keygen.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
port=8000 control_port=8100 model="$root/models/prism-tiny-llava" build="$root/build"
n_enc=1 n_pre=1 n_dec=1 threads=1 keys="" insecure=0 run_dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --port) port=$2; shift 2 ;;
    --control-port) control_port=$2; shift 2 ;;
    --model-path) model=$2; shift 2 ;;
    --build-dir) build=$2; shift 2 ;;
    --encoders) n_enc=$2; shift 2 ;;
    --prefills) n_pre=$2; shift 2 ;;
    --decodes) n_dec=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --curve-keys) keys=$2; shift 2 ;;
    --insecure-no-curve) insecure=1; shift ;;
    --run-dir) run_dir=$2; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "launch.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
ctl="tcp://127.0.0.1:$control_port"
if [ "$insecure" -eq 1 ]; then
  [ -z "$keys" ] || { echo "launch.sh: --curve-keys and --insecure-no-curve contradict each other" >&2; exit 2; }
  sec=(--insecure-no-curve)
else
  if [ -z "$keys" ]; then
    [ -n "$run_dir" ] || { run_dir=$(mktemp -d "${TMPDIR:-/tmp}/prism-run.XXXXXX"); tmp_run=$run_dir; }
    keys="$run_dir/curve-keys"
    "$build/tools/prism_keygen" --out "$keys" >/dev/null
  fi
  sec=(--curve-keys "$keys")
fi
pids=()
cleanup() {
  trap - INT TERM EXIT
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 50); do
    alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive -eq 0 ] && break
    sleep 0.1
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ -z "${tmp_run:-}" ] || rm -rf "$tmp_run"
}
trap cleanup INT TERM EXIT

t0=$(date +%s.%N)
"$build/router/router" --model-path "$model" --port "$port" --control-endpoint "$ctl" "${sec[@]}" & pids+=($!)
for i in $(seq "$n_enc"); do
  "$build/encoder_worker/encoder_worker" --model-path "$model" --router "$ctl" --worker-id "encoder-$i" --threads "$threads" "${sec[@]}" & pids+=($!)
done
for i in $(seq "$n_pre"); do
  "$build/prefill_worker/prefill_worker" --model-path "$model" --router "$ctl" --worker-id "prefill-$i" --threads "$threads" "${sec[@]}" & pids+=($!)
done
for i in $(seq "$n_dec"); do
  "$build/decode_worker/decode_worker" --model-path "$model" --router "$ctl" --worker-id "decode-$i" --threads "$threads" "${sec[@]}" & pids+=($!)
done
for _ in $(seq 600); do
  if curl -sf "http://127.0.0.1:$port/ready" >/dev/null 2>&1; then
    printf 'prism: cluster ready on http://127.0.0.1:%s in %.2fs (Ctrl-C stops it)\n' "$port" \
      "$(echo "$(date +%s.%N) - $t0" | bc)"
    break
  fi
  for p in "${pids[@]}"; do
    kill -0 "$p" 2>/dev/null || { echo "prism: a process exited during start-up" >&2; exit 1; }
  done
  sleep 0.1
done
# Stay in the foreground; if any process dies, stop the rest.
wait -n "${pids[@]}" || true
echo "prism: a process exited; stopping the cluster" >&2
