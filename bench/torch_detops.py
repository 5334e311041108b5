#!/usr/bin/python3
"""torchvision's C++ CPU kernels as the references of bench_detops
(bench/run.sh detops): the ops a detection user calls.

  torch_detops.py nms FILE N THR THREADS
      FILE holds N boxes (N, 4) then N scores, f32.
      torchvision.ops.nms; prints
        NMS ms=<median> kept=<count> impl=torchvision-<version>
  torch_detops.py bnms FILE N THR THREADS
      FILE holds N boxes (N, 4), N scores and N class indices (as f32).
      torchvision.ops.batched_nms (NMS within each class); prints
        BNMS ms=<median> kept=<count> impl=torchvision-<version>
  torch_detops.py roi FILE N C H W K OH OW SR SCALE ALIGNED THREADS
      FILE holds x (N, C, H, W), rois (K, 5), gy (K, C, OH, OW), f32.
      torchvision.ops.roi_align forward, and forward + backward (autograd,
      the output gradient gy) timed together; prints
        ROI ms=<median fwd+bwd> fwd_ms=<median fwd> sum=<sum of out> gsum=<sum of gx>
Each time is the median of 9 runs (5 for roi) after one warm-up, with
torch.set_num_threads(THREADS).  The kept indices are printed as a
checksum (their sum) for bench_detops to compare with kpl's.
"""
import statistics
import sys
import time

import torch
import torchvision
from torchvision.ops import batched_nms, nms, roi_align

IMPL = f"torchvision-{torchvision.__version__.split('+')[0]}"


def timed(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def load(path, sizes):
    data = torch.from_file(path, size=sum(sizes), dtype=torch.float32)
    out, off = [], 0
    for s in sizes:
        out.append(data[off:off + s].clone())
        off += s
    return out


def bench_nms(path, n, thr, classes):
    parts = load(path, [4 * n, n, n] if classes else [4 * n, n])
    boxes, scores = parts[0].reshape(n, 4), parts[1]
    with torch.no_grad():
        if classes:
            idxs = parts[2].long()
            fn = lambda: batched_nms(boxes, scores, idxs, thr)
        else:
            fn = lambda: nms(boxes, scores, thr)
        keep = fn()
        ms = timed(fn, 9)
    tag = "BNMS" if classes else "NMS"
    print(f"{tag} ms={ms:.4f} kept={keep.numel()} keepsum={int(keep.sum())} impl={IMPL}",
          flush=True)


def bench_roi(path, n, c, h, w, k, oh, ow, sr, scale, aligned):
    x, rois, gy = load(path, [n * c * h * w, k * 5, k * c * oh * ow])
    x = x.reshape(n, c, h, w).requires_grad_(True)
    rois, gy = rois.reshape(k, 5), gy.reshape(k, c, oh, ow)

    def fwd():
        with torch.no_grad():
            return roi_align(x, rois, (oh, ow), scale, sr, aligned)

    def fwd_bwd():
        x.grad = None
        roi_align(x, rois, (oh, ow), scale, sr, aligned).backward(gy)

    out = fwd()
    fwd_bwd()
    gsum = x.grad.double().sum().item()
    tf = timed(fwd, 5)
    tb = timed(fwd_bwd, 5)
    print(f"ROI ms={tb:.4f} fwd_ms={tf:.4f} sum={out.double().sum().item():.9e} "
          f"gsum={gsum:.9e} impl={IMPL}", flush=True)


def main():
    what, a = sys.argv[1], sys.argv[2:]
    if what in ("nms", "bnms"):
        torch.set_num_threads(int(a[3]))
        bench_nms(a[0], int(a[1]), float(a[2]), what == "bnms")
    elif what == "roi":
        torch.set_num_threads(int(a[11]))
        bench_roi(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]), int(a[5]), int(a[6]),
                  int(a[7]), int(a[8]), float(a[9]), a[10] == "1")
    else:
        sys.exit(f"torch_detops.py: unknown case {what}")


if __name__ == "__main__":
    main()
