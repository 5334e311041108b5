#!/usr/bin/python3
"""PyTorch CPU reference for bench_fcos (bench/run.sh fcos): FCOS with a
ResNet backbone, the same network and losses as kpl's zoo model "fcos"
(trainer/nn/fcos.c, kpl_nn_fpn, kpl_nn_fcos_head) and kpl__fcos_loss,
written by hand: torchvision is not installed here.

  torch_fcos.py check FILE KEY=VALUE... kpl_out=OUT
      Loads the weights and inputs bench_fcos wrote to FILE (every name
      and shape must match this module tree), runs one forward in training
      mode and the three losses, compares the head's outputs with kpl's
      (OUT), and prints
        CHECK names=<n> positives=<n> loss_cls=<v> loss_box=<v> loss_ctr=<v>
              out_max_abs=<v> out_max_rel=<v>
  torch_fcos.py time FILE KEY=VALUE... train=W,S infer8=W,S infer1=W,S
      Times S training steps after W warm-up ones (zero_grad, forward, the
      losses with target assignment, backward, SGD), then inference
      (evaluation mode, no grad) at batch 8 and batch 1; prints medians:
        TRAIN ms=<step> fwd=<ms> loss=<ms> bwd=<ms> step=<ms> last=<3 losses>
      (last: the losses of the last step, W + S steps from the file's
      weights)
        INFER b=8 ms=<ms>
        INFER b=1 ms=<ms>
  torch_fcos.py mem FILE KEY=VALUE... steps=S
      Runs S training steps and prints the process's peak resident memory,
      and its growth over the resident memory once the model, batch and
      optimizer were made (the peak reset there through
      /proc/self/clear_refs):
        MEM peak_rss=<bytes> base_rss=<bytes> growth=<bytes>
KEY=VALUE: threads classes depth fpn levels convs groups ranges (lo,hi per
level) radius alpha gamma lr momentum wd.

FILE: "KPLFCOS1", then entries: u32 name length, name, u32 ndim, ndim x
i64 dims, f32 data.  Names "p:<param>", "b:<buffer>", "in:<input>",
"out:<output>".
"""
import math
import statistics
import struct
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_segnets import reset_peak_rss, rss_bytes  # shared helpers


def read_entries(path):
    data = open(path, "rb").read()
    if data[:8] != b"KPLFCOS1":
        sys.exit(f"torch_fcos: {path} is not a KPLFCOS1 file")
    off, out = 8, {}
    while off < len(data):
        (ln,) = struct.unpack_from("<I", data, off)
        off += 4
        name = data[off:off + ln].decode()
        off += ln
        (nd,) = struct.unpack_from("<I", data, off)
        off += 4
        dims = struct.unpack_from(f"<{nd}q", data, off)
        off += 8 * nd
        n = math.prod(dims)
        out[name] = torch.from_numpy(np.frombuffer(data, "<f4", n, off).copy()).reshape(dims)
        off += 4 * n
    return out


# ---- the network ----------------------------------------------------------------------------

class BasicBlock(nn.Module):
    def __init__(self, cin, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or cin != planes:
            self.downsample = nn.Sequential(nn.Conv2d(cin, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (self.downsample(x) if self.downsample is not None else x))


class Backbone(nn.Module):
    """torchvision's ResNet-18/34 up to layer4 (ImageNet stem); returns
    layer2..layer4 (C3..C5)."""

    def __init__(self, depth, width=64):
        super().__init__()
        counts = {18: [2, 2, 2, 2], 34: [3, 4, 6, 3]}[depth]
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = width
        for s in range(4):
            blocks = []
            for k in range(counts[s]):
                blocks.append(BasicBlock(cin, width << s, 2 if s > 0 and k == 0 else 1))
                cin = width << s
            setattr(self, f"layer{s + 1}", nn.Sequential(*blocks))
        self.channels = [width * 2, width * 4, width * 8]

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        c2 = self.layer1(x)
        c3 = self.layer2(c2)
        c4 = self.layer3(c3)
        return [c3, c4, self.layer4(c4)]


class Extra(nn.Module):
    def __init__(self, ch, n):
        super().__init__()
        self.n = n
        for j in range(n):
            setattr(self, f"p{6 + j}", nn.Conv2d(ch, ch, 3, 2, 1))


class FPN(nn.Module):
    """kpl_nn_fpn (torchvision's FeaturePyramidNetwork names), extra levels
    from P5's output with a ReLU between them."""

    def __init__(self, in_chs, out, extra):
        super().__init__()
        self.inner_blocks = nn.ModuleList([nn.Conv2d(c, out, 1) for c in in_chs])
        self.layer_blocks = nn.ModuleList([nn.Conv2d(out, out, 3, 1, 1) for _ in in_chs])
        self.extra_blocks = Extra(out, extra) if extra else None

    def forward(self, xs):
        last = self.inner_blocks[-1](xs[-1])
        res = [self.layer_blocks[-1](last)]
        for i in range(len(xs) - 2, -1, -1):
            lat = self.inner_blocks[i](xs[i])
            last = lat + F.interpolate(last, size=lat.shape[-2:], mode="nearest")
            res.insert(0, self.layer_blocks[i](last))
        if self.extra_blocks is not None:
            src = res[-1]
            for j in range(self.extra_blocks.n):
                src = getattr(self.extra_blocks, f"p{6 + j}")(src if j == 0 else F.relu(src))
                res.append(src)
        return res


def tower(ch, convs, groups):
    layers = []
    for _ in range(convs):
        layers += [nn.Conv2d(ch, ch, 3, 1, 1), nn.GroupNorm(groups, ch, eps=1e-5), nn.ReLU()]
    return nn.Sequential(*layers)


class Head(nn.Module):
    """kpl_nn_fcos_head: GN towers, class logits, l t r b = relu(pred x
    scale) x stride, centerness on the regression tower."""

    def __init__(self, ch, classes, levels, convs, groups, strides):
        super().__init__()
        self.cls_tower = tower(ch, convs, groups)
        self.bbox_tower = tower(ch, convs, groups)
        self.cls_logits = nn.Conv2d(ch, classes, 3, 1, 1)
        self.bbox_pred = nn.Conv2d(ch, 4, 3, 1, 1)
        self.centerness = nn.Conv2d(ch, 1, 3, 1, 1)
        self.scales = nn.Parameter(torch.ones(levels))
        self.strides = strides

    def forward(self, feats):
        cls, reg, ctr = [], [], []
        for l, x in enumerate(feats):
            c, b = self.cls_tower(x), self.bbox_tower(x)
            cls.append(self.cls_logits(c))
            reg.append(F.relu(self.bbox_pred(b) * self.scales[l:l + 1]) * self.strides[l])
            ctr.append(self.centerness(b))
        return cls, reg, ctr


class FCOS(nn.Module):
    def __init__(self, depth, fpn, classes, levels, convs, groups, width=64):
        super().__init__()
        self.strides = [8 << l for l in range(levels)]
        self.backbone = Backbone(depth, width)
        self.fpn = FPN(self.backbone.channels, fpn, levels - 3)
        self.head = Head(fpn, classes, levels, convs, groups, self.strides)

    def forward(self, x):
        return self.head(self.fpn(self.backbone(x)))


# ---- the losses (kpl__fcos_loss; mmdetection's FCOS) ------------------------------------------

def points_of(shapes, strides, los, his, device):
    """Every level's locations (x, y) = (s j + s // 2, s i + s // 2),
    level by level, row-major; and each location's stride, lo and hi."""
    pts, st, lo, hi = [], [], [], []
    for (h, w), s, a, b in zip(shapes, strides, los, his):
        ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device),
                                indexing="ij")
        pts.append(torch.stack([xs * s + s // 2, ys * s + s // 2], -1).reshape(-1, 2))
        n = h * w
        st.append(torch.full((n,), float(s)))
        lo.append(torch.full((n,), float(a)))
        hi.append(torch.full((n,), float(b)))
    return torch.cat(pts).float(), torch.cat(st), torch.cat(lo), torch.cat(hi)


def assign(pts, pstride, plo, phi, boxes, labels, nboxes, radius, classes):
    """kpl__fcos_assign for the batch: a location is positive for a box it
    lies in (with radius > 0: in the box cut to radius x stride around its
    centre) whose largest distance from it is in the level's range; the
    least area wins.  Returns cls (N, P; classes = background), ltrb
    (N, P, 4), centerness (N, P), positive mask (N, P)."""
    n, nb, _ = boxes.shape
    x, y = pts[:, 0].view(1, -1, 1), pts[:, 1].view(1, -1, 1)
    x0, y0, x1, y1 = (boxes[..., k].unsqueeze(1) for k in range(4))  # (N, 1, B)
    dl, dt, dr, db = x - x0, y - y0, x1 - x, y1 - y  # (N, P, B)
    valid = (torch.arange(nb).view(1, 1, -1) < nboxes.view(-1, 1, 1)) & (x1 > x0) & (y1 > y0)
    if radius > 0:
        r = (pstride * radius).view(1, -1, 1)
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        bx0, by0 = torch.maximum(cx - r, x0), torch.maximum(cy - r, y0)
        bx1, by1 = torch.minimum(cx + r, x1), torch.minimum(cy + r, y1)
        inside = torch.minimum(torch.minimum(x - bx0, y - by0), torch.minimum(bx1 - x, by1 - y))
    else:
        inside = torch.minimum(torch.minimum(dl, dt), torch.minimum(dr, db))
    reach = torch.maximum(torch.maximum(dl, dt), torch.maximum(dr, db))
    ok = (inside > 0) & (reach >= plo.view(1, -1, 1)) & (reach <= phi.view(1, -1, 1)) & valid
    area = ((x1 - x0) * (y1 - y0)).expand_as(ok)
    best_area, best = torch.where(ok, area, torch.full_like(area, math.inf)).min(dim=2)
    pos = torch.isfinite(best_area)
    cls = torch.where(pos, labels.gather(1, best), torch.full_like(best, classes))
    d = torch.stack([dl, dt, dr, db], -1)  # (N, P, B, 4)
    ltrb = d.gather(2, best.view(n, -1, 1, 1).expand(-1, -1, 1, 4)).squeeze(2)
    ltrb = torch.where(pos.unsqueeze(-1), ltrb, torch.zeros_like(ltrb))
    l, t, r_, b = ltrb.unbind(-1)
    ctr = torch.sqrt(torch.minimum(l, r_) / torch.maximum(l, r_) *
                     (torch.minimum(t, b) / torch.maximum(t, b)))
    ctr = torch.where(pos, ctr, torch.zeros_like(ctr))
    return cls, ltrb, ctr, pos


def giou(p, t, eps=1e-6):
    """GIoU of aligned boxes (x0, y0, x1, y1), as mmdetection's
    bbox_overlaps(mode="giou")."""
    ap = (p[:, 2] - p[:, 0]) * (p[:, 3] - p[:, 1])
    at = (t[:, 2] - t[:, 0]) * (t[:, 3] - t[:, 1])
    wh = (torch.minimum(p[:, 2:], t[:, 2:]) - torch.maximum(p[:, :2], t[:, :2])).clamp(min=0)
    inter = wh[:, 0] * wh[:, 1]
    union = (ap + at - inter).clamp(min=eps)
    ewh = (torch.maximum(p[:, 2:], t[:, 2:]) - torch.minimum(p[:, :2], t[:, :2])).clamp(min=0)
    enclose = (ewh[:, 0] * ewh[:, 1]).clamp(min=eps)
    return inter / union - (enclose - union) / enclose


def fcos_loss(cfg, cls_o, reg_o, ctr_o, boxes, labels, nboxes):
    """The three losses: sigmoid focal / N+, centerness-weighted GIoU /
    sum of centerness targets, centerness BCE / N+ (N+ at least 1).
    Returns the losses and N+."""
    n, classes = cls_o[0].shape[0], cls_o[0].shape[1]
    shapes = [tuple(o.shape[-2:]) for o in cls_o]
    pts, pstride, plo, phi = points_of(shapes, cfg["strides"], cfg["lo"], cfg["hi"], boxes.device)
    cls_t, ltrb_t, ctr_t, pos = assign(pts, pstride, plo, phi, boxes, labels, nboxes,
                                       cfg["radius"], classes)
    flat = lambda os, c: torch.cat([o.permute(0, 2, 3, 1).reshape(n, -1, c) for o in os], 1)
    cls_p, reg_p, ctr_p = flat(cls_o, classes), flat(reg_o, 4), flat(ctr_o, 1).squeeze(-1)
    npos = int(pos.sum())
    norm = max(npos, 1)
    # sigmoid focal loss (torchvision's / mmdetection's formula)
    onehot = F.one_hot(cls_t, classes + 1)[..., :classes].to(cls_p.dtype)
    prob = torch.sigmoid(cls_p)
    ce = F.binary_cross_entropy_with_logits(cls_p, onehot, reduction="none")
    p_t = prob * onehot + (1 - prob) * (1 - onehot)
    a_t = cfg["alpha"] * onehot + (1 - cfg["alpha"]) * (1 - onehot)
    loss_cls = (a_t * ce * (1 - p_t) ** cfg["gamma"]).sum() / norm
    # GIoU of the decoded boxes, weighted by the centerness targets
    xy = pts.unsqueeze(0).expand(n, -1, -1)[pos]
    rp, rt, ct = reg_p[pos], ltrb_t[pos], ctr_t[pos]
    decode = lambda d: torch.cat([xy - d[:, :2], xy + d[:, 2:]], 1)
    loss_box = (ct * (1 - giou(decode(rp), decode(rt)))).sum() / ct.sum().clamp(min=1e-6)
    loss_ctr = F.binary_cross_entropy_with_logits(ctr_p[pos], ct, reduction="sum") / norm
    return (loss_cls, loss_box, loss_ctr), npos


# ---- main -----------------------------------------------------------------------------------

def parse(argv):
    kv = {}
    for a in argv:
        k, _, v = a.partition("=")
        kv[k] = v
    return kv


def build(path, kv):
    levels = int(kv["levels"])
    model = FCOS(int(kv["depth"]), int(kv["fpn"]), int(kv["classes"]), levels, int(kv["convs"]),
                 int(kv["groups"]))
    ent = read_entries(path)
    sd = model.state_dict()
    want = {k: v for k, v in sd.items() if not k.endswith("num_batches_tracked")}
    got = {k[2:]: v for k, v in ent.items() if k[:2] in ("p:", "b:")}
    bad = [f"{k}: kpl {tuple(got[k].shape)}, torch {tuple(want[k].shape)}"
           for k in got if k in want and got[k].shape != want[k].shape]
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if bad or missing or extra:
        sys.exit(f"torch_fcos: state dicts differ: shapes {bad}; only in torch {missing}; "
                 f"only in kpl {extra}")
    params = dict(model.named_parameters())
    for k in (k for k in ent if k.startswith("p:")):
        if k[2:] not in params:
            sys.exit(f"torch_fcos: kpl's parameter {k[2:]} is a buffer here")
    model.load_state_dict(got, strict=False)
    r = [float(v) for v in kv["ranges"].split(",")]
    cfg = {"strides": model.strides, "lo": r[0::2], "hi": r[1::2], "radius": float(kv["radius"]),
           "alpha": float(kv["alpha"]), "gamma": float(kv["gamma"])}
    if len(cfg["lo"]) != levels:
        sys.exit("torch_fcos: ranges do not give lo,hi per level")
    inputs = (ent["in:images"], ent["in:boxes"], ent["in:labels"].long(), ent["in:nboxes"].long())
    return model, cfg, inputs, len(got)


def timed_runs(fn, warm, steps):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(steps):
        ts.append(fn())
    return ts


def main():
    if len(sys.argv) < 3 or sys.argv[1] not in ("check", "time", "mem"):
        sys.exit(__doc__)
    mode, path, kv = sys.argv[1], sys.argv[2], parse(sys.argv[3:])
    torch.set_num_threads(int(kv["threads"]))
    torch.manual_seed(0)
    model, cfg, (images, boxes, labels, nboxes), names = build(path, kv)
    model.train()
    if mode == "check":
        with torch.no_grad():
            cls_o, reg_o, ctr_o = model(images)
            (lc, lb, lr), npos = fcos_loss(cfg, cls_o, reg_o, ctr_o, boxes, labels, nboxes)
        kout = read_entries(kv["kpl_out"])
        amax, rmax = 0.0, 0.0
        for kind, outs in (("cls", cls_o), ("reg", reg_o), ("ctr", ctr_o)):
            for l, o in enumerate(outs):
                k = kout[f"out:{kind}.{l}"]
                if k.shape != o.shape:
                    sys.exit(f"torch_fcos: output {kind}.{l}: kpl {tuple(k.shape)}, "
                             f"torch {tuple(o.shape)}")
                d = float((k - o).abs().max())
                amax = max(amax, d)
                rmax = max(rmax, d / max(float(o.abs().max()), 1e-12))
        print(f"CHECK names={names} positives={npos} loss_cls={lc.item():.9g} "
              f"loss_box={lb.item():.9g} loss_ctr={lr.item():.9g} out_max_abs={amax:.6g} "
              f"out_max_rel={rmax:.6g}", flush=True)
        return
    opt = torch.optim.SGD(model.parameters(), lr=float(kv["lr"]), momentum=float(kv["momentum"]),
                          weight_decay=float(kv["wd"]))
    opt.zero_grad(set_to_none=True)

    def step():
        t0 = time.perf_counter()
        cls_o, reg_o, ctr_o = model(images)
        t1 = time.perf_counter()
        losses, _ = fcos_loss(cfg, cls_o, reg_o, ctr_o, boxes, labels, nboxes)
        total = losses[0] + losses[1] + losses[2]
        vals = [v.item() for v in losses]
        t2 = time.perf_counter()
        total.backward()
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        if not all(math.isfinite(v) for v in vals):
            sys.exit(f"torch_fcos: losses are not finite: {vals}")
        return [(t4 - t0) * 1e3, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3,
                (t4 - t3) * 1e3] + vals

    if mode == "mem":
        base = reset_peak_rss()
        for _ in range(int(kv["steps"])):
            step()
        peak = rss_bytes("VmHWM")
        print(f"MEM peak_rss={peak} base_rss={base} growth={peak - base}", flush=True)
        return
    w, s = (int(v) for v in kv["train"].split(","))
    ts = timed_runs(step, w, s)
    med = [statistics.median(t[i] for t in ts) for i in range(5)]
    print(f"TRAIN ms={med[0]:.3f} fwd={med[1]:.3f} loss={med[2]:.3f} bwd={med[3]:.3f} "
          f"step={med[4]:.3f} last={ts[-1][5]:.6g},{ts[-1][6]:.6g},{ts[-1][7]:.6g}", flush=True)
    model.eval()
    for b, key in ((8, "infer8"), (1, "infer1")):
        x = images[:b].contiguous()

        def infer():
            t0 = time.perf_counter()
            with torch.no_grad():
                model(x)
            return (time.perf_counter() - t0) * 1e3

        w, s = (int(v) for v in kv[key].split(","))
        print(f"INFER b={b} ms={statistics.median(timed_runs(infer, w, s)):.3f}", flush=True)


if __name__ == "__main__":
    main()
