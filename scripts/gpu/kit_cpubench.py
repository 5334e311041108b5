"""kit_cpubench.py — the GPU kit's step 8 (cpubench), run by kit.py: kpl's
ResNet-50 training step on two of the GPU machine's CPU cores (an AMX Xeon
on the H100 and H200 kinds) against the image's PyTorch, and which oneDNN
kernels each side ran (docs/gpu.md)."""
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def step_cpubench(self, parse_result):
    """ResNet-50 b8 (224 px) training steps on two of this machine's cores
    (taskset 0,1; the project's machines have 2): kpl in f32 and bf16
    (kept layouts as timed, every convolution asked for NHWC, and
    plain tensors) against PyTorch's
    channels_last f32 and channels_last + autocast bf16 (the image's
    PyTorch, its own oneDNN), alternating rounds; then one bf16 step of
    each side under ONEDNN_VERBOSE, summarized as the primitives and
    implementations that ran and their time.  bench_nn's rows do the same
    on the project's own machines; this CPU (AMX on the H100 kind) is one
    they never have.  self: kit.py's Kit; parse_result: its RESULT-line
    parser."""
    self.open_log("4-resnet50.log")  # at most 8 files come back
    torch_py = f"{ROOT}/bench/torch_gpu_resnet.py"
    batch, warm, steps = (1, 1, 1) if self.args.rehearse else (8, 2, 5)
    rounds = 1 if self.args.rehearse else self.args.cpubench_rounds
    pin = ["taskset", "-c", "0,1"] if shutil.which("taskset") and (os.cpu_count() or 1) > 2 else []
    rc, secs, to, o = self.run([self.kpl, "info"], 60)
    m = re.search(r"^cpu: (.*)$", o or "", re.M)
    cpu = m.group(1) if m else None
    two = {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    sides = {
        "kpl_f32": ([f"{self.bin}/bench_nn", "--step", "resnet50", str(batch), str(warm),
                     str(steps), "f32"], False),
        "kpl_bf16": ([f"{self.bin}/bench_nn", "--step", "resnet50", str(batch), str(warm),
                      str(steps), "bf16"], False),
        "kpl_bf16_nhwc": ([f"{self.bin}/bench_nn", "--step", "resnet50", str(batch), str(warm),
                           str(steps), "bf16", "nhwc"], False),
        "kpl_bf16_plain": ([f"{self.bin}/bench_nn", "--step", "resnet50", str(batch), str(warm),
                            str(steps), "bf16", "plain"], False),
        "torch_cl_f32": ([sys.executable, torch_py, str(batch), str(warm), str(steps), "f32",
                          "cpu"], True),
        "torch_cl_bf16": ([sys.executable, torch_py, str(batch), str(warm), str(steps), "bf16",
                           "cpu"], True),
    }
    ms = {k: [] for k in sides}
    errors = {}
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            if name not in self.args.cpubench_sides.split(","):
                continue
            if self.left() < 40:
                errors.setdefault(name, "out of time (--budget)")
                continue
            cmd, clean = sides[name]
            rc, secs, to, o = self.run(pin + cmd, 150, env=two, clean=clean)
            res = parse_result(o)
            if rc == 0 and res and "ms_median" in res:
                ms[name].append(res["ms_median"])
            else:
                errors[name] = "timeout" if to else f"exit {rc}: {(o or '')[-300:]}"
    med = {k: (sorted(v)[len(v) // 2] if v else None) for k, v in ms.items()}
    row = dict(case=f"resnet50_b{batch}", cores=2, cpu=cpu, ms=med, rounds=rounds,
               ref=f"torch {torch_version()} channels_last (autocast bf16)")

    def ratio(a, b):
        return round(med[b] / med[a], 3) if med.get(a) and med.get(b) else None
    row.update(bf16_vs_torch_bf16=ratio("kpl_bf16", "torch_cl_bf16"),
               f32_vs_torch_f32=ratio("kpl_f32", "torch_cl_f32"),
               kpl_bf16_over_f32=ratio("kpl_bf16", "kpl_f32"),
               blocked_over_plain_bf16=ratio("kpl_bf16", "kpl_bf16_plain"),
               nhwc_over_auto_bf16=ratio("kpl_bf16_nhwc", "kpl_bf16"),
               nhwc_vs_torch_bf16=ratio("kpl_bf16_nhwc", "torch_cl_bf16"))
    # which oneDNN kernels ran, one bf16 step (after one warm-up) each side
    verbose = {}
    for name in ("kpl_bf16", "kpl_bf16_nhwc", "torch_cl_bf16"):
        if self.left() < 40 or name not in self.args.cpubench_sides.split(","):
            continue
        cmd, clean = sides[name]
        cmd = cmd[:3] + ["1", "1", "1"] + cmd[6:] if name.startswith("kpl") else \
            cmd[:2] + ["1", "1", "1"] + cmd[5:]
        rc, secs, to, o = self.run(pin + cmd, 150, env=dict(two, ONEDNN_VERBOSE="1",
                                                             DNNL_VERBOSE="1"),
                                   clean=clean, quiet=True)
        verbose[name] = onednn_summary(o)
    row["onednn"] = verbose
    for name in sides:
        if name not in self.args.cpubench_sides.split(","):
            errors.pop(name, None)
    if errors:
        kpl_err = {k: v for k, v in errors.items() if k.startswith("kpl")}
        self.record("cpubench", "failed" if kpl_err else "ref_failed",
                    error="; ".join(f"{k}: {v}" for k, v in errors.items()), **row)
    else:
        self.record("cpubench", "passed", **row)

def torch_version():
    r = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                       env=dict(os.environ),
                       capture_output=True, text=True)
    return r.stdout.strip() or None


def onednn_summary(text):
    """The last step's ONEDNN_VERBOSE exec lines (oneDNN 2.x: dnnl_verbose,exec,cpu,KIND,
    IMPL,...,MS; 3.x: onednn_verbose,[TIME,]primitive,exec,cpu,KIND,IMPL,
    ...,MS) summed per primitive kind and implementation: calls and ms."""
    agg = {}
    lines = (text or "").splitlines()
    # only the last step's: the lines between the last two "step N ... ms"
    # lines the programs print (the first step's algorithm search aside)
    marks = [i for i, l in enumerate(lines) if re.search(r"\bstep \d+ [\d.]+ ms", l)]
    if len(marks) >= 2:
        lines = lines[marks[-2] + 1:marks[-1]]
    for line in lines:
        if "_verbose" not in line or ",exec," not in line:
            continue
        f = line.strip().split(",")
        try:
            i = f.index("exec")
            kind, impl = f[i + 2], f[i + 3]
            t = float(f[-1])
        except (ValueError, IndexError):
            continue
        # the layouts: a convolution's src, a reorder's src -> dst
        tags = re.findall(r"blocked:(\w+)", " ".join(f[i + 4:i + 8]))
        key = f"{kind}:{impl}"
        if tags and kind == "convolution":
            key += f" src {tags[0]}"
        elif len(tags) >= 2 and kind == "reorder":
            key += f" {tags[0]}->{tags[1]}"
        a = agg.setdefault(key, [0, 0.0])
        a[0] += 1
        a[1] += t
    top = sorted(agg.items(), key=lambda kv: -kv[1][1])
    return [{"prim": k, "calls": c, "ms": round(t, 1)} for k, (c, t) in top[:16]]
