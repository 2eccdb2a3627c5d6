#!/usr/bin/env bash
# Prism quick start: installs what is missing, builds, and serves the bundled model on CPU.
#   deploy/quickstart.sh [--port N] [launch.sh flags...]   (router on http://127.0.0.1:8000 by default)
# Then, in another terminal:
#   curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
#        -d '{"model":"prism-tiny-llava","messages":[{"role":"user","content":"Hello"}]}'
# With --routers N (N > 1) nginx is installed too and put in front of the routers.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
deps=()
args=("$@")
for ((i = 0; i + 1 < ${#args[@]}; i++)); do
  if [ "${args[i]}" = --routers ] && [ "${args[i+1]}" -gt 1 ] 2>/dev/null; then deps=(--lb); fi
done
"$root/deploy/install-deps.sh" ${deps[@]+"${deps[@]}"}
"$root/deploy/build.sh" "$root/build"
exec "$root/deploy/launch.sh" --build-dir "$root/build" "$@"
