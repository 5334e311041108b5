#!/usr/bin/env bash
# Installs every Debian package kpl needs to build, test and benchmark.
# Idempotent: packages already present are skipped, so a second run costs one
# dpkg query.  Run as root (or with sudo available).
#
#   scripts/setup.sh            build + test dependencies
#   scripts/setup.sh --bench    also the reference side of bench/ (PyTorch, numpy,
#                               and pycocotools from PyPI for /usr/bin/python3, which
#                               Debian does not package; tests use it when present)
#   scripts/setup.sh --fuzz     also clang 14 with libFuzzer and its OpenMP
#                               (scripts/fuzz.sh, tests/fuzz; options combine)
set -euo pipefail

packages=(
  build-essential cmake pkg-config ninja-build
  libdnnl-dev                        # oneDNN: conv, pooling, bn, matmul on CPU
  libopenblas-dev                    # reference side of GEMM tests; BLAS of trainer/fid.h
  liblapacke-dev                     # trainer/fid.h: eigendecompositions (OpenBLAS's LAPACK)
  libopenmpi-dev openmpi-bin         # collective/ mpi backend, launcher
  libucx-dev                         # collective/ ucx backend
  liblmdb-dev                        # dataio/ LMDB source
  libturbojpeg0-dev libjpeg62-turbo-dev  # dataio/ JPEG decode
  libzstd-dev                        # shards and checkpoints
  libjansson-dev                     # KPLRecord METADATA, JSON summaries, COCO JSON
  libxml2-dev                        # dataio/ Pascal VOC annotations
  zlib1g-dev                         # gzip-compressed IDX files
  libyaml-dev                        # recipes
  libprotobuf-c-dev protobuf-c-compiler  # ONNX export
  libpng-dev
  libcmocka-dev                      # unit tests
  python3-numpy python3-pil          # tests: segmentation metrics recomputed with numpy
  python3-scipy                      # tests and bench: FID as pytorch-fid computes it (sqrtm)
  iproute2 util-linux                # launcher tests: two "hosts" as network namespaces
  dataset-fashion-mnist              # the default recipe's data
)
bench_packages=(python3-numpy python3-torch python3-pil python3-pip)
# clang's libFuzzer and sanitizer runtimes live in libclang-rt-14-dev; with
# clang, OpenMP is LLVM's libomp (omp.h and libomp.so).  GNU ld links them.
fuzz_packages=(clang-14 libclang-rt-14-dev libomp-14-dev)

want=("${packages[@]}")
bench=0
for arg in "$@"; do
  case "$arg" in
    --bench) want+=("${bench_packages[@]}"); bench=1 ;;
    --fuzz) want+=("${fuzz_packages[@]}") ;;
    *) echo "setup: unknown option $arg (want --bench, --fuzz)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${want[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
if ((${#missing[@]} == 0)); then
  echo "setup: all ${#want[@]} packages present"
else
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # A fresh machine has no package lists yet; refresh them once when an install
  # is needed (and retry once after a refresh if the lists are stale).
  if ! $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"; then
    $SUDO apt-get update -q
    $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
fi

# onnx and onnxruntime (the ONNX export test, tests/trainer/onnx_check.py;
# skipped without them): PyPI's wheels, pinned to versions built for
# Debian 12's numpy 1.24 (newer ones pull numpy 2, which breaks Debian's
# torch and scipy).
if ! /usr/bin/python3 -c 'import onnx, onnxruntime' 2>/dev/null; then
  echo "setup: installing onnx and onnxruntime (pip) for /usr/bin/python3"
  $SUDO /usr/bin/python3 -m pip install -q --break-system-packages "numpy<2" \
    "onnx==1.16.2" "onnxruntime==1.19.2" ||
    echo "setup: warning: pip could not install onnx/onnxruntime; the ONNX test will be skipped" >&2
fi

# pycocotools (COCO mAP, the reference of trainer/cocoeval.h): PyPI's wheel
# for Debian's python3 and its numpy; pip leaves an installed numpy alone.
if ((bench)) && ! /usr/bin/python3 -c 'import pycocotools.cocoeval' 2>/dev/null; then
  echo "setup: installing pycocotools (pip) for /usr/bin/python3"
  $SUDO /usr/bin/python3 -m pip install -q --break-system-packages pycocotools
fi
