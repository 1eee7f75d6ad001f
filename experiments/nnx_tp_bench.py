"""Where an NNX model's tensor-parallel step time goes: zerojax stage 3 on data N × model M
against a plain `jax.jit` (GSPMD) step of the same model with the same param shardings,
for a Gemma3-shaped model (jax-ml/bonsai's style: the residual stream split over "tp") and a
Qwen3-shaped one (flax's examples/gemma and bonsai's Qwen3 style: the residual stream whole),
both as the test suite writes them (tests/bonsai_models.py, tests/tp_models.py), at a size
set here.

Variants, timed round-robin in one run (one block of `--steps` steps each per repeat, in a
shuffled order), each figure a median over the repeats and a ratio against `gspmd` (the
ratio of the medians, and paired: the median of the per-repeat ratios):

- `gspmd`: `jax.jit` of value_and_grad + the optax update under the model's own mesh
  (fsdp N × tp M, explicit axes), every param stored split as its arrays were built (the
  model's plan on "tp") and over fsdp on its first free dimension that N divides, as stage 3
  splits every param over data, and resharded to its built layout where the loss reads it
  (FSDP's gather; its gradient's reduction is the transpose); the batch over fsdp.
- `gspmd_remat`: the same with each decoder layer under `nnx.remat`: what recomputing the
  layers in the backward costs a plain step.
- `zerojax`: stage 3, default `from_nnx` arguments (the decoder layer the unit); a unit's
  forward runs again in its backward (ZeRO-3 keeps no gathered weight), its model-axis
  collectives with it.
- `zerojax_keep_dots`: `zerojax` with `remat=False`: each unit keeps its matrix products'
  outputs from forward and recomputes only the rest, its gathers included.
- `zerojax_one_unit`: stage 3, `units=()` (one unit, the whole model: nothing recomputed).
- `zerojax_state_split`: `zerojax` with the model state left open over "model" inside the
  step, as before it was held whole (`step.whole`): the Gemma3 shape's `nnx.data` buffers
  are then gathered over "model" every step.

For each compiled step the collectives per step by kind and mesh axis (launches and bytes
one device sends), the matrix products' FLOPs, the compiled peak per device and the copies
are printed beside the times.

    .venv/bin/python experiments/nnx_tp_bench.py --repeats 15 --json runs/nnx_tp.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's zerojax and test models

VARIANTS = ("gspmd", "gspmd_remat", "zerojax", "zerojax_keep_dots", "zerojax_one_unit",
            "zerojax_state_split")
RULES = (("tp", "model"), ("fsdp", "data"))  # the models' axis names on zerojax's mesh
LR = 1e-3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gemma3", "qwen3"],
                   choices=["gemma3", "qwen3"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--data", type=int, default=4, help="the data (fsdp) axis N")
    p.add_argument("--model", type=int, default=2, help="the model (tp) axis M")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128, help="the residual width D")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ff", type=int, default=512, help="the MLP's hidden width")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=16, help="the global batch")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--steps", type=int, default=3, help="steps per timed block")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.width % args.heads or args.batch % args.data:
        p.error("--width must divide by --heads and --batch by --data")
    return args


def setup(args) -> None:
    """Simulated CPU devices; must run before jax starts its backend."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={args.data * args.model}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def build(name, args, mesh):
    """(module built under `mesh`, its decoder layer class) at the sizes of `args`."""
    import bonsai_models as bm
    import jax
    import tp_models as tp
    from flax import nnx

    hd = args.width // args.heads
    if name == "gemma3":
        bm.V, bm.D, bm.HEADS, bm.HD, bm.F, bm.T = (args.vocab, args.width, args.heads, hd,
                                                   args.ff, args.seq)
        cls, make = bm.Gemma3DecoderLayer, lambda: bm.Gemma3(args.layers, rngs=nnx.Rngs(0))
    else:
        tp.V, tp.D, tp.HEADS, tp.HD, tp.F, tp.T = (args.vocab, args.width, args.heads, hd,
                                                   args.ff, args.seq)
        cls, make = tp.Block, lambda: tp.ExplicitLM(args.layers, rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh):
        return make(), cls


def xent(logits, batch):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def nnx_loss(m, b):
    return xent(m(b["x"]), b)


def gspmd(net, cls, mesh, host_batch, remat):
    """(step, state, batch) of the plain jit step on the model's own mesh."""
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.shape["fsdp"]
    graph, template, rest = nnx.split(net, nnx.Param, ...)
    params = nnx.to_pure_dict(template)
    as_built = jax.tree.map(lambda x: x.sharding.spec, params)  # the model computes on these

    def spec(x):
        parts = list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec))
        if "fsdp" not in jax.tree.leaves(parts):
            free = [i for i, e in enumerate(parts) if e is None and x.shape[i] % n == 0]
            if free:
                parts[free[0]] = "fsdp"
        return NamedSharding(mesh, P(*parts))

    remats = {}

    def rematted(module):
        for _, node in nnx.iter_graph(module):
            if isinstance(node, cls):
                if cls not in remats:
                    remats[cls] = type(cls.__name__, (cls,), {"__call__": nnx.remat(cls.__call__)})
                object.__setattr__(node, "__class__", remats[cls])
        return module

    def loss(p, rest, b):
        # stored split over fsdp too; each param read as the model's explicit types say
        p = jax.tree.map(jax.sharding.reshard, p, as_built)
        ps = jax.tree.map(lambda x: x, template)
        nnx.replace_by_pure_dict(ps, p)
        module = nnx.merge(graph, ps, rest)
        logits = (rematted(module) if remat else module)(b["x"])
        # the labels laid out as the logits' batch (Qwen3's are whole: P())
        y = jax.sharding.reshard(b["y"], P(*tuple(jax.typeof(logits).sharding.spec)[:2]))
        return xent(logits, {"y": y})

    tx = optax.adam(LR)

    def train_step(state, rest, b):
        p, opt = state
        value, g = jax.value_and_grad(loss)(p, rest, b)
        u, opt = tx.update(g, opt, p)
        return (optax.apply_updates(p, u), opt), {"loss": value}

    with jax.set_mesh(mesh):
        p = jax.tree.map(lambda x: jax.device_put(x, spec(x)), params)
        state = (p, jax.jit(tx.init)(p))
        batch = jax.device_put(host_batch, NamedSharding(mesh, P("fsdp")))
        jitted = jax.jit(train_step, donate_argnums=0)

        def step(state, b):
            with jax.set_mesh(mesh):
                return jitted(state, rest, b)

        def lower():
            with jax.set_mesh(mesh):
                return jitted.lower(state, rest, batch)

    return step, state, batch, lower


def zero(net, mesh, host_batch, units, remat=True):
    import jax
    import optax

    import zerojax as zj
    from zerojax.mesh import put_batch

    kw = {} if units is None else {"units": units}
    zm = zj.from_nnx(net, nnx_loss, logical_axis_rules=RULES, **kw)
    engine = zj.Engine(zm, optax.adam(LR), mesh, zj.ZeroConfig(stage=3, remat=remat))
    batch = put_batch(host_batch, mesh)
    state = engine.init(jax.random.key(0), batch)
    return engine.step, state, batch, lambda: engine.lower(state, batch)


def collectives(text: str, data: int, model: int) -> dict:
    """The compiled step's collectives per step, by kind and mesh axis: launches and bytes
    one device sends; its copy instructions (count, bytes; those inside fusions too); the
    matrix products' GFLOP per device (a unit recomputed in the backward counts twice)."""
    from zerojax.analysis.hlo import _dtype_bytes, collective_sites, matmul_flops, mesh_axis

    sites, _ = collective_sites(text, data * model)
    launches, sent = Counter(), Counter()
    for s in sites:
        key = f"{s['kind']} over {mesh_axis(s['groups'], 1, data, model)}"
        launches[key] += s["launches"]
        sent[key] += s["sent"]
    copies = re.findall(r"= (\w+)\[([\d,]*)\][^ ]* copy\(", text)
    nbytes = sum(_dtype_bytes(t) * math.prod(int(x) for x in d.split(",") if x)
                 for t, d in copies)
    return {"collectives": {k: {"launches": launches[k], "bytes": int(sent[k])}
                            for k in sorted(launches)},
            "copies": len(copies), "copy_bytes": int(nbytes),
            "matmul_gflop": matmul_flops(text)[0] / 1e9}


def run_model(name, args) -> dict:
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    import zerojax as zj
    import zerojax.step

    devices = np.array(jax.devices()[: args.data * args.model]).reshape(args.data, args.model)
    own = Mesh(devices, ("fsdp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    zmesh = zj.make_mesh(data=args.data, model=args.model)
    r = np.random.default_rng(0)
    host = {k: r.integers(0, args.vocab, (args.batch, args.seq)).astype(np.int32)
            for k in ("x", "y")}
    whole, out, made, states, losses = zerojax.step.whole, {}, {}, {}, {}
    for v in args.variants:
        net, cls = build(name, args, own)
        if v == "zerojax_state_split":  # the state open over "model", as before step.whole
            zerojax.step.whole = lambda plan, model_state: model_state
        try:  # traced (for the text and the first steps) under the patch, run from jit's cache
            step, state, batch, lower = gspmd(net, cls, own, host, v == "gspmd_remat") \
                if v.startswith("gspmd") else \
                zero(net, zmesh, host, () if v == "zerojax_one_unit" else None,
                     remat=v != "zerojax_keep_dots")
            exe = lower().compile()
            out[v] = collectives(exe.as_text(), args.data, args.model)
            mem = exe.memory_analysis()  # per device; the state is donated
            out[v]["peak_mb"] = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                 - mem.alias_size_in_bytes + mem.temp_size_in_bytes) / 1e6
            out[v]["temp_mb"] = mem.temp_size_in_bytes / 1e6
            for _ in range(2):  # compile and warm up
                state, m = step(state, batch)
            jax.block_until_ready(state)
        finally:
            zerojax.step.whole = whole
        states[v], made[v], out[v]["times"] = state, (step, batch), []
    order = np.random.default_rng(0)
    for rep in range(args.repeats):
        for v in [args.variants[i] for i in order.permutation(len(args.variants))]:
            fn, batch = made[v]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                states[v], m = fn(states[v], batch)
            jax.block_until_ready((states[v], m))
            out[v]["times"].append((time.perf_counter() - t0) / args.steps)
            losses[v] = float(m["loss"])
        print(f"  {name} repeat {rep + 1}/{args.repeats}: " + " ".join(
            f"{v}={out[v]['times'][-1] * 1e3:.1f}ms" for v in args.variants), flush=True)
    base = out["gspmd"]["times"] if "gspmd" in out else None
    for v in out:
        med, t = float(np.median(out[v]["times"])), np.array(out[v]["times"])
        out[v].update(median_s=med, loss=losses[v],
                      ratio=None if base is None else med / float(np.median(base)),
                      paired=None if base is None else float(np.median(t / np.array(base))))
    return out


def table(name, res) -> str:
    lines = [f"\n{name}: per step (median), ratio to gspmd, matmul GFLOP and compiled peak per "
             f"device, copies; collectives per step (launches, bytes one device sends)"]
    for v, r in res.items():
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}x (paired {r['paired']:.2f})"
        lines.append(f"  {v:20s} {r['median_s'] * 1e3:8.2f} ms  {ratio:>20s}  "
                     f"loss {r['loss']:.4f}  matmul {r['matmul_gflop']:.3f} GFLOP  "
                     f"peak {r['peak_mb']:.2f} MB (temp {r['temp_mb']:.2f})  "
                     f"copies {r['copies']} ({r['copy_bytes']} B)")
        for k, c in r["collectives"].items():
            lines.append(f"      {k:28s} {c['launches']:4d}  {c['bytes']:10d} B")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    setup(args)
    results = {"args": vars(args)}
    for name in args.models:
        results[name] = run_model(name, args)
        print(table(name, results[name]), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
