#!/usr/bin/env bash
# scripts/gpu/run.sh — the GPU check, run on the GPU machine from the
# repository root, over the kit that scripts/gpu/pack.sh left in .gpu/:
#
#   scripts/gpu/run.sh [--out DIR] [--steps 1,3,...] [--budget SECONDS]
#                      [--rehearse]
#
# Unpacks the kit, points the loader at it and at python3's CUDA wheels,
# prints nvidia-smi, then runs each check under its own time limit and
# writes report.jsonl and one log per step into DIR (default gpu-report/).
# Stops at once, exit 1, with the CUDA error in the report, where there is
# no usable GPU.  scripts/gpu/kit.py does the work; `--help` lists the
# steps; docs/gpu.md says what each checks and keeps the runs' results.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=$(command -v python3 || true)
if [[ -z $py ]]; then
  echo "run.sh: needs python3 (the GPU machine's, with PyTorch, for the reference side)" >&2
  exit 1
fi
exec "$py" "$here/kit.py" "$@"
