#!/usr/bin/python3
"""onnxruntime's side of bench_graph: forward passes of an ONNX model on a
random input (its graph input's shape), ms per pass.

Usage: /usr/bin/python3 ort_infer.py MODEL.onnx THREADS WARMUP STEPS
Prints "RESULT ms_median=... ms_min=... maxrss_MiB=..." (one config per
process, as the torch references).  onnxruntime: intra-op threads THREADS,
one inter-op thread, all graph optimisations (its default ORT_ENABLE_ALL).
Its thread pool spins between ops by default whatever OMP_WAIT_POLICY
says; with OMP_WAIT_POLICY=PASSIVE in the environment (bench/run.sh's,
under which kpl's OpenMP team sleeps between ops) it is told not to
(session.intra_op.allow_spinning=0), so both sides wait alike; the
RESULT line says which (spinning=0|1)."""
import os
import resource
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort

path, threads, warm, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
so = ort.SessionOptions()
so.intra_op_num_threads = threads
so.inter_op_num_threads = 1
spinning = os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE"
if not spinning:
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
inp = sess.get_inputs()[0]
x = np.random.default_rng(0).standard_normal(inp.shape).astype(np.float32)
times = []
for i in range(warm + steps):
    t0 = time.perf_counter()
    sess.run(None, {inp.name: x})
    t1 = time.perf_counter()
    if i >= warm:
        times.append((t1 - t0) * 1e3)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
print(f"RESULT ort={ort.__version__} threads={threads} spinning={int(spinning)} "
      f"ms_median={statistics.median(times):.2f} "
      f"ms_min={min(times):.2f} maxrss_MiB={rss:.0f}", flush=True)
