#!/usr/bin/env bash
# Configures and builds Prism. Usage: deploy/build.sh [BUILD_DIR] [extra cmake args...]
# BUILD_DIR defaults to build/. The CUDA backend is compiled when nvcc is found.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
shift || true
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=${PRISM_BUILD_TYPE:-RelWithDebInfo} "$@" >/dev/null
cmake --build "$build" -j"$(nproc)"
