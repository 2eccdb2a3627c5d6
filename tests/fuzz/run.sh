#!/usr/bin/env bash
# Long fuzzing runs, one harness after the other, at the lowest CPU priority:
#   tests/fuzz/run.sh BUILD_DIR [harness ...]        (BUILD_DIR configured with -DPRISM_FUZZ=ON)
# Each harness runs until FUZZ_RUNS executions (default 10^7) or FUZZ_SECONDS (default 3600),
# whichever comes first; one input may take FUZZ_TIMEOUT seconds (default 10) before it counts as a
# hang. The growing corpus and any crash live in BUILD_DIR/fuzz-work/<harness>/;
# the committed seeds (tests/fuzz/corpus/<harness>/) are read, never written. One summary line per
# harness: executions, exec/s, and the crash files found (none expected).
set -uo pipefail
build=$(cd "${1:?usage: tests/fuzz/run.sh BUILD_DIR [harness ...]}" && pwd); shift
root=$(cd "$(dirname "$0")/../.." && pwd)
runs=${FUZZ_RUNS:-10000000} secs=${FUZZ_SECONDS:-3600} timeout=${FUZZ_TIMEOUT:-10}
harnesses=("$@")
if [ ${#harnesses[@]} -eq 0 ]; then
  harnesses=(fuzz_envelope fuzz_data_url fuzz_openai fuzz_config fuzz_safetensors fuzz_detok fuzz_template
             fuzz_tokenizer_json fuzz_image fuzz_http_server fuzz_body_lift fuzz_prefill_msgs fuzz_decode_msgs
             fuzz_encoder_msgs fuzz_router_ctl fuzz_fetch_url fuzz_grammar)
fi
for h in "${harnesses[@]}"; do
  work="$build/fuzz-work/$h"
  mkdir -p "$work/corpus"
  t0=$(date +%s)
  nice -n 19 "$build/tests/fuzz/$h" -runs="$runs" -max_total_time="$secs" -timeout="$timeout" -print_final_stats=1 \
    -artifact_prefix="$work/" "$work/corpus" "$root/tests/fuzz/corpus/$h" > "$work/log.txt" 2>&1
  rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/log.txt")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$work/log.txt")
  crashes=$(ls "$work" | grep -E '^(crash|leak|timeout|oom)-' | tr '\n' ' ')
  echo "$h rc=$rc execs=${execs:-?} exec_per_s=${rate:-?} wall_s=$(( $(date +%s) - t0 )) crashes=[${crashes}]"
done
