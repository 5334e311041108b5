#!/usr/bin/env bash
# Installs what kpl needs (with the reference tools the equivalence tests
# compare against), builds it and runs the whole test suite.
#   scripts/test.sh [ctest options, e.g. -L unit]
# A missing reference tool or data set fails its test here
# (KPL_REQUIRE_REFS=1, tests/skip.sh); a missing capability (no GPU, one
# GPU for a two-GPU test) is a skip.  The end of the output lists every
# skip, whole tests and parts of tests, with its reason.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
build=${BUILD_DIR:-$root/build}
export KPL_REQUIRE_REFS=1 KPL_SKIP_LOG="$build/Testing/skipped.txt"
mkdir -p "$build/Testing"
: > "$KPL_SKIP_LOG"
rc=0
# the tests run side by side, one per core (TEST_JOBS): they are made to
# pass on a loaded machine, and the suite takes half the time
ctest --test-dir "$build" --output-on-failure -j "${TEST_JOBS:-$(nproc)}" \
  --output-junit "$build/Testing/junit.xml" "$@" || rc=$?
python3 "$root/scripts/skipped.py" "$build/Testing/junit.xml" "$KPL_SKIP_LOG" || rc=1
exit $rc
