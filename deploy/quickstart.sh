#!/usr/bin/env bash
# Prism quick start: installs what is missing, builds, and serves the bundled model on CPU.
#   deploy/quickstart.sh [--port N]      (router on http://127.0.0.1:8000 by default)
# Then, in another terminal:
#   curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
#        -d '{"model":"prism-tiny-llava","messages":[{"role":"user","content":"Hello"}]}'
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/deploy/install-deps.sh"
"$root/deploy/build.sh" "$root/build"
exec "$root/deploy/launch.sh" --build-dir "$root/build" "$@"
