#!/usr/bin/env bash
# parity_e2e.sh BENCH_PARITY KPL SOURCE_DIR — the harness of `bench/run.sh
# parity` (bench/bench_parity.c, bench/torch_parity.py) on tiny sets: both
# cases (FCOS-R18 on fmnist-det, U-Net on fmnist-seg), one epoch of 48
# images.  bench_parity itself fails (exit 1) when the first step's losses
# of kpl and PyTorch differ past 1e-4 (same weights, same batch: the two
# setups would differ) or when the Python evaluator does not give kpl's
# final weights kpl's own AP / mIoU (2e-3).  Here, from its JSON rows:
# one row per case, both sides' figures present, as many losses as steps
# on each side, the second step's losses (after one AdamW step with kpl's
# learning rate, clipping and decay rules) within 1e-3, kpl's row
# figure equal to its own evaluation.  Needs PyTorch, torchvision and
# pycocotools (references: scripts/setup.sh installs them).
set -euo pipefail
bench=$1 kpl=$2 src=$3
source "$src/tests/skip.sh"
py=/usr/bin/python3
for m in torch torchvision pycocotools; do
  "$py" -c "import $m" 2>/dev/null || kpl_skip ref "python3 module $m"
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$bench" "$src/bench" "$src" "$kpl" "$work" --train 48 --val 16 --epochs 1 --control 0 \
  > "$work/rows.jsonl"
"$py" - "$work/rows.jsonl" <<'EOF'
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
cases = sorted(r["case"].split("/")[0] for r in rows)
assert cases == ["fcos", "unet"], f"cases {cases}"
for r in rows:
    name = r["case"]
    assert r["bench"] == "parity" and r["steps"] == 3, (name, r["steps"])
    assert r["ref"] is not None and r["kpl"] is not None, f"{name}: a side has no figure: {r}"
    k, p = r["kpl_loss"], r["ref_loss"]
    assert len(k) == len(p) == r["steps"], f"{name}: {len(k)} and {len(p)} losses"
    assert all(math.isfinite(v) for v in k + p), f"{name}: losses {k} {p}"
    for i, tol in ((0, 1e-4), (1, 1e-3)):
        d = abs(k[i] - p[i]) / abs(p[i])
        assert d <= tol, f"{name}: step {i + 1}: kpl {k[i]}, PyTorch {p[i]} ({d:.2e} > {tol})"
    assert abs(r["kpl"] - r["kpl_own"]) <= 2e-3, f"{name}: {r['kpl']} vs own {r['kpl_own']}"
    assert r["ref_isa"] and r["kpl_math"], name
    print(f"{name}: losses {k[0]:.6f}/{p[0]:.6f} .. {k[-1]:.6f}/{p[-1]:.6f}; "
          f"{r['unit']} kpl {r['kpl']:.4f} (own {r['kpl_own']:.4f}), PyTorch {r['ref']:.4f}")
EOF
echo "parity_e2e: OK"
