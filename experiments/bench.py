"""Steady-state step time of zerojax stages 0-3 against GSPMD FSDP and single-device optax.

Every variant trains the same GPT preset from the same init on the same batch with the same
precision policy (fp32 master params and Adam moments, `--param-dtype` compute) and the same
remat. Variants run round-robin, one timed block each per repeat, so load drift on a shared
machine hits all of them alike; each figure is a median over repeats and a ratio against
GSPMD FSDP from the same run. See docs/performance.md.

    .venv/bin/python experiments/bench.py --preset small8 --devices 8 --batch 16 --json out.json

Tensor parallelism, run when named: stage 3 on data N/M × model M against GSPMD on a
fsdp N/M × tensor M mesh with the same 2-D weight shardings, without and with MaxText's
sharding constraints (`--tp M`, default 2):

    .venv/bin/python experiments/bench.py --variants stage3_tp gspmd_fsdp_tp gspmd_fsdp_tp_hinted
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's zerojax

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import zerojax as zj
from zerojax.analysis.flops import run_peak
from zerojax.analysis.measurement import host_update_peak, peaks, twin_flow_bytes
from zerojax.app.overlap import DEFAULT_COMBINE_BYTES, apply_overlap_flags
from zerojax.app.report import state_bytes_split
from zerojax.mesh import DATA, put_batch
from zerojax.models import GPT
from zerojax.models.gpt import PRESETS
from zerojax.partition import spec_split
from zerojax.precision import DTYPES
from zerojax.units import PlainUnits

BASELINE = "gspmd_fsdp"
HINTED = "gspmd_fsdp_hinted"  # + activation/weight sharding constraints, as MaxText adds
FLOOR = "floor"  # N independent replicas, no communication: the work any step must do
OFFLOAD = "stage3_offload"  # stage 3 with the optimizer state in host memory
# ... with the delayed parameter update from the first step (delayed_update=0): the host's
# update of step t-1 free to run beside step t's forward and backward
OFFLOAD_DPU = "stage3_offload_dpu"
# Twin-Flow (run when named): the host keeps and updates --offload-fraction of the params'
# state, the devices the rest; without and with the delayed update
TWIN, TWIN_DPU = "stage3_twin", "stage3_twin_dpu"
# ZeRO++ (ZeroConfig's options), run when named in --variants: qwZ int8 weight gathers, qgZ
# int4 gradient reductions, both, and both with hpZ on a replica 2 × data N/2 mesh.
ZEROPP = {
    "stage3_qwz": {"quantize_weights": "int8"},
    "stage3_qgz": {"quantize_grads": "int4"},
    "stage3_qwz_qgz": {"quantize_weights": "int8", "quantize_grads": "int4"},
    "stage3_zeropp": {"quantize_weights": "int8", "quantize_grads": "int4", "hpz": True},
}
# Tensor parallelism (--tp M), run when named: zerojax stage 3 on make_mesh(data=N/M, model=M),
# and GSPMD on a fsdp × tensor mesh (MaxText's axis names) with the model's tensor-parallel
# plan (`param_specs()`) over "tensor" and another dimension of each weight over "fsdp".
STAGE3_TP = "stage3_tp"
GSPMD_TP = "gspmd_fsdp_tp"
GSPMD_TP_HINTED = "gspmd_fsdp_tp_hinted"  # + MaxText's weight/activation constraints
TP_VARIANTS = (STAGE3_TP, GSPMD_TP, GSPMD_TP_HINTED)
FSDP, TENSOR = "fsdp", "tensor"
WARMUP_STEPS = 2  # after the compiling call
LR = 3e-4
OPTIMIZER_CHOICES = ("adamw", "clip-adamw", "lamb", "adafactor", "muon")
FLOPS_FORMULA = ("model FLOPs per token = 6·Ψ + 12·L·T·d (PaLM app. B): Ψ the matmul params "
                 "(without the embedding tables), L layers, T seq len, d width; no remat "
                 "recompute; MFU = FLOPs/token × tokens/s ÷ (N × peak bf16 FLOP/s)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small8", choices=sorted(PRESETS))
    p.add_argument("--devices", type=int, default=None,
                   help="mesh size N (default: 8 simulated on CPU, all devices otherwise)")
    p.add_argument("--batch", type=int, default=None, help="global batch (default 2·N)")
    p.add_argument("--param-dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--repeats", type=int, default=7, help="interleaved timed blocks (>= 5)")
    p.add_argument("--steps-per-repeat", type=int, default=2)
    p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute each layer in backward, in every variant")
    p.add_argument("--clip-norm", type=float, default=1.0, help="global-norm clip, every variant")
    p.add_argument("--optimizer", choices=OPTIMIZER_CHOICES, default="adamw",
                   help="adamw: the engine clips (ZeroConfig.clip_norm), the baselines clip in "
                        "an optax chain; the others (an optax clip_by_global_norm chained "
                        "before the optimizer, as users write it) run the same optax chain in "
                        "every variant; muon adds stage1_replicated / stage3_replicated (its "
                        "Newton-Schulz on every device, not on owners)")
    p.add_argument("--variants", nargs="+", default=None,
                   help="subset to run (the baseline always runs); the ZeRO++ variants "
                        f"{', '.join(ZEROPP)} and the tensor-parallel ones "
                        f"{', '.join(TP_VARIANTS)} run only when named")
    p.add_argument("--tp", type=int, default=2, metavar="M",
                   help=f"model axis of {STAGE3_TP} (data N/M × model M) and {GSPMD_TP} "
                        f"(fsdp N/M × tensor M)")
    p.add_argument("--baseline", default=BASELINE,
                   help="the variant the ratios are against (optax_single: one device)")
    p.add_argument("--profile", metavar="DIR", help="write a jax.profiler trace of each variant")
    p.add_argument("--overlap", choices=("off", "flags", "o1"), default="off",
                   help="GPU overlap: zerojax.app.overlap XLA flags, or JAX_OPTIMIZATION_LEVEL=O1")
    p.add_argument("--peak-flops", type=float, default=None, help="per-device peak for MFU")
    p.add_argument("--sequential", action="store_true",
                   help="build, time and free one variant at a time (one model state in device "
                        "memory at once; a variant that runs out of memory is reported n/a)")
    p.add_argument("--hlo", nargs="?", const="", metavar="DIR",
                   help="also report compiled-HLO collectives, op counts and peak memory "
                        "(and write each variant's optimized HLO text to DIR)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write the results as JSON to PATH (default: stdout)")
    p.add_argument("--offload-fraction", type=float, default=0.4,
                   help=f"{TWIN} and {TWIN_DPU}: the host's share of the params' update")
    p.add_argument("--update-params", type=float, default=50e6,
                   help=f"with {OFFLOAD}: also time the offloaded AdamW update alone on a shard "
                        "of this many params against a memory copy in this process "
                        "(experiments/update_bench.py); 0: not")
    args = p.parse_args(argv)
    if args.repeats < 5:
        p.error(f"--repeats {args.repeats}: medians need at least 5 interleaved repeats")
    if args.steps_per_repeat < 1:
        p.error("--steps-per-repeat must be >= 1")
    if args.tp < 2:
        p.error(f"--tp {args.tp}: the model axis of the tensor-parallel variants needs >= 2 "
                f"devices")
    return args


def setup_backend(args) -> list[str]:
    """Sets XLA_FLAGS / JAX_OPTIMIZATION_LEVEL; must run before jax starts its backend."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    # Only the host (CPU) platform reads this flag, so it is harmless on GPU machines.
    flags.append(f"--xla_force_host_platform_device_count={args.devices or 8}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    if args.overlap == "o1":
        os.environ["JAX_OPTIMIZATION_LEVEL"] = "O1"
        jax.config.update("jax_optimization_level", "O1")
        return []
    if args.overlap != "flags":
        return []
    # one layer's compute bytes, without starting the backend
    layer = PRESETS[args.preset].layer_params * np.dtype(DTYPES[args.param_dtype]).itemsize
    return apply_overlap_flags(combine_threshold_bytes=max(layer, DEFAULT_COMBINE_BYTES))


# ---------------------------------------------------------------------------------- variants


@dataclass
class Variant:
    """One thing to time: `step(state, batch) -> (state, metrics)`, donating `state`."""

    name: str
    step: Callable
    state: Any
    batch: Any
    lower: Callable  # () -> jax.stages.Lowered of the step, for --hlo
    times: list = field(default_factory=list)
    cpu: list = field(default_factory=list)  # process CPU seconds per step: work, not waiting
    compile_s: float = 0.0
    loss: float = float("nan")
    memory: dict = field(default_factory=dict)  # the compiled step's memory_analysis, bytes
    engine: Any = None  # zerojax's variants: the engine (offload's host figures come from it)


def zero_variant(name, model, mesh, args, host_batch, stage, prefetch=False,
                 offload=None, owners=True, **zeropp) -> Variant:
    own_clip = args.optimizer == "adamw"  # the engine clips; otherwise the optax chain does
    cfg = zj.ZeroConfig(stage=stage, param_dtype=args.param_dtype, remat=args.remat,
                        clip_norm=args.clip_norm if own_clip else None, prefetch=prefetch,
                        offload=offload, **zeropp)
    if cfg.hpz:  # the same devices as replica 2 × data N/2
        n = mesh.shape[DATA]
        if n < 4 or n % 2:
            raise ValueError(f"hpZ needs a replica axis: an even N >= 4 devices (got {n})")
        mesh = zj.make_mesh(data=n // 2, replica=2, devices=list(mesh.devices.flat))
    # zerojax.adamw is optax.adamw, whose host update an offloaded engine fuses
    engine = zj.Engine(model, zj.adamw(LR) if own_clip else plain_tx(args), mesh, cfg,
                       owners=owners)
    batch = put_batch(host_batch, mesh)
    state = engine.init(jax.random.key(0), batch)
    return Variant(name, engine.step, state, batch, lambda: engine.lower(None, batch),
                   engine=engine)


def named_tx(args) -> optax.GradientTransformation:
    if args.optimizer in ("adamw", "clip-adamw"):
        return optax.adamw(LR)
    if args.optimizer == "lamb":
        return optax.lamb(LR)
    if args.optimizer == "adafactor":
        return optax.adafactor(LR)
    from zerojax.app.presets import build
    return build("muon", LR, weight_decay=0.0)


def plain_tx(args) -> optax.GradientTransformation:
    """The optimizer with the global-norm clip in front (the engine's own clip for adamw)."""
    return optax.chain(optax.clip_by_global_norm(args.clip_norm), named_tx(args))


def fsdp_spec(shape, n: int, first: int = 0) -> P:
    """Shards the largest dimension (from `first` on) divisible by `n`; replicated if none."""
    dims = [i for i in range(first, len(shape)) if n > 1 and shape[i] % n == 0]
    if not dims:
        return P()
    axis = max(dims, key=lambda i: (shape[i], -i))
    return P(*(DATA if i == axis else None for i in range(len(shape))))


class HintedUnits(PlainUnits):
    """MaxText-style hints for GSPMD: each gathered weight replicated, activations on batch."""

    def __init__(self, dtype, remat, mesh):
        super().__init__(dtype, remat)
        self.full, self.act = NamedSharding(mesh, P()), NamedSharding(mesh, P(DATA))

    def gather(self, subtree):
        return jax.lax.with_sharding_constraint(super().gather(subtree), self.full)

    def scan(self, body, carry, stacked):
        hinted = lambda c, p: jax.lax.with_sharding_constraint(body(c, p), self.act)
        return super().scan(hinted, jax.lax.with_sharding_constraint(carry, self.act), stacked)


def optax_variant(name, model, mesh, args, host_batch, hinted=False) -> Variant:
    """Plain jax + optax; with a mesh, GSPMD FSDP (annotations only, XLA picks collectives)."""
    tx = plain_tx(args)
    dtype = DTYPES[args.param_dtype]
    units = HintedUnits(dtype, args.remat, mesh) if hinted else PlainUnits(dtype, args.remat)
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    opt_abstract = jax.eval_shape(tx.init, abstract)
    if mesh is None:  # single device: no shardings at all
        return jit_variant(name, model, tx, units, host_batch, None)
    n = mesh.shape[DATA]
    # The layer axis of the stacked blocks is the scan axis: never shard it.
    p_sh = jax.tree_util.tree_map_with_path(
        lambda path, a: NamedSharding(mesh, fsdp_spec(
            a.shape, n, 1 if jax.tree_util.keystr(path[:1]) == "['blocks']" else 0)),
        abstract)
    # Every optimizer-state leaf sharded as a param of its shape would be (its largest
    # divisible axis; a stacked block's layer axis never), whatever the optimizer.
    o_sh = jax.tree_util.tree_map_with_path(
        lambda path, a: NamedSharding(mesh, fsdp_spec(
            a.shape, n, 1 if "'blocks'" in jax.tree_util.keystr(path) and a.ndim > 2
            else 0)), opt_abstract)
    return jit_variant(name, model, tx, units, host_batch, (p_sh, o_sh, P(DATA)), mesh)


def jit_variant(name, model, tx, units, host_batch, shardings, mesh=None) -> Variant:
    """One `jax.jit` of value_and_grad + the optax update, donating the state; `shardings`:
    (params', optimizer state's NamedShardings, the batch's PartitionSpec) on `mesh`, or None
    for one device. With shardings, GSPMD places every collective."""
    rng = jax.random.key(0)
    if shardings is None:
        p_sh = o_sh = None
        batch = jax.device_put(host_batch, jax.devices()[0])
        shard = {}
    else:
        p_sh, o_sh, b_spec = shardings
        b_sh, out_sh = NamedSharding(mesh, b_spec), NamedSharding(mesh, P())
        batch = jax.device_put(host_batch, b_sh)
        shard = dict(in_shardings=((p_sh, o_sh), b_sh), out_shardings=((p_sh, o_sh), out_sh))

    def train_step(state, batch):
        params, opt_state = state
        loss, g = jax.value_and_grad(lambda p: model.loss(p, batch, units))(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    step = jax.jit(train_step, donate_argnums=0, **shard)
    params = jax.jit(model.init, out_shardings=p_sh)(rng)
    state = (params, jax.jit(tx.init, out_shardings=o_sh)(params))
    return Variant(name, step, state, batch, lambda: step.lower(state, batch))


def tp_spec(shape, split: int | None, fsdp: int, first: int = 0) -> P:
    """MaxText's 2-D weight sharding: dimension `split` (the model's tensor-parallel one, or
    None) over "tensor", and the largest other dimension from `first` on that `fsdp` divides
    over "fsdp" (none if no dimension fits)."""
    dims = [i for i in range(first, len(shape))
            if i != split and fsdp > 1 and shape[i] % fsdp == 0]
    axis = max(dims, key=lambda i: (shape[i], -i)) if dims else None
    return P(*(TENSOR if i == split else FSDP if i == axis else None
               for i in range(len(shape))))


def tp_mesh(devices, m: int) -> Mesh:
    """The devices as a fsdp N/M × tensor M mesh, tensor innermost (as zerojax's model axis)."""
    n = len(devices)
    if n % m:
        raise ValueError(f"--tp {m} does not divide the {n} devices")
    return Mesh(np.array(devices, dtype=object).reshape(n // m, m), (FSDP, TENSOR))


def tp_shardings(model, mesh: Mesh, tx) -> tuple[Any, Any]:
    """(params', optimizer state's NamedShardings) of GSPMD 2-D: each weight as `tp_spec` puts
    it (its `param_specs()` "model" dimension over "tensor"; never the layer axis of the
    stacked blocks over "fsdp"), each optimizer-state copy of the params sharded like them,
    the rest (step counts) replicated."""
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    fsdp = mesh.shape[FSDP]
    specs = treedef.flatten_up_to(model.param_specs())
    p_sh = treedef.unflatten([
        NamedSharding(mesh, tp_spec(a.shape, spec_split(s, a.shape, jax.tree_util.keystr(k)),
                                    fsdp, 1 if jax.tree_util.keystr(k[:1]) == "['blocks']"
                                    else 0))
        for (k, a), s in zip(leaves, specs)])
    replicated = NamedSharding(mesh, P())
    # A state leaf of another shape than its param (factored statistics): replicated.
    o_sh = optax.tree_map_params(
        tx, lambda x, a, sh: sh if x.shape == a.shape else replicated,
        jax.eval_shape(tx.init, abstract), abstract, p_sh,
        transform_non_params=lambda _: replicated)
    return p_sh, o_sh


def stage3_tp_variant(model, devices, args, host_batch) -> Variant:
    """zerojax stage 3 on make_mesh(data=N/M, model=M): ZeRO over "data", the model's
    `param_specs()` plan over "model" (DESIGN.md section 8)."""
    m = tp_mesh(devices, args.tp).shape[TENSOR]  # the same devices, the same check
    mesh = zj.make_mesh(data=len(devices) // m, model=m, devices=devices)
    return zero_variant(STAGE3_TP, model, mesh, args, host_batch, 3)


class TPHintedUnits(PlainUnits):
    """MaxText-style hints on the fsdp × tensor mesh: each gathered weight keeps only its
    "tensor" split (it is gathered over "fsdp" where the model uses it), and the residual
    stream is sharded on batch over "fsdp" at every layer boundary. `specs`: the params'
    PartitionSpecs, a dict of units as the GPT's (the stacked `blocks` per layer)."""

    def __init__(self, dtype, remat, mesh, specs):
        super().__init__(dtype, remat)
        self.act = NamedSharding(mesh, P(FSDP))
        self.weights = {}  # a gathered subtree's structure -> its leaves' shardings
        is_spec = lambda x: isinstance(x, P)
        for key, tree in specs.items():
            lead = 1 if key == "blocks" else 0  # a layer of the stack has no layer axis
            flat, treedef = jax.tree.flatten(tree, is_leaf=is_spec)
            self.weights[treedef] = [NamedSharding(mesh, P(*(e if e == TENSOR else None
                                                             for e in tuple(spec)[lead:])))
                                     for spec in flat]

    def gather(self, subtree):
        full = super().gather(subtree)
        flat, treedef = jax.tree.flatten(full)
        return treedef.unflatten([jax.lax.with_sharding_constraint(x, sh) for x, sh in
                                  zip(flat, self.weights[treedef])])

    def scan(self, body, carry, stacked):
        hinted = lambda c, p: jax.lax.with_sharding_constraint(body(c, p), self.act)
        return super().scan(hinted, jax.lax.with_sharding_constraint(carry, self.act), stacked)


def gspmd_tp_variant(model, devices, args, host_batch, hinted=False) -> Variant:
    """GSPMD with tensor parallelism, MaxText style: fsdp N/M × tensor M, the weights as
    `tp_shardings` puts them, the batch over "fsdp" (replicated over "tensor"); XLA partitions
    each matmul from the shardings. `hinted`: with TPHintedUnits' constraints, so that
    each weight is gathered over "fsdp" and each matmul split over "tensor" (Megatron)."""
    mesh = tp_mesh(devices, args.tp)
    tx = plain_tx(args)
    p_sh, o_sh = tp_shardings(model, mesh, tx)
    dtype = DTYPES[args.param_dtype]
    units = (TPHintedUnits(dtype, args.remat, mesh, jax.tree.map(lambda sh: sh.spec, p_sh))
             if hinted else PlainUnits(dtype, args.remat))
    return jit_variant(GSPMD_TP_HINTED if hinted else GSPMD_TP, model, tx, units, host_batch,
                       (p_sh, o_sh, P(FSDP)), mesh)


def floor_variant(model, mesh, args, host_batch) -> Variant:
    """The work of any N-device step without its communication: N independent replicas, each
    training its own copy (plain optax, same units) on its slice of the batch."""
    tx = plain_tx(args)
    units = PlainUnits(DTYPES[args.param_dtype], args.remat)
    n, spec = mesh.shape[DATA], NamedSharding(mesh, P(DATA))

    def local(state, batch):  # per device: state leaves [1, ...], batch [B/N, T]
        params, opt_state = jax.tree.map(lambda x: x[0], state)
        loss, g = jax.value_and_grad(lambda p: model.loss(p, batch, units))(params)
        updates, opt_state = tx.update(g, opt_state, params)
        new = (optax.apply_updates(params, updates), opt_state)
        return jax.tree.map(lambda x: x[None], new), {"loss": loss[None]}

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(DATA), P(DATA)),
                                 out_specs=(P(DATA), P(DATA))), donate_argnums=0)
    params = model.init(jax.random.key(0))
    state = jax.device_put(jax.tree.map(lambda x: np.broadcast_to(x, (n, *np.shape(x))),
                                        (params, tx.init(params))), spec)
    batch = jax.device_put(host_batch, spec)
    return Variant(FLOOR, step, state, batch, lambda: step.lower(state, batch))


def variant_makers(model, mesh, args, host_batch) -> dict[str, Callable[[], Variant]]:
    """Every variant this mesh can run, by name, each built on call."""
    makers = {
        BASELINE: lambda: optax_variant(BASELINE, model, mesh, args, host_batch),
        HINTED: lambda: optax_variant(HINTED, model, mesh, args, host_batch, hinted=True),
        **{f"stage{s}": (lambda s=s: zero_variant(f"stage{s}", model, mesh, args, host_batch, s))
           for s in range(4)},
        "stage3_prefetch": lambda: zero_variant("stage3_prefetch", model, mesh, args,
                                                host_batch, 3, prefetch=True),
        # The fp32 master and Adam moments in pinned host memory, the update on the host.
        OFFLOAD: lambda: zero_variant(OFFLOAD, model, mesh, args, host_batch, 3,
                                      offload="optimizer"),
        OFFLOAD_DPU: lambda: zero_variant(OFFLOAD_DPU, model, mesh, args, host_batch, 3,
                                          offload="optimizer", delayed_update=0),
        TWIN: lambda: zero_variant(TWIN, model, mesh, args, host_batch, 3, offload="optimizer",
                                   offload_fraction=args.offload_fraction),
        TWIN_DPU: lambda: zero_variant(TWIN_DPU, model, mesh, args, host_batch, 3,
                                       offload="optimizer", delayed_update=0,
                                       offload_fraction=args.offload_fraction),
    }
    devices = list(mesh.devices.flat)
    makers[STAGE3_TP] = lambda: stage3_tp_variant(model, devices, args, host_batch)
    makers[GSPMD_TP] = lambda: gspmd_tp_variant(model, devices, args, host_batch)
    makers[GSPMD_TP_HINTED] = lambda: gspmd_tp_variant(model, devices, args, host_batch,
                                                       hinted=True)
    for name, kw in ZEROPP.items():
        makers[name] = (lambda name=name, kw=kw: zero_variant(name, model, mesh, args,
                                                              host_batch, 3, **kw))
    if args.optimizer == "muon":
        for s in (1, 3):
            makers[f"stage{s}_replicated"] = (
                lambda s=s: zero_variant(f"stage{s}_replicated", model, mesh, args, host_batch,
                                         s, owners=False))
    n = mesh.shape[DATA]
    if n == 1:
        makers["optax_single"] = lambda: optax_variant("optax_single", model, None, args,
                                                       host_batch)
    else:
        makers[FLOOR] = lambda: floor_variant(model, mesh, args, host_batch)
    return makers


def selected(makers, args) -> list[str]:
    """The names to run, in the makers' order; the baseline always runs."""
    named = set(ZEROPP) | set(TP_VARIANTS) | {TWIN, TWIN_DPU}  # run only when named
    wanted = set(args.variants or [n for n in makers if n not in named]) | {args.baseline}
    unknown = wanted - set(makers)
    if unknown:
        raise SystemExit(f"unknown --variants {sorted(unknown)}; choose from {sorted(makers)}")
    return [n for n in makers if n in wanted]


def build_variants(makers, todo, baseline=BASELINE) -> tuple[dict[str, Variant], dict[str, str]]:
    """The variants `todo` that build and warm up; the others map to the reason they are n/a
    (the baseline's failure is raised)."""
    log(f"build + compile {', '.join(todo)}")
    # Compiling is untimed and mostly single-threaded: overlap the variants' compiles.
    with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1)) as pool:
        jobs = {n: pool.submit(_prepare, makers[n]) for n in todo}
    ready, na = {}, {}
    for name, job in jobs.items():
        try:
            v = job.result()
            for _ in range(1 + WARMUP_STEPS):  # the first call only fetches the compiled step
                v.state, m = v.step(v.state, v.batch)
            jax.block_until_ready((v.state, m))
            ready[name] = v
        except Exception as e:  # noqa: BLE001 -- e.g. prefetch not built yet: report, go on
            if name == baseline:
                raise
            na[name] = _reason(e)
            log(f"  {name}: n/a ({na[name]})")
    return ready, na


def _reason(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _prepare(make) -> Variant:
    v = make()
    t0 = time.perf_counter()
    compiled = v.lower().compile()  # fills the jit cache that v.step then hits
    v.compile_s = time.perf_counter() - t0
    v.memory = memory_stats(compiled)
    if v.engine is not None and v.engine.host_mesh is not None:
        # Offload: the step's program is the devices'; the host's update is a program of its
        # own, whose compiled peak is the host's.
        # Twin-Flow's share of the state stays in device memory beside that program.
        twin = twin_flow_bytes(v.engine)
        v.memory |= {"host_state_bytes": state_bytes_split(v.engine, v.state,
                                                           jax.devices()[0])[1],
                     "host_peak_bytes": host_update_peak(v.engine), "twin_flow_bytes": twin,
                     "host_update": v.engine.host_update}  # "fused", or "xla: <why not>"
        if twin and "device_peak_bytes" in v.memory:
            v.memory["device_peak_bytes"] += twin
            v.memory["peak_bytes"] += twin
    return v


def memory_stats(compiled) -> dict:
    """Per-device bytes XLA assigned to the compiled step; peak = argument + output - alias +
    temp (the donated state counted once; measurement.peaks). An offloading variant adds its
    host state and the host update's peak (`_prepare`). Empty where the backend reports
    nothing."""
    mem = compiled.memory_analysis()
    if mem is None:
        return {}
    peak, host_peak = peaks(mem)
    return {"peak_bytes": peak, "temp_bytes": mem.temp_size_in_bytes,
            "argument_bytes": mem.argument_size_in_bytes, "device_peak_bytes": peak,
            "host_peak_bytes": host_peak, "host_state_bytes": 0, "split": "measured"}


def run_sequential(makers, todo, args) -> tuple[dict[str, Variant], dict[str, str]]:
    """One variant at a time: build, warm up, time, then drop its state before the next, so
    device memory holds one model state at once. Ratios compare separate time windows, which
    suits a dedicated accelerator, not a shared CPU."""
    done, na = {}, {}
    for name in todo:
        ready, failed = build_variants(makers, [name], args.baseline)
        na.update(failed)
        if name in ready:
            v = ready[name]
            try:
                time_interleaved(ready, args.repeats, args.steps_per_repeat)
                done[name] = v
            except Exception as e:  # noqa: BLE001 -- e.g. out of memory while timing
                if name == args.baseline:
                    raise
                na[name] = _reason(e)
                log(f"  {name}: n/a ({na[name]})")
            v.state = v.batch = None
        del ready
        gc.collect()
    return done, na


# ---------------------------------------------------------------------------------- timing


def time_interleaved(variants: dict[str, Variant], repeats: int, steps: int) -> None:
    """Round-robin timed blocks, each repeat in its own order (a seeded shuffle), so that no
    variant always follows the same one: a rotated cycle kept each variant's predecessor, and
    on a shared CPU the block after a slow variant ran faster (docs/performance.md)."""
    names = list(variants)
    shuffle = np.random.default_rng(0)
    # Each block starts after a collection, so that no block pays for another's garbage. What
    # exists before the first block (the traced and compiled programs: most of the heap) is
    # frozen out of those collections, which then scan only what the blocks made: each took
    # 0.26 s on the test preset, a third of the CPU bench's run. Unfrozen after, so that a
    # sequential run's collection frees the variant it drops.
    gc.collect()
    gc.freeze()
    try:
        for r in range(repeats):
            for name in [names[i] for i in shuffle.permutation(len(names))]:
                v = variants[name]
                gc.collect()
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    v.state, m = v.step(v.state, v.batch)
                jax.block_until_ready((v.state, m))
                v.times.append((time.perf_counter() - t0) / steps)
                v.cpu.append((time.process_time() - c0) / steps)
                v.loss = float(np.mean(m["loss"]))
            log(f"repeat {r + 1}/{repeats}: " + " ".join(
                f"{n}={variants[n].times[-1] * 1e3:.0f}ms" for n in names))
    finally:
        gc.unfreeze()


def summarize(variants, na, tokens, flops_per_token, peak, n_dev, baseline=BASELINE) -> dict:
    base = variants[baseline].times
    out = {}
    for name, v in variants.items():
        t = np.array(v.times)
        med = float(np.median(t))
        paired = np.array(v.times) / np.array(base)
        tps = tokens / med
        out[name] = {
            "status": "ok", "median_s": med, "min_s": float(t.min()), "max_s": float(t.max()),
            "q25_s": float(np.percentile(t, 25)), "q75_s": float(np.percentile(t, 75)),
            "ratio": med / float(np.median(base)),
            "paired_ratio": float(np.median(paired)),
            "paired_ratio_min": float(paired.min()), "paired_ratio_max": float(paired.max()),
            "cpu_s": float(np.median(v.cpu)),
            "cpu_ratio": float(np.median(v.cpu)) / float(np.median(variants[baseline].cpu)),
            "tokens_per_s": tps,
            "mfu": None if peak is None else flops_per_token * tps / (peak * n_dev),
            "compile_s": v.compile_s, "loss": v.loss, "times_s": [float(x) for x in t],
            **v.memory,
        }
    for name, reason in na.items():
        out[name] = {"status": "n/a", "reason": reason}
    return out


def targets(res: dict, baseline: str = BASELINE) -> dict:
    """The CPU targets, judged on medians; paired and CPU-time figures alongside. Against
    another baseline than GSPMD FSDP: stage 3's ratio to it and the stages' spread. With the
    tensor-parallel variants: stage 3 on data × model against GSPMD fsdp × tensor."""
    ok = lambda n: res.get(n, {}).get("status") == "ok"
    t: dict = {}
    if ok("stage3") and baseline != BASELINE:
        t[f"stage3_over_{baseline}"] = res["stage3"]["ratio"]
    elif ok("stage3"):
        r = res["stage3"]
        t.update(stage3_over_fsdp=r["ratio"], stage3_over_fsdp_paired=r["paired_ratio"],
                 stage3_over_fsdp_cpu=r["cpu_ratio"])
        t["stage3_le_0.8x_fsdp"] = r["ratio"] <= 0.8
    for base in (GSPMD_TP, GSPMD_TP_HINTED):  # tensor parallelism: against GSPMD 2-D
        if ok(STAGE3_TP) and ok(base):
            a, b = res[STAGE3_TP], res[base]
            key = f"{STAGE3_TP}_over_{base}"
            t[key] = a["median_s"] / b["median_s"]
            t[key + "_paired"] = float(np.median(np.array(a["times_s"])
                                                 / np.array(b["times_s"])))
            t[key + "_cpu"] = a["cpu_s"] / b["cpu_s"]
            t[f"{STAGE3_TP}_le_1.0x_{base}"] = t[key] <= 1.0
    if ok(FLOOR) and baseline == BASELINE:  # what a zero-overhead step would score
        t["floor_over_fsdp"] = res[FLOOR]["ratio"]
        t["floor_over_fsdp_cpu"] = res[FLOOR]["cpu_ratio"]
    t.update(dpu_targets(res, ok, baseline))
    if all(ok(f"stage{s}") for s in (1, 2, 3)):
        for key, suffix in (("median_s", ""), ("paired_ratio", "_paired"), ("cpu_s", "_cpu")):
            vals = [res[f"stage{s}"][key] for s in (1, 2, 3)]
            t["stages_123_spread" + suffix] = max(vals) / min(vals) - 1
        t["stages_123_within_10pct"] = t["stages_123_spread"] <= 0.10
    return t


def dpu_targets(res: dict, ok, baseline: str) -> dict:
    """The offloaded step with and without the delayed update: each against the baseline
    (plain optax) and the delayed one against plain offload (median and paired)."""
    t: dict = {}
    for name in (OFFLOAD, OFFLOAD_DPU):
        if ok(name):
            t[f"{name}_over_{baseline}"] = res[name]["ratio"]
    if ok(OFFLOAD) and ok(OFFLOAD_DPU):
        a, b = res[OFFLOAD_DPU], res[OFFLOAD]
        t[f"{OFFLOAD_DPU}_over_{OFFLOAD}"] = a["median_s"] / b["median_s"]
        t[f"{OFFLOAD_DPU}_over_{OFFLOAD}_paired"] = float(np.median(
            np.array(a["times_s"]) / np.array(b["times_s"])))
    return t


# ---------------------------------------------------------------------------------- HLO


_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "f64": 8}
_TRIVIAL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}
_INSTR = re.compile(r"^\s+(?:ROOT )?%\S+ = (\(.*?\)|\w+\[[\d,]*\])\S* ([\w-]+)\((.*)$")


def hlo_stats(text: str) -> dict:
    """Collectives and ops executed per step (while bodies × known trip count), per device."""
    comps, cur, entry = {}, None, None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) ", line)
        if head:
            cur = comps.setdefault(head.group(2), [])
            entry = head.group(2) if head.group(1) else entry
        elif cur is not None and _INSTR.match(line):
            cur.append(_INSTR.match(line).groups())
    stats = {"ops": 0, "fusions": 0, "while_loops": 0, "collectives": {}, "comm_bytes": 0}

    def walk(name, mult):
        for shape, op, rest in comps.get(name, []):
            if op not in _TRIVIAL:
                stats["ops"] += mult
            stats["fusions"] += mult * (op == "fusion")
            if op == "while":
                trips = re.search(r'known_trip_count":\{"n":"(\d+)"', rest)
                stats["while_loops"] += mult
                walk(re.search(r"body=%([\w.-]+)", rest).group(1),
                     mult * (int(trips.group(1)) if trips else 1))
            elif op in ("call", "conditional", "async-start"):
                for callee in re.findall(r"(?:to_apply|calls|branch_computations)=\{?%([\w.-]+)",
                                         rest):
                    walk(callee, mult)
            kind = op.removesuffix("-start")
            if kind in _COLLECTIVES:
                c = stats["collectives"].setdefault(kind, {"count": 0, "bytes": 0})
                arrays = re.findall(r"(\w+)\[([\d,]*)\]", shape)
                if op.endswith("-start"):  # async: (operands, results); count the results
                    arrays = arrays[len(arrays) // 2:]
                nbytes = sum(_BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d)
                             for t, dims in arrays)
                g = _group_size(rest)
                ring = {"all-gather": (g - 1) / g, "reduce-scatter": g - 1,
                        "all-reduce": 2 * (g - 1) / g}.get(kind, 1.0)
                c["count"] += mult
                c["bytes"] += mult * nbytes
                stats["comm_bytes"] += int(mult * nbytes * ring)

    walk(entry, 1)
    return stats


def _group_size(rest: str) -> int:
    named = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", rest)
    if named:  # mesh['axis_0'=2,'axis_1'=1] {'axis_0'}: the product of the named axes
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", named.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", named.group(2)))
    iota = re.search(r"replica_groups=\[\d+,(\d+)\]", rest)
    if iota:
        return int(iota.group(1))
    explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
    return len(explicit.group(1).split(",")) if explicit else 1


def compiled_stats(v: Variant, directory: str = "") -> dict:
    compiled = v.lower().compile()
    text = compiled.as_text()
    if directory:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"{v.name}.hlo.txt"), "w") as f:
            f.write(text)
    stats = hlo_stats(text)
    mem = memory_stats(compiled)
    stats.update({k: mem[k] for k in ("peak_bytes", "temp_bytes") if k in mem})
    return stats


# ---------------------------------------------------------------------------------- main


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine() -> dict:
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}  # None on CPU
    return {"platform": dev.platform, "device_kind": dev.device_kind,
            "device_memory_bytes": stats.get("bytes_limit"),
            "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
            "devices_visible": jax.device_count(), "cpu": _cpu_name(),
            "cpu_count": os.cpu_count(), "jax": jax.__version__,
            "python": platform.python_version(), "loadavg_start": os.getloadavg()}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def peak_flops(args, dev) -> float | None:
    """--peak-flops, else the library's dense bf16/fp16 peak of `dev`
    (`zerojax.analysis.flops.PEAK_TFLOPS`) for a bf16/fp16 run."""
    peak, _ = run_peak(dev, args.param_dtype, args.peak_flops and args.peak_flops / 1e12)
    return None if peak is None else peak * 1e12


def offload_update(params: int, repeats: int, param_dtype: str) -> dict:
    """experiments/update_bench.py's figures: the offloaded update's state traffic per second
    next to np.copyto's, measured in this process."""
    return _update_bench().measure(params, repeats, param_dtype=param_dtype)


def update_table(update: dict) -> str:
    return _update_bench().table(update)


def _update_bench():
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:  # bench.py loaded by path (gpu_bench's probes, the tests)
        sys.path.insert(0, here)
    import update_bench

    return update_bench


def table(result: dict) -> str:
    cfg = result["config"]
    base = "× fsdp" if result["baseline"] == BASELINE else "× base"
    rows = [f"{cfg['preset']}  N={cfg['devices']}  batch={cfg['batch']}  "
            f"{cfg['param_dtype']}  remat={cfg['remat']}  {cfg['repeats']}×"
            f"{cfg['steps_per_repeat']} steps  ({result['machine']['device_kind']})",
            f"{'variant':<18}{'median ms':>10}{'min':>8}{'max':>8}{base:>8}"
            f"{'paired':>8}{'cpu ms':>9}{base:>9}{'tok/s':>9}{'MFU':>7}{'peak MB':>10}"]
    for name, r in result["variants"].items():
        if r["status"] != "ok":
            rows.append(f"{name:<18}{'n/a':>10}  {r['reason']}")
            continue
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        # Device memory: an offloaded optimizer state is not counted.
        peak = f"{r['device_peak_bytes'] / 1e6:.1f}" if "device_peak_bytes" in r else "-"
        rows.append(f"{name:<18}{r['median_s'] * 1e3:>10.1f}{r['min_s'] * 1e3:>8.1f}"
                    f"{r['max_s'] * 1e3:>8.1f}{r['ratio']:>8.3f}{r['paired_ratio']:>8.3f}"
                    f"{r['cpu_s'] * 1e3:>9.0f}{r['cpu_ratio']:>9.3f}"
                    f"{r['tokens_per_s']:>9.0f}{mfu:>7}{peak:>10}")
    rows += [f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}"
             for k, v in result["targets"].items()]
    return "\n".join(rows)


def main(argv=None) -> dict:
    args = parse_args(argv)
    overlap_flags = setup_backend(args)
    n = args.devices or len(jax.devices())
    model = GPT.from_preset(args.preset)
    c = model.cfg
    batch_size = args.batch or 2 * n
    tokens = np.random.default_rng(0).integers(0, c.vocab_size, (batch_size, c.seq_len + 1))
    tokens = tokens.astype(np.int32)
    host_batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    mesh = zj.make_mesh(data=n)
    info = machine()
    makers = variant_makers(model, mesh, args, host_batch)
    todo = selected(makers, args)
    if args.sequential:
        if args.hlo is not None or args.profile:
            raise SystemExit("--sequential frees each variant after timing it; drop --hlo and "
                             "--profile, or run without --sequential")
        variants, na = run_sequential(makers, todo, args)
    else:
        variants, na = build_variants(makers, todo)
        time_interleaved(variants, args.repeats, args.steps_per_repeat)
    info["loadavg_end"] = os.getloadavg()
    peak = peak_flops(args, jax.devices()[0])
    res = summarize(variants, na, batch_size * c.seq_len, model.flops_per_token(), peak, n,
                    args.baseline)
    if args.hlo is not None:
        for name, v in variants.items():
            log(f"HLO stats {name}")
            res[name]["hlo"] = compiled_stats(v, args.hlo)
    update = None
    if OFFLOAD in todo and args.update_params:
        log(f"offloaded update alone, {args.update_params:.3g} params")
        update = offload_update(int(args.update_params), args.repeats, args.param_dtype)
    if args.profile:
        jax.profiler.start_trace(args.profile, create_perfetto_trace=True)
        for name, v in variants.items():
            with jax.profiler.TraceAnnotation(name):
                for _ in range(args.steps_per_repeat):
                    v.state, m = v.step(v.state, v.batch)
                jax.block_until_ready((v.state, m))
        jax.profiler.stop_trace()
    result = {
        "config": {**{k: getattr(args, k) for k in ("preset", "param_dtype", "repeats",
                                                    "steps_per_repeat", "remat", "clip_norm",
                                                    "optimizer", "overlap", "profile",
                                                    "sequential")},
                   "devices": n, "batch": batch_size, "seq_len": c.seq_len,
                   "num_params": model.num_params(), "flops_per_token": model.flops_per_token(),
                   "peak_flops": peak, "flops_formula": FLOPS_FORMULA,
                   "overlap_flags": overlap_flags,
                   "xla_flags": os.environ.get("XLA_FLAGS", ""),
                   "optimization_level": str(jax.config.jax_optimization_level),
                   "argv": sys.argv[1:]},
        "machine": info, "baseline": args.baseline, "variants": res,
        "targets": targets(res, args.baseline), "offload_update": update,
    }
    if args.json is None or args.json != "-":
        print(table(result))
        if update:
            print(update_table(update))
    if args.json == "-":
        print(json.dumps(result, indent=1))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
