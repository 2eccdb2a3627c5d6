#!/usr/bin/env bash
# Starts a local Prism cluster in the foreground and keeps it running: routers, workers of each kind
# and, with --routers N > 1, nginx in front of the routers on --port. A process that dies is started
# again (exponential backoff, reset after a healthy run) and the others keep serving; a restarted
# worker registers with every router by itself. Ctrl-C (or SIGTERM) stops every process: SIGTERM
# first, SIGKILL after the grace period; nothing is left behind.
#
# Usage: deploy/launch.sh [--port N] [--host ADDR] [--model-path DIR] [--build-dir DIR]
#          [--encoders N] [--prefills N] [--decodes N] [--decode-tp T] [--prefill-tp P] [--tp-port N] [--threads N|auto]
#          [--compute-dtype auto|f32|bf16]
#          [--routers N] [--router-port N] [--control-port N] [--lb nginx|none]
#          [--run-dir DIR] [--log-dir DIR] [--ready-timeout S] [--curve-keys DIR | --insecure-no-curve]
#          [--api-key-file FILE]
#          [--router-arg ARG]... [--worker-arg ARG]... [--encoder-arg ARG]... [--prefill-arg ARG]...
#          [--decode-arg ARG]... [--supervisor-arg ARG]...
#
#   --port          public HTTP port: the router's, or nginx's when --routers > 1 (default 8000)
#   --host          address the public port binds (default 127.0.0.1); routers behind nginx bind loopback
#   --routers       number of routers; every worker registers with every one (default 1)
#   --router-port   first router HTTP port when --routers > 1 (default --port + 1)
#   --control-port  control port of router 1; router i uses control-port + i - 1 (default 8100)
#   --decode-tp     ranks (processes, one device each) per decode worker: each of the --decodes
#                   workers is a tensor-parallel group of T processes decode-i (the leader, which the
#                   routers see) and decode-i.r1 .. decode-i.r(T-1) (default 1)
#   --prefill-tp    the same for prefill workers (default 1)
#   --tp-port       the first group link port (loopback); group g uses tp-port + g - 1 (default 8200)
#   --threads       CPU threads of every worker (vision tower, prefill, decode kernels; the encoder
#                   also decodes as many images at once), or auto (the default), from the C cores this
#                   box gives us (nproc, lowered to a cgroup CPU quota): the kernels of all worker
#                   processes share them (C / processes each, at least 1), and the encoders' image
#                   threads take all of them (C / encoders each). --worker-arg, --encoder-arg ...
#                   --threads N / --image-threads N still win (docs/DEPLOY.md, "Threads")
#   --compute-dtype matmul arithmetic of every worker (default auto: the device's own, f32 on cpu):
#                   bf16 rounds each matmul's input to bf16 and sums exact products in fp32 (weights
#                   stored as bf16); on the CPU it runs AVX-512 BF16 dot products, 2-4x the matmul
#                   speed of f32 (docs/DEPLOY.md, "Weight and compute dtype")
#   --lb            what fronts several routers: nginx (Debian's; deploy/install-deps.sh --lb) or none
#   --run-dir       pid files, spec, generated configs (default: a new temporary directory, removed
#                   at exit); each process's pid is in RUN_DIR/NAME.pid while it runs
#   --log-dir       append each process's output to LOG_DIR/NAME.log (default: this terminal)
#   --curve-keys    CURVE key directory (prism_keygen) for every process; default: a fresh one made
#                   in the run directory, so internal links are authenticated without any setup
#   --insecure-no-curve  no CURVE on internal links (isolated networks only; every process warns)
#   --api-key-file  the routers require this API key ("Authorization: Bearer KEY"); FILE must be
#                   yours and readable by no other user. PRISM_API_KEY in the environment does the
#                   same (written to a private file in the run directory). The key never goes on a
#                   command line (every local user can read those): --router-arg --api-key is refused
#   --*-arg ARG     one more flag for the routers / every worker / one kind / prism_supervisor
#                   (e.g. --supervisor-arg --grace=5); repeatable
# Process names: router-1..N, encoder-1.., prefill-1.., decode-1.., nginx.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

# ---------------------------------------------------------------- options
port=8000 host=127.0.0.1 control_port=8100 router_port="" n_routers=1 lb=nginx
model="$root/models/prism-tiny-llava" build="$root/build"
n_enc=1 n_pre=1 n_dec=1 dec_tp=1 pre_tp=1 tp_port=8200 threads=auto compute_dtype=auto run_dir="" log_dir="" ready_timeout=120
router_args=() worker_args=() enc_args=() pre_args=() dec_args=() sup_args=()
curve_keys="" insecure=0 api_key_file=""
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "launch.sh: $*" >&2; exit 2; }
need_int() { [[ "$2" =~ ^[0-9]+$ ]] || die "$1 needs a non-negative integer, got '$2'"; }
while [ $# -gt 0 ]; do
  if [ "$1" = --insecure-no-curve ]; then insecure=1; shift; continue; fi
  [ $# -ge 2 ] || case "$1" in -h|--help) ;; *) die "$1 needs a value" ;; esac
  case "$1" in
    --port) need_int "$1" "$2"; port=$2 ;;
    --host) host=$2 ;;
    --control-port) need_int "$1" "$2"; control_port=$2 ;;
    --router-port) need_int "$1" "$2"; router_port=$2 ;;
    --routers) need_int "$1" "$2"; n_routers=$2 ;;
    --lb) lb=$2 ;;
    --model-path) model=$2 ;;
    --build-dir) build=$2 ;;
    --encoders) need_int "$1" "$2"; n_enc=$2 ;;
    --prefills) need_int "$1" "$2"; n_pre=$2 ;;
    --decodes) need_int "$1" "$2"; n_dec=$2 ;;
    --decode-tp) need_int "$1" "$2"; dec_tp=$2 ;;
    --prefill-tp) need_int "$1" "$2"; pre_tp=$2 ;;
    --tp-port) need_int "$1" "$2"; tp_port=$2 ;;
    --threads) [ "$2" = auto ] || need_int "$1" "$2"; threads=$2 ;;
    --compute-dtype) compute_dtype=$2 ;;
    --run-dir) run_dir=$2 ;;
    --log-dir) log_dir=$2 ;;
    --ready-timeout) need_int "$1" "$2"; ready_timeout=$2 ;;
    --router-arg) router_args+=("$2") ;;
    --worker-arg) worker_args+=("$2") ;;
    --encoder-arg) enc_args+=("$2") ;;
    --prefill-arg) pre_args+=("$2") ;;
    --decode-arg) dec_args+=("$2") ;;
    --supervisor-arg) sup_args+=("$2") ;;
    --curve-keys) curve_keys=$2 ;;
    --api-key-file) api_key_file=$2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
  shift 2
done
[ "$n_routers" -ge 1 ] && [ "$n_routers" -le 64 ] || die "--routers must be 1..64"
[ "$n_enc" -ge 1 ] && [ "$n_pre" -ge 1 ] && [ "$n_dec" -ge 1 ] || die "every tier needs at least one worker"
[ "$threads" = auto ] || [ "$threads" -ge 1 ] || die "--threads must be at least 1 (or auto)"
case "$compute_dtype" in auto|f32|bf16) ;; *) die "--compute-dtype must be auto, f32 or bf16" ;; esac
[ "$dec_tp" -ge 1 ] && [ "$dec_tp" -le 64 ] && [ "$pre_tp" -ge 1 ] && [ "$pre_tp" -le 64 ] ||
  die "--decode-tp and --prefill-tp must be 1..64"
case "$lb" in nginx|none) ;; *) die "--lb must be nginx or none" ;; esac
for a in ${router_args[@]+"${router_args[@]}"}; do
  case "$a" in --api-key|--api-key=*) die "--router-arg --api-key would put the key on a command line: use --api-key-file FILE or PRISM_API_KEY" ;; esac
done
[ -z "$api_key_file" ] || [ -z "${PRISM_API_KEY:-}" ] || die "give the API key one way: --api-key-file or PRISM_API_KEY"
[ -z "$api_key_file" ] || api_key_file=$(realpath -e "$api_key_file") || die "--api-key-file $api_key_file: no such file"
[ -n "$router_port" ] || router_port=$((port + 1))
# The supervisor's spec separates arguments with TABs, one process a line.
for a in "$model" "$build" "$host" "$curve_keys" "$api_key_file" ${router_args[@]+"${router_args[@]}"} ${worker_args[@]+"${worker_args[@]}"} \
         ${enc_args[@]+"${enc_args[@]}"} ${pre_args[@]+"${pre_args[@]}"} ${dec_args[@]+"${dec_args[@]}"}; do
  case "$a" in *$'\t'*|*$'\n'*) die "arguments may not contain a TAB or a newline: '$a'" ;; esac
done
supervisor="$build/deploy/prism_supervisor"
for b in "$supervisor" "$build/tools/prism_keygen" "$build/router/router" "$build/encoder_worker/encoder_worker" \
         "$build/prefill_worker/prefill_worker" "$build/decode_worker/decode_worker"; do
  [ -x "$b" ] || die "$b not found: build first (deploy/build.sh $build)"
done
use_nginx=0
if [ "$n_routers" -gt 1 ] && [ "$lb" = nginx ]; then
  use_nginx=1
  nginx_bin=$(command -v nginx || true)
  [ -n "$nginx_bin" ] || [ ! -x /usr/sbin/nginx ] || nginx_bin=/usr/sbin/nginx
  [ -n "$nginx_bin" ] || die "--routers $n_routers puts nginx in front: install it (deploy/install-deps.sh --lb) or pass --lb none"
fi

# ---------------------------------------------------------------- threads
# The cores this box gives us: the CPUs we may run on (nproc honours affinity and cpusets), lowered
# to a CFS quota (cgroup v2 cpu.max of our cgroup or the root's; v1 cpu.cfs_quota_us), rounded up.
box_cores() {
  local n q="" p="" c f cg
  n=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
  cg=$(sed -n 's/^0:://p' /proc/self/cgroup 2>/dev/null | head -n 1)
  for f in "/sys/fs/cgroup${cg}/cpu.max" /sys/fs/cgroup/cpu.max; do
    if [ -r "$f" ]; then read -r q p < "$f"; break; fi
  done
  if [ -z "$q" ] && [ -r /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]; then
    q=$(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us) p=$(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us)
  fi
  if [[ "$q" =~ ^[0-9]+$ ]] && [[ "$p" =~ ^[0-9]+$ ]] && [ "$q" -gt 0 ] && [ "$p" -gt 0 ]; then
    c=$(( (q + p - 1) / p ))
    [ "$c" -ge "$n" ] || n=$c
  fi
  echo $(( n > 0 ? n : 1 ))
}
# The kernels' threads (vision tower, prefill, decode) meet at a barrier after every op: two
# processes that oversubscribe the cores stall each other's barriers, so their threads share the
# cores. Image decodes are independent tasks (no barrier; the encoder's decode phase and its vision
# tower take turns), so the encoders' image threads take every core.
cores=$(box_cores)
share() { local t=$(( cores / $1 )); echo $(( t > 0 ? t : 1 )); }
if [ "$threads" = auto ]; then
  t_kern=$(share $((n_enc + n_pre * pre_tp + n_dec * dec_tp))) t_img=$(share "$n_enc")
  echo "prism: threads auto, $cores core(s): each worker process's kernels $t_kern thread(s), each encoder" \
       "decodes $t_img image(s) at once (--threads N sets both)" >&2
else
  t_kern=$threads t_img=$threads
  echo "prism: --threads $threads for every worker and image decodes ($cores core(s) here)" >&2
fi

# ---------------------------------------------------------------- layout
# Router i (1-based) serves HTTP on rport[i] and takes workers on rctl[i]; every worker gets every
# router's control endpoint.
rport=() rctl=() ctl_list=""
for i in $(seq "$n_routers"); do
  if [ "$n_routers" -eq 1 ]; then rport[i]=$port; else rport[i]=$((router_port + i - 1)); fi
  rctl[i]="tcp://127.0.0.1:$((control_port + i - 1))"
  ctl_list+="${ctl_list:+,}${rctl[i]}"
done
router_host=$host
[ "$n_routers" -eq 1 ] || [ "$use_nginx" -eq 0 ] || router_host=127.0.0.1

# ---------------------------------------------------------------- prepare the run directory
# Everything a run needs is written here before any process starts: the supervisor's spec,
# generated configs and (with internal-link authentication) key material.
# A run directory holds the cluster's keys and the files the supervisor writes (as root, possibly):
# one that another local user made first, or may write, would run the cluster on their keys and aim
# our writes through their links (issue 26). So it is made here, private (mkdir fails if it exists:
# no race), or adopted only when it is ours (or root's) and no one else may write it.
private_dir() {  # DIR: owned by us or root, not group/other-writable
  local owner mode
  owner=$(stat -L -c %u "$1") && mode=$(stat -L -c %a "$1") || return 1
  [ -d "$1" ] && { [ "$owner" = "$(id -u)" ] || [ "$owner" = 0 ]; } && [ $(( 8#$mode & 8#022 )) -eq 0 ]
}
own_run_dir=0
if [ -z "$run_dir" ]; then
  run_dir=$(mktemp -d "${TMPDIR:-/tmp}/prism-run.XXXXXX")
  own_run_dir=1
elif [ -e "$run_dir" ] || [ -L "$run_dir" ]; then
  private_dir "$run_dir" || die "--run-dir $run_dir is not a private directory of this user (owned by another user, or writable by others); give a new path"
else
  mkdir -p "$(dirname "$run_dir")" && mkdir -m 700 "$run_dir" || die "cannot create --run-dir $run_dir"
fi
run_dir=$(cd "$run_dir" && pwd)
if [ -n "$log_dir" ]; then
  [ -e "$log_dir" ] || mkdir -p -m 700 "$log_dir" || die "cannot create --log-dir $log_dir"
  private_dir "$log_dir" || die "--log-dir $log_dir is not a private directory of this user (owned by another user, or writable by others)"
  log_dir=$(cd "$log_dir" && pwd)
fi
cleanup_run_dir() { [ "$own_run_dir" -eq 0 ] || rm -rf "$run_dir"; }
trap cleanup_run_dir EXIT

# keys: every process authenticates with CURVE keys from one directory (docs/SECURITY.md)
if [ "$insecure" -eq 1 ]; then
  [ -z "$curve_keys" ] || die "--curve-keys and --insecure-no-curve contradict each other"
  sec=(--insecure-no-curve)
else
  if [ -z "$curve_keys" ]; then
    curve_keys="$run_dir/curve-keys"
    "$build/tools/prism_keygen" --out "$curve_keys" >/dev/null || die "prism_keygen failed"
  fi
  curve_keys=$(cd "$curve_keys" && pwd)
  sec=(--curve-keys "$curve_keys")
fi
# The API key: a file the routers read (never argv; the workers do not see it in their environment).
if [ -n "${PRISM_API_KEY:-}" ]; then
  api_key_file="$run_dir/api-key"
  rm -f "$api_key_file"
  (umask 077 && set -o noclobber && printf '%s\n' "$PRISM_API_KEY" > "$api_key_file") || die "cannot write $api_key_file"
fi
unset PRISM_API_KEY
key_args=()
[ -z "$api_key_file" ] || key_args=(--api-key-file "$api_key_file")

if [ "$use_nginx" -eq 1 ]; then
  ngx="$run_dir/nginx"
  mkdir -p "$ngx"
  # The site file is deploy/nginx/prism.conf itself with our upstream servers and listen address.
  awk -v servers="$(for i in $(seq "$n_routers"); do printf '127.0.0.1:%s\n' "${rport[i]}"; done)" \
      -v listen="$host:$port" '
    /^[ \t]*server[ \t]+[0-9.]+:[0-9]+/ {
      if (!done) {
        match($0, /^[ \t]*/); indent = substr($0, 1, RLENGTH)
        rest = $0; sub(/^[ \t]*server[ \t]+[^ \t;]+/, "", rest); sub(/[ \t]*#.*$/, "", rest)
        n = split(servers, s, "\n")
        for (i = 1; i <= n; i++) if (s[i] != "") print indent "server " s[i] rest
        done = 1
      }
      next
    }
    /^[ \t]*listen[ \t]/ { match($0, /^[ \t]*/); print substr($0, 1, RLENGTH) "listen " listen ";"; next }
    { print }' "$root/deploy/nginx/prism.conf" > "$ngx/prism.conf"
  {
    echo "# generated by deploy/launch.sh"
    echo "daemon off;"
    echo "worker_processes auto;"
    echo "pid \"$ngx/nginx.pid\";"
    echo "error_log stderr warn;"
    # As root nginx drops its workers to an unprivileged user; Debian has no group 'nobody'.
    [ "$(id -u)" -ne 0 ] || echo "user nobody nogroup;"
    echo "events { worker_connections 4096; }"
    echo "http {"
    echo "    access_log off;"
    for t in client_body proxy fastcgi uwsgi scgi; do echo "    ${t}_temp_path \"$ngx/tmp-$t\";"; done
    echo "    include \"$ngx/prism.conf\";"
    echo "}"
  } > "$ngx/nginx.conf"
  # nginx's unprivileged workers must reach their temp directories (bodies over 16 MB spill there).
  [ "$(id -u)" -ne 0 ] || chmod 711 "$run_dir" "$ngx"
  "$nginx_bin" -t -q -p "$ngx" -c "$ngx/nginx.conf" -e stderr || die "nginx refuses $ngx/nginx.conf (above)"
fi

spec="$run_dir/supervisor.spec"
proc() {  # NAME PROGRAM ARG...: one spec line, TAB-separated
  local IFS=$'\t'
  printf '%s\n' "$*" >> "$spec"
}
: > "$spec"
for i in $(seq "$n_routers"); do
  proc "router-$i" "$build/router/router" --model-path "$model" --host "$router_host" --port "${rport[i]}" \
       --control-endpoint "${rctl[i]}" "${sec[@]}" ${key_args[@]+"${key_args[@]}"} ${router_args[@]+"${router_args[@]}"}
done
# A worker of tensor-parallel size T > 1 is T processes: NAME (rank 0, the leader: it alone talks to
# the routers) and NAME.r1 .. NAME.r(T-1), joined over the group link tcp://127.0.0.1:PORT. When one
# of them dies the others exit too (a group does not heal) and the supervisor restarts each; the new
# processes form the group again and the leader registers again.
next_tp_port=$tp_port
for kind in encoder prefill decode; do
  case $kind in
    encoder) n=$n_enc; tp=1; extra=(--image-threads "$t_img" ${enc_args[@]+"${enc_args[@]}"}) ;;
    prefill) n=$n_pre; tp=$pre_tp; extra=(${pre_args[@]+"${pre_args[@]}"}) ;;
    decode) n=$n_dec; tp=$dec_tp; extra=(${dec_args[@]+"${dec_args[@]}"}) ;;
  esac
  for i in $(seq "$n"); do
    group=()
    if [ "$tp" -gt 1 ]; then
      group=(--tp-size "$tp" --tp-leader "tcp://127.0.0.1:$next_tp_port")
      next_tp_port=$((next_tp_port + 1))
    fi
    for r in $(seq 0 $((tp - 1))); do
      name="$kind-$i" rank=()
      [ "$r" -eq 0 ] || name="$kind-$i.r$r"
      [ "$tp" -eq 1 ] || rank=(--tp-rank "$r")
      proc "$name" "$build/${kind}_worker/${kind}_worker" --model-path "$model" --router "$ctl_list" \
           --worker-id "$name" --threads "$t_kern" --compute-dtype "$compute_dtype" "${sec[@]}" \
           ${group[@]+"${group[@]}"} ${rank[@]+"${rank[@]}"} ${worker_args[@]+"${worker_args[@]}"} ${extra[@]+"${extra[@]}"}
    done
  done
done
[ "$use_nginx" -eq 0 ] || proc nginx "$nginx_bin" -p "$ngx" -c "$ngx/nginx.conf" -e stderr

# ---------------------------------------------------------------- run
sup_cmd=("$supervisor" --spec "$spec" --run-dir "$run_dir" --fail-fast --exit-with-parent)
[ -z "$log_dir" ] || sup_cmd+=(--log-dir "$log_dir")
sup_cmd+=(${sup_args[@]+"${sup_args[@]}"})
t0=$(date +%s.%N)
"${sup_cmd[@]}" &
sup=$!
stop() {
  trap - INT TERM HUP
  kill -TERM "$sup" 2>/dev/null || true
  local rc=0
  wait "$sup" || rc=$?
  exit "$rc"
}
trap stop INT TERM HUP

url_host() { case "$1" in 0.0.0.0|"") echo 127.0.0.1 ;; ::|"[::]") echo "[::1]" ;; *:*) echo "[$1]" ;; *) echo "$1" ;; esac; }
front="http://$(url_host "$host"):$port"
# Every router first, then the public port: asked before the routers are ready, nginx would count
# their 503s as failures and hold them out of rotation for fail_timeout.
ready_urls=()
if [ "$n_routers" -gt 1 ]; then
  for i in $(seq "$n_routers"); do ready_urls+=("http://$(url_host "$router_host"):${rport[i]}/ready"); done
fi
[ "$n_routers" -gt 1 ] && [ "$use_nginx" -eq 0 ] || ready_urls+=("$front/ready")
deadline=$(( $(date +%s) + ready_timeout ))
while :; do
  all=1
  for u in "${ready_urls[@]}"; do curl -sf -o /dev/null --max-time 2 "$u" || { all=0; break; }; done
  [ $all -eq 0 ] || break
  if ! kill -0 "$sup" 2>/dev/null; then
    rc=0; wait "$sup" || rc=$?
    echo "prism: a process failed at start-up (see the messages above); nothing is running" >&2
    exit $(( rc ? rc : 1 ))
  fi
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "prism: not ready after ${ready_timeout}s; stopping" >&2
    kill -TERM "$sup" 2>/dev/null || true
    wait "$sup" || true
    exit 1
  fi
  sleep 0.1
done
what="$n_routers router$([ "$n_routers" -eq 1 ] || echo s)"
[ "$use_nginx" -eq 0 ] || what+=" behind nginx"
if [ "$n_routers" -gt 1 ] && [ "$use_nginx" -eq 0 ]; then
  front="http://$(url_host "$router_host"):{${rport[1]}..${rport[n_routers]}} (no balancer: --lb none)"
fi
printf 'prism: cluster ready on %s in %.2fs (%s; %s encoder, %s prefill, %s decode; run dir %s; Ctrl-C stops it)\n' \
  "$front" "$(echo "$(date +%s.%N) - $t0" | bc)" "$what" "$n_enc" "$n_pre" "$n_dec" "$run_dir"
rc=0
wait "$sup" || rc=$?
# Reached only when the supervisor stopped by itself (a start-up failure after ready, or a signal
# sent to it directly).
exit "$rc"
