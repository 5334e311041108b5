#!/usr/bin/env python3
"""torch_ref.py — PyTorch's side of `kpl import torch` and of the ONNX
import's logits check (Debian's python3-torch and python3-torchvision;
random weights, nothing downloaded).

  torch_ref.py model OUT ARCH   torchvision's ARCH (resnet18, resnet50) with
      random weights and batch-norm statistics (so that no layer is an
      identity), in eval mode: OUT/ARCH.pth (its state dict, torch.save),
      OUT/ARCH_wrapped.pth (what training scripts save: {"model": the state
      dict with DataParallel's "module." names, "optimizer", "epoch",
      "args": an argparse.Namespace}), OUT/ARCH_train.onnx (exported in
      training mode: names and batch norm kept), OUT/ARCH_eval.onnx
      (exported in eval mode: batch norm folded), OUT/x.npy (2 images,
      float32) and OUT/logits.txt (torch's logits of x, one per line).
  torch_ref.py views OUT        OUT/views.pth: tensors that are views of
      shared storages (offsets, strides, overlaps) in every dtype kpl reads,
      and OUT/views.txt: per tensor "name dtype shape... " then its values
      as the contiguous copy has them (for test_torch_import); also
      OUT/nan.pth (a NaN in one tensor), OUT/legacy.pth (the pre-1.6
      format) and OUT/model.pth (a whole nn.Module, not a state dict).
  torch_ref.py compare A B TOL  two files of numbers, one a line: exit 1
      when any pair differs by more than TOL (prints the largest).
"""
import argparse
import os
import sys


def model(out, arch):
    import numpy as np
    import torch
    import torchvision

    torch.manual_seed(0)
    net = getattr(torchvision.models, arch)(weights=None)
    with torch.no_grad():
        for name, m in net.named_modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
                # a bottleneck's last scale smaller, as training leaves it:
                # the ResNet-50's logits stay near 10, not 1000 (float32
                # rounding is relative: 1e-4 of a logit of 1000 is 0.1)
                if name.endswith("bn3"):
                    m.weight.uniform_(0.3, 0.7)
    net.eval()
    sd = net.state_dict()
    torch.save(sd, os.path.join(out, arch + ".pth"))
    wrapped = {"model": {"module." + k: v for k, v in sd.items()},
               "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "momentum": 0.9}]},
               "epoch": 3, "args": argparse.Namespace(lr=0.1, arch=arch)}
    torch.save(wrapped, os.path.join(out, arch + "_wrapped.pth"))
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    np.save(os.path.join(out, "x.npy"), x.numpy().astype(np.float32))
    with torch.no_grad():
        y = net(x).double()
    with open(os.path.join(out, "logits.txt"), "w") as f:
        f.write("".join("%.9g\n" % v for v in y.flatten().tolist()))
    # Exporting in training mode runs the model in training mode once, which
    # moves batch norm's running statistics: a copy with momentum 0 keeps
    # them as the state dict has them.
    import copy
    frozen = copy.deepcopy(net)
    for m in frozen.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = 0.0
    torch.onnx.export(frozen, x, os.path.join(out, arch + "_train.onnx"), opset_version=13,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    torch.onnx.export(net, x, os.path.join(out, arch + "_eval.onnx"), opset_version=13,
                      do_constant_folding=False)


def views(out):
    import torch

    g = torch.Generator().manual_seed(2)
    base = torch.randn(6, 5, generator=g)
    shared = torch.arange(10, dtype=torch.float32)
    t = {
        "whole": base,
        "rows": base[1:4],               # an offset into the storage
        "transposed": base.t(),          # strides (1, 5)
        "column": base[:, 2],            # offset 2, stride 5
        "every_other": base[::2, 1::2],  # strides (10, 2)
        "overlap_a": shared[0:6],        # two views of one storage that overlap
        "overlap_b": shared[3:10],
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 3),
        "half": base.half()[2:5],
        "bf16": base.bfloat16().t()[1],
        "double": base.double()[4],
        "long": torch.arange(-3, 9, dtype=torch.int64).view(3, 4)[:, 1:3],
        "int": torch.arange(7, dtype=torch.int32) * -5,
        "byte": torch.arange(250, 256, dtype=torch.uint8),
        "bool": base > 0,
        "nd5": torch.arange(2 * 3 * 1 * 2 * 2, dtype=torch.float32).view(2, 3, 1, 2, 2),
    }
    torch.save(t, os.path.join(out, "views.pth"))
    names = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
             torch.float64: "f64", torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8",
             torch.bool: "bool"}
    with open(os.path.join(out, "views.txt"), "w") as f:
        for k, v in t.items():
            vals = v.contiguous().flatten().double().tolist()
            f.write("%s %s %d %s %d %s\n" % (k, names[v.dtype], v.dim(),
                                             " ".join(str(s) for s in v.shape), len(vals),
                                             " ".join("%.17g" % x for x in vals)))
    bad = {"fc.weight": torch.ones(2, 2), "fc.bias": torch.tensor([1.0, float("nan")])}
    torch.save(bad, os.path.join(out, "nan.pth"))
    torch.save({"w": base}, os.path.join(out, "legacy.pth"), _use_new_zipfile_serialization=False)
    torch.save(torch.nn.Linear(2, 2), os.path.join(out, "model.pth"))


def compare(a, b, tol):
    x = [float(v) for v in open(a).read().split()]
    y = [float(v) for v in open(b).read().split()]
    if len(x) != len(y):
        print("%d numbers against %d" % (len(x), len(y)))
        return 1
    worst = max(abs(p - q) for p, q in zip(x, y))
    print("%d logits, largest difference %.3g (allowed %g)" % (len(x), worst, tol))
    return 0 if worst <= tol else 1


if __name__ == "__main__":
    a = sys.argv[1:]
    if len(a) == 3 and a[0] == "model":
        model(a[1], a[2])
    elif len(a) == 2 and a[0] == "views":
        views(a[1])
    elif len(a) == 4 and a[0] == "compare":
        sys.exit(compare(a[1], a[2], float(a[3])))
    else:
        sys.exit(__doc__)
