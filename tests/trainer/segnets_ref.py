#!/usr/bin/python3
"""Reference numbers for the zoo's segmentation networks (trainer/nn/
segnets.c) from the same networks in plain PyTorch (bench/torch_segnets.py;
torchvision is not needed and not used).

    /usr/bin/python3 tests/trainer/segnets_ref.py [OUT_DIR]

writes OUT_DIR/segnets.bin (default OUT_DIR: tests/trainer/data beside this
script), in kpl_refdata.h's format (tests/graph/detops_ref.py's RefFile),
every number f64, inputs and weights rounded to f32 first:

  dl.config         depth, width, in channels, classes, ASPP channels,
                    rates..., of the small DeepLabv3 (ResNet-18 of width 4)
  dl.param.<name>   its weights under torchvision's names; dl.buf.<name>
                    its running statistics (random, so eval mode uses them)
  dl.<case>.*       case os8.train, os16.train (training mode, batch
                    statistics, the dropouts in evaluation mode so that
                    nothing is random), os8.eval, os16.eval: the config
                    (output stride, N, C, H, W), input x, outputs out0
                    (and out1, the aux head's, in training), upstream
                    gradients gy<i>, the input gradient gx, every
                    parameter's gradient grad.<name> (all but os8.eval;
                    none for the aux head in evaluation mode),
                    and in training the running statistics after the
                    forward, buf.<name>
  unet.<t|b>.*      U-Net width 4 depth 3 with transposed convolutions
                    (t) or bilinear upsampling (b) on a 21 x 20 input
                    (odd: the decoder pads): config (width, depth,
                    classes, bilinear, N, C, H, W), param.<name>,
                    buf.<name> (initial), x, out0, gy0, gx, grad.<name>,
                    buf_after.<name>; training mode
  r50.count         torchvision's deeplabv3_resnet50(num_classes=21,
                    aux_loss=True): its parameter count (42,004,074);
                    r50.p.<name> / r50.b.<name> each parameter's / buffer's
                    shape as a vector of dims

The training cases use batch 3, not 2: with 2 images the pooling branch
of the ASPP normalises 2 values per channel, which batch norm maps to
+-1 whatever they are, so that branch's gradients are eps-sized
remainders of cancelling f32 sums (torchvision refuses batch 1 there for
the same reason).  The ResNet is 4 wide, not 8, to keep the file at 2 MB
(each set of gradients of width 8 is 1.7 MB of f64).
"""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "graph"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
from detops_ref import RefFile, f32  # noqa: E402
import torch_segnets as seg  # noqa: E402

torch.set_default_dtype(torch.float64)

DL = dict(depth=18, width=4, in_channels=3, classes=3, aspp=16, rates=(1, 2, 3))
DL_CASES = [  # name, output stride, training, N, gradients
    ("os8.train", 8, True, 3, True),
    ("os16.train", 16, True, 3, True),
    ("os8.eval", 8, False, 2, False),
    ("os16.eval", 16, False, 2, True),
]
DL_HW = (33, 35)
UNET = dict(width=4, depth=3, classes=3, in_channels=1)
UNET_SHAPE = (2, 1, 21, 20)


def randomise(model, g):
    """Weights U(-sqrt(6 / fan_in), +) (activations stay O(1)), biases and
    batch-norm affines random, running statistics random (var in 0.5 ..
    1.5), all rounded to f32."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 4:
                fan_in = p.shape[1] * p.shape[2] * p.shape[3]
                v = (torch.rand(p.shape, generator=g) * 2 - 1) * (6.0 / fan_in) ** 0.5
            elif name.endswith("weight"):  # a batch norm's scale
                v = 0.5 + torch.rand(p.shape, generator=g)
            else:
                v = torch.rand(p.shape, generator=g) - 0.5
            p.copy_(f32(v))
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(f32(torch.rand(b.shape, generator=g) - 0.5))
            elif name.endswith("running_var"):
                b.copy_(f32(0.5 + torch.rand(b.shape, generator=g)))


def buffers(model):
    return {k: v.clone() for k, v in model.named_buffers() if not k.endswith("num_batches_tracked")}


def forward_backward(model, x, training, gys, g):
    """Outputs, running statistics after the forward, and (with gys, or
    fresh ones from g when gys is None and g is not) the gradients of
    sum(out_i * gy_i) for x and every parameter (None where unused: the
    aux head in evaluation mode).  The dropouts are in evaluation mode."""
    model.train(training)
    for d in model.dropouts():
        d.eval()
    x = x.clone().requires_grad_(True)
    outs = model(x)
    bufs = buffers(model)
    if gys is None and g is not None:
        gys = [f32(torch.randn(o.shape, generator=g)) for o in outs]
    if gys is None:
        return outs, bufs, None, None
    loss = sum((o * gy.to(o.dtype)).sum() for o, gy in zip(outs, gys))
    gs = torch.autograd.grad(loss, [x] + [p for _, p in model.named_parameters()],
                             allow_unused=True)
    return outs, bufs, gys, gs


def record(rf, prefix, make, state, x, training, grads, g, bufs_as):
    """One case under prefix: x, out<i>, in training the running statistics
    after the forward (<bufs_as>.<name>), with grads gy<i>, gx and
    grad.<name>.  Each recorded result t also gets <prefix>.f32err.<t>:
    how far PyTorch's own f32 lands from these f64 numbers on this case,
    max |t32 - t64| / max |t64|, which the C test scales into its
    tolerance (training mode sends gradients through many batch norms over
    few values, where f32 loses up to 1e-3 of the largest value)."""
    m64 = make()
    m64.load_state_dict(state)
    outs, bufs, gys, gs = forward_backward(m64, x, training, None, g if grads else None)
    torch.set_default_dtype(torch.float32)
    m32 = make()
    torch.set_default_dtype(torch.float64)
    m32.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    outs32, bufs32, _, gs32 = forward_backward(m32, x.float(), training, gys, None)

    def add(name, t64, t32):
        rf.add(f"{prefix}.{name}", t64)
        scale = max(float(t64.abs().max()), 1e-300)
        rf.add(f"{prefix}.f32err.{name}", [float((t32.double() - t64).abs().max()) / scale])

    rf.add(f"{prefix}.x", x)
    for i, (o, o32) in enumerate(zip(outs, outs32)):
        add(f"out{i}", o, o32)
    if training:
        for k, v in bufs.items():
            add(f"{bufs_as}.{k}", v, bufs32[k])
    if not grads:
        return
    for i, gy in enumerate(gys):
        rf.add(f"{prefix}.gy{i}", gy)
    add("gx", gs[0], gs32[0])
    names = [k for k, _ in m64.named_parameters()]
    for k, gk, gk32 in zip(names, gs[1:], gs32[1:]):
        if gk is not None:
            add(f"grad.{k}", gk, gk32)


def deeplab(rf, g):
    rf.add("dl.config", [DL["depth"], DL["width"], DL["in_channels"], DL["classes"], DL["aspp"],
                         *DL["rates"]])

    def make(os_):
        return lambda: seg.DeepLabV3(DL["depth"], DL["width"], DL["in_channels"], DL["classes"],
                                     os_, DL["rates"], DL["aspp"], True)

    ref = make(8)()
    randomise(ref, g)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    for k, p in ref.named_parameters():
        rf.add(f"dl.param.{k}", p)
    for k, b in buffers(ref).items():
        rf.add(f"dl.buf.{k}", b)
    for name, os_, training, n, grads in DL_CASES:
        # the same weights at either output stride
        x = f32(torch.randn(n, DL["in_channels"], *DL_HW, generator=g))
        rf.add(f"dl.{name}.config", [os_, n, DL["in_channels"], *DL_HW])
        record(rf, f"dl.{name}", make(os_), state, x, training, grads, g, "buf")


def unet(rf, g):
    for tag, bilinear in (("t", False), ("b", True)):
        def make():
            return seg.UNet(UNET["in_channels"], UNET["classes"], UNET["width"], UNET["depth"],
                            bilinear)
        model = make()
        randomise(model, g)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        p = f"unet.{tag}"
        rf.add(f"{p}.config", [UNET["width"], UNET["depth"], UNET["classes"], int(bilinear),
                               *UNET_SHAPE])
        for k, v in model.named_parameters():
            rf.add(f"{p}.param.{k}", v)
        for k, b in buffers(model).items():
            rf.add(f"{p}.buf.{k}", b)
        x = f32(torch.randn(*UNET_SHAPE, generator=g))
        record(rf, p, make, state, x, True, True, g, "buf_after")


def resnet50_names(rf):
    """torchvision's deeplabv3_resnet50(num_classes=21, aux_loss=True)."""
    m = seg.DeepLabV3(50, 64, 3, 21, 8, (12, 24, 36), 256, True)
    count = sum(p.numel() for p in m.parameters())
    assert count == 42004074, count  # torchvision's published figure for this model
    rf.add("r50.count", [count])
    for k, p in m.named_parameters():
        rf.add(f"r50.p.{k}", list(p.shape))
    for k, b in buffers(m).items():
        rf.add(f"r50.b.{k}", list(b.shape))


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "data")
    os.makedirs(out_dir, exist_ok=True)
    torch.set_num_threads(1)
    rf = RefFile()
    g = torch.Generator().manual_seed(2017)
    deeplab(rf, g)
    unet(rf, g)
    resnet50_names(rf)
    rf.write(os.path.join(out_dir, "segnets.bin"))


if __name__ == "__main__":
    main()
