#!/usr/bin/python3
"""PyTorch CPU references for bench_seg's fused-op rows (bench/run.sh seg,
case `ops`): the ops dense prediction and detection run that kpl fuses,
on the same shapes and label patterns as bench_seg.c's ops_case.

  torch_segops.py THREADS REPS

For each op prints
  OP <name> fwd_ms=<median> fwd_bwd_ms=<median>
fwd: the op alone without autograd; fwd_bwd: the op and the gradient of
its inputs that take one (torch.autograd.grad with a given output
gradient, or of the scalar loss).  Medians of REPS runs after one warm-up.
"""
import sys

import torch
import torch.nn.functional as F
from torchvision.ops import sigmoid_focal_loss

from torch_detops import timed  # median of reps runs after a warm-up, ms


def labels(n, classes, ignore_every):
    """(i * 7 + i // 97) % classes, every ignore_every-th 255 (bench_seg.c's)."""
    i = torch.arange(n)
    v = (i * 7 + i // 97) % classes
    if ignore_every:
        v[i % ignore_every == 0] = 255
    return v


def run(name, fn, inputs, gy, reps):
    """fn(*inputs) -> output; gy: its output gradient (None: a scalar)."""
    with torch.no_grad():
        f = timed(lambda: fn(*inputs), reps)
    wants = [t for t in inputs if t.requires_grad]
    b = timed(lambda: torch.autograd.grad(fn(*inputs), wants, gy), reps)
    print(f"OP {name} fwd_ms={f:.4f} fwd_bwd_ms={b:.4f}", flush=True)


def main():
    torch.set_num_threads(int(sys.argv[1]))
    reps = int(sys.argv[2])
    torch.manual_seed(0)
    x = torch.randn(8, 21, 64, 64, requires_grad=True)
    run("resize", lambda t: F.interpolate(t, size=(512, 512), mode="bilinear",
                                          align_corners=False),
        [x], torch.randn(8, 21, 512, 512), reps)
    a = torch.randn(8, 128, 64, 64, requires_grad=True)
    b = torch.randn(8, 128, 64, 64, requires_grad=True)
    run("concat", lambda p, q: torch.cat([p, q], 1), [a, b], torch.randn(8, 256, 64, 64), reps)
    z = torch.randn(8, 21, 256, 256, requires_grad=True)
    y = labels(8 * 256 * 256, 21, 20).reshape(8, 256, 256)
    run("cross_entropy", lambda t: F.cross_entropy(t, y, ignore_index=255), [z], None, reps)
    g = torch.randn(8, 256, 32, 32, requires_grad=True)
    w = torch.randn(256, requires_grad=True)
    bb = torch.randn(256, requires_grad=True)
    run("group_norm", lambda t, ww, bv: F.group_norm(t, 32, ww, bv, 1e-5), [g, w, bb],
        torch.randn(8, 256, 32, 32), reps)
    lg = torch.randn(16384, 80, requires_grad=True)
    cls = labels(16384, 80, 0)
    tgt = torch.zeros(16384, 80)
    rows = torch.arange(16384)
    pos = rows % 10 == 0
    tgt[rows[pos], cls[pos]] = 1
    run("focal", lambda t: sigmoid_focal_loss(t, tgt, 0.25, 2, "sum"), [lg], None, reps)


if __name__ == "__main__":
    main()
