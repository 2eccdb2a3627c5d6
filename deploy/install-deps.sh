#!/usr/bin/env bash
# Installs the Debian packages Prism builds against, skipping what is already there.
# Usage: deploy/install-deps.sh [--lb] [--test]   (needs root or sudo for apt-get)
#   --lb    also nginx, which deploy/launch.sh --routers N (N > 1) puts in front of the routers
#   --test  also what the tests of the deployment files use: nginx, haproxy, systemd-analyze
#           (package systemd), chromium (the status page test, headless), iproute2 (network
#           namespaces for the multi-host and image-fetch tests), openssl (the fetch test's CA) and
#           the Python packages kubernetes-validate and openai (PyPI; the image-URL test drives the
#           router with the unmodified openai client)
set -euo pipefail
pkgs=(build-essential cmake pkg-config python3 curl bc
      libuv1-dev libzmq3-dev libprotobuf-c-dev protobuf-c-compiler
      libjpeg62-turbo-dev libturbojpeg0-dev libspng-dev libpng-dev libopenblas-dev
      libjansson-dev libpcre2-dev libxxhash-dev libcmocka-dev node-llhttp zlib1g-dev
      libcurl4-openssl-dev   # image URLs fetched by the router (router/fetch.c)
      python3-jsonschema python3-yaml
      clang libclang-rt-dev)   # clang + libFuzzer: tests/fuzz (run-all.sh replays the seed corpora)
lb=0 test=0
for a in "$@"; do
  case "$a" in
    --lb) lb=1 ;;
    --test) lb=1 test=1 ;;
    -h|--help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install-deps.sh: unknown argument $a" >&2; exit 2 ;;
  esac
done
[ "$lb" -eq 0 ] || pkgs+=(nginx)
[ "$test" -eq 0 ] || pkgs+=(haproxy systemd python3-pip chromium fonts-dejavu-core iproute2 openssl)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# Into the python3 the tests run with; Debian's own python3 needs --break-system-packages (PEP 668)
# for a package it does not ship.
for py in kubernetes_validate:kubernetes-validate:"the manifest test" openai:openai:"the openai client check"; do
  IFS=: read -r module package user <<<"$py"
  if [ "$test" -eq 1 ] && ! python3 -c "import $module" 2>/dev/null; then
    pip=(python3 -m pip install --quiet --disable-pip-version-check "$package")
    "${pip[@]}" 2>/dev/null || "${pip[@]}" --break-system-packages ||
      echo "install-deps.sh: $package could not be installed; $user will skip" >&2
  fi
done
