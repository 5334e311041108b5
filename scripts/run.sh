#!/usr/bin/env bash
# The main job on a fresh Debian 12 machine: install what kpl needs, build
# it, and train the default recipe — a small CNN on Debian's Fashion-MNIST
# (converted to KPLRecord under data/ on first use), 5 epochs, to >= 91%
# test top-1.  The run directory lands in runs/; the last line printed is
# the JSON summary.  Extra arguments go to `kpl train` (e.g. epochs=1).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh" --train-only
"$root/scripts/build.sh"
kpl="${BUILD_DIR:-$root/build}/bin/kpl"
cd "$root"
"$kpl" --version
exec "$kpl" train recipes/fashion_mnist/cnn.yaml "$@"
