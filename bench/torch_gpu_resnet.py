#!/usr/bin/env python3
"""PyTorch reference for the GPU kit's ResNet-50 case (scripts/gpu/run.sh, step 4).

Usage: python3 torch_gpu_resnet.py BATCH WARMUP STEPS {f32|bf16|fp16} [DEVICE]

The configuration a PyTorch user runs to train fast on one GPU:
torchvision's ResNet-50 (1000 classes, 224x224 inputs) in channels_last,
torch.backends.cudnn.benchmark = True, and for bf16/fp16 torch.autocast
(fp16 with a GradScaler).  f32 keeps PyTorch's defaults: cuDNN may use TF32
for convolutions (torch.backends.cudnn.allow_tf32, on by default), matmuls
stay f32 unless the user asks.  One step = zero_grad + forward + cross
entropy + backward + SGD (lr 0.01, momentum 0.9) on random inputs already on
the GPU, the same work `bench_nn --step resnet50 ...` does in kpl; each step
ends with loss.item(), which waits for the GPU, as kpl's step reads its loss.

Prints one line:
  RESULT model=resnet50 device=... precision=... batch=N ms_median=...
         first_step_ms=... alloc_peak_MiB=... reserved_peak_MiB=...
         loss_first=... loss_last=... cudnn=... torch=...
Steps 0..WARMUP-1 are not timed into the median (as bench_nn --step); the
first of them (cuDNN's algorithm search under benchmark=True) is reported
as first_step_ms.
"""
import contextlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import torchvision


def main():
    if len(sys.argv) not in (5, 6) or sys.argv[4] not in ("f32", "bf16", "fp16"):
        sys.exit(__doc__)
    batch, warm, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    prec = sys.argv[4]
    dev = torch.device(sys.argv[5] if len(sys.argv) == 6 else "cuda:0")
    cuda = dev.type == "cuda"
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=1000).to(dev, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 224, 224, device=dev).contiguous(memory_format=torch.channels_last)
    y = (torch.arange(batch, device=dev) * 7) % 1000
    amp = {"f32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[prec]
    if hasattr(torch.amp, "GradScaler"):
        scaler = torch.amp.GradScaler(dev.type, enabled=prec == "fp16")
    else:  # PyTorch before 2.3 (Debian's 1.13, where the kit rehearses)
        scaler = torch.cuda.amp.GradScaler(enabled=prec == "fp16" and cuda)
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    times, first, loss0, loss1 = [], None, None, None
    for i in range(max(warm, 1) + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=amp) if amp else contextlib.nullcontext():
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        v = loss.item()
        ms = (time.perf_counter() - t0) * 1e3
        if i == 0:
            first, loss0 = ms, v
        if i >= max(warm, 1):
            times.append(ms)
        loss1 = v
        print(f"  torch resnet50 step {i} {ms:.1f} ms loss {v:.4f}", file=sys.stderr)
    mib = 1 << 20
    alloc = torch.cuda.max_memory_allocated(dev) / mib if cuda else float("nan")
    reserved = torch.cuda.max_memory_reserved(dev) / mib if cuda else float("nan")
    cudnn = torch.backends.cudnn.version() if cuda else None
    print(f"RESULT model=resnet50 device={dev} precision={prec} batch={batch} "
          f"ms_median={statistics.median(times):.3f} first_step_ms={first:.1f} "
          f"alloc_peak_MiB={alloc:.0f} reserved_peak_MiB={reserved:.0f} "
          f"loss_first={loss0:.4f} loss_last={loss1:.4f} cudnn={cudnn} torch={torch.__version__}",
          flush=True)


if __name__ == "__main__":
    main()
