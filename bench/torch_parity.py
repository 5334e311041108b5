#!/usr/bin/python3
"""PyTorch side of bench_parity (bench/run.sh parity): trains the network
kpl trained, from kpl's initial weights, on the very batches kpl's
trainer got from its loader (after the transform, augmentation included),
with the learning rate kpl used at each step; then evaluates its own final
weights and kpl's with one evaluator.

  torch_parity.py fcos|unet DIR KEY=VALUE...

DIR is what bench_parity wrote: init.bin and kpl_final.bin (the weights,
"p:<param>" and "b:<buffer>"), train.bin ("t:<step>:<part>") and val.bin
("v:<batch>:<part>"), parts image, boxes, labels, nboxes, mask,
image_size; and run/metrics.jsonl, kpl's log of every step (its losses
and learning rate).  Every file: "KPLPAR1", then entries: u32 name length,
name, u32 ndim, ndim x i64 dims, f32 data.

The optimizer: AdamW (decoupled decay, bias correction per parameter) with
betas, eps, wd; no decay on parameters of at most one dimension when
no_decay=1 (kpl's optimizer.no_decay_bn_bias); the gradients' global norm
clipped to clip when clip > 0, before the step.

KEY=VALUE: threads betas eps wd no_decay clip [control], and the network's:
  fcos: depth width fpn classes levels convs groups ranges (lo,hi per
        level) radius alpha gamma score_thresh topk nms_iou max_dets
  unet: model in_channels classes width depth upsample ignore

Prints on stdout, one line each:
  META torch=<version> isa=<ATen's CPU capability>
  STEP <i> kpl=<kpl's loss> torch=<this side's loss> lr=<lr>      (i from 0)
  EVAL weights=kpl metric=<AP or mIoU> second=<AP50 or pixel accuracy>
  EVAL weights=torch metric=<..> second=<..> seconds=<training seconds>
With control=1, then the control: PyTorch again from init.bin with every
weight moved by about one unit in the last place (x (1 +- 2^-23)), on the
same batches: how far two runs part that differ only in rounding.
  CTL <i> loss=<loss>
  EVAL weights=control metric=<..> second=<..>
"""
import contextlib
import json
import math
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_fcos  # noqa: E402
import torch_segnets  # noqa: E402

MAGIC = b"KPLPAR1"


def entries(path):
    """(name, tensor) of a KPLPAR1 file, in order, read as they come."""
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            sys.exit(f"torch_parity: {path} is not a {MAGIC.decode()} file")
        while True:
            head = f.read(4)
            if not head:
                return
            (ln,) = struct.unpack("<I", head)
            name = f.read(ln).decode()
            (nd,) = struct.unpack("<I", f.read(4))
            dims = struct.unpack(f"<{nd}q", f.read(8 * nd))
            n = math.prod(dims)
            raw = f.read(4 * n)
            if len(raw) != 4 * n:
                sys.exit(f"torch_parity: {path}: entry {name} is cut short")
            yield name, torch.from_numpy(np.frombuffer(raw, "<f4").copy()).reshape(dims)


def batches(path, prefix):
    """The batches of a train.bin or val.bin: dicts of parts, in order."""
    cur, at = {}, None
    for name, t in entries(path):
        p, i, part = name.split(":")
        if p != prefix:
            sys.exit(f"torch_parity: {path}: entry {name} is not a '{prefix}' batch")
        if at is not None and int(i) != at:
            yield cur
            cur = {}
        at = int(i)
        cur[part] = t
    if cur:
        yield cur


def load_weights(model, path):
    """kpl's weights into model; every name and shape must match."""
    got = {k[2:]: v for k, v in entries(path) if k[:2] in ("p:", "b:")}
    want = {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
    diff = torch_segnets.state_diff(want, got)
    if diff:
        sys.exit(f"torch_parity: {path}: state dicts differ: {diff}")
    model.load_state_dict(got, strict=False)
    return model


def cpu_capability():
    """ATen's CPU kernels' ISA (AVX2, AVX512, DEFAULT)."""
    for line in torch.__config__.show().splitlines():
        if "CPU capability usage:" in line:
            return line.split(":", 1)[1].strip()
    return "unknown"


def kpl_log(run_dir):
    """kpl's loss and learning rate at each step, from its metrics.jsonl."""
    loss, lr = [], []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("event") == "train":
                if r["step"] != len(loss) + 1:
                    sys.exit(f"torch_parity: metrics.jsonl: step {r['step']} after "
                             f"{len(loss)}: log.every_steps must be 1")
                loss.append(r["loss"])
                lr.append(r["lr"])
    return loss, lr


# ---- the cases ---------------------------------------------------------------------------------

class Fcos:
    def __init__(self, kv):
        self.kv = kv
        levels = int(kv["levels"])
        r = [float(v) for v in kv["ranges"].split(",")]
        self.strides = [8 << l for l in range(levels)]
        self.cfg = {"strides": self.strides, "lo": r[0::2], "hi": r[1::2],
                    "radius": float(kv["radius"]), "alpha": float(kv["alpha"]),
                    "gamma": float(kv["gamma"])}

    def model(self):
        kv = self.kv
        return torch_fcos.FCOS(int(kv["depth"]), int(kv["fpn"]), int(kv["classes"]),
                               int(kv["levels"]), int(kv["convs"]), int(kv["groups"]),
                               int(kv["width"]))

    def loss(self, model, b):
        cls_o, reg_o, ctr_o = model(b["image"])
        losses, _ = torch_fcos.fcos_loss(self.cfg, cls_o, reg_o, ctr_o, b["boxes"],
                                         b["labels"].long(), b["nboxes"].long())
        return losses[0] + losses[1] + losses[2]

    def detect(self, model, b):
        """kpl's evaluation decoding (trainer/tasks/detect.c): per level,
        sqrt(sigmoid(class) x sigmoid(centerness)) above score_thresh at
        locations inside the image, the level's topk best; boxes decoded,
        clipped to the image; class-wise NMS; the max_dets best."""
        import torchvision
        kv = self.kv
        thresh, topk = float(kv["score_thresh"]), int(kv["topk"])
        iou, max_dets = float(kv["nms_iou"]), int(kv["max_dets"])
        with torch.no_grad():
            cls_o, reg_o, ctr_o = model(b["image"])
        out = []
        for i in range(b["image"].shape[0]):
            h, w = (float(v) for v in b["image_size"][i])
            boxes, scores, labels = [], [], []
            for l, s in enumerate(self.strides):
                C, H, W = cls_o[l].shape[1:]
                q = torch.arange(H * W)
                px, py = (s * (q % W) + s // 2).double(), (s * (q // W) + s // 2).double()
                inside = (px < w) & (py < h)
                sc = torch.sqrt(torch.sigmoid(cls_o[l][i].reshape(C, -1).double()) *
                                torch.sigmoid(ctr_o[l][i].reshape(1, -1).double()))
                sc = sc * inside
                k, loc = torch.nonzero(sc > thresh, as_tuple=True)
                val = sc[k, loc]
                if val.numel() > topk:
                    val, order = torch.sort(val, descending=True, stable=True)
                    val, k, loc = val[:topk], k[order[:topk]], loc[order[:topk]]
                r = reg_o[l][i].reshape(4, -1)[:, loc].double()
                x, y = px[loc], py[loc]
                bx = torch.stack([x - r[0], y - r[1], x + r[2], y + r[3]], 1)
                bx[:, 0::2] = bx[:, 0::2].clamp(0, w)
                bx[:, 1::2] = bx[:, 1::2].clamp(0, h)
                boxes.append(bx.float()), scores.append(val.float()), labels.append(k)
            boxes, scores, labels = torch.cat(boxes), torch.cat(scores), torch.cat(labels)
            keep = torchvision.ops.batched_nms(boxes, scores, labels, iou)[:max_dets]
            out.append((boxes[keep], scores[keep], labels[keep]))
        return out

    def evaluate(self, model, val_path):
        """AP and AP50 by pycocotools, the ground truth the batches' boxes."""
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
        model.eval()
        images, anns, dets = [], [], []
        classes = int(self.kv["classes"])
        for b in batches(val_path, "v"):
            for i, (bx, sc, lab) in enumerate(self.detect(model, b)):
                img = len(images) + 1
                h, w = (int(v) for v in b["image_size"][i])
                images.append({"id": img, "height": h, "width": w})
                for j in range(int(b["nboxes"][i])):
                    x0, y0, x1, y1 = (float(v) for v in b["boxes"][i, j])
                    anns.append({"id": len(anns) + 1, "image_id": img, "iscrowd": 0,
                                 "category_id": int(b["labels"][i, j]) + 1,
                                 "bbox": [x0, y0, x1 - x0, y1 - y0], "area": (x1 - x0) * (y1 - y0)})
                for (x0, y0, x1, y1), s, c in zip(bx.tolist(), sc.tolist(), lab.tolist()):
                    dets.append({"image_id": img, "category_id": c + 1, "score": s,
                                 "bbox": [x0, y0, x1 - x0, y1 - y0]})
        if not dets:
            return 0.0, 0.0
        gt = COCO()
        gt.dataset = {"images": images, "annotations": anns,
                      "categories": [{"id": c + 1, "name": str(c)} for c in range(classes)]}
        with contextlib.redirect_stdout(sys.stderr):
            gt.createIndex()
            ev = COCOeval(gt, gt.loadRes(dets), "bbox")
            ev.evaluate()
            ev.accumulate()
            ev.summarize()
        return float(ev.stats[0]), float(ev.stats[1])


class Unet:
    def __init__(self, kv):
        self.kv = kv
        self.ignore = int(kv["ignore"])

    def model(self):
        return torch_segnets.build_model(self.kv)

    def loss(self, model, b):
        return torch_segnets.seg_loss(model(b["image"]), b["mask"].long(), 0.0)

    def evaluate(self, model, val_path):
        """mIoU over the classes that occur in the labels or the
        predictions, and pixel accuracy, from the confusion matrix of the
        pixels inside each image not labelled `ignore`."""
        model.eval()
        C = int(self.kv["classes"])
        conf = torch.zeros(C * C, dtype=torch.int64)
        for b in batches(val_path, "v"):
            with torch.no_grad():
                pred = model(b["image"])[0].argmax(1)
            lab = b["mask"].long()
            for i in range(lab.shape[0]):
                h, w = (int(v) for v in b["image_size"][i])
                li, pi = lab[i, :h, :w], pred[i, :h, :w]
                ok = li != self.ignore
                conf += torch.bincount(li[ok] * C + pi[ok], minlength=C * C)
        conf = conf.reshape(C, C).double()
        tp = conf.diag()
        union = conf.sum(0) + conf.sum(1) - tp
        iou = tp[union > 0] / union[union > 0]
        return float(iou.mean()), float(tp.sum() / conf.sum())


def train(task, model, d, lrs, kv, tag, kpl_loss=None):
    """model trained on train.bin's batches with kpl's learning rates;
    prints a line per step; returns the seconds it took."""
    no_decay = kv["no_decay"] == "1"
    groups = [{"params": [p for p in model.parameters() if not (no_decay and p.ndim <= 1)],
               "weight_decay": float(kv["wd"])},
              {"params": [p for p in model.parameters() if no_decay and p.ndim <= 1],
               "weight_decay": 0.0}]
    b1, b2 = (float(v) for v in kv["betas"].split(","))
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lrs[0] if lrs else 0,
                            betas=(b1, b2), eps=float(kv["eps"]))
    clip = float(kv["clip"])
    t0 = time.perf_counter()
    n = 0
    for i, b in enumerate(batches(os.path.join(d, "train.bin"), "t")):
        if i >= len(lrs):
            sys.exit(f"torch_parity: train.bin has more batches than kpl's {len(lrs)} steps")
        model.train()
        loss = task.loss(model, b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for g in opt.param_groups:
            g["lr"] = lrs[i]
        opt.step()
        if kpl_loss is not None:
            print(f"STEP {i} kpl={kpl_loss[i]:.9g} torch={loss.item():.9g} lr={lrs[i]:.9g}",
                  flush=True)
        else:
            print(f"{tag} {i} loss={loss.item():.9g}", flush=True)
        n += 1
    if n != len(lrs):
        sys.exit(f"torch_parity: train.bin has {n} batches, kpl took {len(lrs)} steps")
    return time.perf_counter() - t0


def perturbed(model, seed):
    """model with every parameter and buffer multiplied by 1 +- 2^-23 (about
    one unit in the last place of f32), signs drawn from seed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_floating_point():
                sign = torch.randint(0, 2, t.shape, generator=g).to(t.dtype) * 2 - 1
                t.mul_(1 + sign * 2.0 ** -23)
    return model


def main():
    if len(sys.argv) < 3 or sys.argv[1] not in ("fcos", "unet"):
        sys.exit(__doc__)
    case, d = sys.argv[1], sys.argv[2]
    kv = dict(a.partition("=")[::2] for a in sys.argv[3:])
    torch.set_num_threads(int(kv["threads"]))
    torch.manual_seed(0)
    print(f"META torch={torch.__version__} isa={cpu_capability()}", flush=True)
    task = Fcos(kv) if case == "fcos" else Unet(kv)
    kpl_loss, lrs = kpl_log(os.path.join(d, "run"))
    init = os.path.join(d, "init.bin")
    val = os.path.join(d, "val.bin")

    model = load_weights(task.model(), init)
    seconds = train(task, model, d, lrs, kv, "STEP", kpl_loss)
    mine = task.evaluate(model, val)
    kpls = task.evaluate(load_weights(task.model(), os.path.join(d, "kpl_final.bin")), val)
    print(f"EVAL weights=kpl metric={kpls[0]:.9g} second={kpls[1]:.9g}", flush=True)
    print(f"EVAL weights=torch metric={mine[0]:.9g} second={mine[1]:.9g} seconds={seconds:.3f}",
          flush=True)
    if kv.get("control", "0") == "1":
        ctl = perturbed(load_weights(task.model(), init), 1)
        train(task, ctl, d, lrs, kv, "CTL")
        c = task.evaluate(ctl, val)
        print(f"EVAL weights=control metric={c[0]:.9g} second={c[1]:.9g}", flush=True)


if __name__ == "__main__":
    main()
