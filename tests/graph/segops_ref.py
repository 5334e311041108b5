#!/usr/bin/python3
"""Reference numbers for the segmentation ops of graph/nn.c, from PyTorch:

    /usr/bin/python3 tests/graph/segops_ref.py > tests/graph/segops_ref.h

  - per-pixel cross entropy: F.cross_entropy on (N, C, H, W) logits with
    class weights, ignore_index 255 present, label smoothing, the three
    reductions; the loss and the logits' gradient (and one (N, C) case);
  - the soft Dice loss of mmsegmentation 0.x's DiceLoss (use_sigmoid off),
    with ignored pixels left out of both sums (see docs/nn.md): written
    here from its definition, and checked against mmseg's own formula on
    labels without ignored pixels, where the two agree;
  - bilinear resizing: F.interpolate(mode='bilinear', align_corners=False)
    up 7x5 -> 29x13 and down 29x13 -> 7x5 (PyTorch's downsampling without
    antialias), values and input gradients.

Inputs are rounded to f32 first, so that an f32 test feeds exactly the same
values; the references are computed in f64 from them.  The resize inputs
and output gradients are formulas the C test evaluates too (resize_input,
resize_seed), so only the results are kept.
"""
import math

import torch
import torch.nn.functional as F

torch.set_default_dtype(torch.float64)


def f32(t):
    return torch.as_tensor(t, dtype=torch.float64).float().double()


def c_doubles(name, t):
    vals = [repr(float(v)) for v in torch.as_tensor(t).flatten().tolist()]
    lines = []
    for i in range(0, len(vals), 4):
        lines.append("    " + ", ".join(vals[i:i + 4]) + ",")
    return f"static const double {name}[{len(vals)}] = {{\n" + "\n".join(lines) + "\n};\n"


def c_int64s(name, t):
    vals = [str(int(v)) for v in torch.as_tensor(t).flatten().tolist()]
    return f"static const int64_t {name}[{len(vals)}] = {{{', '.join(vals)}}};\n"


out = []
REDS = ["mean", "sum", "none"]

# ---- cross entropy ----------------------------------------------------------------------------

gen = torch.Generator().manual_seed(28)
N, C, H, W = 2, 4, 3, 5
logits = f32(torch.randn(N, C, H, W, generator=gen) * 2)
labels = torch.randint(0, C, (N, H, W), generator=gen)
labels[0, 0, 1] = 255
labels[0, 2, 4] = 255
labels[1, 1, 0] = 255
weight = f32(torch.tensor([0.5, 2.0, 1.0, 0.25]))
seed_none = f32(torch.randn(N, H, W, generator=gen))

out.append(f"#define CE_N {N}\n#define CE_C {C}\n#define CE_H {H}\n#define CE_W {W}\n")
out.append(c_doubles("CE_LOGITS", logits))
out.append(c_int64s("CE_LABELS", labels))
out.append(c_doubles("CE_WEIGHT", weight))
out.append(c_doubles("CE_SEED_NONE", seed_none))
cases = []
for wi, w in enumerate([None, weight]):
    for eps in [0.0, 0.1]:
        for red in REDS:
            x = logits.clone().requires_grad_(True)
            loss = F.cross_entropy(x, labels, weight=w, reduction=red, label_smoothing=eps,
                                   ignore_index=255)
            loss.backward(seed_none if red == "none" else torch.ones(()))
            name = f"CE_{'W' if wi else 'U'}{int(eps * 10)}_{red.upper()}"
            out.append(c_doubles(name + "_LOSS", loss.detach()))
            out.append(c_doubles(name + "_GRAD", x.grad))
            cases.append((name, wi, eps, red))
out.append("#define CE_CASES(X) \\\n" + " \\\n".join(
    f"    X({n}, {w}, {e}, KPL_REDUCE_{r.upper()})" for n, w, e, r in cases) + "\n")

# (N, C) rows with weights, smoothing and an ignored row
x2 = f32(torch.randn(5, 3, generator=gen))
l2 = torch.tensor([2, 0, 255, 1, 1])
w2 = f32(torch.tensor([1.5, 0.5, 3.0]))
out.append(c_doubles("CE2_LOGITS", x2))
out.append(c_int64s("CE2_LABELS", l2))
out.append(c_doubles("CE2_WEIGHT", w2))
x = x2.clone().requires_grad_(True)
loss = F.cross_entropy(x, l2, weight=w2, label_smoothing=0.2, ignore_index=255)
loss.backward()
out.append(c_doubles("CE2_LOSS", loss.detach()))
out.append(c_doubles("CE2_GRAD", x.grad))

# ---- Dice ------------------------------------------------------------------------------------


def dice_loss(x, lab, ignore, smooth, exponent, red):
    """Per sample: mean over classes (but ignore_index) of 1 - (2 sum(p t) + smooth)
    / (sum(p^e) + sum(t^e) + smooth) over the pixels that count."""
    p = F.softmax(x, dim=1)
    c = x.shape[1]
    valid = (lab != ignore).to(x.dtype).unsqueeze(1)
    t = F.one_hot(torch.where(lab == ignore, torch.zeros_like(lab), lab), c)
    t = t.permute(0, 3, 1, 2).to(x.dtype) * valid
    inter = (p * t).sum((2, 3))
    psum = (p.pow(exponent) * valid).sum((2, 3))
    tsum = t.pow(exponent).sum((2, 3))
    per = 1 - (2 * inter + smooth) / (psum + tsum + smooth)
    keep = torch.tensor([i != ignore for i in range(c)], dtype=x.dtype)
    per = (per * keep).sum(1) / c
    return {"mean": per.mean(), "sum": per.sum(), "none": per}[red]


def mmseg_dice(x, lab, ignore, smooth, exponent):
    """mmseg 0.x's DiceLoss(reduction='mean') as it computes it: the valid
    mask only in the numerator, clamped labels one-hot, per-class batch
    means summed and divided by C."""
    p = F.softmax(x, dim=1)
    c = x.shape[1]
    t = F.one_hot(lab.clamp(0, c - 1), c)
    valid = (lab != ignore).to(x.dtype)
    total = 0
    for i in range(c):
        if i == ignore:
            continue
        pi = p[:, i].reshape(x.shape[0], -1)
        ti = t[..., i].reshape(x.shape[0], -1).to(x.dtype)
        vi = valid.reshape(x.shape[0], -1)
        num = (pi * ti * vi).sum(1) * 2 + smooth
        den = (pi.pow(exponent) + ti.pow(exponent)).sum(1) + smooth
        total = total + (1 - num / den).mean()
    return total / c


clean = torch.where(labels == 255, torch.zeros_like(labels), labels)
no0 = clean.clamp(1, C - 1)
for s, e in [(1.0, 2.0), (0.5, 1.0)]:
    for lab, ig in [(clean, 255), (no0, 0)]:  # nothing ignored: the two agree
        a = dice_loss(logits, lab, ig, s, e, "mean")
        b = mmseg_dice(logits, lab, ig, s, e)
        assert abs(a - b) < 1e-12, (s, e, ig, a, b)
    # with ignored pixels mmseg still counts them in the denominator
    assert abs(dice_loss(logits, labels, 255, s, e, "mean") - mmseg_dice(logits, labels, 255, s, e)) > 1e-6

seed_dice = f32(torch.randn(N, generator=gen))
out.append(c_int64s("DICE_LABELS0", clean))  # ignore_index 0 case: no 255 left
out.append(c_doubles("DICE_SEED_NONE", seed_dice))
dcases = []
for k, (lab, labname, ig, s, e, red) in enumerate([
        (labels, "CE_LABELS", 255, 1.0, 2.0, "mean"),
        (labels, "CE_LABELS", 255, 1.0, 2.0, "none"),
        (labels, "CE_LABELS", 255, 0.5, 1.0, "sum"),
        (clean, "DICE_LABELS0", 0, 1.0, 2.0, "mean"),
        (labels, "CE_LABELS", 255, 1.0, 3.0, "none")]):
    x = logits.clone().requires_grad_(True)
    loss = dice_loss(x, lab, ig, s, e, red)
    loss.backward(seed_dice if red == "none" else torch.ones(()))
    name = f"DICE_{k}"
    out.append(c_doubles(name + "_LOSS", loss.detach()))
    out.append(c_doubles(name + "_GRAD", x.grad))
    dcases.append((name, labname, ig, s, e, red))
out.append("#define DICE_CASES(X) \\\n" + " \\\n".join(
    f"    X({n}, {l}, {i}, {s}, {e}, KPL_REDUCE_{r.upper()})" for n, l, i, s, e, r in dcases)
    + "\n")

# ---- bilinear resize -------------------------------------------------------------------------


def resize_input(h, w):
    i = torch.arange(h * w, dtype=torch.float64)
    return f32(torch.sin(0.37 * i) + 0.01 * i).reshape(1, 1, h, w)


def resize_seed(h, w):
    i = torch.arange(h * w, dtype=torch.float64)
    return f32(torch.cos(0.23 * i)).reshape(1, 1, h, w)


# name, input plane, output plane, align_corners: up and down both ways,
# one output row, a 1x1 input, one side kept and the other shrunk
rcases = [("UP", (7, 5), (29, 13), False), ("DOWN", (29, 13), (7, 5), False),
          ("UP_AC", (7, 5), (29, 13), True), ("DOWN_AC", (29, 13), (7, 5), True),
          ("ONE", (5, 4), (1, 3), False), ("ONE_AC", (5, 4), (1, 3), True),
          ("FROM1", (1, 1), (3, 4), False), ("MIXED", (6, 9), (6, 4), False)]
for name, (h, w), (oh, ow), ac in rcases:
    x = resize_input(h, w).requires_grad_(True)
    y = F.interpolate(x, size=(oh, ow), mode="bilinear", align_corners=ac)
    y.backward(resize_seed(oh, ow))
    out.append(c_doubles(f"RESIZE_{name}_Y", y.detach()))
    out.append(c_doubles(f"RESIZE_{name}_GX", x.grad))
out.append("#define RESIZE_CASES(X) \\\n" + " \\\n".join(
    f"    X({n}, {h}, {w}, {oh}, {ow}, {str(ac).lower()})" for n, (h, w), (oh, ow), ac in rcases)
    + "\n")

print("/* segops_ref.h — made by tests/graph/segops_ref.py (torch "
      f"{torch.__version__}); do not edit. */")
print("#include <stdint.h>\n")
print("\n".join(out))
