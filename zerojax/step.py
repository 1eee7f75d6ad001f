"""The training step: a pure function run per device inside the engine's shard_map.

Per stage, what the step differentiates ("diff args", one per param leaf) and how the
gradient reaches its owner:

  stage 0: full compute params        grad -> psum over all devices (all-reduce)
  stage 1: full compute params        grad -> psum_scatter over "data" after backward
  stage 2: zero shard-shaped stand-ins grad -> psum_scatter per unit inside backward (_view)
  stage 3: compute shards             grad -> psum_scatter per unit inside backward (_gather)

With a replica axis (hybrid sharding) the 1/N gradient shard is then summed over "replica";
under hpZ the shards span both axes and stage 3's backward reduces over both.
The ZeRO++ options change how these collectives travel (`plan.wire`, collectives.py), not
which ones run.

With `offload="optimizer"` the master shard and the optimizer state live on the host's CPU
devices and the step is split (offload/host.py): `local_grads` and `settle` on the devices,
the update on the host, `_refresh` on the devices again, so the device never holds fp32
master or moments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from zerojax.collectives import (
    Wire,
    all_reduce,
    gather_layer,
    gather_units,
    reduce_scatter_leaf,
    vary,
)
from zerojax.collectives.pieces import on_pieces
from zerojax.config import ZeroConfig
from zerojax.errors import ModelError
from zerojax.mesh import DATA, REPLICA
from zerojax.partition import Layout, pad_flat, unpad
from zerojax.precision import DTYPES, update_loss_scale
from zerojax.state import TrainState
from zerojax.units import ShardUnits, UnitReused, make_handles
from zerojax.update import ShardedUpdate

# The memory spaces an offloaded step moves values between inside its program (the gradient
# shard to the host, per unit; a hosted master read on the devices: `on_device`).
HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


def to_memory(tree, space):
    return jax.tree.map(lambda x: jax.device_put(x, space), tree)


@dataclass(frozen=True)
class StepPlan:
    """Everything static a step needs."""

    model: Any
    optimizer: optax.GradientTransformation
    update: ShardedUpdate  # the optimizer over this layout's shards (update/)
    layout: Layout  # over the "data" axis (shards = 1 in stage 0)
    config: ZeroConfig
    axes: tuple[str, ...]  # all mesh axes, ("replica", "data") or ("data",)
    replica: int
    data: int

    @property
    def dtype(self):
        return DTYPES[self.config.param_dtype]

    @property
    def rdtype(self):
        return DTYPES[self.config.grad_dtype]

    @property
    def reduced_dtype(self):
        """The dtype of the reduced gradient shard the update takes: float32 at stages 2-3 with
        grad_accum > 1 (each micro-batch's reduced shard is summed in float32), else the
        reduction dtype. A delayed update's pending gradient waits in it."""
        cfg = self.config
        return jnp.float32 if cfg.stage >= 2 and cfg.grad_accum > 1 else self.rdtype

    @property
    def stores_compute(self) -> bool:
        return stores_compute(self.config.param_dtype, self.config.stage, self.config.offload)

    @property
    def wire(self) -> Wire:
        """How the unit collectives travel: the config's ZeRO++ options."""
        cfg = self.config
        return Wire(cfg.quantize_weights, cfg.quantize_grads, cfg.quant_block,
                    self.replica if cfg.hpz else 1)


def stores_compute(param_dtype: str, stage: int, offload: str | None = None) -> bool:
    """Whether `TrainState.compute` holds compute params apart from the fp32 master."""
    # float32 stages 0 and 3 compute on the master itself; stages 1-2 keep replicated compute
    # params next to the master shard, so they hold both even in float32. An offloaded
    # master is in host memory, so the device needs its own compute copy in every stage.
    return offload is not None or not (param_dtype == "float32" and stage in (0, 3))


def split_loss(out):
    """`loss` or `(loss, aux)` -> `(loss, aux)`, with a clear error for anything else."""
    loss, aux = out if isinstance(out, tuple) else (out, {})
    if not hasattr(loss, "shape") or loss.shape != ():
        raise ModelError(f"Model.loss must return a scalar loss (or (loss, aux)); got "
                         f"{getattr(loss, 'shape', type(loss))}")
    if not isinstance(aux, Mapping):
        raise ModelError(f"Model.loss returned aux of type {type(aux).__name__}; aux must be a "
                         f"dict of scalar metrics")
    for name, v in aux.items():
        if jnp.shape(v) != ():
            raise ModelError(
                f"aux value {name!r} has shape {jnp.shape(v)}; aux holds scalar metrics "
                f"(averaged over devices): reduce it to a scalar, or keep arrays such as "
                f"BatchNorm statistics in the model state (init_state and units.set_state)")
    return loss, aux


def device_key(rng, step, axes) -> jax.Array:
    """The typed key of `step` on this device: the base key folded with the step and the
    device's position on the batch axes (`axes`)."""
    key = jax.random.fold_in(jax.random.wrap_key_data(rng), step)
    return jax.random.fold_in(key, lax.axis_index(axes))


_EXAMPLES = 0x7FFFFFFF  # folded into the base key for the per-example keys: not a device position


def example_keys(rng, step, axes, local: int) -> tuple[jax.Array, jax.Array]:
    """(the typed key of `step` for per-example keys, the global batch index of this device's
    first example): neither depends on how many devices share the batch."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(rng), _EXAMPLES), step)
    return key, lax.axis_index(axes) * local


def average_state(model_state, axes):
    """The model state made replicated: leaves still varying over the batch axes (statistics of
    one device's batch) are averaged; integer leaves (counters) must agree, so take the max."""
    def avg(x):
        over = tuple(a for a in axes if a in jax.typeof(x).mat.varying)
        if not over:
            return x
        if jnp.issubdtype(x.dtype, jnp.floating):
            return lax.pmean(x, over)
        if x.dtype == jnp.bool_:
            return lax.pmax(x.astype(jnp.int32), over).astype(jnp.bool_)
        return lax.pmax(x, over)

    return jax.tree.map(avg, model_state)


def whole(plan: StepPlan, model_state):
    """The model state whole over `model`, as stored (`P()`): the shard_map leaves that axis
    open, and a leaf read beside a split activation was gathered over it every step."""
    if model_state is None or plan.layout.model == 1:
        return model_state
    return jax.tree.map(lambda x: lax.with_sharding_constraint(x, P()), model_state)


def compute_params(plan: StepPlan, state: TrainState) -> list:
    """Per-leaf compute params as stored for this stage (derived from master when equal)."""
    if state.compute is not None:
        return jax.tree.leaves(state.compute)
    masters = jax.tree.leaves(state.master)
    if plan.config.stage == 0:
        return [on_pieces(unpad, leaf, m, True, False)
                for m, leaf in zip(masters, plan.layout.leaves)]
    return masters


def per_unit(plan: StepPlan) -> bool:
    """Whether each unit's reduced gradient shard goes to the host inside the backward (stages
    2-3 with offload), rather than the whole gradient after it. Not (yet) where the shard is
    still summed after its reduce-scatter or produced by another backward rule: micro-batch
    sums (grad_accum > 1), the replica all-reduce and hpZ (replica > 1), prefetch's backward,
    leaves split over the model axis; nor with qgZ's quantized reductions, whose blocks turn
    the norm's last-bit difference into visible ones (docs/performance.md)."""
    cfg = plan.config
    return (cfg.offload is not None and cfg.stage >= 2 and cfg.grad_accum == 1
            and plan.replica == 1 and not (cfg.stage == 3 and cfg.prefetch)
            and plan.layout.model == 1 and cfg.quantize_grads is None)


def local_step(plan: StepPlan, state: TrainState, batch):
    """One optimizer step on this device's batch slice; returns (new state, metrics)."""
    reduced, model_state, means = local_grads(plan, state, batch)
    master, opt_state, shards = plan.update(reduced, state.opt_state, state.master)
    new, metrics = settle(plan, state, reduced, model_state, means)
    compute = _refresh(plan, shards, state.compute) if plan.stores_compute else None
    lr = learning_rate(opt_state)
    if lr is not None:
        metrics["lr"] = lr
    return new._replace(master=master, opt_state=opt_state, compute=compute), metrics


def local_grads(plan: StepPlan, state: TrainState, batch, kept: frozenset[int] = frozenset()):
    """This device's forward, backward and reduction: `(reduced, model state, mean metrics)`,
    `reduced` as the update takes it: (the summed, loss-scaled gradient shard per leaf, its
    divisor, the global norm, the finite flag of dynamic loss scaling or None, the global
    loss). The master and optimizer state are not read (offload keeps them elsewhere).
    `kept`: with offload, the leaves whose gradient stays in device memory (Twin-Flow's)."""
    if per_unit(plan):
        try:
            return _local_grads(plan, state, batch, True, kept)
        except UnitReused:  # a unit used so that its gradient is summed after it leaves
            pass
    return _local_grads(plan, state, batch, False)


def settle(plan: StepPlan, state: TrainState, reduced, model_state, means: dict):
    """The step's bookkeeping besides the update: (the state with the step counted, the loss
    scale and the model state moved on, the metrics)."""
    cfg, norm, finite = plan.config, reduced[2], reduced[3]
    ls, metrics = state.loss_scale, {}
    if cfg.dynamic_scale:
        model_state = _keep(finite, model_state, state.model_state)
        ls = update_loss_scale(ls, finite, cfg.loss_scale_interval)
        metrics["loss_scale"] = ls.scale
        metrics["skipped"] = (~finite).astype(jnp.int32)
    # In every precision, not only where dynamic loss scaling skips the step: a NaN batch or a
    # diverged fp32 run is flagged in the step that made it.
    means = dict(means)
    metrics.update(loss=means.pop("loss"), grad_norm=norm,
                   nonfinite=(~jnp.isfinite(norm)).astype(jnp.int32), **means)
    return state._replace(step=state.step + 1, loss_scale=ls, model_state=model_state), metrics


def _local_grads(plan: StepPlan, state: TrainState, batch, to_host: bool,
                 kept: frozenset[int] = frozenset()):
    cfg, layout = plan.config, plan.layout
    stage, k = cfg.stage, cfg.grad_accum
    comp = compute_params(plan, state)

    full = None
    if stage <= 1:
        args = [vary(c, plan.axes) for c in comp]
    elif stage == 2:
        full = [vary(c, plan.axes) for c in comp]
        args = [vary(jnp.zeros(_shard_shape(layout, leaf), plan.rdtype), plan.axes)
                for leaf in layout.leaves]
    else:
        args = [vary(c.astype(plan.rdtype), plan.axes) for c in comp]
    handles = make_handles(layout)
    scale = state.loss_scale.scale
    # Each device differentiates its share of the global mean: its micro-batch's mean loss
    # divided by the number of shares (replica × data × micro-batches) before the backward, not
    # after the reduction. So every row's gradient is scale / global batch on any mesh, and a
    # float16 backward overflows as it does on one device, however many devices split the batch
    # (divided after, a device's values grew with its share: one more skip per doubling of N).
    # The division by a power of two is exact: such runs' numbers are bitwise as before.
    seed = scale / (plan.replica * plan.data * k)
    denom = scale
    if to_host:
        # What is differentiated: per leaf a zero in host memory (its gradient arrives there,
        # unit by unit; a kept leaf's stays in device memory) and a zero f32 per unit (its
        # gradient: the unit's sum of squares).
        zero = lambda leaf: jnp.zeros(_shard_shape(layout, leaf), plan.rdtype)
        standins = [vary(zero(leaf) if i in kept else to_memory(zero(leaf), HOST), plan.axes)
                    for i, leaf in enumerate(layout.leaves)]
        sqs = [vary(jnp.zeros(_shard_shape(layout, leaf)[:-1], jnp.float32), plan.axes)
               for leaf in layout.leaves]
        bases, args = args, (standins, sqs)
    key = device_key(state.rng, state.step, plan.axes)
    local = jax.tree.leaves(batch)[0].shape[0]
    ex_key, first = example_keys(state.rng, state.step, plan.axes, local)

    def loss_fn(args, mb, model_state, j):
        m = local // k
        host = (*args, denom, kept) if to_host else None
        args = bases if to_host else args
        units = ShardUnits(stage, layout, args, full, plan.dtype, cfg.remat, cfg.prefetch,
                           key=jax.random.fold_in(key, j), state=model_state, training=True,
                           example_key=ex_key, rows=first + j * m + jnp.arange(m),
                           wire=plan.wire, host=host)
        loss, aux = split_loss(plan.model.loss(handles, mb, units))
        loss = loss.astype(jnp.float32)
        return loss * seed, (loss, aux, units.state)

    grad_fn = jax.grad(loss_fn, has_aux=True)
    micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)
    if k == 1:
        grads, (loss, aux, model_state) = grad_fn(
            args, jax.tree.map(lambda x: x[0], micro), whole(plan, state.model_state), 0)
    else:
        # The model state goes through the micro-batches in order; typed device-varying
        # throughout, since a micro-step may leave it per device.
        vary_all = lambda t: jax.tree.map(lambda x: vary(x, plan.axes), t)

        def accumulate(carry, xs):
            (acc, ms), (mb, j) = carry, xs
            g, (l, a, ms) = grad_fn(args, mb, ms, j)
            acc = jax.tree.map(lambda s, x: s + x.astype(jnp.float32), acc, g)
            return (acc, vary_all(ms)), (l, a)

        acc0 = [jnp.zeros(a.shape, jnp.float32) for a in args]
        acc0 = [vary(a, plan.axes) for a in acc0]
        (grads, model_state), (losses, auxs) = lax.scan(
            accumulate, (acc0, vary_all(whole(plan, state.model_state))), (micro, jnp.arange(k)))
        loss, aux = losses.mean(), jax.tree.map(lambda x: x.mean(), auxs)
    model_state = whole(plan, average_state(model_state, plan.axes))

    if to_host:  # the shards in host memory; their sums of squares, per unit, on the device
        grads, sqs = grads
        sq = sum(jnp.sum(q) for q in sqs)
    else:
        grads = _reduce(plan, grads)  # the reduced shard, in the reduction (or accumulation) dtype
        sq = sum(jnp.sum(jnp.square(_unscale(g, denom))) for g in grads)
    if stage >= 1:
        sq = lax.psum(sq, layout.axis)
    norm = jnp.sqrt(sq)

    # norm is global, so every device takes the same branch
    finite = jnp.isfinite(norm) if cfg.dynamic_scale else None
    means = _mean_metrics(loss, aux, plan.axes)
    return (layout.unflatten(grads), denom, norm, finite, means["loss"]), model_state, means


def learning_rate(opt_state) -> jax.Array | None:
    """The learning rate this step used, where the optimizer state carries it: the first
    `learning_rate` of an `optax.inject_hyperparams` state (as f32), else None."""
    kind = optax.InjectStatefulHyperparamsState
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kind)):
        if isinstance(node, kind) and "learning_rate" in node.hyperparams:
            lr = node.hyperparams["learning_rate"]
            if jnp.shape(lr) == () and jnp.issubdtype(jnp.result_type(lr), jnp.floating):
                return jnp.asarray(lr, jnp.float32)
    return None


def on_device(state: TrainState) -> TrainState:
    """`state` (inside jit) with an offloaded master and optimizer state read into device
    memory, for computations that are not the host update (the checkpoint layout)."""
    return state._replace(master=to_memory(state.master, DEVICE),
                          opt_state=to_memory(state.opt_state, DEVICE))


def _keep(finite, new, old):
    """`new` where the step's gradients are finite, else `old` (a skipped step)."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def _unscale(g, denom):
    """A summed, loss-scaled gradient shard as the fp32 mean gradient."""
    return g.astype(jnp.float32) / denom


def _shard_shape(layout: Layout, leaf) -> tuple[int, ...]:
    """This device's part of a flat leaf: `[L?, M?, k]` (the model axis automatic)."""
    return (*layout.flat_shape(leaf)[:-1], layout.shard_size(leaf))


def _reduce(plan: StepPlan, grads: list) -> list:
    """Summed gradients in the master layout: full (stage 0) or this device's shard. A split
    leaf's model pieces are reduced each on its own device of "model" (`on_pieces`)."""
    stage, layout, wire = plan.config.stage, plan.layout, plan.wire
    sizes = [plan.data if a == DATA else plan.replica for a in plan.axes]
    if stage == 0:
        return [on_pieces(lambda g, lf: pad_flat(
            all_reduce(g.astype(plan.rdtype), plan.axes, sizes, wire, plan.dtype), lf, 1),
            leaf, g, False, True) for g, leaf in zip(grads, layout.leaves)]
    if stage == 1:
        # [L?, N·k] {U_data} -> [L?, k], per model piece
        grads = [on_pieces(lambda g, lf: reduce_scatter_leaf(
            pad_flat(g.astype(plan.rdtype), lf, plan.data), plan.data, wire), leaf, g, False,
            True) for g, leaf in zip(grads, layout.leaves)]
    if plan.replica > 1 and not wire.hpz:  # the 1/N shard, summed over replicas
        grads = [on_pieces(lambda g, lf: all_reduce(g, REPLICA, [plan.replica], wire,
                                                    plan.dtype), leaf, g, True, True)
                 for g, leaf in zip(grads, layout.leaves)]
    return grads


def _refresh(plan: StepPlan, masters: list, old) -> Any:
    """New compute params from the updated master leaves (fp32, or already in compute dtype
    when offloaded): cast (stages 0, 3) or all_gather (1, 2).

    Stages 1/2 write each gathered layer into `old`, the donated compute params of the step
    before (dead once backward is done), so XLA updates that buffer in place instead of
    building a second replicated copy of the params and copying it out.
    """
    layout, dtype = plan.layout, plan.dtype
    if plan.config.stage == 0:
        return layout.unflatten(on_pieces(lambda m, lf: unpad(m.astype(dtype), lf), leaf, m,
                                          True, False)
                                for m, leaf in zip(masters, layout.leaves))
    if plan.config.stage == 3:
        return layout.unflatten(m.astype(dtype) for m in masters)

    # One all_gather per layer for the stacked leaves (one loop per depth: a model may scan
    # stacks of different depths), one for all the others.
    # Gathered in compute dtype, not fp32; replicated ("invarying") as the state says.
    olds, out, n = jax.tree.leaves(old), [None] * len(masters), layout.shards
    for depth in sorted({leaf.shape[0] for leaf in layout.leaves if leaf.stacked}):
        idx = [i for i, leaf in enumerate(layout.leaves) if leaf.stacked and leaf.shape[0] == depth]
        leaves, stacks = [layout.leaves[i] for i in idx], [masters[i] for i in idx]

        def layer(i, bufs, leaves=leaves, stacks=stacks):
            units = gather_layer(stacks, i, leaves, n, dtype, replicated=True, wire=plan.wire)
            return [lax.dynamic_update_index_in_dim(b, u, i, 0) for b, u in zip(bufs, units)]

        for i, v in zip(idx, lax.fori_loop(0, depth, layer, [olds[i] for i in idx])):
            out[i] = v
    flat = [i for i, leaf in enumerate(layout.leaves) if not leaf.stacked]
    if flat:
        units = gather_units([masters[i] for i in flat], [layout.leaves[i] for i in flat], n,
                             dtype, replicated=True, wire=plan.wire)
        for i, v in zip(flat, units):
            out[i] = v
    return layout.unflatten(out)


def local_eval(plan: StepPlan, state: TrainState, batch, real, offset) -> dict:
    """The sums of the loss and aux metrics over the real examples of all devices' batch
    slices, without gradients or updates: each device's mean times its number of real examples
    (`real`: 1 per real example, 0 per pad; a device holds only real examples or, in the
    padded part of an evaluation, one example), summed over the devices. `offset`: the global
    batch index of this part's first example (for the per-example keys)."""
    stage = plan.config.stage
    comp = compute_params(plan, state)
    # No backward: stages 0-2 read their replicated params directly; stage 3 gathers units.
    # The model state is read, not updated; keys are those of the step's first micro-batch.
    key = jax.random.fold_in(device_key(state.rng, state.step, plan.axes), 0)
    local = jax.tree.leaves(batch)[0].shape[0]
    ex_key, first = example_keys(state.rng, state.step, plan.axes, local)
    units = ShardUnits(3 if stage == 3 else 1, plan.layout, comp, None, plan.dtype, False,
                       key=key, state=state.model_state, training=False, example_key=ex_key,
                       rows=offset + first + jnp.arange(local), wire=plan.wire)
    loss, aux = split_loss(plan.model.loss(make_handles(plan.layout), batch, units))
    count = jnp.sum(real)
    # where, not a product: a device holding only pads adds nothing, even a NaN of its own.
    total = lambda v: lax.psum(jnp.where(count > 0, jnp.asarray(v, jnp.float32) * count, 0.0),
                               plan.axes)
    return {"loss": total(loss), **{name: total(v) for name, v in aux.items()}}


def _mean_metrics(loss, aux: dict, axes) -> dict:
    """The loss and aux metrics, as f32 means over all devices."""
    metrics = {"loss": lax.pmean(loss.astype(jnp.float32), axes)}
    for name, v in aux.items():
        metrics[name] = lax.pmean(jnp.asarray(v, jnp.float32), axes)
    return metrics
