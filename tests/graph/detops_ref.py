#!/usr/bin/python3
"""Reference numbers for the detection ops of graph/vision.h and the FPN of
trainer/layers.h, written from the papers' and torchvision's definitions
in plain PyTorch (torchvision is not needed and not used).

    /usr/bin/python3 tests/graph/detops_ref.py [OUT_DIR]

writes, with fixed seeds, into OUT_DIR (default: tests/graph/data beside
this script):
    roi_align.bin   ROI Align (He et al. 2017, torchvision.ops.roi_align's
                    sampling and edge rules): inputs, outputs, the input
                    gradient for a given output gradient
    focal_loss.bin  sigmoid focal loss (Lin et al. 2017,
                    torchvision.ops.sigmoid_focal_loss)
    box_coder.bin   FCOS's (l, t, r, b) distances and the (dx, dy, dw, dh)
                    deltas of torchvision's BoxCoder, encode and decode,
                    with decode's gradients
    fpn.bin         a feature pyramid (Lin et al. 2017; torchvision's
                    FeaturePyramidNetwork + LastLevelP6P7): its weights
                    under torchvision's names, inputs, outputs, gradients

Every number is f64.  Inputs are rounded to f32 first, so that an f32 test
feeds exactly the same values; the references are computed in f64 from
them.  The C tests (tests/graph/test_detops.c, tests/trainer/test_fpn.c)
read the files with tests/kpl_refdata.h.

File format (little-endian): the line "KPLTREF 1\n", then per tensor a
line "NAME NDIM D0 D1 ...\n" followed by D0*D1*... f64 values, and the
line "end\n" last.
"""
import math
import os
import struct
import sys

import torch
import torch.nn.functional as F

torch.set_default_dtype(torch.float64)


# ---- the file -------------------------------------------------------------------------------

class RefFile:
    def __init__(self):
        self.records = []

    def add(self, name, t):
        t = torch.as_tensor(t, dtype=torch.float64).detach().contiguous()
        assert " " not in name and name not in [n for n, _ in self.records], name
        self.records.append((name, t))

    def add_all(self, prefix, **tensors):
        for name, t in tensors.items():
            self.add(f"{prefix}.{name}", t)

    def write(self, path):
        with open(path, "wb") as f:
            f.write(b"KPLTREF 1\n")
            for name, t in self.records:
                dims = " ".join(str(d) for d in t.shape)
                f.write(f"{name} {t.dim()}{' ' if dims else ''}{dims}\n".encode())
                f.write(struct.pack(f"<{t.numel()}d", *t.flatten().tolist()))
            f.write(b"end\n")
        print(f"{path}: {len(self.records)} tensors, {os.path.getsize(path)} bytes")


def f32(t):
    """t rounded to the nearest f32, kept as f64."""
    return torch.as_tensor(t, dtype=torch.float64).float().double()


def close(a, b, tol, what):
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= tol, f"{what}: max error {err}"


# ---- ROI Align --------------------------------------------------------------------------------

def roi_geometry(roi, scale, oh, ow, sampling, aligned):
    """torchvision's per-roi quantities: start, bin size and sampling grid."""
    off = 0.5 if aligned else 0.0
    x0 = roi[1] * scale - off
    y0 = roi[2] * scale - off
    x1 = roi[3] * scale - off
    y1 = roi[4] * scale - off
    rw, rh = x1 - x0, y1 - y0
    if not aligned:  # the legacy version makes every roi at least 1 x 1
        rw, rh = max(rw, 1.0), max(rh, 1.0)
    bh, bw = rh / oh, rw / ow
    gh = sampling if sampling > 0 else math.ceil(rh / oh)
    gw = sampling if sampling > 0 else math.ceil(rw / ow)
    return y0, x0, bh, bw, gh, gw


def sample_coords(start, binsz, n, grid):
    return [start + p * binsz + (i + 0.5) * binsz / grid for p in range(n) for i in range(grid)]


def bilinear_axis(c, size):
    """One axis of torchvision's bilinear_interpolate: validity, the two
    neighbours and their weights (lo gets h, hi gets l)."""
    c = torch.tensor(c, dtype=torch.float64)
    valid = (c >= -1.0) & (c <= size)
    c = torch.where(c <= 0, torch.zeros_like(c), c)
    lo = torch.where(valid, c.floor(), torch.zeros_like(c)).long()
    end = lo >= size - 1
    lo = torch.where(end, torch.full_like(lo, size - 1), lo)
    hi = torch.where(end, lo, lo + 1)
    c = torch.where(end, lo.double(), c)
    l = torch.where(valid, c - lo, torch.zeros_like(c))
    return lo, hi, l, 1 - l, valid


def roi_align(x, rois, oh, ow, scale, sampling, aligned):
    """(K, C, oh, ow), differentiable in x (autograd through gathers)."""
    N, C, H, W = x.shape
    outs = []
    for roi in rois.tolist():
        y0, x0, bh, bw, gh, gw = roi_geometry(roi, scale, oh, ow, sampling, aligned)
        ylo, yhi, ly, hy, vy = bilinear_axis(sample_coords(y0, bh, oh, gh), H)
        xlo, xhi, lx, hx, vx = bilinear_axis(sample_coords(x0, bw, ow, gw), W)
        p = x[int(roi[0])]
        v1, v2 = p[:, ylo][:, :, xlo], p[:, ylo][:, :, xhi]
        v3, v4 = p[:, yhi][:, :, xlo], p[:, yhi][:, :, xhi]
        w1, w2 = hy[:, None] * hx[None, :], hy[:, None] * lx[None, :]
        w3, w4 = ly[:, None] * hx[None, :], ly[:, None] * lx[None, :]
        val = (w1 * v1 + w2 * v2 + w3 * v3 + w4 * v4) * (vy[:, None] & vx[None, :])
        out = val.reshape(C, oh, gh, ow, gw).sum((2, 4)) / max(gh * gw, 1)
        outs.append(out)
    return torch.stack(outs) if outs else x.new_zeros(0, C, oh, ow)


def roi_align_loop(x, rois, oh, ow, scale, sampling, aligned):
    """The same, one sample at a time as the definition reads: a check of
    the vectorised version above."""
    N, C, H, W = x.shape
    out = torch.zeros(rois.shape[0], C, oh, ow)

    def interp(p, y, xx):
        if y < -1.0 or y > H or xx < -1.0 or xx > W:
            return torch.zeros(C)
        y, xx = max(y, 0.0), max(xx, 0.0)
        yl, xl = int(y), int(xx)
        if yl >= H - 1:
            yl = yh = H - 1
            y = float(yl)
        else:
            yh = yl + 1
        if xl >= W - 1:
            xl = xh = W - 1
            xx = float(xl)
        else:
            xh = xl + 1
        ly, lx = y - yl, xx - xl
        hy, hx = 1 - ly, 1 - lx
        return (hy * hx * p[:, yl, xl] + hy * lx * p[:, yl, xh] + ly * hx * p[:, yh, xl]
                + ly * lx * p[:, yh, xh])

    for k, roi in enumerate(rois.tolist()):
        y0, x0, bh, bw, gh, gw = roi_geometry(roi, scale, oh, ow, sampling, aligned)
        p = x[int(roi[0])]
        for ph in range(oh):
            for pw in range(ow):
                acc = torch.zeros(C)
                for iy in range(gh):
                    for ix in range(gw):
                        acc += interp(p, y0 + ph * bh + (iy + 0.5) * bh / gh,
                                      x0 + pw * bw + (ix + 0.5) * bw / gw)
                out[k, :, ph, pw] = acc / max(gh * gw, 1)
    return out


def make_rois(g, n_img, himg, wimg, k):
    """k rois on a 1/64 pixel grid (exact in f32, and their differences
    too): random ones, then the awkward ones."""
    q = lambda v: round(v * 64) / 64
    rois = []
    for i in range(k):
        b = i % n_img
        xa = (torch.rand(1, generator=g).item() * 1.3 - 0.2) * wimg
        ya = (torch.rand(1, generator=g).item() * 1.3 - 0.2) * himg
        w = torch.rand(1, generator=g).item() * 0.8 * wimg
        h = torch.rand(1, generator=g).item() * 0.8 * himg
        rois.append([b, q(xa), q(ya), q(xa + w), q(ya + h)])
    last = n_img - 1
    rois += [
        [last, 0, 0, wimg, himg],                              # the whole image
        [0, q(-0.3 * wimg), q(-0.4 * himg), q(0.3 * wimg), q(0.2 * himg)],  # over the top left
        [last, q(0.5 * wimg), q(0.6 * himg), q(1.4 * wimg), q(1.3 * himg)],  # over the bottom right
        [0, q(0.4 * wimg), q(0.4 * himg), q(0.4 * wimg) + 0.25, q(0.4 * himg) + 0.125],  # tiny
        [last, q(0.3 * wimg), q(0.7 * himg), q(0.3 * wimg), q(0.7 * himg)],  # no area
        [0, 3 * wimg, 3 * himg, 4 * wimg, 5 * himg],          # outside: every sample is 0
        [last, q(-1.5 * wimg), 0, q(-0.5 * wimg), himg],      # outside on the left
    ]
    return torch.tensor(rois)


ROI_CASES = [
    # name, N, C, H, W, out_h, out_w, spatial_scale, sampling_ratio, aligned, random rois
    ("a", 2, 3, 10, 12, 3, 4, 0.5, 2, True, 6),
    ("b", 2, 2, 9, 7, 2, 2, 0.25, 0, False, 6),
    ("c", 1, 2, 6, 8, 5, 3, 1.0, -1, True, 5),
    ("d", 3, 2, 7, 9, 2, 3, 1.0 / 16, 3, False, 5),
]


def roi_align_file(out_dir):
    rf = RefFile()
    g = torch.Generator().manual_seed(20240527)
    for name, N, C, H, W, oh, ow, scale, sr, aligned, k in ROI_CASES:
        x = f32(torch.randn(N, C, H, W, generator=g)).requires_grad_(True)
        rois = make_rois(g, N, H / scale, W / scale, k)
        y = roi_align(x, rois, oh, ow, scale, sr, aligned)
        close(y, roi_align_loop(x.detach(), rois, oh, ow, scale, sr, aligned), 1e-13,
              f"roi_align {name}: vectorised vs one sample at a time")
        gy = f32(torch.randn(y.shape, generator=g))
        (gx,) = torch.autograd.grad(y, x, gy)
        rf.add_all(f"roi_align.{name}", params=[oh, ow, scale, sr, 1.0 if aligned else 0.0],
                   x=x, rois=rois, out=y, gy=gy, gx=gx)
    rf.write(os.path.join(out_dir, "roi_align.bin"))


# ---- sigmoid focal loss ------------------------------------------------------------------------

def focal_loss(z, y, alpha, gamma):
    """Per element: alpha_t (1 - p_t)^gamma CE(p, y), p = sigmoid(z).
    1 - p_t = y sigmoid(-z) + (1 - y) sigmoid(z): the same number as
    torchvision's 1 - (p y + (1 - p)(1 - y)), without its cancellation
    for large |z|; CE is the binary cross entropy of the logits."""
    ce = F.binary_cross_entropy_with_logits(z, y, reduction="none")
    q = y * torch.sigmoid(-z) + (1 - y) * torch.sigmoid(z)
    loss = ce * q ** gamma
    if alpha >= 0:
        loss = (alpha * y + (1 - alpha) * (1 - y)) * loss
    return loss


def focal_loss_torchvision_formula(z, y, alpha, gamma):
    """torchvision's formula as its source reads it (for moderate z)."""
    p = torch.sigmoid(z)
    ce = F.binary_cross_entropy_with_logits(z, y, reduction="none")
    p_t = p * y + (1 - p) * (1 - y)
    loss = ce * ((1 - p_t) ** gamma)
    if alpha >= 0:
        loss = (alpha * y + (1 - alpha) * (1 - y)) * loss
    return loss


FOCAL_CASES = [
    # name, alpha, gamma, soft targets
    ("a", 0.25, 2.0, False),
    ("b", -1.0, 2.0, False),
    ("c", 0.25, 0.5, False),
    ("d", 0.75, 0.0, False),
    ("e", 0.4, 1.5, True),
]


def focal_file(out_dir):
    rf = RefFile()
    g = torch.Generator().manual_seed(7)
    for name, alpha, gamma, soft in FOCAL_CASES:
        z = torch.randn(6, 9, generator=g) * 4
        # large logits of both signs against both targets
        z[5] = torch.tensor([30.0, -30.0, 100.0, -100.0, 200.0, -200.0, 0.0, 17.5, -17.5])
        z = f32(z).requires_grad_(True)
        y = (torch.rand(6, 9, generator=g) < 0.3).double()
        y[5] = torch.tensor([1.0, 1, 1, 1, 0, 0, 1, 0, 1])
        if soft:
            y[:3] = f32(torch.rand(3, 9, generator=g))
        loss = focal_loss(z, y, alpha, gamma)
        moderate = z.detach().abs() < 12
        close(loss[moderate], focal_loss_torchvision_formula(z, y, alpha, gamma)[moderate], 1e-12,
              f"focal {name}: stable vs torchvision's formula")
        gy = f32(torch.rand(loss.shape, generator=g) + 0.5)
        (gz,) = torch.autograd.grad(loss, z, gy, retain_graph=True)
        (gz_mean,) = torch.autograd.grad(loss.mean(), z)
        rf.add_all(f"focal.{name}", params=[alpha, gamma], logits=z, targets=y, loss=loss,
                   mean=loss.mean(), sum=loss.sum(), gy=gy, grad=gz, grad_mean=gz_mean)
    rf.write(os.path.join(out_dir, "focal_loss.bin"))


# ---- box coders -------------------------------------------------------------------------------

def ltrb_encode(points, boxes):
    px, py = points[:, 0], points[:, 1]
    return torch.stack([px - boxes[:, 0], py - boxes[:, 1], boxes[:, 2] - px, boxes[:, 3] - py], 1)


def ltrb_decode(points, d):
    px, py = points[:, 0], points[:, 1]
    return torch.stack([px - d[:, 0], py - d[:, 1], px + d[:, 2], py + d[:, 3]], 1)


def delta_encode(gt, anchors, w):
    """torchvision's BoxCoder.encode_single: gt relative to anchors."""
    aw, ah = anchors[:, 2] - anchors[:, 0], anchors[:, 3] - anchors[:, 1]
    ax, ay = anchors[:, 0] + 0.5 * aw, anchors[:, 1] + 0.5 * ah
    gw, gh = gt[:, 2] - gt[:, 0], gt[:, 3] - gt[:, 1]
    gx, gy = gt[:, 0] + 0.5 * gw, gt[:, 1] + 0.5 * gh
    return torch.stack([w[0] * (gx - ax) / aw, w[1] * (gy - ay) / ah,
                        w[2] * torch.log(gw / aw), w[3] * torch.log(gh / ah)], 1)


def delta_decode(d, anchors, w, clip):
    """torchvision's BoxCoder.decode_single: dw, dh clamped above at clip."""
    aw, ah = anchors[:, 2] - anchors[:, 0], anchors[:, 3] - anchors[:, 1]
    ax, ay = anchors[:, 0] + 0.5 * aw, anchors[:, 1] + 0.5 * ah
    dx, dy = d[:, 0] / w[0], d[:, 1] / w[1]
    dw = torch.clamp(d[:, 2] / w[2], max=clip)
    dh = torch.clamp(d[:, 3] / w[3], max=clip)
    cx, cy = dx * aw + ax, dy * ah + ay
    pw, ph = torch.exp(dw) * aw, torch.exp(dh) * ah
    return torch.stack([cx - 0.5 * pw, cy - 0.5 * ph, cx + 0.5 * pw, cy + 0.5 * ph], 1)


def rand_boxes(g, n, field, lo, hi):
    xy = torch.rand(n, 2, generator=g) * field
    wh = lo + torch.rand(n, 2, generator=g) * (hi - lo)
    return f32(torch.cat([xy, xy + wh], 1))


def box_coder_file(out_dir):
    rf = RefFile()
    g = torch.Generator().manual_seed(99)
    # (l, t, r, b): points inside and outside their boxes
    P = 9
    boxes = rand_boxes(g, P, 50, 2, 30)
    points = f32(torch.rand(P, 2, generator=g) * 70 - 5).requires_grad_(True)
    d = f32(torch.rand(P, 4, generator=g) * 20 - 2).requires_grad_(True)
    dec = ltrb_decode(points, d)
    gy = f32(torch.randn(dec.shape, generator=g))
    gp, gd = torch.autograd.grad(dec, (points, d), gy)
    rf.add_all("ltrb", points=points, boxes=boxes, encoded=ltrb_encode(points.detach(), boxes),
               ltrb=d, decoded=dec, gy=gy, grad_points=gp, grad_ltrb=gd)
    # (dx, dy, dw, dh), two coders
    for name, w, clip in [("a", (10.0, 10.0, 5.0, 5.0), math.log(1000.0 / 16)),
                          ("b", (1.0, 1.0, 1.0, 1.0), 2.0)]:
        n = 8
        anchors = rand_boxes(g, n, 100, 4, 60).requires_grad_(True)
        gt = rand_boxes(g, n, 100, 1, 80)
        d = f32(torch.randn(n, 4, generator=g) * torch.tensor([w[0], w[1], w[2], w[3]]) * 0.3)
        d[1, 2] = w[2] * (clip + 1.5)  # dw above the clip: no gradient through it
        d[2, 3] = w[3] * (clip + 0.25)
        d[3, 2] = -w[2] * 3            # far below: fine
        d.requires_grad_(True)
        dec = delta_decode(d, anchors, w, clip)
        gy = f32(torch.randn(dec.shape, generator=g))
        ga, gd = torch.autograd.grad(dec, (anchors, d), gy)
        enc = delta_encode(gt, anchors.detach(), w)
        close(delta_decode(enc, anchors.detach(), w, 1e9), gt, 1e-10, "delta round trip")
        rf.add_all(f"delta.{name}", params=list(w) + [clip], anchors=anchors, gt=gt, encoded=enc,
                   deltas=d, decoded=dec, gy=gy, grad_anchors=ga, grad_deltas=gd)
    rf.write(os.path.join(out_dir, "box_coder.bin"))


# ---- FPN --------------------------------------------------------------------------------------

def kaiming_uniform_a1(g, shape):
    """torch.nn.init.kaiming_uniform_(w, a=1): U(-sqrt(3 / fan_in), +)."""
    fan_in = shape[1] * shape[2] * shape[3]
    b = math.sqrt(3.0 / fan_in)
    return (torch.rand(shape, generator=g) * 2 - 1) * b


def fpn_params(g, in_ch, out, extra, from_input):
    """Parameters under torchvision's FeaturePyramidNetwork names (biases
    random here, 0 in torchvision's init, so that loading them is tested)."""
    ps = {}
    for i, c in enumerate(in_ch):
        ps[f"inner_blocks.{i}.weight"] = kaiming_uniform_a1(g, (out, c, 1, 1))
        ps[f"inner_blocks.{i}.bias"] = torch.rand(out, generator=g) - 0.5
    for i in range(len(in_ch)):
        ps[f"layer_blocks.{i}.weight"] = kaiming_uniform_a1(g, (out, out, 3, 3))
        ps[f"layer_blocks.{i}.bias"] = torch.rand(out, generator=g) - 0.5
    for j in range(extra):
        cin = in_ch[-1] if (j == 0 and from_input) else out
        ps[f"extra_blocks.p{6 + j}.weight"] = kaiming_uniform_a1(g, (out, cin, 3, 3))
        ps[f"extra_blocks.p{6 + j}.bias"] = torch.rand(out, generator=g) - 0.5
    return {k: f32(v).requires_grad_(True) for k, v in ps.items()}


def fpn_forward(ps, xs, extra, from_input):
    """torchvision's top-down path: lateral 1x1, nearest upsampling to the
    lateral's size, add, 3x3 output convs; then LastLevelP6P7: stride-2
    3x3 convs from P5 (or C5), relu between them."""
    n = len(xs)
    last = F.conv2d(xs[-1], ps[f"inner_blocks.{n - 1}.weight"], ps[f"inner_blocks.{n - 1}.bias"])
    outs = [F.conv2d(last, ps[f"layer_blocks.{n - 1}.weight"], ps[f"layer_blocks.{n - 1}.bias"],
                     padding=1)]
    for i in range(n - 2, -1, -1):
        lat = F.conv2d(xs[i], ps[f"inner_blocks.{i}.weight"], ps[f"inner_blocks.{i}.bias"])
        up = F.interpolate(last, size=lat.shape[-2:], mode="nearest")
        # kpl's nearest index is i * in // out: the same rows for these sizes
        hi = [r * last.shape[2] // lat.shape[2] for r in range(lat.shape[2])]
        wi = [c * last.shape[3] // lat.shape[3] for c in range(lat.shape[3])]
        close(up, last[:, :, hi][:, :, :, wi], 0, "nearest indices")
        last = lat + up
        outs.insert(0, F.conv2d(last, ps[f"layer_blocks.{i}.weight"], ps[f"layer_blocks.{i}.bias"],
                                padding=1))
    src = xs[-1] if from_input else outs[-1]
    for j in range(extra):
        src = F.conv2d(src if j == 0 else F.relu(src), ps[f"extra_blocks.p{6 + j}.weight"],
                       ps[f"extra_blocks.p{6 + j}.bias"], stride=2, padding=1)
        outs.append(src)
    return outs


FPN_CASES = [
    # name, in channels, out channels, input sizes (C3, C4, C5), extra levels, from C5
    ("a", (3, 5, 6), 4, ((9, 11), (5, 6), (3, 3)), 2, False),  # FCOS: P6, P7 from P5
    ("b", (2, 4, 7), 3, ((8, 8), (4, 4), (2, 2)), 2, True),    # RetinaNet: from C5
]


def fpn_file(out_dir):
    rf = RefFile()
    g = torch.Generator().manual_seed(31)
    for name, in_ch, out, sizes, extra, from_input in FPN_CASES:
        ps = fpn_params(g, in_ch, out, extra, from_input)
        xs = [f32(torch.randn(1, c, h, w, generator=g)).requires_grad_(True)
              for c, (h, w) in zip(in_ch, sizes)]
        outs = fpn_forward(ps, xs, extra, from_input)
        gys = [f32(torch.randn(o.shape, generator=g)) for o in outs]
        loss = sum((o * gy).sum() for o, gy in zip(outs, gys))
        names = list(ps)
        grads = torch.autograd.grad(loss, xs + [ps[k] for k in names])
        p = f"fpn.{name}"
        rf.add(f"{p}.params", [len(in_ch), *in_ch, out, extra, 1.0 if from_input else 0.0])
        for k in names:
            rf.add(f"{p}.param.{k}", ps[k])
        for i, x in enumerate(xs):
            rf.add(f"{p}.x{i}", x)
            rf.add(f"{p}.gx{i}", grads[i])
        for i, (o, gy) in enumerate(zip(outs, gys)):
            rf.add(f"{p}.out{i}", o)
            rf.add(f"{p}.gy{i}", gy)
        for k, gk in zip(names, grads[len(xs):]):
            rf.add(f"{p}.grad.{k}", gk)
    rf.write(os.path.join(out_dir, "fpn.bin"))


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(
        os.path.abspath(__file__)), "data")
    os.makedirs(out_dir, exist_ok=True)
    torch.set_num_threads(1)
    roi_align_file(out_dir)
    focal_file(out_dir)
    box_coder_file(out_dir)
    fpn_file(out_dir)


if __name__ == "__main__":
    main()
