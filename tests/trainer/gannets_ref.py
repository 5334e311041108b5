#!/usr/bin/python3
"""Reference numbers for the zoo's GAN networks (trainer/nn/gannets.c) and
the layers under them (spectral norm, instance norm, pixel shuffle) from
the same networks in plain PyTorch (bench/torch_gans.py).

    /usr/bin/python3 tests/trainer/gannets_ref.py [OUT_DIR]

writes OUT_DIR/gannets.bin (default OUT_DIR: tests/trainer/data beside this
script) in kpl_refdata.h's format, every number f64, inputs and weights
rounded to f32 first.  Networks (narrow, so the file stays small):

  dg   dcgan    latent 8, width 4, 3 x 28 x 28 (7 -> 14 -> 28), batch norm
  dgn  dcgan    latent 4, width 4, 1 x 16 x 16, no norm (biases everywhere)
  dd   dcgan_d  width 4, 3 x 32 x 32, batch norm, spectral norm
  dl   dcgan_d  width 4, 1 x 28 x 28, layer norm (the WGAN-GP critic)
  di   dcgan_d  width 4, 3 x 16 x 16, instance norm
  sg   sngan    latent 8, g_width 8, 3 x 32 x 32
  sd   sngan_d  d_width 8, 3 x 32 x 32, spectral norm
  sdn  sngan_d  d_width 8, 3 x 32 x 32, no spectral norm

For each: <net>.config (kind: 0 G, 1 D; latent, width, channels, side,
norm: 0 none 1 batch 2 instance 3 layer; spectral norm), <net>.param.<name>
and <net>.buf.<name> (random weights, BN running statistics random,
spectral norm's u and v as PyTorch drew them), then cases <net>.<case>:

  train / eval   config (training, pre: forwards run first, without
                 gradients, on the same input), x, out0, gy0, gx,
                 grad.<name> (every parameter), and in training the
                 buffers after the forward, buf.<name> (running statistics;
                 u and v after pre + 1 power iterations)
  gp / r1        a penalty through double backward in training mode,
                 g = grad(sum D(x), x, create_graph): gp (WGAN-GP) =
                 mean((|g| - 1)^2) at x = xhat, r1 = mean(|g|^2) at real x;
                 x, value, grad.<name> (torch.autograd.grad of the
                 penalty w.r.t. every parameter it depends on; the
                 others, such as the last layer's bias, have none)

Each recorded result r also has <prefix>.f32err.<r>: how far PyTorch's own
f32 lands from the f64 numbers, max |r32 - r64| / max |r64|, which the C
test scales into its tolerance.

  ps.*    F.pixel_shuffle(x, 2) of (2, 8, 3, 2): x, out, gy, gx
  inorm.* nn.InstanceNorm2d(3, affine=True) of (2, 3, 4, 5): x, weight,
          bias, out, gy, gx, gweight, gbias; inorm.plain.* without affine
  full.sg / full.sd  SN-GAN's full-size CIFAR-10 networks (latent 128,
          widths 256 and 128): count (parameters), p.<name> and b.<name>
          (each tensor's shape)
"""
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "graph"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
from detops_ref import RefFile, f32  # noqa: E402
import torch_gans as tg  # noqa: E402

torch.set_default_dtype(torch.float64)

NORMS = {"none": 0, "batch": 1, "instance": 2, "layer": 3}
# name: (kind, latent, width, channels, side, norm, spectral norm), cases, batch
NETS = {
    "dg": (("g", 8, 4, 3, 28, "batch", False), ["train", "eval"], 3),
    "dgn": (("g", 4, 4, 1, 16, "none", False), ["train"], 2),
    "dd": (("d", 0, 4, 3, 32, "batch", True), ["train", "eval", "r1"], 3),
    "dl": (("d", 0, 4, 1, 28, "layer", False), ["train", "gp"], 3),
    "di": (("d", 0, 4, 3, 16, "instance", False), ["train"], 2),
    "sg": (("sg", 8, 8, 3, 32, "batch", False), ["train"], 2),
    "sd": (("sd", 0, 8, 3, 32, "none", True), ["train", "eval", "gp"], 2),
    "sdn": (("sd", 0, 8, 3, 32, "none", False), ["gp"], 2),
}
PRE = 2  # training forwards before the checked one (spectral norm's u, v move)


def make(cfg):
    kind, latent, width, ch, side, norm, sn = cfg
    if kind == "g":
        return lambda: tg.DCGANGenerator(latent, width, ch, side, norm)
    if kind == "d":
        return lambda: tg.DCGANDiscriminator(width, ch, side, norm, sn)
    if kind == "sg":
        return lambda: tg.SNGANGenerator(latent, width, ch, side)
    return lambda: tg.SNGANDiscriminator(width, ch, side, sn)


def randomise(model, g):
    """Weights U(-sqrt(6 / fan), +) (fan: the elements per output row),
    biases U(-0.5, 0.5), norm scales U(0.5, 1.5), running statistics
    random (var in 0.5 .. 1.5), all rounded to f32; u and v keep PyTorch's
    draws."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan = p[0].numel()
                v = (torch.rand(p.shape, generator=g) * 2 - 1) * (6.0 / fan) ** 0.5
            elif name.endswith("weight"):
                v = 0.5 + torch.rand(p.shape, generator=g)
            else:
                v = torch.rand(p.shape, generator=g) - 0.5
            p.copy_(f32(v))
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(f32(torch.rand(b.shape, generator=g) - 0.5))
            elif name.endswith("running_var"):
                b.copy_(f32(0.5 + torch.rand(b.shape, generator=g)))
            else:
                b.copy_(f32(b))


def build(maker, st, dtype):
    torch.set_default_dtype(dtype)
    m = maker()
    torch.set_default_dtype(torch.float64)
    m.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in st.items()})
    return m


def params(m):
    return [(k, p) for k, p in m.named_parameters()]


def run_plain(m, x, training, gy):
    """pre forwards (training only), then out = m(x) and the gradients of
    sum(out gy) for x and every parameter; the buffers after."""
    m.train(training)
    if training:
        with torch.no_grad():
            for _ in range(PRE):
                m(x)
    x = x.clone().requires_grad_(True)
    out = m(x)
    bufs = {k: v.clone() for k, v in tg.state(m).items() if k not in dict(m.named_parameters())}
    grads = torch.autograd.grad((out * gy.to(out.dtype)).sum(), [x] + [p for _, p in params(m)])
    return out, bufs, grads


def run_penalty(m, x, kind):
    m.train(True)
    x = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
    n = g.flatten(1).norm(2, dim=1)
    val = ((n - 1) ** 2).mean() if kind == "gp" else (n ** 2).mean()
    # None where the penalty does not depend on the parameter (the last
    # layer's bias: the input gradient does not see it)
    return val, torch.autograd.grad(val, [p for _, p in params(m)], allow_unused=True)


def network(rf, net, g):
    cfg, cases, n = NETS[net]
    kind, latent, width, ch, side, norm, sn = cfg
    rf.add(f"{net}.config", [0 if kind in ("g", "sg") else 1, latent, width, ch, side,
                             NORMS[norm], int(sn)])
    maker = make(cfg)
    ref = maker()
    randomise(ref, g)
    st = {k: v.clone() for k, v in tg.state(ref).items()}
    for k, p in ref.named_parameters():
        rf.add(f"{net}.param.{k}", p)
    for k, b in st.items():
        if k not in dict(ref.named_parameters()):
            rf.add(f"{net}.buf.{k}", b)
    names = [k for k, _ in ref.named_parameters()]
    shape = (n, latent) if kind in ("g", "sg") else (n, ch, side, side)
    for case in cases:
        p = f"{net}.{case}"
        m64, m32 = build(maker, st, torch.float64), build(maker, st, torch.float32)

        def add(name, t64, t32):
            rf.add(f"{p}.{name}", t64)
            scale = max(float(t64.abs().max()), 1e-300)
            rf.add(f"{p}.f32err.{name}", [float((t32.double() - t64).abs().max()) / scale])

        if case in ("gp", "r1"):
            if case == "gp":  # xhat between a real and a fake batch
                a, b = torch.rand(shape, generator=g) * 2 - 1, torch.rand(shape, generator=g) * 2 - 1
                e = torch.rand(n, 1, 1, 1, generator=g)
                x = f32(e * a + (1 - e) * b)
            else:
                x = f32(torch.rand(shape, generator=g) * 2 - 1)
            rf.add(f"{p}.x", x)
            v64, g64 = run_penalty(m64, x, case)
            v32, g32 = run_penalty(m32, x.float(), case)
            add("value", v64.reshape(1), v32.reshape(1))
            for k, a64, a32 in zip(names, g64, g32):
                if a64 is not None:
                    add(f"grad.{k}", a64, a32)
            continue
        training = case == "train"
        rf.add(f"{p}.config", [int(training), PRE if training else 0])
        x = f32(torch.randn(shape, generator=g))
        out_shape = (n, ch, side, side) if kind in ("g", "sg") else (n, 1)
        gy = f32(torch.randn(out_shape, generator=g))
        rf.add(f"{p}.x", x)
        rf.add(f"{p}.gy0", gy)
        o64, b64, g64 = run_plain(m64, x, training, gy)
        o32, b32, g32 = run_plain(m32, x.float(), training, gy)
        add("out0", o64, o32)
        add("gx", g64[0], g32[0])
        for k, a64, a32 in zip(names, g64[1:], g32[1:]):
            add(f"grad.{k}", a64, a32)
        if training:
            for k, v in b64.items():
                add(f"buf.{k}", v, b32[k])


def layers(rf, g):
    x = f32(torch.randn(2, 8, 3, 2, generator=g)).requires_grad_(True)
    y = F.pixel_shuffle(x, 2)
    gy = f32(torch.randn(y.shape, generator=g))
    (gx,) = torch.autograd.grad((y * gy).sum(), x)
    rf.add_all("ps", x=x, out=y, gy=gy, gx=gx)
    for tag, affine in (("inorm", True), ("inorm.plain", False)):
        m = torch.nn.InstanceNorm2d(3, affine=affine)
        x = f32(torch.randn(2, 3, 4, 5, generator=g)).requires_grad_(True)
        rf.add(f"{tag}.x", x)
        if affine:
            with torch.no_grad():
                m.weight.copy_(f32(0.5 + torch.rand(3, generator=g)))
                m.bias.copy_(f32(torch.rand(3, generator=g) - 0.5))
            rf.add_all(tag, weight=m.weight, bias=m.bias)
        y = m(x)
        gy = f32(torch.randn(y.shape, generator=g))
        gs = torch.autograd.grad((y * gy).sum(), [x] + list(m.parameters()))
        rf.add_all(tag, out=y, gy=gy, gx=gs[0])
        if affine:
            rf.add_all(tag, gweight=gs[1], gbias=gs[2])


def full_size(rf):
    for tag, m in (("sg", tg.SNGANGenerator(128, 256, 3, 32)),
                   ("sd", tg.SNGANDiscriminator(128, 3, 32, True))):
        count = sum(p.numel() for p in m.parameters())
        rf.add(f"full.{tag}.count", [count])
        pn = dict(m.named_parameters())
        for k, v in tg.state(m).items():
            rf.add(f"full.{tag}.{'p' if k in pn else 'b'}.{k}", list(v.shape))
        print(f"full-size {tag}: {count} parameters")


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "data")
    os.makedirs(out_dir, exist_ok=True)
    torch.set_num_threads(1)
    torch.manual_seed(2018)  # spectral norm's u and v
    rf = RefFile()
    g = torch.Generator().manual_seed(2018)
    for net in NETS:
        network(rf, net, g)
    layers(rf, g)
    full_size(rf)
    rf.write(os.path.join(out_dir, "gannets.bin"))


if __name__ == "__main__":
    main()
