#!/usr/bin/env python3
"""cocoeval_ref.py — pycocotools' COCOeval as the reference for kpl's
(trainer/cocoeval.h, docs/cocoeval.md).

  cocoeval_ref.py gen OUTDIR [--seed S] [--cases N] [--scale X]
      writes N random awkward cases: NAME.gt.json (COCO instances),
      NAME.dt.json (COCO results) and NAME.expected.json (pycocotools'
      twelve figures as {"AP": ..., "ARl": ...}).  The committed cases of
      tests/trainer/data/cocoeval/ were made by
        /usr/bin/python3 tests/trainer/cocoeval_ref.py gen tests/trainer/data/cocoeval --seed 27
  cocoeval_ref.py eval GT.json DT.json [--time]
      pycocotools' figures for two files as one JSON line; --time adds the
      seconds of loading ("load_s") and of evaluate+accumulate+summarize
      ("eval_s") (bench/bench_cocoeval.c reads them).
  cocoeval_ref.py live KPL [--seed S] [--cases N]
      fresh random cases checked live: `KPL data cocoeval` against
      pycocotools; exit 0 when every figure agrees to 1e-3, 1 otherwise,
      without pycocotools 77 (a skip) or 1 (ref_missing.py).

Awkward on purpose: crowd regions, images without ground truth or without
detections, more than 100 detections on an image, ties in score,
categories absent from the detections or from the ground truth,
non-contiguous ids, areas on the range boundaries (32^2, 96^2), boxes
copied from the ground truth and jittered around the IoU thresholds,
objects annotated twice (equal IoUs: the later box wins), empty
and negative widths, detections of unknown categories and annotations of
unknown images (both skipped by pycocotools), an annotation with id 0, 60
categories (more precision entries than numpy sums in one block).

pycocotools' loadRes fails on an empty results list (it reads the first
entry); for that case the detections are given to COCOeval as an empty
COCO object, which is what an empty list means.
"""
import argparse
import contextlib
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time

NAMES = ["AP", "AP50", "AP75", "APs", "APm", "APl",
         "AR1", "AR10", "AR100", "ARs", "ARm", "ARl"]


def pycocotools_stats(gt_path, dt_path, timing=False):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    with contextlib.redirect_stdout(io.StringIO()):
        t0 = time.perf_counter()
        gt = COCO(gt_path)
        with open(dt_path) as f:
            dets = json.load(f)
        if dets:
            dt = gt.loadRes(dets)
        else:
            dt = COCO()
            dt.dataset = {"images": list(gt.dataset["images"]),
                          "categories": list(gt.dataset["categories"]),
                          "annotations": []}
            dt.createIndex()
        t1 = time.perf_counter()
        e = COCOeval(gt, dt, "bbox")
        e.evaluate()
        e.accumulate()
        e.summarize()
        t2 = time.perf_counter()
    out = {k: float(v) for k, v in zip(NAMES, e.stats)}
    if timing:
        out["load_s"] = t1 - t0
        out["eval_s"] = t2 - t1
    return out


def rbox(rng, big=False):
    """x, y, w, h over three decades of size (small, medium, large)."""
    s = rng.choice([4, 16, 30, 32, 60, 96, 150, 300]) if not big else rng.choice([150, 300])
    w = max(1.0, s * rng.uniform(0.5, 1.5))
    h = max(1.0, s * rng.uniform(0.5, 1.5))
    if rng.random() < 0.5:
        w, h = float(round(w)), float(round(h))
    else:
        w, h = round(w, 1), round(h, 1)
    return [round(rng.uniform(0, 400), 1), round(rng.uniform(0, 400), 1), w, h]


def jitter(rng, b, amount):
    x, y, w, h = b
    dx, dy = rng.uniform(-amount, amount) * w, rng.uniform(-amount, amount) * h
    sw, sh = 1 + rng.uniform(-amount, amount), 1 + rng.uniform(-amount, amount)
    return [round(x + dx, 2), round(y + dy, 2), round(w * sw, 2), round(h * sh, 2)]


def make_case(rng, kind, scale):
    n_img = max(1, int(rng.randint(3, 14) * scale))
    n_cat = rng.randint(1, 6)
    if kind == "many_cats":  # over 8192 precision entries: numpy sums them in blocks
        n_img, n_cat = max(1, int(16 * scale)), 60
    img_ids = rng.sample(range(1, 10**6), n_img)
    cat_ids = rng.sample(range(1, 200), n_cat)
    images = [{"id": i, "width": 640, "height": 480} for i in img_ids]
    if kind == "dup_images":
        images.append(dict(images[0]))  # listed twice: one image
    rng.shuffle(images)
    cats = [{"id": c, "name": "c%d" % c} for c in cat_ids]
    rng.shuffle(cats)
    gt_cats = cat_ids if kind != "cat_without_gt" else cat_ids[1:] or cat_ids
    det_cats = cat_ids if kind != "cat_without_dets" else cat_ids[:1]
    anns, dets = [], []
    next_id = 0 if kind == "id_zero" else rng.randint(1, 1000)
    for img in img_ids:
        n_gt = rng.choice([0, 0, 1, 2, 3, 5, 8] if kind != "many_cats" else [6, 10])
        gts = []
        for _ in range(n_gt):
            crowd = rng.random() < (0.4 if kind == "crowd" else 0.08)
            b = rbox(rng, big=crowd)
            area = b[2] * b[3]
            r = rng.random()
            if r < 0.1:
                area = rng.choice([32 * 32, 96 * 96])  # on a range boundary
            elif r < 0.6:
                area = round(area * rng.uniform(0.4, 1.0), 2)  # a mask inside its box
            a = {"id": next_id, "image_id": img, "category_id": rng.choice(gt_cats),
                 "bbox": b, "area": area, "iscrowd": int(crowd)}
            next_id += rng.randint(1, 3)
            gts.append(a)
            if rng.random() < 0.06:  # annotated twice: IoU ties between boxes
                twin = dict(a, id=next_id, area=rng.choice([a["area"], 32 * 32, 96 * 96]))
                next_id += 1
                gts.append(twin)
        anns += gts
        if rng.random() < 0.15:
            continue  # an image without detections
        ties = kind == "ties" or rng.random() < 0.2

        def score():
            s = rng.random()
            return round(s, 1) if ties else round(s, 4)

        for g in gts:
            for _ in range(rng.choice([0, 1, 1, 2, 3])):
                r = rng.random()
                b = list(g["bbox"]) if r < 0.15 else jitter(rng, g["bbox"], rng.choice([0.05, 0.1, 0.2, 0.35]))
                c = g["category_id"] if rng.random() < 0.85 else rng.choice(cat_ids)
                if c in det_cats:
                    dets.append({"image_id": img, "category_id": c, "bbox": b, "score": score()})
        n_fp = rng.randint(0, 6)
        if kind == "many_dets" and img == img_ids[0]:
            n_fp = 140  # over the 100 per image and category
        for _ in range(n_fp):
            c = rng.choice(det_cats) if kind != "many_dets" or img != img_ids[0] else det_cats[0]
            b = rbox(rng)
            if rng.random() < 0.03:
                b[2] = 0.0 if rng.random() < 0.5 else -b[2]  # empty or negative width
            dets.append({"image_id": img, "category_id": c, "bbox": b, "score": score()})
    if kind == "unknown_ids":
        # skipped by pycocotools: detections of an unknown category,
        # annotations of an unknown image or category
        dets.append({"image_id": img_ids[0], "category_id": 999, "bbox": [1, 2, 30, 40],
                     "score": 0.9})
        anns.append({"id": next_id + 1, "image_id": 10**7, "category_id": cat_ids[0],
                     "bbox": [1, 2, 30, 40], "area": 1200, "iscrowd": 0})
        anns.append({"id": next_id + 2, "image_id": img_ids[0], "category_id": 999,
                     "bbox": [1, 2, 30, 40], "area": 1200, "iscrowd": 0})
    if kind == "empty_dets":
        dets = []
    rng.shuffle(anns)
    if kind != "ties":
        rng.shuffle(dets)
    return {"images": images, "categories": cats, "annotations": anns}, dets


KINDS = ["plain", "crowd", "ties", "many_dets", "empty_dets", "cat_without_dets",
         "cat_without_gt", "unknown_ids", "id_zero", "dup_images", "plain", "crowd",
         "many_cats"]


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, separators=(",", ":"))
        f.write("\n")


def gen(outdir, seed, ncases, scale):
    rng = random.Random(seed)
    os.makedirs(outdir, exist_ok=True)
    names = []
    for i in range(ncases):
        kind = KINDS[i % len(KINDS)]
        name = "case%02d_%s" % (i, kind)
        gt, dets = make_case(rng, kind, scale)
        gp, dp = os.path.join(outdir, name + ".gt.json"), os.path.join(outdir, name + ".dt.json")
        write_json(gp, gt)
        write_json(dp, dets)
        write_json(os.path.join(outdir, name + ".expected.json"), pycocotools_stats(gp, dp))
        names.append(name)
    return names


def live(kpl, seed, ncases):
    try:
        import pycocotools.cocoeval  # noqa: F401
    except ImportError:
        from ref_missing import missing
        missing("cocoeval_ref", "pycocotools for /usr/bin/python3")
    worst, exact, total = 0.0, 0, 0
    with tempfile.TemporaryDirectory() as d:
        names = gen(d, seed, ncases, 3.0)
        for name in names:
            want = json.load(open(os.path.join(d, name + ".expected.json")))
            r = subprocess.run([kpl, "data", "cocoeval", os.path.join(d, name + ".gt.json"),
                                os.path.join(d, name + ".dt.json")], capture_output=True, text=True)
            if r.returncode != 0:
                print("%s: kpl data cocoeval failed (%d): %s" % (name, r.returncode, r.stderr))
                return 1
            got = json.loads(r.stdout)
            for k in NAMES:
                diff = abs(got[k] - want[k])
                worst = max(worst, diff)
                exact += got[k] == want[k]
                total += 1
                if diff > 1e-3:
                    print("%s: %s = %r, pycocotools %r" % (name, k, got[k], want[k]))
    print("cocoeval_ref: %d cases (seed %d), %d of %d figures bit-equal to pycocotools, "
          "largest difference %.3g" % (ncases, seed, exact, total, worst))
    return 0 if worst <= 1e-3 else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen")
    g.add_argument("outdir")
    g.add_argument("--seed", type=int, default=27)
    g.add_argument("--cases", type=int, default=len(KINDS))
    g.add_argument("--scale", type=float, default=1.0)
    e = sub.add_parser("eval")
    e.add_argument("gt")
    e.add_argument("dt")
    e.add_argument("--time", action="store_true")
    lv = sub.add_parser("live")
    lv.add_argument("kpl")
    lv.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    lv.add_argument("--cases", type=int, default=2 * len(KINDS))
    a = p.parse_args()
    if a.cmd == "gen":
        for n in gen(a.outdir, a.seed, a.cases, a.scale):
            print(n)
        return 0
    if a.cmd == "eval":
        print(json.dumps(pycocotools_stats(a.gt, a.dt, a.time)))
        return 0
    return live(a.kpl, a.seed, a.cases)


if __name__ == "__main__":
    sys.exit(main())
