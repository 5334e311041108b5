#!/usr/bin/env bash
# scripts/gpu/pack.sh — packs the GPU kit: kpl built with CUDA for the H100
# (sm_90 machine code plus compute_90 PTX), the programs the GPU checks run,
# every shared library they load that a GPU machine's image lacks, Open MPI
# relocatable, and a Fashion-MNIST subset, as one zstd archive in .gpu/
# (ignored by git), carried to the GPU machine and run there by
# scripts/gpu/run.sh.  docs/gpu.md says what the kit runs and why.
#
#   scripts/gpu/pack.sh [--train N]   build and pack (N training images of
#                                     Fashion-MNIST, default 30000; the
#                                     10000 test images always)
#   scripts/gpu/pack.sh --check       prove, without a GPU, that the packed
#                                     kit is complete: unpacked with the
#                                     carried zstd, every program and
#                                     library in it finds each library it
#                                     needs inside the kit or among those
#                                     the GPU image provides (PROVIDED below)
#
# Environment: BUILD_DIR (default build-gpu/), KPL_GPU_MAX_MIB (48).
# Exit status: 0 done; 1 a failed build or check, or a kit over the size
# limit; 2 no nvcc (the CUDA toolkit) on this machine, or a bad argument.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=$root/.gpu
build=${BUILD_DIR:-$root/build-gpu}
max_mib=${KPL_GPU_MAX_MIB:-48}

# What the GPU machine's image provides, so the kit must not carry it:
# glibc and the compiler's runtime (every Linux has them; never carried, as
# a second glibc cannot be mixed with the system's loader), the driver's
# libcuda and libnvidia-*, and CUDA's libraries that PyTorch's wheels
# install there (nvidia-cuda-runtime, nvidia-cublas, nvidia-cudnn-cu13,
# nvidia-nccl-cu13), found by run.sh from python3's site-packages.
PROVIDED_RE='^(linux-vdso\.so\.1|ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libmvec\.so\.1|libpthread\.so\.0|libdl\.so\.2|librt\.so\.1|libutil\.so\.1|libresolv\.so\.2|libstdc\+\+\.so\.6|libgcc_s\.so\.1|libcuda\.so\.1|libnvidia-.*|libcudart\.so\.13|libcublas\.so\.13|libcublasLt\.so\.13|libcudnn.*\.so\.9|libnccl\.so\.2)$'
# The programs of the checks (kit.py runs them by these names).
PROGRAMS=(kpl test_cuda test_loader_cuda test_ddp_cuda test_collective bench_nn)
# The CPU suite (kit.py's step cpu): every C unit test and its ISA variants
# (ctest labels unit and isa: a test_* program run without arguments), for
# the GPU machine's CPU, a Xeon with AMX that no other machine of the
# project has.  Left out: test_cuda's CPU variants (the kit runs test_cuda
# on the GPU), test_cifar (its data comes from a numpy script, and the
# image's python has no numpy), test_plugin and test_detector_plugin (they
# load plugin libraries built beside them).
CPU_SKIP_RE='^(test_cuda.*|test_cifar|test_plugin|test_detector_plugin)$'

die() { echo "pack.sh: $*" >&2; exit 1; }

# deps FILE...: "name path" for every library the files need (ldd's
# transitive closure; path "not-found" when the loader finds none).
deps() {
  local f
  for f in "$@"; do
    ldd "$f" 2> /dev/null | awk '$2 == "=>" { print $1, ($3 == "not" ? "not-found" : $3) }'
  done | sort -u
}

# elves DIR: every ELF program and library under DIR, a path a line.
elves() {
  find "$1" -type f \( -perm -u+x -o -name '*.so*' \) -exec sh -c \
    'head -c 4 "$1" | grep -q "ELF" && echo "$1"' _ {} \;
}

# check_kit DIR: every ELF file under DIR resolves each library inside DIR or
# among PROVIDED; prints what it checked, returns 1 on any miss.
check_kit() {
  local kit=$1 bad=0 n=0 f name path
  local lp="$kit/build/lib:$kit/lib:$kit/ompi/lib"
  while IFS= read -r f; do
    n=$((n + 1))
    while read -r name path; do
      if [[ $name =~ $PROVIDED_RE ]]; then continue; fi
      if [[ $path == "$kit"/* ]]; then continue; fi
      echo "pack.sh --check: ${f#"$kit"/} needs $name, found ${path/not-found/nowhere}" \
           "(outside the kit, and not among what the GPU image provides)" >&2
      bad=1
    done < <(LD_LIBRARY_PATH=$lp deps "$f")
  done < <(elves "$kit")
  echo "pack.sh --check: $n programs and libraries checked"
  return $bad
}

# cpu_candidates BUILD: before the build, the programs the CPU suite may
# need (ctest lists no command for a program not built yet): for each
# unit/isa test named test_*, the longest target its name is or starts with
# (test_kernels_avx2 -> test_kernels), one a line
cpu_candidates() {
  local targets
  targets=$(cmake --build "$1" --target help | sed -n 's/^\.\.\. \(test_[A-Za-z0-9_]*\).*/\1/p')
  ctest --test-dir "$1" --show-only=json-v1 -L 'unit|isa' | python3 -c '
import json, re, sys
skip, targets = re.compile(sys.argv[1]), set(sys.argv[2].split())
out = set()
for t in json.load(sys.stdin)["tests"]:
    name = t["name"]
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    if not name.startswith("test_") or skip.match(name) or "cuda" in props.get("LABELS", []):
        continue
    best = max((x for x in targets if name == x or name.startswith(x + "_")), key=len, default=None)
    if best and not skip.match(best):
        out.add(best)
print("\n".join(sorted(out)))' "$CPU_SKIP_RE" "$targets"
}
# cpu_suite BUILD: after the build, ctest's JSON of the CPU suite's tests in
# BUILD (stdout)
cpu_suite() {
  ctest --test-dir "$1" --show-only=json-v1 -L 'unit|isa' | python3 -c '
import json, os, re, sys
skip = re.compile(sys.argv[1])
d = json.load(sys.stdin)
keep = []
for t in d["tests"]:
    cmd = t.get("command") or []
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    prog = os.path.basename(cmd[0]) if cmd else ""
    if (len(cmd) == 1 and prog.startswith("test_") and "cuda" not in props.get("LABELS", [])
            and not skip.match(t["name"]) and not skip.match(prog)):
        keep.append(t)
d["tests"] = keep
json.dump(d, sys.stdout)' "$CPU_SKIP_RE"
}
# cpu_programs JSON: the programs of a cpu_suite list, one a line
cpu_programs() {
  python3 -c 'import json, os, sys
print("\n".join(sorted({os.path.basename(t["command"][0]) for t in json.load(open(sys.argv[1]))["tests"]})))' "$1"
}

unpack() { # unpack ARCHIVE DIR: with the zstd carried beside the archive
  LD_LIBRARY_PATH="$out/unpack" "$out/unpack/zstd" -q -d --long=28 -c "$1" | tar -x -C "$2"
}

if [[ ${1:-} == --check ]]; then
  [[ -s $out/kit.tar.zst && -x $out/unpack/zstd ]] \
    || die "no kit in $out: run scripts/gpu/pack.sh first"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  unpack "$out/kit.tar.zst" "$tmp" || die "$out/kit.tar.zst does not unpack"
  kit=$tmp/kit
  status=0
  for p in "${PROGRAMS[@]}"; do
    [[ -x $kit/build/bin/$p ]] || { echo "pack.sh --check: build/bin/$p missing" >&2; status=1; }
  done
  for f in tests.json cpu_tests.json MANIFEST.json ompi/env.sh data/fashion-mnist/t10k-images-idx3-ubyte.gz; do
    [[ -s $kit/$f ]] || { echo "pack.sh --check: $f missing" >&2; status=1; }
  done
  while read -r p; do
    [[ -x $kit/build/bin/$p ]] || { echo "pack.sh --check: build/bin/$p (CPU suite) missing" >&2; status=1; }
  done < <(cpu_programs "$kit/cpu_tests.json")
  check_kit "$kit" || status=1
  # the unpacker itself (run.sh uses it where the GPU machine has no zstd)
  while read -r name path; do
    [[ $name =~ $PROVIDED_RE || $path == "$out/unpack/"* ]] && continue
    echo "pack.sh --check: unpack/zstd needs $name from $path" >&2
    status=1
  done < <(LD_LIBRARY_PATH=$out/unpack deps "$out/unpack/zstd")
  # the programs start with the kit's libraries (no GPU: kpl says so)
  env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="$kit/build/lib:$kit/lib:$kit/ompi/lib" \
    "$kit/build/bin/kpl" info > "$tmp/info.txt" 2>&1 \
    || { echo "pack.sh --check: kpl info failed: $(cat "$tmp/info.txt")" >&2; status=1; }
  grep -q 'CUDA backend: built' "$tmp/info.txt" \
    || { echo "pack.sh --check: the kit's kpl was built without CUDA: $(cat "$tmp/info.txt")" >&2; status=1; }
  stub=$(find "$kit/lib" -name 'libicudata.so.*' -size -64k)
  [[ -n $stub ]] && echo "pack.sh --check: ${stub#"$kit"/} is the stand-in for ICU's data (scripts/gpu/icudata_stub.c)"
  if ((status == 0)); then
    echo "pack.sh --check: OK: $(du -m "$out/kit.tar.zst" | cut -f1) MiB, $(jq -r .commit "$kit/MANIFEST.json" 2>/dev/null || sed -n 's/.*"commit": *"\([^"]*\)".*/\1/p' "$kit/MANIFEST.json")"
  fi
  exit $status
fi

train=30000
while (($#)); do
  case $1 in
    --train) [[ ${2:-} =~ ^[0-9]+$ && $2 -ge 1000 ]] || { echo "pack.sh: --train wants a number >= 1000" >&2; exit 2; }
             train=$2; shift 2 ;;
    *) echo "pack.sh: unknown argument '$1' (want --train N or --check)" >&2; exit 2 ;;
  esac
done

nvcc=$(command -v nvcc || true)
[[ -n $nvcc ]] || { [[ -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc; }
if [[ -z $nvcc ]]; then
  echo "pack.sh: no nvcc (the CUDA toolkit) on this machine: kpl's CUDA backend cannot be built here" >&2
  exit 2
fi
for t in zstd ldd python3; do
  command -v $t > /dev/null || die "needs $t"
done
[[ -r /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]] \
  || die "no Fashion-MNIST in /usr/share/datasets/fashion-mnist (scripts/setup.sh installs it)"

t0=$(date +%s)
echo "pack.sh: building kpl with CUDA (sm_90 + PTX) in $build"
# only the kit's programs and the CPU suite's tests (their targets; kpl's is kpl_cli):
# less than the whole build, which matters in CI
mkdir -p "$build"
cpu_json=$build/cpu_tests.json
{ cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKPL_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 &&
  mapfile -t cpu_progs < <(cpu_candidates "$build" | grep .) &&
  ((${#cpu_progs[@]})) &&
  cmake --build "$build" -j "${JOBS:-$(nproc)}" --target kpl_cli "${PROGRAMS[@]:1}" "${cpu_progs[@]}" &&
  cpu_suite "$build" > "$cpu_json" &&
  mapfile -t cpu_progs < <(cpu_programs "$cpu_json" | grep .) &&
  ((${#cpu_progs[@]} > 10)); } \
  > "$build/kit-build.log" 2>&1 \
  || { tail -30 "$build/kit-build.log" >&2; die "the build failed, or found no CPU suite (whole log: $build/kit-build.log)"; }
grep -q 'KPL_HAVE_CUDA 1' "$build/include/kpl_config.h" || die "$build was configured without CUDA"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
kit=$stage/kit
mkdir -p "$kit/build/bin" "$kit/build/lib" "$kit/lib" "$kit/data/fashion-mnist"
for p in "${PROGRAMS[@]}" "${cpu_progs[@]}"; do
  cp "$build/bin/$p" "$kit/build/bin/"
done
cp "$cpu_json" "$kit/cpu_tests.json"
cp -a "$build"/lib/libkpl.so* "$kit/build/lib/"

# Open MPI, relocatable (singleton MPI_Init forks its orted; mpirun -np 1)
"$root/scripts/gpu/ompi_bundle.sh" "$kit/ompi" > "$stage/ompi.log" 2>&1 \
  || { cat "$stage/ompi.log" >&2; die "scripts/gpu/ompi_bundle.sh failed"; }

# every library the programs, kpl's library and Open MPI's programs and
# plugins load, less what the GPU image provides
mapfile -t elves < <(elves "$kit")
while read -r name path; do
  [[ $name =~ $PROVIDED_RE ]] && continue
  [[ $path == not-found ]] && die "$name, needed by the kit, is not found on this machine"
  [[ $path == "$kit"/* || $path == "$build"/* ]] && continue
  [[ -e $kit/lib/$name || -e $kit/ompi/lib/$name ]] && continue
  cp -L "$path" "$kit/lib/$name"
done < <(LD_LIBRARY_PATH="$kit/build/lib:$kit/ompi/lib" deps "${elves[@]}")

# ICU's data library: the stand-in (icudata_stub.c says why)
for f in "$kit"/lib/libicudata.so.*; do
  [[ -e $f ]] || continue
  so=$(basename "$f")
  major=${so#libicudata.so.}
  major=${major%%.*}
  cc -O2 -shared -fPIC -DICU_DATA_SYMBOL="icudt${major}_dat" -Wl,-soname,"$so" \
     -o "$f" "$root/scripts/gpu/icudata_stub.c"
done

# Fashion-MNIST: the first N training images and all test images, as IDX
python3 - "$train" "$kit/data/fashion-mnist" <<'EOF'
import gzip, struct, sys
src = "/usr/share/datasets/fashion-mnist"
train, dst = int(sys.argv[1]), sys.argv[2]
for split, n in (("train", train), ("t10k", 10 ** 9)):
    for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
        name = f"{split}-{kind}.gz"
        d = gzip.open(f"{src}/{name}", "rb").read()
        magic, count = struct.unpack(">II", d[:8])
        ndim = magic & 0xFF
        head = 4 + 4 * ndim
        item = 1
        for i in range(1, ndim):
            item *= struct.unpack(">I", d[4 + 4 * i:8 + 4 * i])[0]
        n = min(n, count)
        with gzip.open(f"{dst}/{name}", "wb", compresslevel=9) as f:
            f.write(d[:4] + struct.pack(">I", n) + d[8:head] + d[head:head + n * item])
EOF

# the cuda-labelled tests as ctest knows them (commands, properties)
ctest --test-dir "$build" --show-only=json-v1 -L cuda > "$kit/tests.json"
commit=$(git -C "$root" rev-parse --short=12 HEAD 2> /dev/null || echo unknown)
dirty=$(git -C "$root" status --porcelain 2> /dev/null | grep -qv '^??' && echo true || echo false)
glibc=$(for f in "${elves[@]}"; do objdump -T "$f" 2> /dev/null; done |
        grep -o 'GLIBC_[0-9.]*' | sort -t. -k2,2n -k3,3n -u | tail -1)
cuda=$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
cat > "$kit/MANIFEST.json" << EOF
{"kit": 1, "commit": "$commit", "dirty": $dirty, "packed": "$(date -u +%FT%TZ)",
 "build_dir": "$build", "source_dir": "$root", "mpirun": "$(command -v mpirun)",
 "cuda": "$cuda", "cuda_arch": "sm_90+compute_90", "glibc_min": "${glibc#GLIBC_}",
 "fmnist_train": $train, "fmnist_test": 10000,
 "provided": "$(sed 's/\\/\\\\/g' <<< "$PROVIDED_RE")"}
EOF

mkdir -p "$out"
rm -f "$out/kit.tar.zst"
echo "pack.sh: compressing ($(du -sm "$kit" | cut -f1) MiB)"
tar -C "$stage" -cf - kit | zstd -q -19 --long=28 -T0 -o "$out/kit.tar.zst"
# the unpacker: zstd and its libraries, for a GPU machine without zstd
rm -rf "$out/unpack"
mkdir -p "$out/unpack"
cp -L "$(command -v zstd)" "$out/unpack/zstd"
while read -r name path; do
  [[ $name =~ $PROVIDED_RE ]] || cp -L "$path" "$out/unpack/$name"
done < <(deps "$(command -v zstd)")

bytes=$(stat -c %s "$out/kit.tar.zst")
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "pack.sh: $out/kit.tar.zst: $mib MiB (commit $commit$([[ $dirty == true ]] && echo ', with uncommitted changes'), $(( $(date +%s) - t0 )) s)"
awk -v b="$bytes" -v m="$max_mib" 'BEGIN { exit !(b <= m * 1048576) }' \
  || die "the kit is $mib MiB, over the limit of $max_mib MiB (fewer --train images?)"
