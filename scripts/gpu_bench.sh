#!/usr/bin/env bash
# One command for the GPU figures: MFU, tokens/s and compiled peak memory of plain optax and
# zerojax stages 0-3 on the ~1B preset in bf16, the same with the XLA overlap flags
# (--xla-overlap of `zerojax train`), and the largest GPT shape that steps without running out
# of memory. The ZeRO++ variants are in the default --variants: qwZ int8 gathers, qgZ int4
# reductions, both, and both with hpZ on replica 2 × data N/2 (n/a below --devices 4).
# Writes OUT/gpu_bench.json and OUT/gpu_bench.md (OUT: runs/gpu_bench unless --out).
#
#   usage: scripts/gpu_bench.sh [experiments/gpu_bench.py options...]
#   e.g.   scripts/gpu_bench.sh --out runs/h100
#          scripts/gpu_bench.sh --parts largest --largest-variants stage3   # one part again
#
# Environment: PYTHON (default: the project's .venv/bin/python when it exists, else python3),
# XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.95). On a CPU machine it runs too (simulated
# devices, no MFU): tests/test_bench.py runs it on the tiny preset.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.venv/bin/python"
[[ -x $venv ]] || venv=python3
PYTHON=${PYTHON:-$venv}
exec "$PYTHON" "$root/experiments/gpu_bench.py" "$@"
