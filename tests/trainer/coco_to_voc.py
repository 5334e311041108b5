#!/usr/bin/env python3
"""coco_to_voc.py SRC VOC_ROOT VAL_GT.json — a Pascal VOC tree made from
`kpl data synth fmnist-det SRC` (SRC/<split>.json with SRC/<split>/*.jpg):
JPEGImages/<split>_<stem>.jpg, Annotations/<id>.xml (VOC's 1-based,
inclusive corners; Fashion-MNIST's class k named as VOC's class k; every
fourth object marked difficult) and ImageSets/Main/{train,val}.txt.  The
training list also gets an image whose only object is of no VOC class (a
bad annotation: data.convert.skip_bad) and one without objects
(data.convert.drop_empty).

VAL_GT.json: the validation split's ground truth as COCO JSON, read back
from the XML written here the way docs/detection-data.md says kpl reads
VOC (mmdetection's: each corner truncated, minus 1; difficult objects
ignored, as COCO ignores crowds), image ids the list's line numbers from
0 and category ids the VOC class numbers from 1 (the detection task's
for labels the records give no category id: label + 1): pycocotools on it
and on the run's detections.json must give the run's figures."""
import json
import math
import os
import shutil
import sys
import xml.etree.ElementTree as ET

VOC = ["aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
       "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa",
       "train", "tvmonitor"]


def write_xml(path, fname, w, h, objects):
    ann = ET.Element("annotation")
    ET.SubElement(ann, "filename").text = fname
    size = ET.SubElement(ann, "size")
    ET.SubElement(size, "width").text = str(w)
    ET.SubElement(size, "height").text = str(h)
    ET.SubElement(size, "depth").text = "3"
    for name, (x0, y0, x1, y1), difficult in objects:
        o = ET.SubElement(ann, "object")
        ET.SubElement(o, "name").text = name
        ET.SubElement(o, "difficult").text = str(difficult)
        bb = ET.SubElement(o, "bndbox")
        for k, v in zip(("xmin", "ymin", "xmax", "ymax"), (x0, y0, x1, y1)):
            ET.SubElement(bb, k).text = str(v)
    ET.ElementTree(ann).write(path)


def main(src, root, gt_out):
    for d in ("JPEGImages", "Annotations", "ImageSets/Main"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    for split in ("train", "val"):
        coco = json.load(open(os.path.join(src, split + ".json")))
        by_image = {}
        for a in coco["annotations"]:
            by_image.setdefault(a["image_id"], []).append(a)
        ids = []
        n = 0
        for im in coco["images"]:
            stem = os.path.splitext(im["file_name"])[0]
            vid = "%s_%s" % (split, stem)
            shutil.copy(os.path.join(src, split, im["file_name"]),
                        os.path.join(root, "JPEGImages", vid + ".jpg"))
            objects = []
            for a in by_image.get(im["id"], []):
                x, y, w, h = a["bbox"]
                # 1-based inclusive corners of the pixels [x, x + w)
                box = (int(x) + 1, int(y) + 1, int(x + w), int(y + h))
                objects.append((VOC[a["category_id"] - 1], box, int(n % 4 == 3)))
                n += 1
            write_xml(os.path.join(root, "Annotations", vid + ".xml"), vid + ".jpg",
                      im["width"], im["height"], objects)
            ids.append(vid)
        if split == "train":  # a bad annotation and an empty image, on copies of the first
            first = coco["images"][0]
            for vid, objects in (("train_bad", [("unicorn", (5, 5, 40, 40), 0)]),
                                 ("train_empty", [])):
                shutil.copy(os.path.join(src, split, first["file_name"]),
                            os.path.join(root, "JPEGImages", vid + ".jpg"))
                write_xml(os.path.join(root, "Annotations", vid + ".xml"), vid + ".jpg",
                          first["width"], first["height"], objects)
                ids.append(vid)
        with open(os.path.join(root, "ImageSets", "Main", split + ".txt"), "w") as f:
            f.write("".join(i + "\n" for i in ids))
    # the validation ground truth, read back from the XML
    images, anns = [], []
    for k, vid in enumerate(open(os.path.join(root, "ImageSets/Main/val.txt")).read().split()):
        ann = ET.parse(os.path.join(root, "Annotations", vid + ".xml")).getroot()
        w, h = int(ann.find("size/width").text), int(ann.find("size/height").text)
        images.append({"id": k, "file_name": "JPEGImages/%s.jpg" % vid, "width": w, "height": h})
        for o in ann.findall("object"):
            c = [math.trunc(float(o.find("bndbox/" + t).text)) - 1
                 for t in ("xmin", "ymin", "xmax", "ymax")]
            bw, bh = c[2] - c[0], c[3] - c[1]
            anns.append({"id": len(anns) + 1, "image_id": k,
                         "category_id": VOC.index(o.find("name").text) + 1,
                         "bbox": [c[0], c[1], bw, bh], "area": bw * bh,
                         "iscrowd": int(o.find("difficult").text)})
    cats = [{"id": k + 1, "name": n} for k, n in enumerate(VOC)]
    json.dump({"images": images, "annotations": anns, "categories": cats}, open(gt_out, "w"))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: coco_to_voc.py SRC VOC_ROOT VAL_GT.json")
    main(*sys.argv[1:])
