#!/usr/bin/env python3
"""gen_cifar.py OUT [SEED]: small CIFAR-10 and CIFAR-100 sets in the layouts
they are distributed in, for test_cifar.c and cli_cifar.sh; gen_cifar.py
--seeds DIR: the seed corpus of tests/fuzz/fuzz_pickle.c (a batch of one
image of each set, the meta files, both ways of pickling, a binary record,
a small array of another shape).

  OUT/c10/cifar-10-batches-bin     data_batch_1..5.bin, test_batch.bin,
                                   batches.meta.txt
  OUT/c10/cifar-10-batches-py      the same images and labels, pickled by
                                   Python 3 at protocol 2 (bytes keys, so
                                   bytes go through _codecs.encode)
  OUT/c10py2/cifar-10-batches-py   ... and as Python 2's cPickle wrote the
                                   files that are distributed (str as
                                   SHORT_BINSTRING/BINSTRING,
                                   numpy.core.multiarray)
  OUT/c100/cifar-100-binary        train.bin, test.bin, fine_label_names.txt,
                                   coarse_label_names.txt
  OUT/c100/cifar-100-python        train, test, meta (Python 3, protocol 2)
  OUT/c100py2/cifar-100-python     (Python 2's way)

The binary files are the ground truth the tests compare with: each pickle
holds the same images and labels, and is loaded back here with
pickle.load(encoding='bytes') and compared before the script exits.
CIFAR-100's train split has 300 images, so that the pickles' memo passes
256 entries (LONG_BINPUT) and a few repeated file names are memo lookups
past 256 (LONG_BINGET).
"""
import io
import os
import pickle
import struct
import sys
import warnings

import numpy as np

C10_NAMES = ["airplane", "automobile", "bird", "cat", "deer",
             "dog", "frog", "horse", "ship", "truck"]
C100_FINE = ["fine_%02d" % i for i in range(100)]
C100_FINE[7] = "caf\u00e9_07"  # UTF-8 on every path to classes.txt
C100_COARSE = ["coarse_%02d" % i for i in range(20)]
C10_SIZES = {"data_batch_%d" % (i + 1): n for i, n in enumerate([7, 5, 6, 4, 3])}
C10_SIZES["test_batch"] = 9
C100_SIZES = {"train": 300, "test": 11}


class Py2Pickler(pickle._Pickler):
    """Python's own pickler, writing str and bytes as Python 2's str
    (SHORT_BINSTRING, BINSTRING), as cPickle did for the CIFAR files."""
    dispatch = pickle._Pickler.dispatch.copy()

    def save_str8(self, obj):
        b = obj.encode("utf-8") if isinstance(obj, str) else obj
        if len(b) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(b)]) + b)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(b)) + b)
        self.memoize(obj)

    dispatch[bytes] = save_str8
    dispatch[str] = save_str8


def dump(obj, path, py2):
    if py2:
        f = io.BytesIO()
        Py2Pickler(f, protocol=2).dump(obj)
        data = f.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")
    else:
        data = pickle.dumps(obj, protocol=2)
    with open(path, "wb") as f:
        f.write(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = pickle.loads(data, encoding="bytes")
    return back


def key(k, py2):
    # Python 2's str keys load as bytes, like Python 3's bytes keys
    return k if py2 else k.encode()


def write_set(out, c100, rng):
    sizes = C100_SIZES if c100 else C10_SIZES
    bdir = os.path.join(out, "c100" if c100 else "c10",
                        "cifar-100-binary" if c100 else "cifar-10-batches-bin")
    os.makedirs(bdir)
    batches = {}
    for name, n in sizes.items():
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        fine = rng.integers(0, 100 if c100 else 10, size=n)
        coarse = rng.integers(0, 20, size=n)
        batches[name] = (data, fine, coarse)
        with open(os.path.join(bdir, name + ".bin"), "wb") as f:
            for i in range(n):
                head = [int(coarse[i]), int(fine[i])] if c100 else [int(fine[i])]
                f.write(bytes(head) + data[i].tobytes())
    if c100:
        for fn, names in (("fine_label_names.txt", C100_FINE),
                          ("coarse_label_names.txt", C100_COARSE)):
            with open(os.path.join(bdir, fn), "w", encoding="utf-8") as f:
                f.write("\n".join(names) + "\n")
    else:
        with open(os.path.join(bdir, "batches.meta.txt"), "w") as f:
            f.write("\n".join(C10_NAMES) + "\n\n")

    for py2 in (False, True):
        pdir = os.path.join(out, ("c100" if c100 else "c10") + ("py2" if py2 else ""),
                            "cifar-100-python" if c100 else "cifar-10-batches-py")
        os.makedirs(pdir)
        for name, (data, fine, coarse) in batches.items():
            n = len(data)
            files = ["img_%05d.png" % i for i in range(n)]
            if n > 280:
                files = files[:290] + files[270:280]  # the same objects again: memo lookups
            d = {key("batch_label", py2): key("batch %s" % name, py2),
                 key("filenames", py2): files}
            if c100:
                d[key("fine_labels", py2)] = [int(x) for x in fine]
                d[key("coarse_labels", py2)] = [int(x) for x in coarse]
            else:
                d[key("labels", py2)] = [int(x) for x in fine]
            d[key("data", py2)] = data
            back = dump(d, os.path.join(pdir, name), py2)
            assert np.array_equal(back[b"data"], data)
            assert back[b"data"].dtype == np.uint8 and back[b"data"].shape == (n, 3072)
            if c100:
                assert back[b"fine_labels"] == list(fine) and back[b"coarse_labels"] == list(coarse)
            else:
                assert back[b"labels"] == list(fine)
        if c100:
            meta = {"fine_label_names": C100_FINE, "coarse_label_names": C100_COARSE}
            back = dump(meta, os.path.join(pdir, "meta"), py2)
            want = [s.encode() for s in C100_FINE] if py2 else C100_FINE
            assert back[b"fine_label_names" if py2 else "fine_label_names"] == want
        else:
            meta = {"num_cases_per_batch": 10000, "label_names": C10_NAMES, "num_vis": 3072}
            dump(meta, os.path.join(pdir, "batches.meta"), py2)


def seeds(out):
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(7)
    img = rng.integers(0, 256, size=(1, 3072), dtype=np.uint8)
    dump({"batch_label": "seed", "labels": [3], "data": img, "filenames": ["a.png"]},
         os.path.join(out, "c10-batch-py2"), True)
    dump({b"fine_labels": [42], b"coarse_labels": [17], b"data": img},
         os.path.join(out, "c100-batch-py3"), False)
    dump({"label_names": C10_NAMES, "num_vis": 3072}, os.path.join(out, "c10-meta-py3"), False)
    dump({"fine_label_names": C100_FINE, "coarse_label_names": C100_COARSE},
         os.path.join(out, "c100-meta-py2"), True)
    dump({b"data": np.arange(8, dtype=np.uint8).reshape(2, 4), b"labels": [1, 2]},
         os.path.join(out, "small-array-py3"), False)
    with open(os.path.join(out, "c10-record-bin"), "wb") as f:
        f.write(bytes([5]) + img.tobytes())


def main():
    if sys.argv[1] == "--seeds":
        seeds(sys.argv[2])
        return
    out = sys.argv[1]
    rng = np.random.default_rng(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    write_set(out, False, rng)
    write_set(out, True, rng)


if __name__ == "__main__":
    main()
