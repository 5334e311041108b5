"""torchvision_onnx.py OUT.onnx {plain|external|badraw|escape|nan|folded} — an ONNX
file holding the initializers torchvision's ResNet-18 state dict has, by
its names (conv1.weight, layer1.0.bn1.running_mean, ...,
num_batches_tracked as int64), with random values: half as raw_data,
half as float_data; `external` keeps the large ones in OUT.onnx.data;
`badraw` cuts 4 bytes off one tensor's raw_data; `escape` points one
tensor's external data outside the model's directory; `nan` puts a NaN in
layer3.1.bn2.running_var; `folded` names the tensors as torch.onnx.export
in eval mode does after folding batch norm into the convolutions
(onnx::Conv_N, no batch norm tensors).  Prints the sum of
layer4.1.conv2.weight (f64) for the caller to compare."""
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

out, kind = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
tensors = []


def conv(name, o, i, k):
    tensors.append((name + ".weight", (rng.standard_normal((o, i, k, k)) * 0.05).astype(np.float32)))


def bn(name, c):
    tensors.append((name + ".weight", rng.uniform(0.5, 1.5, c).astype(np.float32)))
    tensors.append((name + ".bias", rng.uniform(-0.1, 0.1, c).astype(np.float32)))
    tensors.append((name + ".running_mean", rng.uniform(-0.1, 0.1, c).astype(np.float32)))
    tensors.append((name + ".running_var", rng.uniform(0.5, 1.5, c).astype(np.float32)))
    tensors.append((name + ".num_batches_tracked", np.array(100, dtype=np.int64)))


conv("conv1", 64, 3, 7)
bn("bn1", 64)
inp = 64
for li, (c, stride) in enumerate([(64, 1), (128, 2), (256, 2), (512, 2)], 1):
    for b in range(2):
        p = "layer%d.%d" % (li, b)
        conv(p + ".conv1", c, inp if b == 0 else c, 3)
        bn(p + ".bn1", c)
        conv(p + ".conv2", c, c, 3)
        bn(p + ".bn2", c)
        if b == 0 and (stride != 1 or inp != c):
            conv(p + ".downsample.0", c, inp, 1)
            bn(p + ".downsample.1", c)
    inp = c
tensors.append(("fc.weight", (rng.standard_normal((1000, 512)) * 0.01).astype(np.float32)))
tensors.append(("fc.bias", np.zeros(1000, dtype=np.float32)))

if kind == "nan":
    dict(tensors)["layer3.1.bn2.running_var"][5] = np.nan
if kind == "folded":
    convs = [(n, a) for n, a in tensors if n.endswith("conv1.weight") or n.endswith("conv2.weight")
             or n.endswith("downsample.0.weight") or n == "conv1.weight"]
    tensors = [("onnx::Conv_%d" % (200 + 2 * i), a) for i, (n, a) in enumerate(convs)] + \
              [("onnx::Conv_%d" % (201 + 2 * i), np.zeros(a.shape[0], np.float32))
               for i, (n, a) in enumerate(convs)] + [t for t in tensors if t[0].startswith("fc.")]
inits = []
for k, (name, a) in enumerate(tensors):
    if a.dtype == np.float32 and k % 2:
        inits.append(helper.make_tensor(name, TensorProto.FLOAT, a.shape, a.flatten().tolist()))
    else:
        inits.append(numpy_helper.from_array(a, name))
if kind == "badraw":
    t = next(t for t in inits if t.name == "layer2.0.conv1.weight")
    if not t.raw_data:
        t.raw_data = numpy_helper.to_array(t).tobytes()
        del t.float_data[:]
    t.raw_data = t.raw_data[:-4]
graph = helper.make_graph([], "resnet18", [], [], initializer=inits)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
if kind in ("external", "escape"):
    onnx.save_model(model, out, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=os.path.basename(out) + ".data", size_threshold=4096)
    if kind == "escape":
        m = onnx.load(out, load_external_data=False)
        for t in m.graph.initializer:
            for e in t.external_data:
                if e.key == "location":
                    e.value = "../" + e.value
        onnx.save(m, out)
else:
    onnx.save(model, out)
if kind != "folded":
    print("%.9e" % float(dict(tensors)["layer4.1.conv2.weight"].astype(np.float64).sum()))
