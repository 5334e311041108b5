#!/usr/bin/env bash
# bench/run.sh [GROUP...] — builds kpl in Release and runs its benchmarks,
# printing one JSON object per case on stdout (nothing else); progress and
# diagnostics go to stderr.  See bench/README.md for the fields.
#
# Groups: kernels autograd nn data comm scale train launch graph cocoeval fid detops fcos seg gan
# parity (none = all of them).
# Exit status: 0 ok; 1 build failure or a benchmark program failed (the
# other groups still run); 2 bad usage or missing reference programs.
#
# Environment:
#   KPL_BENCH_BUILD   build directory (default: build-bench/ in the project)
#   KPL_BASELINES     reference programs (default: ../shared/baselines
#                     beside the project)
#   KPL_BENCH_CUDA    KPL_CUDA for the build (default OFF: CPU benchmarks)
#   KPL_BENCH_ROUNDS  rounds of kpl/reference alternation (default 5)
#   KPL_BENCH_LINKS   the scale group's link speeds (default "1gbit 2500mbit 10gbit")
#   KPL_BENCH_SCALE   its cases (default scale18,scale50,hier)
#   OMP_WAIT_POLICY   exported to kpl and the references alike (default
#                     PASSIVE: idle OpenMP threads sleep instead of spinning,
#                     which matters on 2 shared cores)
set -euo pipefail

all=(kernels autograd nn data comm scale train launch graph cocoeval fid detops fcos seg gan parity)
usage() { echo "usage: bench/run.sh [GROUP...]   groups: ${all[*]} (none = all)"; }

groups=()
for g in "$@"; do
  case "$g" in
    -h | --help) usage; exit 0 ;;
  esac
  if [[ " ${all[*]} " != *" $g "* ]]; then
    echo "bench/run.sh: unknown group '$g'" >&2
    usage >&2
    exit 2
  fi
  groups+=("$g")
done
((${#groups[@]})) || groups=("${all[@]}")

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
build=${KPL_BENCH_BUILD:-$root/build-bench}
baselines=${KPL_BASELINES:-$here/../../shared/baselines}
if [[ ! -d "$baselines" ]]; then
  echo "bench/run.sh: reference programs not found at $baselines (set KPL_BASELINES)" >&2
  exit 2
fi
baselines=$(cd "$baselines" && pwd)
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
echo "bench: references from $baselines; OMP_WAIT_POLICY=$OMP_WAIT_POLICY" >&2

# --- build kpl (Release) -----------------------------------------------------
mkdir -p "$build"
log="$build/bench-build.log"
echo "bench: building kpl (Release) into $build" >&2
if ! { cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKPL_TESTS=OFF \
         -DKPL_CUDA="${KPL_BENCH_CUDA:-OFF}" &&
       cmake --build "$build" -j "$(nproc)"; } >"$log" 2>&1; then
  tail -n 40 "$log" >&2
  echo "bench/run.sh: build failed (full log: $log)" >&2
  exit 1
fi

# --- the reference programs that are C sources ----------------------------------
tools="$build/bench-tools"
mkdir -p "$tools"
build_tool() { # NAME GCC-FLAGS...: compile baselines/NAME.c when it is newer
  local name=$1
  shift
  [[ "$tools/$name" -nt "$baselines/$name.c" ]] && return 0
  echo "bench: compiling $name.c ($*)" >&2
  gcc "$@" -o "$tools/$name" "$baselines/$name.c" >&2
}

failed=()
run_group() { # GROUP: runs its benchmark program(s); JSON goes to stdout
  local g=$1 rc=0
  echo "bench: group $g" >&2
  case "$g" in
    kernels)
      build_tool memcpy_bw -O2 || return 1
      # fma_peak.c holds an AVX-512 and an AVX2 loop; the AVX-512 one only
      # compiles with -mavx512f.  bench_kernels runs `fma_peak 256` on
      # AVX2-only CPUs, a path without AVX-512 instructions.
      if [[ "$(uname -m)" == x86_64 ]]; then
        build_tool fma_peak -O2 -mavx512f -mfma || return 1
      fi
      "$build/bin/bench_kernels" "$baselines" "$tools" || rc=$?
      ;;
    autograd)
      "$build/bin/bench_autograd" "$baselines" || rc=$?
      ;;
    nn)
      "$build/bin/bench_nn" "$baselines" "$here" || rc=$?
      ;;
    graph)
      "$build/bin/bench_graph" "$baselines" "$here" || rc=$?
      ;;
    data)
      "$build/bin/bench_data" "$build" "$baselines" || rc=$?
      "$build/bin/bench_transform" "$baselines" || rc=$?
      ;;
    comm)
      # Shared memory (Open MPI's vader; UCX's posix/sysv/cma), then TCP on
      # loopback for both, then the overlap of a training step (one thread
      # per rank: 2 ranks on 2 cores).
      local mpirun=(mpirun --allow-run-as-root --oversubscribe -np 2)
      "${mpirun[@]}" "$build/bin/bench_comm" --transport shm --cases busbw,r50 || rc=$?
      "${mpirun[@]}" --mca btl tcp,self -x UCX_TLS=tcp,self \
        "$build/bin/bench_comm" --transport tcp --cases busbw,r50 || rc=$?
      "${mpirun[@]}" -x OMP_NUM_THREADS=1 "$build/bin/bench_comm" --cases overlap || rc=$?
      ;;
    scale)
      # Data parallelism over a link (bench/cluster.sh: nodes as network
      # namespaces on their own cores, veth links shaped by tbf), one job
      # per link speed: ResNet-18 CIFAR and ResNet-50 on 2 nodes x 1 rank
      # (one core and one thread each), then the hierarchical allreduce on
      # 2 nodes x 2 ranks.  Open MPI's transport as kplrun sets it (the UCX
      # pml), UCX on TCP between the nodes and shared memory inside them.
      # (ob1's btl tcp moved only ~60% of the link per direction when both
      # directions were busy, as in every allreduce, unless
      # btl_tcp_links > 1.)
      local cases=${KPL_BENCH_SCALE:-scale18,scale50,hier} link crc
      local mpi='mpirun --allow-run-as-root --oversubscribe --bind-to none $KPL_CLUSTER_MPI'
      mpi+=' --mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any -x UCX_TLS=tcp,sm,self'
      mpi+=' --mca mpi_yield_when_idle 1 -x OMP_NUM_THREADS=1 -x KPL_BENCH_ROUNDS'
      # shellcheck disable=SC2206
      local links=(${KPL_BENCH_LINKS:-1gbit 2500mbit 10gbit})
      for link in "${links[@]}"; do
        local models=${cases//hier/}
        if [[ $models == *scale* ]]; then
          crc=0
          "$here/cluster.sh" --nodes 2 --bandwidth "$link" -- sh -c \
            "$mpi -np 2 '$build/bin/bench_comm' --transport $link --cases $models" || crc=$?
          ((crc == 77)) && { echo "bench: scale: no simulated cluster here, skipped" >&2; return 0; }
          ((crc == 0)) || rc=$crc
        fi
        if [[ $cases == *hier* ]]; then
          crc=0
          "$here/cluster.sh" --nodes 2 --slots 2 --bandwidth "$link" -- sh -c \
            "$mpi -np 4 '$build/bin/bench_comm' --transport $link --cases hier" || crc=$?
          ((crc == 77)) && { echo "bench: scale: no simulated cluster here, skipped" >&2; return 0; }
          ((crc == 0)) || rc=$crc
        fi
      done
      ;;
    train)
      # The lenet recipe through `kpl train` against torch_fmnist.py, in
      # alternating rounds; Fashion-MNIST is converted under the build dir.
      mkdir -p "$build/bench-train"
      "$build/bin/bench_train" "$build/bin/kpl" "$root" "$baselines" "$build/bench-train" || rc=$?
      ;;
    launch)
      # kplrun against a bare mpirun: start-up, output, teardown
      "$here/bench_launch.sh" "$build/bin/kplrun" || rc=$?
      ;;
    cocoeval)
      # COCO mAP of 5000 images x 100 detections against pycocotools
      # (scripts/setup.sh --bench installs it); the set is written once.
      mkdir -p "$build/bench-cocoeval"
      "$build/bin/bench_cocoeval" "$root" "$build/bench-cocoeval" || rc=$?
      ;;
    fid)
      # FID of 10k x 2 feature vectors, dims 128 and 2048, against numpy +
      # scipy (python3-scipy); the features are written once.
      mkdir -p "$build/bench-fid"
      "$build/bin/bench_fid" "$root" "$build/bench-fid" || rc=$?
      ;;
    detops)
      # NMS, batched NMS and ROI Align against torchvision's C++ kernels
      # (torch_detops.py)
      "$build/bin/bench_detops" "$here" "$build" || rc=$?
      ;;
    fcos)
      # FCOS-R18 train step, inference and losses against the same network
      # and losses in PyTorch (torch_fcos.py; no torchvision); the weights
      # and inputs go through a file under the build dir.
      mkdir -p "$build/bench-fcos"
      "$build/bin/bench_fcos" "$here" "$build/bench-fcos" || rc=$?
      ;;
    seg)
      # U-Net and DeepLabv3-R18 train steps, inference and peak memory
      # against the same networks in PyTorch (torch_segnets.py; no
      # torchvision); weights, batch and outputs go through a file under
      # the build dir.  KPL_BENCH_SEG_ARGS: bench_seg's size options.
      mkdir -p "$build/bench-seg"
      # shellcheck disable=SC2086
      "$build/bin/bench_seg" "$here" "$build/bench-seg" ${KPL_BENCH_SEG_ARGS:-} || rc=$?
      ;;
    gan)
      # DCGAN (BCE) and WGAN-GP (gradient penalty by double backward)
      # iterations on the zoo's dcgan pair against the same networks in
      # PyTorch (torch_gans.py); weights and batch go through a file under
      # the build dir.  KPL_BENCH_GAN_ARGS: bench_gan's size options.
      mkdir -p "$build/bench-gan"
      # shellcheck disable=SC2086
      "$build/bin/bench_gan" "$here" "$build/bench-gan" ${KPL_BENCH_GAN_ARGS:-} || rc=$?
      ;;
    parity)
      # kpl's FCOS and U-Net recipes trained a few hundred steps next to the
      # same networks in PyTorch on the very batches kpl's loader gave, from
      # the same weights, with kpl's learning rate at every step; both final
      # weights evaluated alike (torch_parity.py).  KPL_BENCH_PARITY_ARGS:
      # bench_parity's options (--cases, --train, --val, --epochs).
      mkdir -p "$build/bench-parity"
      # shellcheck disable=SC2086
      "$build/bin/bench_parity" "$here" "$root" "$build/bin/kpl" "$build/bench-parity" \
        ${KPL_BENCH_PARITY_ARGS:-} || rc=$?
      ;;
    *)
      echo "bench: group '$g' has no benchmarks yet" >&2
      ;;
  esac
  return "$rc"
}

for g in "${groups[@]}"; do
  t0=$SECONDS
  # Other work on the machine skews results, the 2-thread cases most.
  read -r load1 _ </proc/loadavg 2>/dev/null || load1=0
  if awk -v l="$load1" 'BEGIN { exit !(l > 0.7) }'; then
    echo "bench: load average $load1 before group $g: other processes compete for the cores" >&2
  fi
  if run_group "$g"; then
    echo "bench: group $g done in $((SECONDS - t0)) s" >&2
  else
    rc=$?
    echo "bench/run.sh: group $g failed (exit status $rc)" >&2
    failed+=("$g")
  fi
done
if ((${#failed[@]})); then
  echo "bench/run.sh: failed groups: ${failed[*]}" >&2
  exit 1
fi
