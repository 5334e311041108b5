#!/usr/bin/env python3
"""fid_ref.py — the references of trainer/fid.h, with numpy and scipy.

FID as pytorch-fid's calculate_frechet_distance computes it: mean and
numpy.cov(rowvar=False) of each set, scipy.linalg.sqrtm of the product of
the covariances, and when that square root is not finite the same with
eps * I (1e-6) added to both covariances; the real part (an imaginary part
on the diagonal above 1e-3 is an error there); |mu1 - mu2|^2 + Tr(S1) +
Tr(S2) - 2 Tr(sqrtm).  The Inception Score as the original code and
torch-fidelity split it: part i is rows [i n // splits, (i + 1) n // splits).

Features and probabilities come as raw float32 files (rows x columns,
row-major, little-endian), as tests/trainer/test_fid.c and
bench/bench_fid.c write them.  One JSON object per line on stdout.

  fid_ref.py fid DIM A.f32 B.f32        {"fid", "offset", "max_imag", "fid_eigh"}
  fid_ref.py is CLASSES SPLITS P.f32     {"mean", "std"}
  fid_ref.py bench DIM A.f32 B.f32       {"moments_s", "fid_s", "fid"}: seconds of
                                         the two moments and of the distance
"""
import json
import sys
import time

import numpy as np
import scipy.linalg


def load(path, cols):
    x = np.fromfile(path, dtype="<f4")
    if x.size % cols:
        sys.exit(f"fid_ref.py: {path}: {x.size} values are not rows of {cols}")
    return x.reshape(-1, cols)


def moments(x):
    x = x.astype(np.float64)
    return x.mean(axis=0), np.cov(x, rowvar=False)


def frechet(mu1, s1, mu2, s2, eps=1e-6):
    """pytorch-fid's formula; returns (fid, offset used, largest imaginary part)."""
    diff = mu1 - mu2
    covmean, _ = scipy.linalg.sqrtm(s1.dot(s2), disp=False)
    offset = False
    if not np.isfinite(covmean).all():
        offset = True
        eye = np.eye(s1.shape[0]) * eps
        covmean = scipy.linalg.sqrtm((s1 + eye).dot(s2 + eye))
    imag = 0.0
    if np.iscomplexobj(covmean):
        imag = float(np.max(np.abs(covmean.imag)))
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            sys.exit(f"fid_ref.py: imaginary component {imag}")
        covmean = covmean.real
    fid = diff.dot(diff) + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean)
    return float(fid), offset, imag


def frechet_eigh(mu1, s1, mu2, s2):
    """The symmetric form kpl computes, in numpy: for the comparison."""
    w, v = np.linalg.eigh(s1)
    root = v * np.sqrt(np.clip(w, 0, None))
    lam = np.linalg.eigvalsh(root.T @ s2 @ root)
    diff = mu1 - mu2
    return float(diff.dot(diff) + np.trace(s1) + np.trace(s2) - 2 * np.sqrt(np.clip(lam, 0, None)).sum())


def inception_score(p, splits):
    p = p.astype(np.float64)
    n = p.shape[0]
    scores = []
    for i in range(splits):
        part = p[i * n // splits:(i + 1) * n // splits]
        py = part.mean(axis=0, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            kl = np.where(part > 0, part * (np.log(part) - np.log(py)), 0.0)
        scores.append(np.exp(kl.sum(axis=1).mean()))
    return float(np.mean(scores)), float(np.std(scores))


def main(argv):
    if len(argv) >= 4 and argv[0] in ("fid", "bench"):
        dim = int(argv[1])
        a, b = load(argv[2], dim), load(argv[3], dim)
        if argv[0] == "fid":
            m1, s1 = moments(a)
            m2, s2 = moments(b)
            fid, offset, imag = frechet(m1, s1, m2, s2)
            print(json.dumps({"fid": fid, "offset": offset, "max_imag": imag,
                              "fid_eigh": frechet_eigh(m1, s1, m2, s2)}))
        else:
            t0 = time.perf_counter()
            m1, s1 = moments(a)
            m2, s2 = moments(b)
            t1 = time.perf_counter()
            fid, _, _ = frechet(m1, s1, m2, s2)
            t2 = time.perf_counter()
            print(json.dumps({"moments_s": t1 - t0, "fid_s": t2 - t1, "fid": fid}))
    elif len(argv) == 4 and argv[0] == "is":
        mean, std = inception_score(load(argv[3], int(argv[1])), int(argv[2]))
        print(json.dumps({"mean": mean, "std": std}))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
