#!/usr/bin/python3
"""The zoo's segmentation networks (trainer/nn/segnets.c) in plain PyTorch,
for tests/trainer/segnets_ref.py (reference numbers) and bench_seg
(bench/run.sh seg); torchvision is not installed here and not used.

  DeepLabV3  torchvision's deeplabv3_resnet50 layout and names on a ResNet
             of any depth and width: backbone.conv1/bn1/layer1..4 (stride
             replaced by dilation as torchvision's replace_stride_with_
             dilation: output stride 8 dilates layer3 by 2 and layer4 by 4,
             16 layer4 by 2; a basic block dilates its first convolution
             only, as mmsegmentation's), classifier (ASPP, 3x3 conv + BN +
             ReLU, 1x1 to the classes), aux_classifier (torchvision's
             FCNHead on layer3).  Both outputs bilinearly resized
             (align_corners False) to the input's size; aux only in
             training mode, as kpl (torchvision gives it in both modes).
  UNet       kpl's U-Net: inc, down1..downD (max-pool 2, double conv),
             up1..upD (ConvTranspose2d 2/2, or bilinear x2 with
             align_corners False; then a double conv of concat(skip, up),
             the up map zero-padded to the skip's size when an odd size
             left it short), outc 1x1.

As a program (bench_seg's reference side):

  torch_segnets.py check FILE KEY=VALUE...
      Loads the model and the batch bench_seg wrote to FILE (every name
      and shape must match), runs one training-mode forward with dropout
      off and prints
        CHECK names=<n> loss=<v> out_max_abs=<v> out_max_rel=<v>
      comparing the outputs with the file's "out:" entries.
  torch_segnets.py time FILE KEY=VALUE... train=W,S infer=W,S
      Times S training steps after W warm-up ones (forward, per-pixel
      cross entropy with ignore_index 255 (+ aux_weight x the aux head's),
      backward, SGD with momentum), then inference of the first image
      (evaluation mode, no grad); prints medians:
        TRAIN ms=<ms> fwd=<ms> loss=<ms> bwd=<ms> step=<ms> last=<loss>
        INFER ms=<ms>
      layout=channels_last runs the model and batch in PyTorch's
      channels_last memory format (default nchw).
  torch_segnets.py mem FILE KEY=VALUE... what=train|infer steps=S
      Runs S training steps (or inferences) and prints the process's peak
      resident memory, and its growth over the resident memory after the
      model and batch were loaded (the peak reset there through
      /proc/self/clear_refs):
        MEM peak_rss=<bytes> base_rss=<bytes> growth=<bytes>
KEY=VALUE: model (deeplabv3|unet) threads depth width in_channels classes
output_stride aspp rates (a,b,c) aux aux_weight upsample lr momentum wd.

FILE (bench_seg writes it): "KPLSEG1", then entries: u32 name length,
name, u32 ndim, ndim x i64 dims, f32 data.  Names "p:<param>",
"b:<buffer>", "in:images", "in:labels" (as f32), "out:<i>".
"""
import math
import statistics
import struct
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---- ResNet with dilation ---------------------------------------------------------------------

class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin, planes, stride, dilation):
        super().__init__()
        # a dilated basic block dilates its first convolution alone (mmsegmentation)
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, dilation, dilation, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or cin != planes:
            self.downsample = nn.Sequential(nn.Conv2d(cin, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (self.downsample(x) if self.downsample is not None else x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin, planes, stride, dilation):
        super().__init__()
        out = planes * 4
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        # torchvision's v1.5: the stride (and the dilation) on the 3x3
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, dilation, dilation, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or cin != out:
            self.downsample = nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (self.downsample(x) if self.downsample is not None else x))


COUNTS = {18: [2, 2, 2, 2], 34: [3, 4, 6, 3], 50: [3, 4, 6, 3], 101: [3, 4, 23, 3],
          152: [3, 8, 36, 3]}


class ResNetBackbone(nn.Module):
    """torchvision's ResNet up to layer4 (ImageNet stem) at output stride 8,
    16 or 32; forward returns (layer3, layer4)."""

    def __init__(self, depth, width, in_channels, output_stride):
        super().__init__()
        block = Bottleneck if depth >= 50 else BasicBlock
        self.conv1 = nn.Conv2d(in_channels, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        dilate = [False, False, output_stride <= 8, output_stride <= 16]
        cin, dilation = width, 1
        for s in range(4):
            stride, previous = (2 if s > 0 else 1), dilation
            if dilate[s]:
                dilation *= stride
                stride = 1
            blocks = []
            for k in range(COUNTS[depth][s]):
                blocks.append(block(cin, width << s, stride if k == 0 else 1,
                                    previous if k == 0 else dilation))
                cin = (width << s) * block.expansion
            setattr(self, f"layer{s + 1}", nn.Sequential(*blocks))
        self.channels = cin

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        c4 = self.layer3(self.layer2(self.layer1(x)))
        return c4, self.layer4(c4)


# ---- DeepLabv3 ----------------------------------------------------------------------------------

def conv_bn_relu(cin, cout, k, dilation=1):
    return [nn.Conv2d(cin, cout, k, padding=dilation * (k // 2), dilation=dilation, bias=False),
            nn.BatchNorm2d(cout), nn.ReLU()]


class ASPPPooling(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(nn.AdaptiveAvgPool2d(1), *conv_bn_relu(cin, cout, 1))

    def forward(self, x):
        y = super().forward(x)
        return F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)


class ASPP(nn.Module):
    def __init__(self, cin, rates, cout, dropout=0.5):
        super().__init__()
        branches = [nn.Sequential(*conv_bn_relu(cin, cout, 1))]
        branches += [nn.Sequential(*conv_bn_relu(cin, cout, 3, r)) for r in rates]
        branches.append(ASPPPooling(cin, cout))
        self.convs = nn.ModuleList(branches)
        self.project = nn.Sequential(*conv_bn_relu(len(branches) * cout, cout, 1),
                                     nn.Dropout(dropout))

    def forward(self, x):
        return self.project(torch.cat([b(x) for b in self.convs], 1))


class DeepLabV3(nn.Module):
    def __init__(self, depth=50, width=64, in_channels=3, classes=21, output_stride=8,
                 rates=(12, 24, 36), aspp=256, aux=True):
        super().__init__()
        self.backbone = ResNetBackbone(depth, width, in_channels, output_stride)
        c5 = self.backbone.channels
        self.classifier = nn.Sequential(ASPP(c5, rates, aspp), *conv_bn_relu(aspp, aspp, 3),
                                        nn.Conv2d(aspp, classes, 1))
        self.aux_classifier = None
        if aux:
            c4 = c5 // 2
            self.aux_classifier = nn.Sequential(*conv_bn_relu(c4, c4 // 4, 3), nn.Dropout(0.1),
                                                nn.Conv2d(c4 // 4, classes, 1))

    def forward(self, x):
        size = x.shape[-2:]
        c4, c5 = self.backbone(x)
        out = [F.interpolate(self.classifier(c5), size=size, mode="bilinear",
                             align_corners=False)]
        if self.aux_classifier is not None and self.training:
            out.append(F.interpolate(self.aux_classifier(c4), size=size, mode="bilinear",
                                     align_corners=False))
        return out

    def dropouts(self):
        return [m for m in self.modules() if isinstance(m, nn.Dropout)]


# ---- U-Net ----------------------------------------------------------------------------------------

class DoubleConv(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.double_conv = nn.Sequential(*conv_bn_relu(cin, cout, 3), *conv_bn_relu(cout, cout, 3))

    def forward(self, x):
        return self.double_conv(x)


class Down(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.maxpool_conv = nn.Sequential(nn.MaxPool2d(2), DoubleConv(cin, cout))

    def forward(self, x):
        return self.maxpool_conv(x)


class Up(nn.Module):
    def __init__(self, cin, cout, bilinear):
        super().__init__()
        if bilinear:
            self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
            self.conv = DoubleConv(cin + cout, cout)
        else:
            self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2)
            self.conv = DoubleConv(2 * cout, cout)

    def forward(self, x, skip):
        x = self.up(x)
        dh, dw = skip.shape[2] - x.shape[2], skip.shape[3] - x.shape[3]
        if dh or dw:
            x = F.pad(x, [dw // 2, dw - dw // 2, dh // 2, dh - dh // 2])
        return self.conv(torch.cat([skip, x], 1))


class UNet(nn.Module):
    def __init__(self, in_channels=1, classes=2, width=64, depth=4, bilinear=False):
        super().__init__()
        self.depth = depth
        self.inc = DoubleConv(in_channels, width)
        for i in range(1, depth + 1):
            setattr(self, f"down{i}", Down(width << (i - 1), width << i))
        for i in range(1, depth + 1):
            setattr(self, f"up{i}", Up(width << (depth - i + 1), width << (depth - i), bilinear))
        self.outc = nn.Conv2d(width, classes, 1)

    def forward(self, x):
        skips = []
        x = self.inc(x)
        for i in range(1, self.depth + 1):
            skips.append(x)
            x = getattr(self, f"down{i}")(x)
        for i in range(1, self.depth + 1):
            x = getattr(self, f"up{i}")(x, skips[self.depth - i])
        return [self.outc(x)]

    def dropouts(self):
        return []


def build_model(kv):
    """The network a bench_seg KEY=VALUE set describes."""
    if kv["model"] == "deeplabv3":
        return DeepLabV3(int(kv["depth"]), int(kv["width"]), int(kv["in_channels"]),
                         int(kv["classes"]), int(kv["output_stride"]),
                         [int(r) for r in kv["rates"].split(",")], int(kv["aspp"]),
                         kv["aux"] == "1")
    return UNet(int(kv["in_channels"]), int(kv["classes"]), int(kv["width"]), int(kv["depth"]),
                kv["upsample"] == "bilinear")


# ---- bench_seg's reference side -----------------------------------------------------------------

def read_entries(path, magic=b"KPLSEG1"):
    """The entries of a file bench_seg (or bench_gan, magic KPLGAN1) wrote,
    by name."""
    import numpy as np
    data = open(path, "rb").read()
    if data[:7] != magic:
        sys.exit(f"torch_segnets: {path} is not a {magic.decode()} file")
    off, out = 7, {}
    while off < len(data):
        (ln,) = struct.unpack_from("<I", data, off)
        off += 4
        name = data[off:off + ln].decode()
        off += ln
        (nd,) = struct.unpack_from("<I", data, off)
        off += 4
        dims = struct.unpack_from(f"<{nd}q", data, off)
        off += 8 * nd
        n = math.prod(dims)
        out[name] = torch.from_numpy(np.frombuffer(data, "<f4", n, off).copy()).reshape(dims)
        off += 4 * n
    return out


def state_diff(want, got):
    """None when the tensors got (kpl's, by name) are want's (a state
    dict) in names and shapes, else what differs."""
    bad = [f"{k}: kpl {tuple(got[k].shape)}, torch {tuple(want[k].shape)}"
           for k in got if k in want and got[k].shape != want[k].shape]
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if bad or missing or extra:
        return f"shapes {bad}; only in torch {missing}; only in kpl {extra}"
    return None


def load(path, kv):
    model = build_model(kv)
    ent = read_entries(path)
    want = {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
    got = {k[2:]: v for k, v in ent.items() if k[:2] in ("p:", "b:")}
    diff = state_diff(want, got)
    if diff:
        sys.exit(f"torch_segnets: state dicts differ: {diff}")
    params = dict(model.named_parameters())
    for k in (k for k in ent if k.startswith("p:")):
        if k[2:] not in params:
            sys.exit(f"torch_segnets: kpl's parameter {k[2:]} is a buffer here")
    model.load_state_dict(got, strict=False)
    return model, ent["in:images"], ent["in:labels"].long(), ent, len(got)


def seg_loss(outs, labels, aux_weight):
    """Per-pixel cross entropy (mean over the pixels not labelled 255), the
    aux head's weighted by aux_weight."""
    loss = F.cross_entropy(outs[0], labels, ignore_index=255)
    if len(outs) > 1:
        loss = loss + aux_weight * F.cross_entropy(outs[1], labels, ignore_index=255)
    return loss


def rss_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return -1


def reset_peak_rss():
    """VmHWM back to the current RSS (Linux >= 4.0); the current RSS."""
    base = rss_bytes("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return base


def images_format(images):
    return (torch.channels_last if images.is_contiguous(memory_format=torch.channels_last)
            and not images.is_contiguous() else torch.contiguous_format)


def main():
    if len(sys.argv) < 3 or sys.argv[1] not in ("check", "time", "mem"):
        sys.exit(__doc__)
    mode, path = sys.argv[1], sys.argv[2]
    kv = dict(a.partition("=")[::2] for a in sys.argv[3:])
    torch.set_num_threads(int(kv["threads"]))
    torch.manual_seed(0)
    model, images, labels, ent, names = load(path, kv)
    if kv.get("layout", "nchw") == "channels_last":
        # PyTorch's other CPU layout for convolutions (oneDNN NHWC); the
        # logits come out channels_last too and the loss takes them so
        model = model.to(memory_format=torch.channels_last)
        images = images.contiguous(memory_format=torch.channels_last)
    aux_weight = float(kv.get("aux_weight", "0.5"))
    model.train()
    if mode == "check":
        for d in model.dropouts():
            d.eval()
        with torch.no_grad():
            outs = model(images)
            loss = seg_loss(outs, labels, aux_weight)
        amax, rmax = 0.0, 0.0
        for i, o in enumerate(outs):
            k = ent.get(f"out:{i}")
            if k is None or k.shape != o.shape:
                sys.exit(f"torch_segnets: output {i}: kpl {None if k is None else tuple(k.shape)}"
                         f", torch {tuple(o.shape)}")
            d = float((k - o).abs().max())
            amax = max(amax, d)
            rmax = max(rmax, d / max(float(o.abs().max()), 1e-12))
        if f"out:{len(outs)}" in ent:
            sys.exit(f"torch_segnets: kpl gives more than {len(outs)} outputs")
        print(f"CHECK names={names} loss={loss.item():.9g} out_max_abs={amax:.6g} "
              f"out_max_rel={rmax:.6g}", flush=True)
        return
    opt = torch.optim.SGD(model.parameters(), lr=float(kv["lr"]), momentum=float(kv["momentum"]),
                          weight_decay=float(kv["wd"]))
    opt.zero_grad(set_to_none=True)

    def step():
        t0 = time.perf_counter()
        outs = model(images)
        t1 = time.perf_counter()
        loss = seg_loss(outs, labels, aux_weight)
        val = loss.item()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        if not math.isfinite(val):
            sys.exit(f"torch_segnets: the loss is not finite: {val}")
        return [(t4 - t0) * 1e3, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3,
                (t4 - t3) * 1e3, val]

    x1 = images[:1].contiguous(memory_format=images_format(images))

    def infer():
        t0 = time.perf_counter()
        with torch.no_grad():
            model(x1)
        return (time.perf_counter() - t0) * 1e3

    if mode == "mem":
        base = reset_peak_rss()
        if kv["what"] == "infer":
            model.eval()
        for _ in range(int(kv["steps"])):
            step() if kv["what"] == "train" else infer()
        peak = rss_bytes("VmHWM")
        print(f"MEM peak_rss={peak} base_rss={base} growth={peak - base}", flush=True)
        return
    w, s = (int(v) for v in kv["train"].split(","))
    for _ in range(w):
        step()
    ts = [step() for _ in range(s)]
    med = [statistics.median(t[i] for t in ts) for i in range(5)]
    print(f"TRAIN ms={med[0]:.3f} fwd={med[1]:.3f} loss={med[2]:.3f} bwd={med[3]:.3f} "
          f"step={med[4]:.3f} last={ts[-1][5]:.6g}", flush=True)
    model.eval()
    w, s = (int(v) for v in kv["infer"].split(","))
    for _ in range(w):
        infer()
    print(f"INFER ms={statistics.median(infer() for _ in range(s)):.3f}", flush=True)


if __name__ == "__main__":
    main()
