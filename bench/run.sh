#!/usr/bin/env bash
# bench/run.sh [GROUP...] — builds kpl (Release) and prints one JSON line per
# benchmark case on stdout; diagnostics go to stderr.
# Groups: kernels autograd nn data comm train graph (none = all).
# Environment: KPL_BENCH_BUILD (build dir, default build-bench/),
#              KPL_BASELINES (default ../shared/baselines beside the project).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KPL_BENCH_BUILD:-$root/build-bench}
baselines=${KPL_BASELINES:-$root/../shared/baselines}
all=(kernels autograd nn data comm train graph)

groups=("$@")
((${#groups[@]})) || groups=("${all[@]}")
for g in "${groups[@]}"; do
  [[ " ${all[*]} " == *" $g "* ]] || { echo "bench/run.sh: unknown group '$g' (groups: ${all[*]})" >&2; exit 2; }
done
[[ -d "$baselines" ]] || { echo "bench/run.sh: reference programs not found at $baselines (set KPL_BASELINES)" >&2; exit 2; }
baselines=$(cd "$baselines" && pwd)

echo "bench: building into $build" >&2
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKPL_TESTS=OFF -DKPL_CUDA=OFF >/dev/null
cmake --build "$build" -j "$(nproc)" >/dev/null

tools="$build/bench-tools"
mkdir -p "$tools"
build_tool() { # name, extra flags
  [[ "$tools/$1" -nt "$baselines/$1.c" ]] || gcc -O2 $2 -o "$tools/$1" "$baselines/$1.c"
}
build_tool memcpy_bw ""
build_tool fma_peak "-mavx512f -mfma"

for g in "${groups[@]}"; do
  case "$g" in
    kernels) "$build/bin/bench_kernels" "$baselines" "$tools" ;;
    autograd) "$build/bin/bench_autograd" "$baselines" ;;
    *) echo "bench: group '$g' has no benchmarks yet" >&2 ;;
  esac
done
