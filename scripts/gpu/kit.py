#!/usr/bin/env python3
"""kit.py — the GPU kit's checks, run on the GPU machine by scripts/gpu/run.sh.

Unpacks the kit that scripts/gpu/pack.sh made (.gpu/kit.tar.zst), points the
loader at it and at the CUDA libraries of python3's nvidia-* wheels, and runs
the checks of docs/gpu.md, each step under its own time limit and all of them
inside --budget seconds, so that one hang cannot eat the others:

  0 preflight  nvidia-smi, the kit's libraries, `kpl info` (stops here, exit
               1, with the CUDA error where there is no usable GPU), kpl demo
  1 tests      the cuda-labelled ctest tests one GPU allows (nccl: step 5)
  2 sanitizer  compute-sanitizer memcheck on test_cuda's kernel group,
               racecheck on the vision kernels
  3 recipe     the default recipe on cuda:0, 2 epochs, f32, bf16 and fp16
  4 resnet50   a ResNet-50 training step, kpl against PyTorch on the GPU
  5 nccl       kpl's collective layer through NCCL, a world of one rank
  6 tasks      FCOS, DeepLabv3, DCGAN for a few steps on cuda:0; kpl export
               and kpl infer of step 3's GPU checkpoint
  7 cpu        the C unit tests and their ISA variants on this machine's CPU
               (an AMX Xeon on the H100 machine: the only one the project
               reaches); its lines go to step 1's log
  8 cpubench   a ResNet-50 b8 training step on 2 of this CPU's cores, kpl
               f32/bf16 (kept layouts as chosen, NHWC asked, plain) against
               PyTorch channels_last f32/autocast bf16, and which oneDNN
               kernels each side ran; lines in step 4's log

Everything lands in --out (default gpu-report/): report.jsonl, one JSON line
per result, and one log per step (at most 8 files).  --rehearse runs the same
steps on this machine's CPU with small sizes, to try the kit's plumbing
where no GPU is at hand (what needs a GPU is then reported as skipped).

Exit status: 0 all ran and passed; 1 a step failed or timed out, or no GPU.
"""
import argparse
import glob
import json
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import time

import kit_cpubench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = ("tests", "sanitizer", "recipe", "resnet50", "nccl", "tasks", "cpu", "cpubench")


class Kit:
    def __init__(self, args):
        self.args = args
        self.out = os.path.abspath(args.out)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget
        self.failures = 0
        os.makedirs(self.out, exist_ok=True)
        # a new report replaces an earlier run's files, and only those: --out
        # may name a folder that holds other things
        for f in glob.glob(os.path.join(self.out, "[0-6]-*.log")) + \
                glob.glob(os.path.join(self.out, "report.jsonl")):
            os.remove(f)
        self.report = open(os.path.join(self.out, "report.jsonl"), "a", buffering=1)
        self.log = None
        self.env = dict(os.environ)
        self.dev = "cpu" if args.rehearse else "cuda:0"
        self.gpus = 0
        self.child = None  # the running command's process group (its own session)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.stopped)

    def stopped(self, sig, frame):
        """SIGTERM/SIGINT/SIGHUP: the running command is in a session of its
        own, out of reach of a signal to run.sh's group, so it is ended here,
        the report says so, and the kit exits 128 + sig."""
        if self.child:
            try:
                os.killpg(self.child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.record("summary", "interrupted", signal=signal.Signals(sig).name,
                    failures=self.failures, seconds=round(time.monotonic() - self.t0, 1))
        os._exit(128 + sig)

    # ---- output --------------------------------------------------------------------------
    def open_log(self, name):
        if self.log:
            self.log.close()
        self.log = open(os.path.join(self.out, name), "a", buffering=1)

    def say(self, text):
        print(text, flush=True)
        if self.log:
            self.log.write(text + "\n")

    def record(self, step, status, **fields):
        row = {"step": step, "status": status}
        row.update(fields)
        self.report.write(json.dumps(row) + "\n")
        # a reference that fails leaves its comparison without a figure: a
        # failure too, but in a rehearsal (PyTorch need not be installed)
        if status in ("failed", "timeout") or (status == "ref_failed" and not self.args.rehearse):
            self.failures += 1
        brief = {k: v for k, v in row.items() if k not in ("tail", "error")}
        self.say("REPORT " + json.dumps(brief) + (f"  ({row.get('error')})" if row.get("error") else ""))

    def left(self):
        return self.deadline - time.monotonic()

    # ---- running a command ---------------------------------------------------------------
    def run(self, cmd, limit, cwd=None, env=None, quiet=False, clean=False):
        """Runs cmd (a list) with its output in the step's log, killed with its
        whole process group at min(limit, what the budget leaves).  Returns
        (rc, seconds, timed_out, output); rc None when it never started."""
        limit = max(1.0, min(limit, self.left() - 5))
        # clean: the environment run.sh was started with (PyTorch's side must
        # not load the kit's libraries)
        e = dict(os.environ, PYTHONUNBUFFERED="1") if clean else dict(self.env)
        if env:
            e.update(env)
        self.say(f"$ {' '.join(cmd)}   (limit {limit:.0f} s{', cwd ' + cwd if cwd else ''})")
        start = time.monotonic()
        try:
            p = subprocess.Popen(cmd, cwd=cwd, env=e, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as err:
            self.say(f"cannot start: {err}")
            return None, 0.0, False, str(err)
        self.child = p.pid
        chunks, timed_out = [], False
        os.set_blocking(p.stdout.fileno(), False)
        while True:
            try:
                data = p.stdout.read()
            except (BlockingIOError, TypeError):
                data = None
            if data:
                text = data.decode("utf-8", "replace")
                chunks.append(text)
                if self.log:
                    self.log.write(text)
                if not quiet:
                    sys.stdout.write(text)
                    sys.stdout.flush()
            if p.poll() is not None:
                rest = p.stdout.read() or b""
                if rest:
                    text = rest.decode("utf-8", "replace")
                    chunks.append(text)
                    if self.log:
                        self.log.write(text)
                break
            if time.monotonic() - start > limit:
                timed_out = True
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
                break
            time.sleep(0.05)
        try:  # what the command left behind (a daemon of its group)
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.child = None
        secs = time.monotonic() - start
        self.say(f"-> exit {p.returncode}{' (killed at its time limit)' if timed_out else ''}, {secs:.1f} s")
        return p.returncode, secs, timed_out, "".join(chunks)

    # ---- set-up --------------------------------------------------------------------------
    def unpack(self):
        bundle = os.path.abspath(self.args.bundle)
        archive = os.path.join(bundle, "kit.tar.zst")
        if not os.path.exists(archive):
            return f"no kit at {archive}: run scripts/gpu/pack.sh on a machine with nvcc, carry .gpu"
        work = os.path.abspath(self.args.work)
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        zstd = shutil.which("zstd")
        zenv = dict(os.environ)
        if not zstd:
            zstd = os.path.join(bundle, "unpack", "zstd")
            zenv["LD_LIBRARY_PATH"] = os.path.join(bundle, "unpack")
        cmd = f"'{zstd}' -q -d --long=28 -c '{archive}' | tar -x -C '{work}'"
        r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], env=zenv,
                           capture_output=True, text=True)
        if r.returncode:
            return f"unpacking {archive} failed: {r.stderr.strip()[-400:]}"
        self.kit = os.path.join(work, "kit")
        with open(os.path.join(self.kit, "MANIFEST.json")) as f:
            self.manifest = json.load(f)
        return None

    def wheel_lib_dirs(self):
        """The lib/ folders of python3's nvidia-* wheels (cuDNN, NCCL, cuBLAS,
        the CUDA runtime), found from site-packages, not hard-coded."""
        roots = list(site.getsitepackages()) + [site.getusersitepackages()]
        dirs = []
        for r in roots:
            for d in sorted(glob.glob(os.path.join(r, "nvidia", "**", "lib"), recursive=True)):
                if glob.glob(os.path.join(d, "lib*.so*")) and d not in dirs:
                    dirs.append(d)
        return dirs

    def set_env(self):
        k = self.kit
        self.wheels = self.wheel_lib_dirs()
        cuda_lib = [d for d in ("/usr/local/cuda/lib64",) if os.path.isdir(d)]
        paths = [f"{k}/build/lib", f"{k}/lib", f"{k}/ompi/lib"] + self.wheels + cuda_lib
        old = os.environ.get("LD_LIBRARY_PATH")
        self.env["LD_LIBRARY_PATH"] = ":".join(paths + ([old] if old else []))
        # Open MPI relocated: the variables its env.sh sets
        r = subprocess.run(["bash", "-c", f". '{k}/ompi/env.sh' && env -0"], capture_output=True,
                           env=dict(self.env, KIT_OMPI=f"{k}/ompi"))
        if r.returncode == 0:
            for item in r.stdout.split(b"\0"):
                if b"=" in item:
                    key, val = item.decode().split("=", 1)
                    if key.startswith(("OMPI_", "OPAL_", "PMIX_")) or key in ("PATH",):
                        self.env[key] = val
        self.env["PATH"] = f"{k}/build/bin:" + self.env.get("PATH", "")
        self.env["KPL_FMNIST_DIR"] = f"{k}/data/fashion-mnist"
        self.env["PYTHONUNBUFFERED"] = "1"
        self.bin = f"{k}/build/bin"
        self.kpl = f"{k}/build/bin/kpl"
        self.scratch = os.path.join(os.path.abspath(self.args.work), "runs")
        os.makedirs(self.scratch, exist_ok=True)

    # ---- 0: preflight --------------------------------------------------------------------
    def preflight(self):
        self.open_log("0-preflight.log")
        info = {"host": os.uname().nodename}
        err = self.unpack()
        if err:
            self.record("preflight", "failed", error=err, **info)
            return False
        self.set_env()
        info.update(commit=self.manifest.get("commit"), dirty=self.manifest.get("dirty"),
                    packed=self.manifest.get("packed"), wheel_lib_dirs=self.wheels)
        smi = shutil.which("nvidia-smi")
        if smi:
            self.run([smi], 30)
            rc, _, _, o = self.run([smi, "--query-gpu=name,driver_version,memory.total",
                                    "--format=csv,noheader"], 30)
            if rc == 0 and o.strip():
                parts = [p.strip() for p in o.strip().splitlines()[0].split(",")]
                info.update(gpu=parts[0], driver=parts[1] if len(parts) > 1 else None,
                            gpu_memory=parts[2] if len(parts) > 2 else None)
        else:
            self.say("no nvidia-smi on PATH")
        # glibc: the kit's programs were linked against the packing machine's
        need = self.manifest.get("glibc_min", "0")
        have = os.confstr("CS_GNU_LIBC_VERSION").split()[-1] if hasattr(os, "confstr") else "0"
        info.update(glibc=have, glibc_needed=need)
        if tuple(map(int, have.split("."))) < tuple(map(int, need.split("."))):
            self.record("preflight", "failed", error=f"glibc {have} here, the kit needs {need}", **info)
            return False
        # every library of the kit's programs resolves
        missing = set()
        for p in glob.glob(f"{self.bin}/*"):
            r = subprocess.run(["ldd", p], capture_output=True, text=True, env=self.env)
            for line in r.stdout.splitlines():
                if "not found" in line:
                    missing.add(f"{os.path.basename(p)}: {line.split()[0]}")
        if missing:
            self.say("\n".join(sorted(missing)))
            self.record("preflight", "failed", error="libraries not found: " + "; ".join(sorted(missing)),
                        **info)
            return False
        rc, _, to, o = self.run([self.kpl, "info"], 60)
        info["kpl_info"] = o.strip().splitlines()[-3:] if o else None
        m = re.search(r"devices: cpu((?:, cuda:\d+)*)", o or "")
        self.gpus = len(re.findall(r"cuda:\d+", m.group(1))) if m else 0
        info["gpus"] = self.gpus
        if rc != 0 or to:
            self.record("preflight", "failed", error=f"kpl info: exit {rc}: {(o or '').strip()[-300:]}",
                        **info)
            return False
        if self.gpus == 0 and not self.args.rehearse:
            why = re.search(r"\(no CUDA GPU found: (.*)\)", o or "")
            self.record("preflight", "failed", error="no usable CUDA GPU: " +
                        (why.group(1) if why else "kpl info lists no cuda:0"), **info)
            return False
        self.record("preflight", "passed", seconds=round(time.monotonic() - self.t0, 1), **info)
        # a first computation on the device: its failure is reported, and the
        # steps still run (each says more than this can)
        rc, secs, to, o = self.run([self.kpl, "demo", "--device", self.dev], 60)
        self.record("demo", "passed" if rc == 0 and not to else "timeout" if to else "failed",
                    seconds=round(secs, 1), tail=(o or "").strip()[-600:])
        return True

    # ---- 1 and 5: the ctest tests --------------------------------------------------------
    def ctest_cases(self, select, listing="tests.json"):
        with open(os.path.join(self.kit, listing)) as f:
            tests = json.load(f)["tests"]
        build, src = self.manifest["build_dir"], self.manifest["source_dir"]
        mpirun = self.manifest.get("mpirun") or "/usr/bin/mpirun"
        cases = []
        for t in tests:
            if not select(t["name"]):
                continue
            props = {p["name"]: p["value"] for p in t.get("properties", [])}
            # ctest's fixtures (kpl_tmpdirs makes each test's TMPDIR with
            # cmake -E, a cmake the GPU image may hold elsewhere): run_ctest
            # makes the directory itself
            if "FIXTURES_SETUP" in props or "FIXTURES_CLEANUP" in props:
                continue

            def here(s):
                if s == mpirun or s.endswith("/mpirun"):
                    return shutil.which("mpirun", path=self.env["PATH"]) or s
                if s.startswith(build):
                    return self.kit + "/build" + s[len(build):]
                if s.startswith(src):
                    return ROOT + s[len(src):]
                return s
            cmd = [here(c) for c in t["command"]]
            cwd = here(props.get("WORKING_DIRECTORY", self.kit))
            os.makedirs(cwd, exist_ok=True)
            env = {}
            for kv in props.get("ENVIRONMENT", []):
                key, val = kv.split("=", 1)
                env[key] = val
            np_ = int(cmd[cmd.index("-np") + 1]) if "-np" in cmd else 1
            cases.append(dict(name=t["name"], cmd=cmd, cwd=cwd, env=env, ranks=np_,
                              skip=int(props.get("SKIP_RETURN_CODE", -1)),
                              timeout=float(props.get("TIMEOUT", 1500))))
        return cases

    def run_ctest(self, step, select, limit_each, listing="tests.json", gpu_tests=True):
        cases = self.ctest_cases(select, listing)
        if not cases:
            self.record(step, "failed", error=f"no such tests in the kit's {listing}")
        for c in cases:
            if self.left() < 15:
                self.record(step, "not_run", test=c["name"], error="out of time (--budget)")
                continue
            if c["env"].get("TMPDIR"):
                os.makedirs(c["env"]["TMPDIR"], exist_ok=True)
            rc, secs, to, o = self.run(c["cmd"], min(c["timeout"], limit_each), cwd=c["cwd"],
                                       env=c["env"])
            tail = (o or "")[-1500:]
            if to:
                self.record(step, "timeout", test=c["name"], seconds=round(secs, 1), tail=tail)
            elif rc == 0:
                self.record(step, "passed", test=c["name"], seconds=round(secs, 1))
            elif rc == c["skip"]:
                # a GPU test's skip is right only where it needs more GPUs than
                # there are; a CPU test's says what the machine lacks (a tool)
                ok = not gpu_tests or c["ranks"] > max(self.gpus, 0) or self.args.rehearse
                self.record(step, "skipped" if ok else "failed", test=c["name"],
                            seconds=round(secs, 1),
                            error=None if ok else "skipped on a machine with a GPU", tail=tail)
            else:
                self.record(step, "failed", test=c["name"], seconds=round(secs, 1), rc=rc, tail=tail)

    def step_tests(self):
        self.open_log("1-tests.log")
        self.run_ctest("tests", lambda n: "nccl" not in n, self.args.test_limit)

    def step_nccl(self):
        self.open_log("5-nccl.log")
        self.env["NCCL_DEBUG"] = "INFO"
        self.run_ctest("nccl", lambda n: "nccl" in n, 120)
        self.env.pop("NCCL_DEBUG", None)

    # ---- 7: the CPU suite -----------------------------------------------------------------
    def step_cpu(self):
        """pack.sh's CPU suite (cpu_tests.json): every C unit test and its
        ONEDNN_MAX_CPU_ISA variants, as ctest runs them, on this machine's
        CPU.  The programs hold the packing machine's paths: the source
        folder's (this checkout where it sits at the same path) and the build
        folder's, which is made a link to the kit's build folder where it does
        not exist here (test_cocoeval starts the kpl at that path)."""
        self.open_log("1-tests.log")  # at most 8 files come back: with step 1's
        if not os.path.exists(os.path.join(self.kit, "cpu_tests.json")):
            self.record("cpu", "failed", error="the kit has no CPU suite (cpu_tests.json)")
            return
        build = self.manifest["build_dir"]
        if not os.path.lexists(build):
            try:
                os.makedirs(os.path.dirname(build), exist_ok=True)
                os.symlink(os.path.join(self.kit, "build"), build)
            except OSError as e:
                self.say(f"cannot link {build} to the kit's build folder: {e}")
        rc, secs, to, o = self.run([self.kpl, "info"], 60)
        m = re.search(r"^cpu: (.*)$", o or "", re.M)
        self.record("cpu", "passed" if rc == 0 and not to else "failed", test="kpl info",
                    seconds=round(secs, 1), cpu=m.group(1) if m else None)
        # a rehearsal tries the plumbing on two short ones
        quick = ("test_keys", "test_kernels_avx2")
        self.run_ctest("cpu", (lambda n: n in quick) if self.args.rehearse else (lambda n: True),
                       self.args.test_limit, listing="cpu_tests.json", gpu_tests=False)

    # ---- 2: compute-sanitizer ------------------------------------------------------------
    def step_sanitizer(self):
        self.open_log("2-sanitizer.log")
        cs = shutil.which("compute-sanitizer") or next(iter(sorted(
            glob.glob("/usr/local/cuda*/bin/compute-sanitizer") +
            glob.glob("/opt/nvidia/**/compute-sanitizer", recursive=True))), None)
        if not cs:
            self.record("sanitizer", "skipped" if self.args.rehearse else "failed",
                        error="no compute-sanitizer on this machine")
            return
        test = f"{self.bin}/test_cuda"
        runs = [
            # every kernel family of test_cuda's main group; the caching
            # allocator hands each tensor its own cudaMalloc, so that an
            # access past a tensor is past an allocation memcheck knows
            ("memcheck", ["--tool", "memcheck", "--leak-check", "no"], "", 120),
            ("racecheck", ["--tool", "racecheck", "--racecheck-report", "all"],
             "test_box_kernels,test_roi_align_kernels", 120),
        ]
        for tool, opts, only, limit in runs:
            env = {"KPL_CUDA_ALLOC_UNCACHED": "1"}
            if only:
                # NMS over 3001 boxes, not 100003: racecheck needs minutes for those
                env.update(KPL_TEST_ONLY=only, KPL_TEST_SMALL="1")
            else:
                env["KPL_TEST_ONLY"] = "cuda"  # test_cuda's kernel group, by its name
            rc, secs, to, o = self.run([cs] + opts + ["--error-exitcode", "99", test], limit, env=env,
                                       quiet=True)
            errors = re.findall(r"=+ ERROR SUMMARY: (\d+) error", o or "")
            hazards = re.findall(r"=+ RACECHECK SUMMARY: (\d+) hazard", o or "")
            n = int(errors[-1]) if errors else None
            ran = re.findall(r"\[=+\] (\d+) test\(s\) run", o or "")
            fields = dict(tool=tool, seconds=round(secs, 1), errors=n,
                          hazards=int(hazards[-1]) if hazards else None,
                          tests=sum(map(int, ran)), only=env["KPL_TEST_ONLY"])
            if to:
                self.record("sanitizer", "timeout", tail=(o or "")[-1500:], **fields)
            elif rc == 0 and (n in (0, None)):
                self.record("sanitizer", "passed", **fields)
            else:
                first = re.search(r"=+ (Invalid|Race|Uninitialized|Program hit|Error).*", o or "")
                self.record("sanitizer", "failed", rc=rc, error=first.group(0)[:300] if first else None,
                            tail=(o or "")[-2500:], **fields)

    # ---- 3: the default recipe -----------------------------------------------------------
    def fm_args(self):
        return [f"data.root={self.scratch}/fm", f"data.convert.source={self.kit}/data/fashion-mnist",
                "log.progress=never"]

    def step_recipe(self):
        self.open_log("3-recipe.log")
        self.ckpt = None
        recipe = f"{ROOT}/recipes/fashion_mnist/cnn.yaml"
        epochs = 1 if self.args.rehearse else 2
        extra = ["data.train.limit=2048", "data.val.limit=1000"] if self.args.rehearse else []
        for prec in ("f32", "bf16", "fp16"):
            rd = f"{self.scratch}/cnn-{prec}"
            shutil.rmtree(rd, ignore_errors=True)
            cmd = [self.kpl, "train", recipe, f"device={self.dev}", f"epochs={epochs}",
                   f"precision={prec}", "data.workers=4", f"run_dir={rd}"] + self.fm_args() + extra
            rc, secs, to, o = self.run(cmd, 150)
            done = last_json(o, "done")
            peak = None
            try:
                with open(f"{rd}/metrics.jsonl") as f:
                    peaks = [json.loads(l).get("peak_mb") for l in f if '"timing"' in l]
                peak = max(p for p in peaks if p is not None) if peaks else None
            except (OSError, ValueError):
                pass
            fields = dict(precision=prec, epochs=epochs, seconds=round(secs, 1),
                          top1=done.get("val_top1") if done else None,
                          img_per_s=round(done["images_per_sec"], 1) if done else None,
                          peak_gpu_MiB=round(peak, 1) if peak else None,
                          skipped_steps=done.get("skipped_steps") if done else None,
                          train_examples=self.manifest.get("fmnist_train"))
            if to:
                self.record("recipe", "timeout", tail=(o or "")[-1500:], **fields)
            elif rc != 0 or not done:
                self.record("recipe", "failed", rc=rc, tail=(o or "")[-1500:], **fields)
            else:
                if prec == "f32":
                    self.ckpt = done.get("checkpoint")
                self.record("recipe", "passed", **fields)

    # ---- 4: ResNet-50 against PyTorch ----------------------------------------------------
    def step_resnet50(self):
        self.open_log("4-resnet50.log")
        torch_py = f"{ROOT}/bench/torch_gpu_resnet.py"
        if self.args.rehearse:
            configs, warm, steps, hw = [(2, "f32"), (2, "bf16"), (2, "fp16")], 1, 2, None
        else:
            configs = [(128, "bf16"), (128, "f32"), (128, "fp16"), (64, "bf16"), (64, "f32"),
                       (64, "fp16")]
            warm, steps = 3, 10
        for i, (batch, prec) in enumerate(configs):
            if self.left() < 30:
                self.record("resnet50", "not_run", case=f"b{batch}/{prec}", error="out of time (--budget)")
                continue
            kcmd = [f"{self.bin}/bench_nn", "--step", "resnet50", str(batch), str(warm), str(steps),
                    prec, f"device={self.dev}"] + (["tf32"] if prec == "f32" else [])
            tcmd = [sys.executable, torch_py, str(batch), str(warm), str(steps), prec, self.dev]
            sides = [("kpl", kcmd), ("torch", tcmd)]
            if i % 2:
                sides.reverse()  # which side goes first alternates
            res = {}
            for side, cmd in sides:
                rc, secs, to, o = self.run(cmd, 120, clean=side == "torch")
                r = parse_result(o)
                res[side] = r if (rc == 0 and r) else {"error": "timeout" if to else f"exit {rc}",
                                                      "tail": (o or "")[-800:]}
            k, t = res["kpl"], res["torch"]
            row = dict(case=f"b{batch}/{prec}", batch=batch, precision=prec,
                       kpl_ms=k.get("ms_median"), ref_ms=t.get("ms_median"),
                       kpl_first_ms=k.get("first_step_ms"), ref_first_ms=t.get("first_step_ms"),
                       kpl_alloc_peak_MiB=k.get("alloc_peak_MiB"),
                       ref_alloc_peak_MiB=t.get("alloc_peak_MiB"),
                       kpl_reserved_peak_MiB=k.get("reserved_peak_MiB"),
                       ref_reserved_peak_MiB=t.get("reserved_peak_MiB"),
                       kpl_loss=[k.get("loss_first"), k.get("loss_last")],
                       ref_loss=[t.get("loss_first"), t.get("loss_last")],
                       ref_name=f"torch {t.get('torch')} channels_last cudnn.benchmark"
                                + (" autocast" if prec != "f32" else " (cuDNN TF32 default)"),
                       kpl_tf32=prec == "f32", target=0.9)
            if row["kpl_ms"] and row["ref_ms"]:
                row["ratio"] = round(row["ref_ms"] / row["kpl_ms"], 3)
                row["img_per_s"] = round(batch * 1000 / row["kpl_ms"], 1)
                row["ref_img_per_s"] = round(batch * 1000 / row["ref_ms"], 1)
            if row["kpl_alloc_peak_MiB"] and row["ref_alloc_peak_MiB"]:
                row["mem_ratio"] = round(row["kpl_alloc_peak_MiB"] / row["ref_alloc_peak_MiB"], 3)
            if row["kpl_first_ms"] and row["ref_first_ms"]:
                row["first_ratio"] = round(row["kpl_first_ms"] / row["ref_first_ms"], 3)
            if "error" in k:
                self.record("resnet50", "failed", error=f"kpl: {k['error']}", tail=k.get("tail"), **row)
            elif "error" in t:
                # the reference failing is not kpl's failure, but the case has no ratio
                self.record("resnet50", "ref_failed", error=f"torch: {t['error']}", tail=t.get("tail"),
                            **row)
            else:
                self.record("resnet50", "passed", **row)

    # ---- 6: the other tasks, export and infer --------------------------------------------
    def step_tasks(self):
        self.open_log("6-tasks.log")
        fm = f"{self.kit}/data/fashion-mnist"
        s = self.scratch
        q = ["log.progress=never", f"device={self.dev}"]
        det = f"{ROOT}/recipes/detection/fcos_r18_fmnistdet.yaml"
        seg = f"{ROOT}/recipes/segmentation/deeplabv3_r18_fmnistseg.yaml"
        gan = f"{ROOT}/recipes/gan/dcgan_fmnist.yaml"
        cnn = f"{ROOT}/recipes/fashion_mnist/cnn.yaml"
        fid_recipe = f"{s}/fid_cnn.yaml"
        with open(fid_recipe, "w") as f:
            f.write(f"base: {cnn}\ndata:\n  root: {s}/fm\n  convert:\n    source: {fm}\n")
        jobs = [
            ("fcos", [[self.kpl, "data", "synth", "fmnist-det", f"{s}/det", "--train", "160", "--val",
                       "16", "--objects", "3", "--sides", "32", "64", "--fmnist", fm, "--quiet"],
                      [self.kpl, "train", det, f"data.root={s}/det", f"data.convert.source={s}/det",
                       "model.width=16", "model.fcos.fpn_channels=32", "model.fcos.gn_groups=8",
                       "epochs=2", "eval.every_epochs=2", f"run_dir={s}/fcos"] + q],
             ("val_ap50", "val_ap")),
            ("deeplabv3", [[self.kpl, "data", "synth", "fmnist-seg", f"{s}/seg", "--train", "160",
                            "--val", "12", "--size", "64", "--sides", "24", "48", "--fmnist", fm,
                            "--quiet"],
                           [self.kpl, "train", seg, f"data.root={s}/seg",
                            f"data.convert.source={s}/seg", "data.train.transform.size=[64, 64]",
                            "data.val.transform.max_side=64", "model.width=16",
                            "model.deeplabv3.aspp_channels=64", "epochs=2", "eval.every_epochs=2",
                            f"run_dir={s}/seg-run"] + q],
             ("val_miou",)),
            # the feature network's recipe says where its data is, as a user's
            # would: the GAN task reads it again to build the network
            ("dcgan", [[self.kpl, "data", "fid-net", "--recipe", fid_recipe, "-o", f"{s}/fid.kpl",
                        "--force", "epochs=1", "data.train.limit=6000"] + q,
                       [self.kpl, "train", gan, f"data.root={s}/fm", f"data.convert.source={fm}",
                        f"task.gan.fid_network={s}/fid.kpl", f"task.gan.fid_recipe={fid_recipe}",
                        "model.width=32", "data.train.limit=1280", "data.val.limit=1000",
                        "task.gan.fid_samples=1000", "epochs=1", f"run_dir={s}/gan"] + q],
             ("val_fid", "val_is")),
        ]
        for name, cmds, keys in jobs:
            ok, secs, last = True, 0.0, ""
            for cmd in cmds:
                rc, sec, to, o = self.run(cmd, 120)
                secs += sec
                last = o or ""
                if rc != 0 or to:
                    ok = False
                    self.record("tasks", "timeout" if to else "failed", task=name, seconds=round(secs, 1),
                                command=" ".join(os.path.basename(c) for c in cmd[:3]), rc=rc,
                                tail=last[-1500:])
                    break
            if ok:
                done = last_json(last, "done") or {}
                figures = {k: done.get(k) for k in keys}
                self.record("tasks", "passed" if done else "failed", task=name, seconds=round(secs, 1),
                            **figures)
        # export the GPU-trained default model, infer on the CPU
        if not getattr(self, "ckpt", None):
            self.record("tasks", "not_run", task="export_infer", error="no checkpoint from step 3")
            return
        m = f"{s}/cnn.kplm"
        rc, sec, to, o = self.run([self.kpl, "export", cnn] + self.fm_args() +
                                  ["--checkpoint", self.ckpt, "-o", m, "--batch", "32"], 60)
        if rc != 0 or to:
            self.record("tasks", "failed", task="export", rc=rc, tail=(o or "")[-1500:])
            return
        rc, sec, to, o = self.run([self.kpl, "eval", cnn, f"device={self.dev}", "data.val.limit=1000",
                                   "--checkpoint", self.ckpt] + self.fm_args(), 60)
        ev = last_json(o, "eval") or {}
        rc2, sec2, to2, o2 = self.run([self.kpl, "infer", m, f"{s}/fm/test", "--limit", "1000"], 60,
                                      quiet=True)
        inf = last_json(o2, None) or {}
        fields = dict(task="export_infer", eval_top1=ev.get("val_top1", ev.get("top1")),
                      infer_top1=inf.get("top1"), examples=inf.get("examples"),
                      seconds=round(sec + sec2, 1))
        good = (rc == 0 and rc2 == 0 and fields["eval_top1"] is not None and
                fields["infer_top1"] is not None and
                abs(float(fields["eval_top1"]) - float(fields["infer_top1"])) < 0.15)
        self.record("tasks", "passed" if good else "failed", tail=None if good else (o2 or "")[-800:],
                    **fields)

    # ---- 8: the CPU's training step against PyTorch (kit_cpubench.py) -------------------
    def step_cpubench(self):
        kit_cpubench.step_cpubench(self, parse_result)


def last_json(text, event):
    """The last JSON object line of text whose "event" is event (any when None)."""
    for line in reversed((text or "").splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                j = json.loads(line)
            except ValueError:
                continue
            if event is None or j.get("event") == event:
                return j
    return None


def parse_result(text):
    """The key=value fields of a RESULT line (numbers as floats)."""
    for line in reversed((text or "").splitlines()):
        if line.startswith("RESULT "):
            out = {}
            for kv in line.split()[1:]:
                if "=" in kv:
                    k, v = kv.split("=", 1)
                    try:
                        out[k] = float(v)
                    except ValueError:
                        out[k] = v
            return out
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu-report", help="report folder (default gpu-report/)")
    ap.add_argument("--bundle", default=os.path.join(ROOT, ".gpu"), help="the packed kit's folder")
    ap.add_argument("--work", default="/tmp/kpl-gpu-kit", help="where the kit is unpacked")
    ap.add_argument("--budget", type=float, default=450, help="seconds for the whole run (450)")
    ap.add_argument("--steps", default="tests,nccl,recipe,resnet50,tasks,sanitizer,cpu,cpubench",
                    help="which steps, in this order, by name or number 1-8 (default all, the "
                         "slow sanitizer and the CPU's last)")
    ap.add_argument("--test-limit", type=float, default=120, help="seconds per ctest test (120)")
    ap.add_argument("--cpubench-rounds", type=int, default=2,
                    help="step cpubench: alternating rounds (2)")
    ap.add_argument("--cpubench-sides",
                    default="kpl_f32,kpl_bf16,kpl_bf16_nhwc,kpl_bf16_plain,torch_cl_f32,torch_cl_bf16",
                    help="step cpubench: which sides run (default all six)")
    ap.add_argument("--rehearse", action="store_true",
                    help="run the steps on this machine's CPU with small sizes (no GPU needed)")
    args = ap.parse_args()
    want = []
    for s in args.steps.split(","):
        s = s.strip()
        if s.isdigit() and 1 <= int(s) <= len(STEPS):
            s = STEPS[int(s) - 1]
        if s not in STEPS:
            ap.error(f"--steps: unknown step '{s}' (want {', '.join(STEPS)} or 1-{len(STEPS)})")
        want.append(s)
    kit = Kit(args)
    if not kit.preflight():
        kit.say(f"run.sh: stopped at the preflight; the report is in {kit.out}")
        return 1
    for s in dict.fromkeys(want):
        if kit.left() < 20:
            kit.record(s, "not_run", error="out of time (--budget)")
            continue
        t = time.monotonic()
        try:
            getattr(kit, "step_" + s)()
        except Exception as e:  # a bug of the kit must not lose the other steps
            kit.record(s, "failed", error=f"kit.py: {type(e).__name__}: {e}")
        kit.say(f"== step {s}: {time.monotonic() - t:.0f} s")
    kit.record("summary", "failed" if kit.failures else "passed", failures=kit.failures,
               seconds=round(time.monotonic() - kit.t0, 1))
    return 1 if kit.failures else 0


if __name__ == "__main__":
    sys.exit(main())
