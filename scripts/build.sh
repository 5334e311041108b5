#!/usr/bin/env bash
# Configures and builds kpl into BUILD_DIR (default: build/).
#   scripts/build.sh [extra cmake -D options]
# Environment: BUILD_DIR, BUILD_TYPE (Release), JOBS (nproc).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" "$@" >/dev/null
cmake --build "$build" -j "${JOBS:-$(nproc)}"
