#!/usr/bin/env bash
# synth_pycocotools.sh KPL: pycocotools (PyPI; scripts/setup.sh installs it)
# reads a small fmnist-det set: its COCO API loads both JSON files, and for
# every annotation the area and box it computes from the RLE equal the ones
# kpl wrote.  Without Fashion-MNIST or pycocotools: tests/skip.sh's ref.
set -euo pipefail
kpl=$1
. "$(dirname "$0")/../skip.sh"
[[ -r /usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz ]] ||
  kpl_skip ref "Fashion-MNIST (dataset-fashion-mnist)"
/usr/bin/python3 -c 'import pycocotools' 2> /dev/null || kpl_skip ref "pycocotools for /usr/bin/python3"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$kpl" data synth fmnist-det "$tmp/s" --train 60 --val 20 --seed 3 --quiet > /dev/null
/usr/bin/python3 - "$tmp/s" <<'PY'
import sys
from pycocotools import mask as M
from pycocotools.coco import COCO
n = 0
for split in ("train", "val"):
    c = COCO("%s/%s.json" % (sys.argv[1], split))
    for a in c.loadAnns(c.getAnnIds()):
        r = a["segmentation"]
        assert int(M.area(r)) == a["area"], (split, a["id"], "area")
        assert [int(v) for v in M.toBbox(r)] == a["bbox"], (split, a["id"], "bbox")
        n += 1
assert n > 80, n
print("synth_pycocotools: %d annotations agree" % n)
PY
