#!/usr/bin/python3
"""PyTorch CPU reference for bench_nn's per-layer convolution timings.

Usage: torch_conv_layers.py NTHREADS BATCH C,O,HW,K,STRIDE ...
For each shape (padding K//2, no bias) times F.conv2d forward, the input
gradient and the weight gradient (torch.ops.aten.convolution_backward with
one output mask each), median of 5 after one warm-up, and prints
  LAYER <index> <fwd_ms> <bwd_data_ms> <bwd_weight_ms>
"""
import statistics, sys, time
import torch
import torch.nn.functional as F


def timed(fn):
    fn()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def main():
    torch.set_num_threads(int(sys.argv[1]))
    B = int(sys.argv[2])
    torch.manual_seed(0)
    for i, spec in enumerate(sys.argv[3:]):
        c, o, hw, k, s = (int(v) for v in spec.split(","))
        x = torch.randn(B, c, hw, hw)
        w = torch.randn(o, c, k, k) * 0.1
        p = k // 2
        y = F.conv2d(x, w, None, s, p)
        gy = torch.randn_like(y)
        cb = torch.ops.aten.convolution_backward
        args = (gy, x, w, None, [s, s], [p, p], [1, 1], False, [0, 0], 1)
        with torch.no_grad():
            f = timed(lambda: F.conv2d(x, w, None, s, p))
            d = timed(lambda: cb(*args, [True, False, False]))
            g = timed(lambda: cb(*args, [False, True, False]))
        print(f"LAYER {i} {f:.4f} {d:.4f} {g:.4f}", flush=True)


if __name__ == "__main__":
    main()
