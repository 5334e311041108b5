#!/usr/bin/env python3
"""tb_boxes_check.py EVENTS GT.json DETS.json N — the detection task's
TensorBoard images (val/detections_0 .. N-1 of the last evaluation in the
event file EVENTS) decoded and checked against the run: image k is
validation image k of GT.json (COCO), with its ground-truth boxes drawn in
green (0, 220, 0) and the detections of DETS.json (the same evaluation's
detections.json) scoring 0.3 or more, the 32 best, in red (255, 40, 40),
all in the drawn image's pixels (the files' boxes are the stored image's:
scaled to it).  Every expected box edge must be drawn (90% of its pixels in
its colour, red allowed over green, within a pixel), and 95% of the red
pixels must lie on an expected detection's edge.  Exit 0 when they agree,
1 with what differs."""
import io
import json
import sys

from PIL import Image

GREEN, RED = (0, 220, 0), (255, 40, 40)


def last_png(data, tag):
    at = data.rfind(tag.encode())
    if at < 0:
        sys.exit("no image tagged %s in the event file" % tag)
    start = data.find(b"\x89PNG", at)
    end = data.find(b"IEND", start)
    return Image.open(io.BytesIO(data[start:end + 8])).convert("RGB")


def edges(box, w, h):
    """The pixels draw_rect colours for box (x0, y0, x1, y1) in an h x w image."""
    x0, y0, x1, y1 = (int(min(max(v, 0), lim - 1)) for v, lim in zip(box, (w, h, w, h)))
    px = set()
    for x in range(x0, x1 + 1):
        px.add((x, y0)), px.add((x, y1))
    for y in range(y0, y1 + 1):
        px.add((x0, y)), px.add((x1, y))
    return px


def near(p, pixels):
    return any((p[0] + dx, p[1] + dy) in pixels for dx in (-1, 0, 1) for dy in (-1, 0, 1))


def main(events, gt_path, dets_path, n):
    data = open(events, "rb").read()
    gt = json.load(open(gt_path))
    dets = json.load(open(dets_path))
    bad = []
    for k in range(n):
        im = last_png(data, "val/detections_%d" % k)
        w, h = im.size
        info = gt["images"][k]
        sx, sy = info["width"] / w, info["height"] / h
        pix = im.load()
        want_green = [a["bbox"] for a in gt["annotations"] if a["image_id"] == info["id"]]
        mine = sorted((d for d in dets if d["image_id"] == info["id"]), key=lambda d: -d["score"])
        want_red = [d["bbox"] for d in mine if d["score"] >= 0.3][:32]
        red_edges = set()
        for colour, boxes in ((GREEN, want_green), (RED, want_red)):
            for b in boxes:
                # the stored image's pixels to the drawn (transformed) image's
                box = (b[0] / sx, b[1] / sy, (b[0] + b[2]) / sx, (b[1] + b[3]) / sy)
                e = edges(box, w, h)
                if colour == RED:
                    red_edges |= e
                ok = sum(near_colour(pix, p, colour, w, h) for p in e)
                if ok < 0.9 * len(e):
                    bad.append("image %d: %s box %s: %d of %d edge pixels drawn" %
                               (k, "ground-truth" if colour == GREEN else "detection",
                                [round(v, 1) for v in box], ok, len(e)))
        reds = [(x, y) for y in range(h) for x in range(w) if pix[x, y] == RED]
        stray = [p for p in reds if not near(p, red_edges)]
        if reds and len(stray) > 0.05 * len(reds):
            bad.append("image %d: %d of %d red pixels on no detection's edge (%d detections "
                       "drawn)" % (k, len(stray), len(reds), len(want_red)))
        print("image %d (%dx%d): %d ground-truth boxes, %d detections >= 0.3, %d red pixels"
              % (k, w, h, len(want_green), len(want_red), len(reds)))
    if bad:
        print("\n".join(bad))
        return 1
    return 0


def near_colour(pix, p, colour, w, h):
    """p or a neighbour within a pixel has colour (or red over green)."""
    allowed = (colour, RED) if colour == GREEN else (RED,)
    for dx in (-1, 0, 1):
        for dy in (-1, 0, 1):
            x, y = p[0] + dx, p[1] + dy
            if 0 <= x < w and 0 <= y < h and pix[x, y] in allowed:
                return True
    return False


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit("usage: tb_boxes_check.py EVENTS GT.json DETS.json N")
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
