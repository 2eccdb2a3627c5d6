#!/usr/bin/env bash
# Installs the Debian packages Prism builds against, skipping what is already there.
# Usage: deploy/install-deps.sh   (needs root or sudo for apt-get)
set -euo pipefail
pkgs=(build-essential cmake pkg-config python3 curl bc
      libuv1-dev libzmq3-dev libprotobuf-c-dev protobuf-c-compiler
      libjpeg62-turbo-dev libturbojpeg0-dev libspng-dev libpng-dev libopenblas-dev
      libjansson-dev libpcre2-dev libxxhash-dev libcmocka-dev node-llhttp zlib1g-dev
      clang libclang-rt-dev)   # clang + libFuzzer: tests/fuzz (run-all.sh replays the seed corpora)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "installing: ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
