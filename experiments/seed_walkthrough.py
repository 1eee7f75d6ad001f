"""The walkthrough on 2 simulated devices: what each device holds before and after one Adam step.

A 4-weight MLP, W = [2.0, -3.0, 1.0, 0.5], device 0 sees x=[1, 3], y=5 and device 1
x=[2, 1], y=7; Adam lr 0.1, betas (0.9, 0.999), eps 1e-8; fp16 compute params.

zerojax shards every leaf on its own (as FSDP2 does) rather than one flat vector (as
DeepSpeed does): with leaves layer1.w = [w1, w2], layer2.w = [w3], layer2.b = [w4], device 0
owns w1, w3, w4 and device 1 owns w2 (plus zero padding). Every stage ends at the same numbers.

    .venv/bin/python experiments/seed_walkthrough.py [--stage 0 1 2 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax.mesh import DATA
from zerojax.models import SeedMLP
from zerojax.units import ShardUnits, make_handles

BATCH = {"x": np.array([[1.0, 3.0], [2.0, 1.0]], np.float32),
         "y": np.array([5.0, 7.0], np.float32)}
NAMES = {"['layer1']['w']": ["w1", "w2"], "['layer2']['w']": ["w3"], "['layer2']['b']": ["w4"]}
SEED_ORDER = ["w1", "w2", "w3", "w4"]


def make_engine(stage: int) -> zj.Engine:
    opt = optax.adam(0.1, b1=0.9, b2=0.999, eps=1e-8)
    cfg = zj.ZeroConfig(stage=stage, param_dtype="float16", loss_scale=1.0)
    return zj.Engine(SeedMLP(), opt, zj.make_mesh(data=2), cfg)


def holdings(engine: zj.Engine, tree, device) -> dict[str, float]:
    """Which weights `device` holds of a state pytree (padded flat or logical layout)."""
    out = {}
    for leaf, x in zip(engine.layout.leaves, jax.tree.leaves(tree)):
        for shard in x.addressable_shards:
            if shard.device != device:
                continue
            (sl,) = shard.index if shard.index else (slice(None),)
            start = sl.start or 0
            for j, v in enumerate(np.asarray(shard.data, np.float64).reshape(-1)):
                names = NAMES[leaf.path]
                i = start + j
                out[names[i] if i < len(names) else f"pad({names[0]})"] = float(v)
    return dict(sorted(out.items()))


def _opt_field(state, name):
    return optax.tree_utils.tree_get(state.opt_state, name)


def snapshot(engine: zj.Engine, state) -> list[dict]:
    rows = []
    for d in engine.mesh.devices.reshape(-1):
        compute = state.compute if state.compute is not None else state.master
        rows.append({"device": d.id,
                     "fp16 params": holdings(engine, compute, d),
                     "fp32 master": holdings(engine, state.master, d),
                     "m": holdings(engine, _opt_field(state, "mu"), d),
                     "v": holdings(engine, _opt_field(state, "nu"), d)})
    return rows


def stage3_inside(engine: zj.Engine, state) -> list[dict]:
    """Replays stage 3's units on the state: each device's gathered layers and grad partition."""
    plan, layout = engine.plan, engine.layout
    handles = make_handles(layout)

    def body(compute, batch):
        args = [c.astype(jnp.float32) for c in jax.tree.leaves(compute)]
        gathered = ShardUnits(3, layout, args, None, plan.dtype, True).gather(handles)
        grads = jax.grad(lambda a: engine.model.loss(
            handles, batch, ShardUnits(3, layout, a, None, plan.dtype, True)))(args)
        # psum_scatter summed the two devices' gradients; the seed averages them.
        return gathered, layout.unflatten(g / 2 for g in grads)

    specs = layout.specs()
    fn = jax.shard_map(body, mesh=engine.mesh, in_specs=(specs, P(DATA)),
                       out_specs=(layout.unflatten(P(DATA) for _ in layout.leaves), specs))
    gathered, grads = jax.jit(fn)(state.compute, zj.mesh.put_batch(BATCH, engine.mesh))
    rows = []
    for i, d in enumerate(engine.mesh.devices.reshape(-1)):
        full = {}
        for leaf, x in zip(layout.leaves, jax.tree.leaves(gathered)):
            local = np.asarray(x.addressable_shards[i].data, np.float64).reshape(-1)
            full.update(zip(NAMES[leaf.path], local[: leaf.size].tolist()))
        rows.append({"device": d.id, "gathered fp16 layers (temporary)": dict(sorted(full.items())),
                     "reduce-scattered grad partition": holdings(engine, grads, d)})
    return rows


def run_stage(stage: int) -> dict:
    """One step of the seed under `stage`: per-device holdings before/after and final values."""
    engine = make_engine(stage)
    state = engine.init(jax.random.key(0), BATCH)
    before = snapshot(engine, state)
    inside = stage3_inside(engine, state) if stage == 3 else None
    state, metrics = engine.step(state, BATCH)
    after = snapshot(engine, state)
    merged = {k: {} for k in ("fp16 params", "fp32 master", "m", "v")}
    for row in after:
        for k in merged:
            merged[k].update({n: v for n, v in row[k].items() if not n.startswith("pad")})
    final = {k: [merged[k][n] for n in SEED_ORDER] for k in merged}
    final["loss"] = float(metrics["loss"])
    return {"stage": stage, "before": before, "inside": inside, "after": after, "final": final}


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for when in ("before", "inside", "after"):
        rows = result[when]
        if not rows:
            continue
        table = Table(title=f"stage {result['stage']}: {when} the step")
        cols = [k for k in rows[0] if k != "device"]
        table.add_column("device")
        for c in cols:
            table.add_column(c)
        for r in rows:
            table.add_row(str(r["device"]), *(
                ", ".join(f"{n}={v:.6g}" for n, v in r[c].items()) for c in cols))
        console.print(table)
    console.print(f"loss (mean over devices) = {result['final']['loss']:.6g}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--json", action="store_true", help="print the final values as JSON")
    args = ap.parse_args(argv)
    results = [run_stage(s) for s in args.stage]
    if args.json:
        print(json.dumps({f"stage{r['stage']}": r["final"] for r in results}, indent=1))
    else:
        for r in results:
            _print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
