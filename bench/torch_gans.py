#!/usr/bin/python3
"""The zoo's GAN networks (trainer/nn/gannets.c) in plain PyTorch, for
tests/trainer/gannets_ref.py (reference numbers) and bench_gan
(bench/run.sh gan).  Parameter and buffer names are kpl's, so state dicts
map one to one (spectral norm through torch.nn.utils.spectral_norm:
weight_orig, weight_u, weight_v).

  DCGANGenerator      pytorch/examples' dcgan layout (main.<i>) for a side
                      s0 x 2^k (s0 in 4..7): ConvTranspose2d(latent, w 2^(k-1),
                      s0) + norm + ReLU, k ConvTranspose2d 4/2/1 halving the
                      channels (the last to C, then tanh); a convolution has
                      a bias only where no norm follows it.
  DCGANDiscriminator  k Conv2d 4/2/1 (w, 2w, ...) with LeakyReLU(0.2), no
                      norm on the first; Conv2d(kernel s0) to one score.
                      Norms: batch, instance (affine), layer (GroupNorm(1, C)),
                      none.  Init: N(0, 0.02) weights, zero biases, batch
                      norm scales N(1, 0.02).
  SNGANGenerator      SN-GAN's CIFAR ResNet (pytorch-gan-collections'
                      layout): linear to b x b x g_width, 3 up blocks
                      (residual BN ReLU up conv3 BN ReLU conv3; shortcut up
                      conv1), output BN ReLU conv3 tanh.
  SNGANDiscriminator  optimized block, down block, 2 plain blocks, ReLU,
                      global sum, linear (no bias); spectral norm on every
                      layer unless spectral_norm=False.  Xavier-uniform
                      init (gain sqrt 2 on the residual convolutions), zero
                      biases.

As a program (bench_gan's reference side):

  torch_gans.py check FILE KEY=VALUE...
      Loads G, D and the batch bench_gan wrote to FILE (every name and
      shape must match), runs one iteration and prints
        CHECK names=<n> <loss>=<v>...
  torch_gans.py time FILE KEY=VALUE... iters=W,S
      Times S iterations after W warm-up ones; prints medians:
        ITER ms=<ms> d=<ms> g=<ms> last=<loss>
  torch_gans.py mem FILE KEY=VALUE... steps=S
      Runs S iterations and prints the peak resident memory and its growth
      over the resident memory once models and batch are loaded:
        MEM peak_rss=<bytes> base_rss=<bytes> growth=<bytes>
KEY=VALUE: mode (dcgan|wgangp) threads latent width channels side g_norm
d_norm lr beta1 beta2 gp_weight.

One iteration:
  dcgan   fake = G(z); D step: BCE(D(real), 1) + BCE(D(fake.detach()), 0),
          Adam; G step (D's parameters not requiring grad): the
          non-saturating BCE(D(fake), 1), Adam.
  wgangp  critic step: fake = G(z) without grad; D(fake).mean() -
          D(real).mean() + gp_weight ((|grad_xhat D(xhat)| - 1)^2).mean()
          with xhat = eps real + (1 - eps) fake, the gradient by
          create_graph; Adam.  G step: fake = G(z), -D(fake).mean(), Adam.

FILE (bench_gan writes it): "KPLGAN1", then entries: u32 name length,
name, u32 ndim, ndim x i64 dims, f32 data.  Names "g:<tensor>",
"d:<tensor>" (parameters and buffers), "in:z", "in:real", "in:eps".
"""
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import spectral_norm

from torch_segnets import read_entries, reset_peak_rss, rss_bytes, state_diff  # shared helpers


# ---- DCGAN --------------------------------------------------------------------------------------

def dcgan_side(side):
    """side = s0 2^k with s0 in 4..7, k >= 1."""
    s, k = side, 0
    while s > 7 and s % 2 == 0:
        s //= 2
        k += 1
    if k < 1 or not 4 <= s <= 7:
        raise ValueError(f"side {side} is not s0 x 2^k with s0 in 4..7 and k >= 1")
    return s, k


def make_norm(kind, ch):
    if kind == "batch":
        return [nn.BatchNorm2d(ch)]
    if kind == "instance":
        return [nn.InstanceNorm2d(ch, affine=True)]
    if kind == "layer":
        return [nn.GroupNorm(1, ch)]
    return []


def dcgan_init(model):
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.normal_(m.weight, 1.0, 0.02)
            nn.init.zeros_(m.bias)


class DCGANGenerator(nn.Module):
    def __init__(self, latent=100, width=64, channels=3, side=64, norm="batch"):
        super().__init__()
        s0, k = dcgan_side(side)
        ch = width << (k - 1)
        layers = [nn.ConvTranspose2d(latent, ch, s0, 1, 0, bias=norm == "none"),
                  *make_norm(norm, ch), nn.ReLU()]
        for i in range(1, k + 1):
            last = i == k
            out = channels if last else ch // 2
            layers.append(nn.ConvTranspose2d(ch, out, 4, 2, 1, bias=last or norm == "none"))
            layers += [nn.Tanh()] if last else [*make_norm(norm, out), nn.ReLU()]
            ch = out
        self.main = nn.Sequential(*layers)
        dcgan_init(self)

    def forward(self, z):
        return self.main(z.view(z.shape[0], -1, 1, 1))


class DCGANDiscriminator(nn.Module):
    def __init__(self, width=64, channels=3, side=64, norm="batch", sn=False):
        super().__init__()
        s0, k = dcgan_side(side)
        layers, cin = [], channels
        for i in range(k):
            n = norm if i else "none"
            layers.append(nn.Conv2d(cin, width << i, 4, 2, 1, bias=n == "none"))
            layers += [*make_norm(n, width << i), nn.LeakyReLU(0.2)]
            cin = width << i
        layers.append(nn.Conv2d(cin, 1, s0, 1, 0))
        self.main = nn.Sequential(*layers)
        dcgan_init(self)
        if sn:
            for m in self.main:
                if isinstance(m, nn.Conv2d):
                    spectral_norm(m)

    def forward(self, x):
        return self.main(x).view(x.shape[0], 1)


# ---- SN-GAN's ResNets ----------------------------------------------------------------------------

def xavier(layer, gain):
    nn.init.xavier_uniform_(layer.weight, gain)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)
    return layer


class ResBlock(nn.Module):
    """residual(x) + shortcut(x); an empty shortcut is the identity."""

    def __init__(self, residual, shortcut):
        super().__init__()
        self.residual = nn.Sequential(*residual)
        self.shortcut = nn.Sequential(*shortcut)

    def forward(self, x):
        return self.residual(x) + self.shortcut(x)


def conv(cin, cout, k, gain):
    return xavier(nn.Conv2d(cin, cout, k, 1, k // 2), gain)


class SNGANGenerator(nn.Module):
    def __init__(self, latent=128, width=256, channels=3, side=32):
        super().__init__()
        if side % 8 or not 32 <= side <= 64:
            raise ValueError(f"sngan: side {side} is not 32, 40, 48, 56 or 64")
        self.bottom, self.width = side // 8, width
        self.linear = xavier(nn.Linear(latent, self.bottom ** 2 * width), 1.0)
        r2 = math.sqrt(2)
        self.blocks = nn.Sequential(*[
            ResBlock([nn.BatchNorm2d(width), nn.ReLU(), nn.Upsample(scale_factor=2),
                      conv(width, width, 3, r2), nn.BatchNorm2d(width), nn.ReLU(),
                      conv(width, width, 3, r2)],
                     [nn.Upsample(scale_factor=2), conv(width, width, 1, 1.0)])
            for _ in range(3)])
        self.output = nn.Sequential(nn.BatchNorm2d(width), nn.ReLU(),
                                    conv(width, channels, 3, 1.0), nn.Tanh())

    def forward(self, z):
        h = self.linear(z).view(z.shape[0], self.width, self.bottom, self.bottom)
        return self.output(self.blocks(h))


class SNGANDiscriminator(nn.Module):
    def __init__(self, width=128, channels=3, side=32, sn=True):
        super().__init__()
        if side % 8 or not 32 <= side <= 64:
            raise ValueError(f"sngan_d: side {side} is not 32, 40, 48, 56 or 64")
        r2, w = math.sqrt(2), width
        self.model = nn.Sequential(
            ResBlock([conv(channels, w, 3, r2), nn.ReLU(), conv(w, w, 3, r2), nn.AvgPool2d(2)],
                     [nn.AvgPool2d(2), conv(channels, w, 1, 1.0)]),
            ResBlock([nn.ReLU(), conv(w, w, 3, r2), nn.ReLU(), conv(w, w, 3, r2), nn.AvgPool2d(2)],
                     [conv(w, w, 1, 1.0), nn.AvgPool2d(2)]),
            ResBlock([nn.ReLU(), conv(w, w, 3, r2), nn.ReLU(), conv(w, w, 3, r2)], []),
            ResBlock([nn.ReLU(), conv(w, w, 3, r2), nn.ReLU(), conv(w, w, 3, r2)], []),
            nn.ReLU())
        self.linear = xavier(nn.Linear(w, 1, bias=False), 1.0)
        if sn:
            for m in self.modules():
                if isinstance(m, (nn.Conv2d, nn.Linear)):
                    spectral_norm(m)

    def forward(self, x):
        return self.linear(self.model(x).sum(dim=(2, 3)))


def state(model):
    """Parameters and buffers by name (no num_batches_tracked: kpl has none)."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}


def gradient_penalty(d, xhat):
    """((|grad_xhat D(xhat)|_2 - 1)^2).mean() over the batch, by create_graph."""
    xhat = xhat.detach().requires_grad_(True)
    (g,) = torch.autograd.grad(d(xhat).sum(), xhat, create_graph=True)
    return ((g.flatten(1).norm(2, dim=1) - 1) ** 2).mean()


# ---- bench_gan's reference side -------------------------------------------------------------------

def load_into(model, ent, prefix, who):
    want = state(model)
    got = {k[len(prefix):]: v for k, v in ent.items() if k.startswith(prefix)}
    diff = state_diff(want, got)
    if diff:
        sys.exit(f"torch_gans: {who}'s state dicts differ: {diff}")
    with torch.no_grad():
        for k, v in want.items():
            v.copy_(got[k])
    return len(got)


def build(kv, ent):
    side, c, w = int(kv["side"]), int(kv["channels"]), int(kv["width"])
    g = DCGANGenerator(int(kv["latent"]), w, c, side, kv["g_norm"])
    d = DCGANDiscriminator(w, c, side, kv["d_norm"], False)
    n = load_into(g, ent, "g:", "G") + load_into(d, ent, "d:", "D")
    return g, d, n


class Iteration:
    """One GAN iteration of bench_gan's mode on fixed z, real and eps."""

    def __init__(self, kv, g, d, ent):
        self.mode, self.g, self.d = kv["mode"], g, d
        self.z, self.real, self.eps = ent["in:z"], ent["in:real"], ent["in:eps"]
        betas = (float(kv["beta1"]), float(kv["beta2"]))
        self.opt_g = torch.optim.Adam(g.parameters(), lr=float(kv["lr"]), betas=betas)
        self.opt_d = torch.optim.Adam(d.parameters(), lr=float(kv["lr"]), betas=betas)
        self.gp_weight = float(kv.get("gp_weight", "10"))
        n = self.z.shape[0]
        self.ones, self.zeros = torch.ones(n, 1), torch.zeros(n, 1)

    def run(self):
        """[total ms, D step ms, G step ms], losses."""
        t0 = time.perf_counter()
        if self.mode == "dcgan":
            fake = self.g(self.z)
            loss_d = (F.binary_cross_entropy_with_logits(self.d(self.real), self.ones) +
                      F.binary_cross_entropy_with_logits(self.d(fake.detach()), self.zeros))
            loss_d.backward()
            self.opt_d.step()
            self.opt_d.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            self.d.requires_grad_(False)
            loss_g = F.binary_cross_entropy_with_logits(self.d(fake), self.ones)
            loss_g.backward()
            self.opt_g.step()
            self.opt_g.zero_grad(set_to_none=True)
            self.d.requires_grad_(True)
            losses = {"loss_d": loss_d.item(), "loss_g": loss_g.item()}
        else:
            with torch.no_grad():
                fake = self.g(self.z)
            xhat = self.eps * self.real + (1 - self.eps) * fake
            gp = gradient_penalty(self.d, xhat)
            loss_d = self.d(fake).mean() - self.d(self.real).mean() + self.gp_weight * gp
            loss_d.backward()
            self.opt_d.step()
            self.opt_d.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            self.d.requires_grad_(False)
            loss_g = -self.d(self.g(self.z)).mean()
            loss_g.backward()
            self.opt_g.step()
            self.opt_g.zero_grad(set_to_none=True)
            self.d.requires_grad_(True)
            losses = {"loss_d": loss_d.item(), "gp": gp.item(), "loss_g": loss_g.item()}
        t2 = time.perf_counter()
        if not all(math.isfinite(v) for v in losses.values()):
            sys.exit(f"torch_gans: a loss is not finite: {losses}")
        return [(t2 - t0) * 1e3, (t1 - t0) * 1e3, (t2 - t1) * 1e3], losses


def main():
    if len(sys.argv) < 3 or sys.argv[1] not in ("check", "time", "mem"):
        sys.exit(__doc__)
    mode, path = sys.argv[1], sys.argv[2]
    kv = dict(a.partition("=")[::2] for a in sys.argv[3:])
    torch.set_num_threads(int(kv["threads"]))
    ent = read_entries(path, b"KPLGAN1")
    g, d, names = build(kv, ent)
    g.train()
    d.train()
    it = Iteration(kv, g, d, ent)
    if mode == "check":
        _, losses = it.run()
        print("CHECK names=%d %s" % (names, " ".join(f"{k}={v:.9g}" for k, v in losses.items())),
              flush=True)
        return
    if mode == "mem":
        base = reset_peak_rss()
        for _ in range(int(kv["steps"])):
            it.run()
        peak = rss_bytes("VmHWM")
        print(f"MEM peak_rss={peak} base_rss={base} growth={peak - base}", flush=True)
        return
    w, s = (int(v) for v in kv["iters"].split(","))
    for _ in range(w):
        it.run()
    runs = [it.run() for _ in range(s)]
    med = [statistics.median(r[0][i] for r in runs) for i in range(3)]
    print(f"ITER ms={med[0]:.3f} d={med[1]:.3f} g={med[2]:.3f} "
          f"last={runs[-1][1]['loss_d']:.6g}", flush=True)


if __name__ == "__main__":
    main()
