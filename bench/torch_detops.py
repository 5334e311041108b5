#!/usr/bin/python3
"""PyTorch CPU references for bench_detops (bench/run.sh detops).

torchvision is not installed on these machines, so its C++ ops
(torchvision.ops.nms, roi_align) are not available: the references are
PyTorch written from the definitions, the way a user without torchvision
would write them (and so are the rows' ref_name).

  torch_detops.py nms FILE N THR THREADS
      FILE holds N boxes (N, 4) then N scores, f32.  Greedy NMS as the
      classic vectorised loop (sort by score, keep the best, drop the rest
      with IoU > THR, repeat), eager and TorchScript; prints the faster:
        NMS ms=<median> kept=<count> impl=<eager|script>
  torch_detops.py roi FILE N C H W K OH OW SR SCALE ALIGNED THREADS
      FILE holds x (N, C, H, W), rois (K, 5), gy (K, C, OH, OW), f32.  ROI
      Align (torchvision's sampling, fixed sampling ratio SR) vectorised
      over every roi with gathers on a channels-last view; forward and
      backward (autograd) timed together; prints
        ROI ms=<median fwd+bwd> fwd_ms=<median fwd> sum=<sum of out> gsum=<sum of gx>
Each time is the median of 5 runs after one warm-up.
"""
import statistics
import sys
import time
from typing import List

import torch


def timed(fn, reps=5):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def nms_greedy(boxes, scores, thr: float):
    x1, y1, x2, y2 = boxes.unbind(1)
    areas = (x2 - x1) * (y2 - y1)
    order = torch.sort(scores, descending=True, stable=True)[1]
    keep: List[torch.Tensor] = []
    while order.numel() > 0:
        i = order[0]
        keep.append(i)
        rest = order[1:]
        iw = (torch.minimum(x2[rest], x2[i]) - torch.maximum(x1[rest], x1[i])).clamp(min=0)
        ih = (torch.minimum(y2[rest], y2[i]) - torch.maximum(y1[rest], y1[i])).clamp(min=0)
        inter = iw * ih
        iou = inter / (areas[i] + areas[rest] - inter)
        order = rest[iou <= thr]
    return torch.stack(keep) if len(keep) > 0 else order


nms_script = torch.jit.script(nms_greedy)


def bench_nms(path, n, thr):
    data = torch.from_file(path, size=5 * n, dtype=torch.float32)
    boxes, scores = data[:4 * n].reshape(n, 4).clone(), data[4 * n:].clone()
    with torch.no_grad():
        k1 = nms_greedy(boxes, scores, thr)
        k2 = nms_script(boxes, scores, thr)
        assert torch.equal(k1, k2), "eager and script disagree"
        te = timed(lambda: nms_greedy(boxes, scores, thr))
        ts = timed(lambda: nms_script(boxes, scores, thr))
    ms, impl = (te, "eager") if te <= ts else (ts, "script")
    print(f"NMS ms={ms:.4f} kept={k1.numel()} impl={impl}", flush=True)


def axis(c, size):
    """torchvision's bilinear_interpolate along one axis: neighbours,
    weights and validity of every coordinate in c."""
    valid = (c >= -1.0) & (c <= size)
    c = c.clamp(min=0)
    lo = c.floor().long().clamp(max=size - 1)
    end = lo >= size - 1
    hi = torch.where(end, lo, lo + 1)
    c = torch.where(end, lo.to(c.dtype), c)
    l = (c - lo) * valid
    h = (1 - (c - lo)) * valid
    return lo, hi, l, h


def roi_align(x, rois, oh: int, ow: int, scale: float, sr: int, aligned: bool):
    n, ch, hh, ww = x.shape
    k = rois.shape[0]
    off = 0.5 if aligned else 0.0
    b = rois[:, 0].long()
    x0, y0 = rois[:, 1] * scale - off, rois[:, 2] * scale - off
    rw, rh = rois[:, 3] * scale - off - x0, rois[:, 4] * scale - off - y0
    if not aligned:
        rw, rh = rw.clamp(min=1), rh.clamp(min=1)
    bh, bw = rh / oh, rw / ow
    iy = torch.arange(oh * sr, dtype=x.dtype)
    ix = torch.arange(ow * sr, dtype=x.dtype)
    ys = y0[:, None] + (iy // sr) * bh[:, None] + ((iy % sr) + 0.5) * bh[:, None] / sr
    xs = x0[:, None] + (ix // sr) * bw[:, None] + ((ix % sr) + 0.5) * bw[:, None] / sr
    ylo, yhi, ly, hy = axis(ys, hh)
    xlo, xhi, lx, hx = axis(xs, ww)
    flat = x.permute(0, 2, 3, 1).reshape(n * hh * ww, ch)  # channels last
    base = (b * hh * ww)[:, None, None]

    def at(yi, xi):
        return flat[base + yi[:, :, None] * ww + xi[:, None, :]]  # (K, Sy, Sx, C)

    w = lambda a, c: (a[:, :, None] * c[:, None, :])[..., None]
    val = (w(hy, hx) * at(ylo, xlo) + w(hy, lx) * at(ylo, xhi) + w(ly, hx) * at(yhi, xlo)
           + w(ly, lx) * at(yhi, xhi))
    out = val.reshape(k, oh, sr, ow, sr, ch).mean((2, 4))
    return out.permute(0, 3, 1, 2)


def bench_roi(path, n, c, h, w, k, oh, ow, sr, scale, aligned):
    sizes = [n * c * h * w, k * 5, k * c * oh * ow]
    data = torch.from_file(path, size=sum(sizes), dtype=torch.float32)
    x = data[:sizes[0]].reshape(n, c, h, w).clone().requires_grad_(True)
    rois = data[sizes[0]:sizes[0] + sizes[1]].reshape(k, 5).clone()
    gy = data[sizes[0] + sizes[1]:].reshape(k, c, oh, ow).clone()

    def fwd():
        with torch.no_grad():
            return roi_align(x, rois, oh, ow, scale, sr, aligned)

    def fwd_bwd():
        x.grad = None
        roi_align(x, rois, oh, ow, scale, sr, aligned).backward(gy)

    out = fwd()
    fwd_bwd()
    gsum = x.grad.sum().item()
    tf = timed(fwd)
    tb = timed(fwd_bwd)
    print(f"ROI ms={tb:.4f} fwd_ms={tf:.4f} sum={out.sum().item():.6e} gsum={gsum:.6e}",
          flush=True)


def main():
    what = sys.argv[1]
    if what == "nms":
        path, n, thr, threads = sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
        torch.set_num_threads(threads)
        bench_nms(path, n, thr)
    elif what == "roi":
        a = sys.argv[2:]
        torch.set_num_threads(int(a[11]))
        bench_roi(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]), int(a[5]), int(a[6]),
                  int(a[7]), int(a[8]), float(a[9]), a[10] == "1")
    else:
        sys.exit(f"torch_detops.py: unknown case {what}")


if __name__ == "__main__":
    main()
