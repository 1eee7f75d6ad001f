"""Layout discovery: one abstract trace of the model's loss learns its units.

`units.scan` marks a stacked leaf (keep the layer axis), `units.gather` one unit; the trace
records which leaves each one saw (`units.RecordingUnits`) and the engine adopts that layout
(`Engine.set_units`: `step_plan`). `Engine._discover` is this module's `discover`.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax.errors import ModelError
from zerojax.layout.logical import abstract_key_data
from zerojax.mesh import DATA, REPLICA, check_batch
from zerojax.partition import Layout, LeafSpec
from zerojax.precision import DTYPES
from zerojax.step import StepPlan, device_key, example_keys, split_loss
from zerojax.units import RecordingUnits, make_handles
from zerojax.update import ShardedUpdate, StepUpdate, takes_value


def discover(engine, params_abstract, batch) -> None:
    """Traces the loss once, abstractly, to learn which leaves are scanned or gathered.

    The trace runs inside a shard_map over this engine's mesh, as the step does, so a
    model may name the batch axes in a collective (`lax.pmean(x, batch_axes(mesh))`)."""
    check_batch(batch, engine.mesh, engine.config.grad_accum, jax.process_count())
    paths_avals = jax.tree.flatten_with_path(params_abstract)[0]
    treedef = jax.tree.structure(params_abstract)
    avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for _, x in paths_avals]
    paths = [jax.tree_util.keystr(p) for p, _ in paths_avals]
    flat = Layout(tuple(LeafSpec(p, a.shape, False) for p, a in zip(paths, avals)),
                  treedef, 1, True)
    # The plan's refusals (nothing split on a model axis, a split M does not divide) need
    # no trace: made here, before it, as the leaves would be split were none stacked.
    engine._splits(flat.leaves, treedef)
    devices = engine.replica * engine.data
    local = engine.config.grad_accum * devices
    recs = []

    def micro(x):  # one micro-batch per device, as a global batch
        n = jnp.shape(x)[0] * jax.process_count() // local
        return jax.ShapeDtypeStruct((n * devices, *jnp.shape(x)[1:]), jnp.result_type(x))

    def trace(b, rng, model_state):
        m = jax.tree.leaves(b)[0].shape[0]
        ex_key, first = example_keys(rng, 0, engine.axes, m)
        rec = RecordingUnits(avals, DTYPES[engine.config.param_dtype],
                             key=jax.random.fold_in(device_key(rng, 0, engine.axes), 0),
                             state=model_state, example_key=ex_key,
                             rows=first + jnp.arange(m))
        recs.append(rec)
        split_loss(engine.model.loss(make_handles(flat), b, rec))
        return ()

    body = jax.shard_map(trace, mesh=engine.mesh, in_specs=(P(engine.axes), P(), P()),
                         out_specs=(), axis_names=frozenset(engine.axes), check_vma=False)
    jax.eval_shape(body, jax.tree.map(micro, batch), abstract_key_data(),
                   engine._abstract_model_state())
    rec = recs[-1]
    unused = [p for i, p in enumerate(paths) if i not in rec.uses]
    if unused:
        # As plain JAX would: the gradient of an unused parameter is zero.
        warnings.warn(f"the model's loss never gathers parameter(s) {', '.join(unused)}; "
                      f"they get a zero gradient (pass them through units.gather or "
                      f"units.scan to train them)", stacklevel=3)
    both = [p for i, p in enumerate(paths) if len(rec.uses.get(i, ())) > 1]
    if both:
        raise ModelError(f"parameter(s) {', '.join(both)} are used by both units.gather and "
                         f"units.scan; a leaf is either one unit or a stack of layer units")
    engine.set_units(tuple(LeafSpec(p, a.shape, rec.uses.get(i) == {"scan"})
                         for i, (p, a) in enumerate(zip(paths, avals))), treedef)


def step_plan(engine, leaves: tuple[LeafSpec, ...], treedef) -> StepPlan:
    """The plan of the engine's step for the units `leaves` (`Engine.set_units`): the layout
    of its shards, split over the mesh's `model` axis as the model's annotations say, and the
    optimizer over them. For the units the engine has, its own plan, and with it the programs
    made for that plan (a second init traces and compiles no program again)."""
    cfg = engine.config
    stage0 = cfg.stage == 0
    leaves = engine._splits(tuple(leaves), treedef)
    if engine.plan is not None and (engine.plan.layout.leaves, engine.plan.layout.treedef) == (
            leaves, treedef):
        return engine.plan
    if cfg.hpz:  # hpZ: the primary shard over every device, data-major (collectives.py)
        layout = Layout(tuple(leaves), treedef, engine.data * engine.replica,
                        axes=(DATA, REPLICA))
    else:
        layout = Layout(tuple(leaves), treedef, 1 if stage0 else engine.data,
                        replicated=stage0)
    how = StepUpdate(cfg.clip_norm, DTYPES[cfg.param_dtype] if cfg.offload else None,
                     takes_value(engine.optimizer))
    update = ShardedUpdate(engine.optimizer, layout, how, axis=layout.axis,
                           owners=engine.owners)
    return StepPlan(engine.model, engine.optimizer, update, layout, cfg, engine.axes,
                    engine.replica, engine.data)
