#!/usr/bin/env bash
# Installs what kpl needs, builds it and runs the whole test suite.
#   scripts/test.sh [ctest options, e.g. -L unit]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
ctest --test-dir "${BUILD_DIR:-$root/build}" --output-on-failure "$@"
