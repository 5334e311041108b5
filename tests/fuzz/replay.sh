#!/usr/bin/env bash
# Runs a fuzz target once on every file under the given directories (seed
# corpus, regression inputs); missing directories are skipped.  Exits with
# the target's status: non-zero when an input crashes, leaks or hangs.
#   tests/fuzz/replay.sh BUILD/bin/fuzz_recipe tests/fuzz/corpus/recipe tests/fuzz/regress/recipe
set -euo pipefail
bin=$1
shift
files=()
for d in "$@"; do
  [[ -d $d ]] || continue
  while IFS= read -r -d '' f; do files+=("$f"); done \
    < <(find "$d" -type f ! -name 'README*' -print0 | sort -z)
done
if ((${#files[@]} == 0)); then
  echo "replay: no inputs in $*"
  exit 0
fi
echo "replay: ${#files[@]} inputs through $(basename "$bin")"
# Given files, libFuzzer runs each once; a hang of 25 s counts as a failure.
exec "$bin" -timeout=25 -rss_limit_mb=2560 "${files[@]}"
