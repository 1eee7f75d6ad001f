"""Whether two engines of one process run alike when XLA:CPU loads their programs from jax's
persistent compilation cache: the host tier's 3 steps of the test GPT on replica 2 x data 2
(stage 3, clipping), then a second engine alike (`--second host`, the same programs, or
`--second nvme`, the NVMe tier) on the same batches, in a fresh process per run, with one
fresh cache directory (the first run writes it, the others read it). The two engines' losses
and grad norms should agree bitwise (they do without the cache); the table says per run
whether they did, or how the process ended (its first `Check failed` line). docs/testing.md
has what this found.

    .venv/bin/python experiments/cpu_cache_collectives.py --runs 6 --second host
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, tempfile, jax, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
import zerojax as zj
from helpers import CLIP, engine_run, fused_adamw, gpt_batch, tiny_gpt
model = tiny_gpt()
batches = [gpt_batch(model.cfg, 8, s) for s in range(3)]
mesh = zj.make_mesh(replica=2, data=2, devices=jax.devices()[:4])
cfg = dict(offload="optimizer", stage=3, clip_norm=CLIP)
second = dict(offload_device="nvme", nvme_path=tempfile.mkdtemp()) if sys.argv[1] == "nvme" \\
    else {}
runs = []
for extra in ({}, second):
    losses, _, _ = engine_run(zj.Engine(model, fused_adamw(), mesh, zj.ZeroConfig(**cfg, **extra)),
                              batches)
    runs.append([losses.tolist(), engine_run.norms.tolist()])
print("RESULT", json.dumps(runs))
"""


def run(second: str, cache: str | None) -> tuple[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(
        ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8 "
               "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT / "tests"))
    if cache:
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    p = subprocess.run([sys.executable, "-c", CHILD, second], env=env, capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return "ran", json.loads(line[7:])
    fail = [x for x in p.stderr.splitlines() if "Check failed" in x or "Termination" in x]
    return f"exit {p.returncode}", (fail[0][:240] if fail else p.stderr[-300:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=6, help="runs with the cache (the first writes)")
    ap.add_argument("--second", choices=("host", "nvme"), default="host")
    args = ap.parse_args()
    counts = {}
    with tempfile.TemporaryDirectory(prefix="zerojax-cache-") as cache:
        for i, where in enumerate([None] + [cache] * args.runs):
            how, got = run(args.second, where)
            what = how if how != "ran" else "alike" if got[0] == got[1] else "DIFFERENT"
            label = "without the cache" if where is None else f"cached run {i - 1}"
            counts[what] = counts.get(what, 0) + (where is not None)
            print(f"{label}: {what}: " + (f"norms {got[0][1]} / {got[1][1]}" if how == "ran"
                                           else str(got)))
    print(f"with the cache, {args.runs} runs (second engine: {args.second}): {counts}")


if __name__ == "__main__":
    main()
