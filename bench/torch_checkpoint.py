#!/usr/bin/python3
"""PyTorch's side of bench_nn's `recompute` rows: a ResNet training step
(shared/baselines/torch_resnet.py's model, SGD with momentum) with every
residual block run through torch.utils.checkpoint (the same segments
kpl's memory.recompute: blocks recomputes), or plain.

Usage: /usr/bin/python3 torch_checkpoint.py BASELINES_DIR {r18|r50} {plain|checkpoint}
           NTHREADS BATCH WARMUP STEPS
Prints one RESULT line: median step ms and the process's peak RSS.
"""
import resource
import statistics
import sys
import time

sys.path.insert(0, sys.argv[1])
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402
from torch_resnet import ResNet, BasicBlock, Bottleneck  # noqa: E402

arch, var = sys.argv[2], sys.argv[3]
nt, B, warm, steps = (int(a) for a in sys.argv[4:8])
torch.set_num_threads(nt)
torch.manual_seed(0)
if arch == "r18":
    model, hw, nc = ResNet(BasicBlock, [2, 2, 2, 2], 10, False), 32, 10
else:
    model, hw, nc = ResNet(Bottleneck, [3, 4, 6, 3], 1000, True), 224, 1000


class Checkpointed(torch.nn.Module):
    """A block whose activations are recomputed in the backward."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        # non-reentrant: the variant PyTorch recommends, which keeps
        # gradients flowing to the parameters as kpl's regions do
        return checkpoint(self.block, x, use_reentrant=False)


if var == "checkpoint":
    model.layers = torch.nn.Sequential(*[Checkpointed(b) for b in model.layers])
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
x = torch.randn(B, 3, hw, hw)
y = torch.randint(0, nc, (B,))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
model.train()


def step():
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


times = []
for i in range(warm + steps):
    t0 = time.perf_counter()
    loss = step()
    t1 = time.perf_counter()
    if i >= warm:
        times.append((t1 - t0) * 1e3)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
print(f"RESULT arch={arch} var={var} threads={nt} batch={B} ms_median={statistics.median(times):.1f} "
      f"maxrss_MiB={rss:.0f} rss_before_MiB={rss0:.0f} loss={float(loss):.4f}", flush=True)
