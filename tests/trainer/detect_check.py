#!/usr/bin/env python3
"""detect_check.py GT.json DETECTIONS.json FIGURES_JSON_LINE [IMAGES]

pycocotools' COCOeval (bbox) of a detection run's results file against the
COCO JSON its validation split was converted from, compared with the twelve
figures kpl reported (the "val_ap".. fields of a metrics.jsonl "eval" record,
or "ap".. of kpl eval's result line).  IMAGES: evaluate only the first N
images in ascending id (a run with data.val.limit=N).  Exit 0 when every
figure agrees to 1e-3, 1 otherwise; without pycocotools 77 (a skip) or 1 (ref_missing.py).
"""
import contextlib
import io
import json
import sys

try:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
except ImportError:
    from ref_missing import missing
    missing("detect_check", "pycocotools for /usr/bin/python3")

NAMES = ["ap", "ap50", "ap75", "aps", "apm", "apl", "ar1", "ar10", "ar100", "ars", "arm", "arl"]


def main():
    gt_path, dets_path, line = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(gt_path)
        ids = sorted(gt.getImgIds())
        if len(sys.argv) > 4:
            ids = ids[: int(sys.argv[4])]
        dets = json.load(open(dets_path))
        ev = COCOeval(gt, gt.loadRes(dets) if dets else COCO(), "bbox")
        ev.params.imgIds = ids
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    bad = 0
    for k, name in enumerate(NAMES):
        kpl = line.get("val_" + name, line.get(name))
        ref = float(ev.stats[k])
        ok = kpl is not None and abs(float(kpl) - ref) <= 1e-3
        print(f"{name:6s} kpl {kpl} pycocotools {ref:.6f}{'' if ok else '  <-- differs'}")
        bad |= not ok
    print(f"{len(dets)} detections, {len(ids)} images")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
