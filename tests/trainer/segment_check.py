#!/usr/bin/env python3
"""segment_check.py PRED_DIR GT_DIR CLASSES IGNORE METRICS_LINE

Recomputes a segmentation evaluation with numpy from the predicted masks
kpl saved (task.segmentation.save_predictions: PRED_DIR/<stem>.png) and
the ground-truth masks (GT_DIR/<stem>.png): the confusion matrix over
every pixel whose label is not IGNORE, then mIoU (classes that occur in
neither the labels nor the predictions left out, as mmsegmentation's
nanmean), pixel accuracy and mean class accuracy.  They must equal the
val_miou, val_aacc and val_macc of METRICS_LINE (a JSON line kpl printed)
to 1e-9.  Exit 0 when they agree, 1 when not, without numpy or PIL
77 (a skip) or 1 (ref_missing.py)."""
import json
import os
import sys

try:
    import numpy as np
    from PIL import Image
except ImportError as e:  # a machine without the test packages
    from ref_missing import missing
    missing("segment_check", f"numpy/PIL for /usr/bin/python3 ({e})")


def main():
    pred_dir, gt_dir, classes, ignore, line = sys.argv[1:6]
    classes, ignore = int(classes), int(ignore)
    got = json.loads(line)
    conf = np.zeros((classes, classes), dtype=np.int64)
    stems = sorted(os.path.splitext(f)[0] for f in os.listdir(pred_dir) if f.endswith(".png"))
    if not stems:
        print("segment_check: no predictions in", pred_dir)
        return 1
    for stem in stems:
        pred = np.asarray(Image.open(os.path.join(pred_dir, stem + ".png")))
        gt = np.asarray(Image.open(os.path.join(gt_dir, stem + ".png")))
        if pred.shape != gt.shape:
            print(f"segment_check: {stem}: prediction {pred.shape}, labels {gt.shape}")
            return 1
        keep = gt != ignore
        g, p = gt[keep].astype(np.int64), pred[keep].astype(np.int64)
        if g.size and (g.max() >= classes or p.max() >= classes):
            print(f"segment_check: {stem}: a value past {classes - 1}")
            return 1
        conf += np.bincount(g * classes + p, minlength=classes * classes).reshape(classes, classes)
    tp = np.diag(conf).astype(np.float64)
    rows, cols = conf.sum(1).astype(np.float64), conf.sum(0).astype(np.float64)
    union = rows + cols - tp
    with np.errstate(invalid="ignore", divide="ignore"):
        iou, acc = tp / union, tp / rows
    want = {"val_miou": np.nanmean(iou), "val_aacc": tp.sum() / rows.sum(),
            "val_macc": np.nanmean(acc)}
    bad = 0
    for k, v in want.items():
        ok = abs(got[k] - v) <= 1e-9
        print(f"{k}: kpl {got[k]:.12f} numpy {v:.12f} over {len(stems)} images {'ok' if ok else 'DIFFERS'}")
        bad |= not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
