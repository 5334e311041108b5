#!/usr/bin/env bash
# Installs every Debian package kpl needs to build, test and benchmark.
# Idempotent: packages already present are skipped, so a second run costs one
# dpkg query.  Run as root (or with sudo available).
#
#   scripts/setup.sh            build + test dependencies, with the reference tools
#                               the equivalence tests compare kpl against: numpy,
#                               scipy, PIL, PyTorch and torchvision (Debian) and
#                               pycocotools, onnx,
#                               onnxruntime (PyPI, for /usr/bin/python3); it fails
#                               when one cannot be installed, since the README's
#                               test command fails without them (tests/skip.sh)
#   scripts/setup.sh --train-only  only what building and training need (the
#                               main job, scripts/run.sh): no PyPI
#   scripts/setup.sh --bench    also the reference side of bench/ (PyTorch, which the
#                               default set has already)
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
  libzip-dev                         # kpl import torch: torch.save's zip archives
  libcmocka-dev                      # unit tests
  iproute2 util-linux                # launcher tests: two "hosts" as network namespaces
  dataset-fashion-mnist              # the default recipe's data
)
# the reference tools of the equivalence tests (and pip for PyPI's)
ref_packages=(
  python3-numpy python3-pil          # segmentation metrics recomputed with numpy
  python3-scipy                      # FID as pytorch-fid computes it (sqrtm)
  python3-pip                        # pycocotools, onnx, onnxruntime below
  python3-torch python3-torchvision  # kpl import torch/onnx: torchvision's ResNets' logits
)
bench_packages=()
# clang's libFuzzer and sanitizer runtimes live in libclang-rt-14-dev; with
# clang, OpenMP is LLVM's libomp (omp.h and libomp.so).  GNU ld links them.
fuzz_packages=(clang-14 libclang-rt-14-dev libomp-14-dev)

want=("${packages[@]}")
refs=1
for arg in "$@"; do
  case "$arg" in
    --train-only) refs=0 ;;
    --bench) want+=("${bench_packages[@]}") ;;
    --fuzz) want+=("${fuzz_packages[@]}") ;;
    *) echo "setup: unknown option $arg (want --train-only, --bench, --fuzz)" >&2; exit 2 ;;
  esac
done
if ((refs)); then want+=("${ref_packages[@]}"); fi

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

((refs)) || exit 0
# PyPI's reference tools for /usr/bin/python3, which Debian does not
# package: onnx and onnxruntime (the ONNX export test,
# tests/trainer/onnx_check.py), pinned to versions built for Debian 12's
# numpy 1.24 (newer ones pull numpy 2, which breaks Debian's torch and
# scipy); pycocotools (COCO mAP, the reference of trainer/cocoeval.h).  pip
# leaves an installed numpy alone.
if ! /usr/bin/python3 -c 'import onnx, onnxruntime, pycocotools.cocoeval' 2>/dev/null; then
  echo "setup: installing onnx, onnxruntime and pycocotools (pip) for /usr/bin/python3"
  if ! $SUDO /usr/bin/python3 -m pip install -q --break-system-packages "numpy<2" \
    "onnx==1.16.2" "onnxruntime==1.19.2" pycocotools; then
    echo "setup: error: pip could not install onnx, onnxruntime and pycocotools from PyPI;" \
      "the equivalence tests need them (scripts/setup.sh --train-only installs only what" \
      "training needs)" >&2
    exit 1
  fi
fi
