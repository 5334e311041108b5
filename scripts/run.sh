#!/usr/bin/env bash
# The main job on a fresh Debian 12 machine: install what kpl needs, build
# it, and run it.  Until the trainer lands (issue 7) the job is the compute
# demo, which fits known weights and fails loudly if any kernel is wrong.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
kpl="${BUILD_DIR:-$root/build}/bin/kpl"
"$kpl" --version
"$kpl" info
"$kpl" demo "$@"
