#!/usr/bin/env bash
# Builds kpl's libFuzzer targets (clang 14, ASan + UBSan) and runs them
# (docs/fuzzing.md).  For each target: its regression inputs
# (tests/fuzz/regress/TARGET) are replayed first, then it fuzzes a copy of
# its seed corpus for the given time, so the tree stays clean.  Exits 1 on
# any finding, naming the reproducer.
#
#   scripts/fuzz.sh                        every target, 30 s each
#   scripts/fuzz.sh --seconds 600 recipe   one target, 10 minutes
#   scripts/fuzz.sh --replay               only replay corpora and regressions
#   scripts/fuzz.sh --keep-going image     fork mode: go on past crashes,
#                                          collecting them all
# Options: --seconds N, --replay, --keep-going, --no-setup (skip the
# package check), --no-build.  Environment: BUILD_DIR (build-fuzz),
# FUZZ_WORK (BUILD_DIR/fuzz-work: corpora, logs, artifacts), JOBS.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build-fuzz}
work=${FUZZ_WORK:-$build/fuzz-work}
all=(record record_parse recipe checkpoint image lmdb hosts coco cocoeval pickle model onnx)

# Per target: the longest input worth trying (the seeds are far smaller).
declare -A max_len=([record]=16384 [record_parse]=1024 [recipe]=4096 [checkpoint]=8192
                    [image]=16384 [lmdb]=2048 [hosts]=1024 [coco]=4096 [cocoeval]=8192
                    [pickle]=16384 [model]=16384 [onnx]=16384)

seconds=30 replay_only=0 keep_going=0 setup=1 do_build=1 targets=()
while (($#)); do
  case "$1" in
    --seconds) seconds=$2; shift ;;
    --seconds=*) seconds=${1#*=} ;;
    --replay) replay_only=1 ;;
    --keep-going) keep_going=1 ;;
    --no-setup) setup=0 ;;
    --no-build) do_build=0 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
    *)
      if [[ -z ${max_len[$1]:-} ]]; then
        echo "fuzz.sh: no target '$1' (targets: ${all[*]})" >&2
        exit 2
      fi
      targets+=("$1") ;;
  esac
  shift
done
((${#targets[@]})) || targets=("${all[@]}")

if ((setup)); then "$root/scripts/setup.sh" --fuzz; fi
if ((do_build)); then
  echo "== fuzz build in $build"
  CC=clang-14 cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKPL_FUZZ=ON \
    -DKPL_CUDA=OFF -DKPL_TESTS=OFF >/dev/null
  cmake --build "$build" -j "${JOBS:-$(nproc)}" --target kpl_fuzz
fi
bin=$build/bin
mkdir -p "$work"

failed=0
summary=()
for t in "${targets[@]}"; do
  exe=$bin/fuzz_$t
  dict=$root/tests/fuzz/dict/$t.dict
  flags=(-rss_limit_mb=2560 -timeout=10)

  # 1. Regressions first, one by one, so a failure names its input.
  regress=$root/tests/fuzz/regress/$t
  if [[ -d $regress ]]; then
    while IFS= read -r -d '' f; do
      if ! "$exe" "${flags[@]}" "$f" >"$work/$t.regress.log" 2>&1; then
        echo "FAIL $t: regression input $f (log: $work/$t.regress.log)"
        tail -n 30 "$work/$t.regress.log"
        failed=1
        summary+=("$t: regression $f fails")
      fi
    done < <(find "$regress" -type f ! -name 'README*' -print0 | sort -z)
  fi
  if ((replay_only)); then
    if "$root/tests/fuzz/replay.sh" "$exe" "$root/tests/fuzz/corpus/$t" >"$work/$t.replay.log" 2>&1; then
      summary+=("$t: corpus replayed")
    else
      echo "FAIL $t: a seed fails (log: $work/$t.replay.log)"
      tail -n 30 "$work/$t.replay.log"
      failed=1
      summary+=("$t: corpus replay fails")
    fi
    continue
  fi

  # 2. Fuzz a copy of the seed corpus.
  corpus=$work/corpus/$t
  artifacts=$work/artifacts/$t
  rm -rf "$corpus" "$artifacts"
  mkdir -p "$corpus" "$artifacts"
  cp "$root/tests/fuzz/corpus/$t"/* "$corpus"/
  [[ -f $dict ]] && flags+=(-dict="$dict")
  flags+=(-max_len="${max_len[$t]}" -max_total_time="$seconds" -print_final_stats=1
          -artifact_prefix="$artifacts/")
  if ((keep_going)); then
    flags+=(-fork=1 -ignore_crashes=1 -ignore_ooms=1 -ignore_timeouts=1)
  fi
  echo "== fuzz_$t: $seconds s (log: $work/$t.log)"
  rc=0
  "$exe" "${flags[@]}" "$corpus" >"$work/$t.log" 2>&1 || rc=$?
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$work/$t.log" | tail -n1 | grep -o '[0-9]*$' || true)
  rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$work/$t.log" | tail -n1 | grep -o '[0-9]*$' || true)
  cov=$(grep -o 'cov: [0-9]* ft: [0-9]*' "$work/$t.log" | tail -n1 || true)
  if [[ -z $execs ]]; then # fork mode: "#N: cov: C ft: F corp: K exec/s R ..."
    last=$(grep -E '^#[0-9]+: cov' "$work/$t.log" | tail -n1 || true)
    execs=$(sed -E 's/^#([0-9]+):.*/\1/' <<<"$last")
    rate=$(grep -oE 'exec/s [0-9]+' <<<"$last" | grep -oE '[0-9]+' || true)
  fi
  # A harness killed by a crash or a timeout cannot remove its scratch directory.
  rm -rf /dev/shm/kpl-fuzz-"$t"-* /tmp/kpl-fuzz-"$t"-*
  found=$(find "$artifacts" -type f | sort)
  line="$t: ${execs:-?} runs, ${rate:-?} exec/s, ${cov:-cov ?}, corpus $(find "$corpus" -type f | wc -l) files"
  if [[ -n $found || $rc -ne 0 ]]; then
    failed=1
    echo "FINDING in $t (exit $rc); reproducer(s):"
    if [[ -n $found ]]; then
      echo "$found" | sed 's/^/  /'
    else
      echo "  (none saved; see $work/$t.log)"
    fi
    grep -m1 -A12 'ERROR: \|runtime error:\|==ERROR' "$work/$t.log" || tail -n 20 "$work/$t.log"
    echo "  replay: $exe $(echo "$found" | head -n1)"
    summary+=("$line: FINDING")
  else
    summary+=("$line: ok")
  fi
done

echo "== fuzz summary"
printf '  %s\n' "${summary[@]}"
exit "$failed"
