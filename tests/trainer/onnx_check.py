#!/usr/bin/env python3
"""onnx_check.py KPL MODEL.kplm MODEL.onnx WORKDIR — the ONNX file kpl
exported runs in onnxruntime and gives kpl's outputs: a random input batch
(shape from the ONNX graph's input) goes through onnxruntime and through
`kpl infer MODEL.kplm x.npy --logits`; the largest absolute difference of
the outputs must stay below 1e-4.  The ONNX checker must accept the file.
Without onnx or onnxruntime: exit 77 (a skip) or 1 (ref_missing.py)."""
import json
import subprocess
import sys

try:
    import numpy as np
    import onnx
    import onnxruntime as ort
except ImportError as e:
    from ref_missing import missing
    missing("onnx_check", f"onnx/onnxruntime for /usr/bin/python3 ({e})")

kpl, kplm, path, work = sys.argv[1:5]
model = onnx.load(path)
onnx.checker.check_model(model, full_check=True)
opset = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
assert opset and opset[0] >= 13, f"opset {opset}"
inp = model.graph.input[0]
shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
rng = np.random.default_rng(7)
x = rng.standard_normal(shape).astype(np.float32)
np.save(f"{work}/x.npy", x)
sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
want = sess.run(None, {inp.name: x})[0].reshape(shape[0], -1)
out = subprocess.run([kpl, "infer", kplm, f"{work}/x.npy", "--logits", "--top", "1"],
                     check=True, capture_output=True, text=True).stdout
rows = [json.loads(l)["logits"] for l in out.splitlines() if '"logits"' in l]
got = np.array(rows, dtype=np.float64)
assert got.shape == want.shape, f"kpl {got.shape}, onnxruntime {want.shape}"
err = float(np.max(np.abs(got - want)))
scale = float(np.max(np.abs(want)))
print(f"onnx_check: {path}: {len(model.graph.node)} ONNX nodes, opset {opset[0]}, "
      f"max |kpl - onnxruntime| = {err:.3g} (outputs up to {scale:.3g})")
sys.exit(0 if err < 1e-4 else 1)
