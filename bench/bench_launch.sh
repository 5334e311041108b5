#!/usr/bin/env bash
# bench_launch.sh KPLRUN — what kplrun costs over a bare mpirun, side by
# side in alternating rounds (KPL_BENCH_ROUNDS, default 5), one JSON line
# per case on stdout:
#   start     -np 2 of `true`: seconds from start to exit (lower is better);
#             kplrun's share: asking ompi_info for UCX, the agents, the logs
#   output    -np 2 ranks each printing 200000 lines of 64 bytes to a
#             file: MB/s through the whole path (higher is better); kplrun
#             adds the agent's line splitting and [rN] prefixes, the log
#             files and its own merge
#   teardown  -np 2, rank 1 exits 3 at once, rank 0 sleeps: seconds from
#             start to the launcher's exit (lower is better); Open MPI's own
#             teardown (SIGCONT, 1 s, SIGTERM, SIGKILL) dominates both
# Both sides run as root with --oversubscribe and Open MPI's defaults
# otherwise; kplrun picks its own (UCX, binding), as a user would get them.
set -euo pipefail
kplrun=$1
rounds=${KPL_BENCH_ROUNDS:-5}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mpirun=(mpirun --allow-run-as-root --oversubscribe -np 2)
kpl=("$kplrun" -np 2 --log-dir "$tmp/logs")

elapsed() { # CMD...: seconds the command took (its output to $tmp/out)
  local t0=$EPOCHREALTIME
  "$@" > "$tmp/out" 2> "$tmp/err" || true
  awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.4f\n", b - a }'
}
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
# The CPU, in every row as bench_common.h's rows have it.
cpu_model=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //; s/["\\]/ /g; s/ *$//')
cpu_features=$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2- | tr ' ' '\n' |
  grep -xE 'sse4_2|avx|avx2|fma|f16c|avx512f|avx512bw|avx512vl|avx512_vnni|avx512_bf16|amx_bf16' |
  paste -sd, -)
range() { sort -g | awk 'NR == 1 { lo = $1 } { hi = $1 } END { printf "[%s,%s]", lo, hi }'; }
# bench_case NAME UNIT BETTER SCALE KPL-CMD ::: REF-CMD: alternating rounds, which
# side goes first alternating too; SCALE turns seconds into the unit
# (empty: seconds as they are, else SCALE / seconds)
bench_case() {
  local name=$1 unit=$2 better=$3 scale=$4
  shift 4
  local k=() r=() seen=0
  for a in "$@"; do
    if [[ $a == ::: && $seen == 0 ]]; then seen=1; continue; fi
    if ((seen)); then r+=("$a"); else k+=("$a"); fi
  done
  : > "$tmp/k" && : > "$tmp/r"
  for ((i = 0; i < rounds; i++)); do
    if ((i % 2)); then
      elapsed "${r[@]}" >> "$tmp/r"; elapsed "${k[@]}" >> "$tmp/k"
    else
      elapsed "${k[@]}" >> "$tmp/k"; elapsed "${r[@]}" >> "$tmp/r"
    fi
  done
  local conv='{ print $1 }'
  [[ -n $scale ]] && conv="{ printf \"%.4f\\n\", $scale / \$1 }"
  local kv rv kr rr
  kv=$(awk "$conv" "$tmp/k" | median) rv=$(awk "$conv" "$tmp/r" | median)
  kr=$(awk "$conv" "$tmp/k" | range) rr=$(awk "$conv" "$tmp/r" | range)
  local ratio
  if [[ $better == higher ]]; then ratio=$(awk -v a="$kv" -v b="$rv" 'BEGIN { printf "%.3f", a / b }')
  else ratio=$(awk -v a="$kv" -v b="$rv" 'BEGIN { printf "%.3f", b / a }'); fi
  printf '{"bench":"launch","case":"%s","unit":"%s","better":"%s","kpl":%s,"ref":%s,"ref_name":"mpirun","ratio":%s,"target":null,"rounds":%d,"kpl_range":%s,"ref_range":%s,"cpu":"%s","cpu_features":"%s"}\n' \
    "$name" "$unit" "$better" "$kv" "$rv" "$ratio" "$rounds" "$kr" "$rr" "$cpu_model" "$cpu_features"
}

bench_case start/np2 s lower "" "${kpl[@]}" -- true ::: "${mpirun[@]}" true

lines=200000
text=$(printf "%063d" 7) # 63 characters and a newline
job="yes $text | head -n $lines"
mb=$(awk -v n=$lines 'BEGIN { print 2 * n * 64 / 1e6 }')
bench_case output/np2 MB/s higher "$mb" "${kpl[@]}" -- sh -c "$job" ::: "${mpirun[@]}" sh -c "$job"
# every line arrived whole, on both sides (a bare mpirun forwards output
# in chunks of up to 4 KB, which may cut one rank's line with another's)
whole() { grep -c "^$1$text\$" "$tmp/out" || true; }
n=$(whole "")
[[ $n == $((2 * lines)) ]] || echo "bench_launch: mpirun delivered $n whole lines of $((2 * lines))" >&2
"${kpl[@]}" -- sh -c "$job" > "$tmp/out" 2> /dev/null
for r in 0 1; do
  n=$(whole "\[r$r\] ")
  [[ $n == "$lines" ]] || { echo "bench_launch: kplrun delivered $n whole lines of rank $r of $lines" >&2; exit 1; }
done

fail='if [ "${OMPI_COMM_WORLD_RANK}" = 1 ]; then exit 3; fi; sleep 30'
bench_case teardown/np2 s lower "" "${kpl[@]}" -- sh -c "$fail" ::: "${mpirun[@]}" sh -c "$fail"
