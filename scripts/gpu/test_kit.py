#!/usr/bin/env python3
"""test_kit.py — kit.py's own logic, without a kit or a GPU (CI stage 3).

  - a command that hangs is killed at its limit with everything it started
    (its process group), reported as timed out, and the budget still holds;
  - ctest's commands map from the packing machine's paths to the kit's and
    the repository's, mpirun to the one on PATH, ranks read from -np;
  - the RESULT lines and JSON lines of kpl's programs parse;
  - --out loses nothing but an earlier run's report and logs;
  - SIGTERM to the kit's process group ends the command it runs too.
Exit status 0 when every check holds.
"""
import json
import os
import shutil
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kit  # noqa: E402


def main():
    tmp = tempfile.mkdtemp()
    try:
        args = types.SimpleNamespace(out=os.path.join(tmp, "out"), budget=60, rehearse=True,
                                     work=os.path.join(tmp, "work"), bundle=tmp)
        # --out keeps what is not the kit's: only an earlier report goes
        os.makedirs(args.out)
        for name in ("mine.txt", "report.jsonl", "3-recipe.log"):
            with open(os.path.join(args.out, name), "w") as f:
                f.write("old\n")
        k = kit.Kit(args)
        assert sorted(os.listdir(args.out)) == ["mine.txt", "report.jsonl"], os.listdir(args.out)
        assert open(os.path.join(args.out, "report.jsonl")).read() == "", "the old report stayed"
        k.open_log("test.log")
        # a hang, with a grandchild holding the pipe open (a sleep of this
        # test's own length, so that no other process on the machine counts)
        nap = "300.%d" % os.getpid()
        t0 = time.monotonic()
        rc, secs, timed_out, out = k.run(["bash", "-c", "echo started; sleep %s & sleep %s" % (nap, nap)],
                                         2, quiet=True)
        took = time.monotonic() - t0
        assert timed_out and rc is not None and rc < 0, (rc, timed_out)
        assert 1.5 < took < 10, took
        assert "started" in out, out
        # nothing of the group survives (killed processes may take a moment
        # to go on a loaded machine: up to 10 s)
        for _ in range(100):
            alive = os.popen("pgrep -f 'sleep %s'" % nap.replace(".", "[.]")).read().split()
            if not alive:
                break
            time.sleep(0.1)
        assert not alive, f"left running: {alive}"
        # a command that ends on its own
        rc, secs, timed_out, out = k.run(["bash", "-c", "echo done; exit 3"], 10, quiet=True)
        assert rc == 3 and not timed_out and "done" in out
        # a budget nearly spent cuts a limit
        k.deadline = time.monotonic() + 7
        t0 = time.monotonic()
        k.run(["sleep", "30"], 100, quiet=True)
        assert time.monotonic() - t0 < 6, "the budget did not cut the limit"

        # ctest's commands mapped to the kit
        k.kit = os.path.join(tmp, "work", "kit")
        os.makedirs(k.kit)
        k.manifest = {"build_dir": "/b/build-gpu", "source_dir": "/b", "mpirun": "/usr/bin/mpirun"}
        k.env["PATH"] = os.path.join(tmp, "bin") + ":" + k.env["PATH"]
        os.makedirs(os.path.join(tmp, "bin"))
        mpirun = os.path.join(tmp, "bin", "mpirun")
        with open(mpirun, "w") as f:
            f.write("#!/bin/sh\n")
        os.chmod(mpirun, 0o755)
        tests = {"tests": [
            {"name": "test_cuda", "command": ["/b/build-gpu/bin/test_cuda"],
             "properties": [{"name": "SKIP_RETURN_CODE", "value": 77},
                            {"name": "TIMEOUT", "value": 600.0},
                            {"name": "ENVIRONMENT", "value": ["A=1", "B=x=y"]},
                            {"name": "WORKING_DIRECTORY", "value": "/b/build-gpu/tests/kernels"}]},
            {"name": "test_ddp_cuda_np2",
             "command": ["/usr/bin/mpirun", "--allow-run-as-root", "-np", "2",
                         "/b/build-gpu/bin/test_ddp_cuda"], "properties": []},
            {"name": "train_cuda", "command": ["/b/tests/trainer/train_cuda_e2e.sh",
                                               "/b/build-gpu/bin/kpl", "/b"], "properties": []},
        ]}
        with open(os.path.join(k.kit, "tests.json"), "w") as f:
            json.dump(tests, f)
        cases = {c["name"]: c for c in k.ctest_cases(lambda n: True)}
        c = cases["test_cuda"]
        assert c["cmd"] == [k.kit + "/build/bin/test_cuda"], c
        assert c["cwd"] == k.kit + "/build/tests/kernels" and os.path.isdir(c["cwd"]), c
        assert c["env"] == {"A": "1", "B": "x=y"} and c["skip"] == 77 and c["timeout"] == 600, c
        c = cases["test_ddp_cuda_np2"]
        assert c["cmd"][0] == mpirun and c["ranks"] == 2, c
        assert c["cmd"][-1] == k.kit + "/build/bin/test_ddp_cuda", c
        c = cases["train_cuda"]
        assert c["cmd"] == [kit.ROOT + "/tests/trainer/train_cuda_e2e.sh",
                            k.kit + "/build/bin/kpl", kit.ROOT], c
        # the CPU suite's listing (step cpu) maps alike
        cpu = {"tests": [{"name": "test_kernels_avx2", "command": ["/b/build-gpu/bin/test_kernels"],
                          "properties": [{"name": "ENVIRONMENT",
                                          "value": ["ONEDNN_MAX_CPU_ISA=AVX2"]}]}]}
        with open(os.path.join(k.kit, "cpu_tests.json"), "w") as f:
            json.dump(cpu, f)
        (c,) = k.ctest_cases(lambda n: True, "cpu_tests.json")
        assert c["cmd"] == [k.kit + "/build/bin/test_kernels"], c
        assert c["env"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"} and c["ranks"] == 1, c

        # SIGTERM to the kit (as a scheduler sends it to run.sh's group)
        # ends the command it runs, in its own session, and says so
        script = ("import sys, types; sys.path.insert(0, %r); import kit; "
                  "k = kit.Kit(types.SimpleNamespace(out=%r, budget=60, rehearse=True, "
                  "work=%r, bundle=%r)); k.run(['bash', '-c', 'sleep $((300 + 1)) & sleep $((300 + 1))'], 50)"
                  % (os.path.dirname(os.path.abspath(__file__)), os.path.join(tmp, "out2"),
                     tmp, tmp))
        import subprocess
        p = subprocess.Popen([sys.executable, "-c", script], start_new_session=True,
                             stdout=subprocess.DEVNULL)
        for _ in range(100):  # until the command runs
            if os.popen("pgrep -f 'sleep 30[1]'").read().split():
                break
            time.sleep(0.1)
        os.killpg(p.pid, 15)
        assert p.wait(timeout=10) == 128 + 15, p.returncode
        time.sleep(0.3)
        alive = os.popen("pgrep -f 'sleep 30[1]'").read().split()
        assert not alive, f"left running after SIGTERM: {alive}"
        last = open(os.path.join(tmp, "out2", "report.jsonl")).read().splitlines()[-1]
        assert '"status": "interrupted", "signal": "SIGTERM"' in last, last

        # output parsing
        r = kit.parse_result("noise\nRESULT model=resnet50 ms_median=12.5 torch=2.11.0+cu130\n")
        assert r == {"model": "resnet50", "ms_median": 12.5, "torch": "2.11.0+cu130"}, r
        text = '{"event":"train","step":1}\nnot json {\n{"event":"done","val_top1":91.5}\ntail\n'
        assert kit.last_json(text, "done")["val_top1"] == 91.5
        assert kit.last_json(text, None)["event"] == "done"
        assert kit.last_json(text, "eval") is None
        print("test_kit.py: OK")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
