"""`units.gather` / `units.scan` per ZeRO stage: the only place the stages differ in compute."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import get_opaque_trace_state

from zerojax.collectives import (
    PLAIN,
    barrier,
    gather_from,
    gather_unit,
    reduce_scatter_units,
    stack_source,
    view,
)
from zerojax.errors import ModelError

HOST = jax.memory.Space.Host

# ---------------------------------------------------------------------------------------------
# What every Units offers besides gather/scan: PRNG keys, the model state, the training flag.


class Context:
    """`units.rng()`, `units.example_rngs()`, `units.state`, `units.set_state`,
    `units.training`.

    `key`: the typed key of this (step, device, micro-batch), or None (no randomness). Call `c`
    gets `fold_in(key, c)`; inside a `units.scan` body, call `c` of layer `i` gets
    `fold_in(fold_in(call key of the scan, i), c)`, so each layer draws its own numbers.
    `example_key` and `rows` (the global batch index of each local example): the same for
    per-example keys, `fold_in(call key, row)`, which no device count or micro-batching changes.
    """

    def _context(self, key=None, state=None, training: bool = True, example_key=None,
                 rows=None):
        self._keys, self._rows = (key, example_key), rows
        self._calls, self._in_scan = 0, False
        self._state = state
        self.training = training

    def _draw(self) -> tuple:
        """This call's (device, example) keys; the next call gets the next index."""
        c, self._calls = self._calls, self._calls + 1
        return tuple(None if k is None else jax.random.fold_in(k, c) for k in self._keys)

    def rng(self) -> jax.Array:
        """A fresh typed PRNG key: a pure function of (base key, step, device, micro-batch,
        call index)."""
        if self._keys[0] is None:
            raise ModelError("units.rng() has no key here; give the units one (e.g. "
                             "PlainUnits(rng=jax.random.key(0)))")
        return self._draw()[0]

    def example_rngs(self) -> jax.Array:
        """A typed key per example of the device's (micro-)batch, `[B_local]`, from the
        example's index in the global batch: dropout drawn with them is the same on any number
        of devices and micro-batches."""
        if self._keys[1] is None or self._rows is None:
            raise ModelError("units.example_rngs() has no keys here; give the units them (e.g. "
                             "PlainUnits(rng=jax.random.key(0), examples=batch_size))")
        key = self._draw()[1]
        return jax.vmap(lambda r: jax.random.fold_in(key, r))(self._rows)

    @property
    def state(self):
        """The model state as of this (micro-)step; None for a model without `init_state`."""
        return self._state

    def set_state(self, new_state) -> None:
        """Records the updated model state (same structure, shapes and dtypes)."""
        if self._in_scan:
            raise ModelError("units.set_state was called inside a units.scan body; return the "
                             "layer's new state from the body (in the carry) and call "
                             "units.set_state once, outside the scan")
        check_same_state(self._state, new_state)
        self._state = new_state

    def _layer_fn(self, body):
        """`body(c, p)` as `fn(c, p, i)`: inside, `units.rng()` draws layer `i`'s keys."""
        keys = self._draw()

        def fn(c, p, i):
            saved = self._keys, self._calls, self._in_scan
            self._keys = tuple(None if k is None else jax.random.fold_in(k, i) for k in keys)
            self._calls, self._in_scan = 0, True
            try:
                return body(c, p)
            finally:
                self._keys, self._calls, self._in_scan = saved

        return fn


def check_same_state(old, new) -> None:
    """ModelError unless `new` has `old`'s structure, shapes and dtypes."""
    if old is None:
        raise ModelError("units.set_state was called but the model has no init_state(rng); "
                         "define init_state to give the model a state")
    spec = lambda t: {jax.tree_util.keystr(p): (jnp.shape(x), jnp.result_type(x))
                      for p, x in jax.tree.flatten_with_path(t)[0]}
    want, got = spec(old), spec(new)
    if jax.tree.structure(old) != jax.tree.structure(new) or want != got:
        fmt = lambda d: "absent" if d is None else f"{jnp.dtype(d[1]).name}{d[0]}"
        diffs = [f"{k}: expected {fmt(want.get(k))}, got {fmt(got.get(k))}"
                 for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
        raise ModelError("units.set_state got a state unlike the model's: "
                         + ("; ".join(diffs[:10]) or "another tree structure")
                         + "; keep init_state's structure, shapes and dtypes")


class PlainUnits(Context):
    """Units over real (unsharded) arrays: the single-device reference and plain Flax use.

    `gather` casts to `dtype` (when given); `scan` is `lax.scan` over the layer axis.
    `rng`, `state`, `training`: what `units.rng()`, `units.state` and `units.training` give;
    `examples`: the batch size, for `units.example_rngs()` (rows 0..examples-1, from `rng`).
    """

    def __init__(self, dtype: Any = None, remat: bool = False, *, rng=None, state=None,
                 training: bool = True, examples: int | None = None):
        self.dtype, self.remat = dtype, remat
        rows = None if examples is None else jnp.arange(examples)
        self._context(rng, state, training, rng, rows)

    def gather(self, subtree):
        if self.dtype is None:
            return jax.tree.map(jnp.asarray, subtree)
        return jax.tree.map(lambda x: jnp.asarray(x).astype(self.dtype), subtree)

    def scan(self, body, carry, stacked):
        fn = self._layer_fn(body)

        def step(c, layer):
            p, i = layer
            return fn(c, self.gather(p), i), None

        if self.remat:
            step = jax.checkpoint(step)
        return lax.scan(step, carry, (stacked, _layer_index(stacked)))[0]


def _layer_index(stacked):
    return jnp.arange(jax.tree.leaves(stacked)[0].shape[0])


# ---------------------------------------------------------------------------------------------
# Handles: what `Model.loss` receives in place of arrays.


class Handle:
    """Stands for one parameter leaf; only `units.gather` / `units.scan` turn it into an array."""

    __slots__ = ("index", "path")

    def __init__(self, index: int, path: str):
        self.index, self.path = index, path

    def __repr__(self):
        return f"Handle({self.path})"

    def _refuse(self, *_, **__):
        raise ModelError(f"parameter {self.path} was used as an array; pass it through "
                         f"units.gather(...) or units.scan(...) first")

    __jax_array__ = __array__ = _refuse
    __add__ = __radd__ = __mul__ = __rmul__ = __matmul__ = __rmatmul__ = _refuse
    __sub__ = __rsub__ = __truediv__ = __getitem__ = _refuse


def make_handles(layout):
    """The params pytree with a `Handle` at every leaf."""
    return layout.unflatten(Handle(i, leaf.path) for i, leaf in enumerate(layout.leaves))


def _handles(subtree, what: str) -> list[Handle]:
    leaves = jax.tree.leaves(subtree)
    for h in leaves:
        if not isinstance(h, Handle):
            raise ModelError(f"units.{what} got {type(h).__name__}, not a parameter subtree; "
                             f"pass (a subtree of) the params that loss() received")
    return leaves


def _rebuild(subtree, values):
    return jax.tree.unflatten(jax.tree.structure(subtree), values)


# ---------------------------------------------------------------------------------------------
# Discovery: one abstract trace of the loss learns which leaves are gathered and which scanned.


class RecordingUnits(Context):
    """Records, per leaf, how the loss consumes it: 'gather' or 'scan'."""

    def __init__(self, avals, dtype, key=None, state=None, example_key=None, rows=None):
        self.avals = avals  # per-leaf ShapeDtypeStruct of the logical params
        self.dtype = dtype
        self.uses: dict[int, set[str]] = {}
        self._context(key, state, True, example_key, rows)

    def _value(self, h, per_layer=False):
        shape = self.avals[h.index].shape[1:] if per_layer else self.avals[h.index].shape
        return jnp.zeros(shape, self.dtype)

    def gather(self, subtree):
        hs = _handles(subtree, "gather")
        for h in hs:
            self.uses.setdefault(h.index, set()).add("gather")
        return _rebuild(subtree, [self._value(h) for h in hs])

    def scan(self, body, carry, stacked):
        hs = _handles(stacked, "scan")
        lengths = {self.avals[h.index].shape[:1] for h in hs}
        if len(lengths) != 1 or () in lengths:
            listing = ", ".join(f"{h.path}: {self.avals[h.index].shape}" for h in hs)
            raise ModelError(f"units.scan needs every leaf stacked on axis 0 with the same "
                             f"number of layers; got {listing}")
        for h in hs:
            self.uses.setdefault(h.index, set()).add("scan")
        (length,) = lengths.pop()
        xs = _rebuild(stacked, [jnp.zeros((length, *self._value(h, True).shape), self.dtype)
                                for h in hs])
        fn = self._layer_fn(body)
        return lax.scan(lambda c, p: (fn(c, *p), None), carry, (xs, jnp.arange(length)))[0]


# ---------------------------------------------------------------------------------------------
# The stages. Each `ShardUnits` runs inside the step's shard_map over the local batch; `args`
# are the per-leaf differentiated values (see `diff_args` in engine.py).


def _remat(fn, remat: bool, stage: int):
    if remat:
        return jax.checkpoint(fn)
    if stage >= 2:
        # Without full remat, stages 2/3 still must not save gathered weights per layer:
        # save matmul outputs (activations) and recompute the rest, the gathers included.
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return fn


class UnitReused(Exception):
    """A unit whose gradient may be complete only after several uses that `arrive` cannot sum
    on the device first (a stack scanned twice; a unit used inside a loop, `units.scan` body
    or other transformation of the loss): it cannot leave the device per unit, and the step
    falls back to sending it after the backward."""


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def arrive(base, standin, sq, denom, host=True):
    """A unit's device value `base` (stage 2: zeros, stage 3: its shard), tied to `standin`, a
    zero of the same shape in host memory (in device memory where `host` is False: a leaf
    that Twin-Flow updates on the devices), and `sq`, a zero f32 scalar per unit.

    Backward, the unit's reduced gradient shard `g` (its cotangent, right after the unit's
    reduce-scatter) becomes `standin`'s cotangent, moved to host memory where `host`, in its
    own dtype; and `sq`'s cotangent is its unscaled sum of squares, `sum((g / denom)²)`,
    computed on the device before the shard leaves, so the global norm needs no host
    computation.
    """
    del standin, sq, denom
    return base


def _arrive_fwd(base, standin, sq, denom, host):
    del standin, sq, host
    return base, denom


def _arrive_bwd(host, denom, g):
    sq = jnp.sum(jnp.square(g.astype(jnp.float32) / denom))
    return None, jax.device_put(g, HOST) if host else g, sq, None


arrive.defvjp(_arrive_fwd, _arrive_bwd)


class ShardUnits(Context):
    """`gather`/`scan` for one stage inside the shard_map step.

    `host`: (per-leaf host stand-ins, per-leaf unit sum-of-squares stand-ins, the gradient's
    divisor, the leaves whose gradient stays in device memory: Twin-Flow's), or None. When
    given (stages 2-3 with offload), every unit passes through `arrive`, so its reduced
    gradient shard goes to host memory inside the backward, as the unit's reduce-scatter
    produces it.
    """

    def __init__(self, stage, layout, args, full, dtype, remat, prefetch=False, *, key=None,
                 state=None, training=True, example_key=None, rows=None, wire=PLAIN,
                 host=None):
        self._context(key, state, training, example_key, rows)
        self.stage = stage
        self.layout = layout  # partition.Layout over the data axis
        self.args = args  # per-leaf differentiated values
        self.full = full  # stage 2: per-leaf replicated compute params (logical); else None
        self.dtype = dtype
        self.remat = remat
        self.prefetch = prefetch
        self.wire = wire  # how the unit collectives travel (ZeRO++ options; collectives.py)
        self.host = host
        self._arrived: dict[int, Any] = {}  # gathered leaves, each tied to its stand-in once
        self._scanned: set[int] = set()
        self._trace = get_opaque_trace_state() if host is not None else None

    def _loss_level(self):
        """UnitReused unless called at the loss's own level, not inside a loop (a units.scan
        body included) or another transformation, where a use may repeat."""
        if get_opaque_trace_state() != self._trace:
            raise UnitReused

    def _arrive(self, i):
        """Leaf `i`'s differentiated value for `gather`: its unit passes through `arrive` once
        however often it is gathered, so its uses' gradients are summed on the device first."""
        if self.host is None:
            return self.args[i]
        self._loss_level()
        if i not in self._arrived:
            standins, sqs, denom, kept = self.host
            self._arrived[i] = arrive(self.args[i], standins[i], sqs[i], denom, i not in kept)
        return self._arrived[i]

    def _units(self, idx, args, fulls, src=None):
        """Several leaves' unit values (logical unit shape, compute dtype) from their local
        pieces, with one collective for all of them: an all_gather (stage 3) forward, a
        reduce-scatter (stages 2, 3) backward. `src`: hpZ's secondary shard of the unit."""
        leaves = tuple(self.layout.leaves[i] for i in idx)
        if self.stage <= 1:
            return [a.astype(self.dtype) for a in args]
        if self.stage == 2:
            return view(fulls, args, leaves, self.layout.shards, self.wire)
        return gather_unit(args, src, leaves, self.layout.shards, self.dtype, self.wire)

    def _source(self, idx, xs):
        """hpZ's secondary shard of the units of leaves `idx` (stage 3), else None."""
        if self.stage != 3:
            return None
        leaves = tuple(self.layout.leaves[i] for i in idx)
        return stack_source(xs, leaves, self.layout.shards, self.dtype, self.wire)

    def gather(self, subtree):
        hs = _handles(subtree, "gather")
        idx = [h.index for h in hs]
        fulls = None if self.full is None else [self.full[i] for i in idx]
        args = [self._arrive(i) for i in idx]
        return _rebuild(subtree, self._units(idx, args, fulls, self._source(idx, args)))

    def scan(self, body, carry, stacked):
        hs = _handles(stacked, "scan")
        idx = [h.index for h in hs]
        if self.stage == 3 and self.prefetch:
            return _prefetch_scan(self, body, carry, stacked, idx)
        xs = [self.args[i] for i in idx]
        fulls = None if self.full is None else [self.full[i] for i in idx]
        src = self._source(idx, xs)  # hpZ: gathered over "replica" once, before the loop
        fn = self._layer_fn(body)
        hosts = None
        if self.host is not None:
            self._loss_level()
            if self._scanned & set(idx):
                raise UnitReused
            self._scanned |= set(idx)
            standins, sqs, denom, kept = self.host
            hosts = ([standins[i] for i in idx], [sqs[i] for i in idx])
            homes = [i not in kept for i in idx]

        def step(c, layer):
            args_l, fulls_l, src_l, hosts_l, i = layer
            if hosts_l is not None:  # each layer's gradient shard leaves in its own iteration
                args_l = [arrive(a, s, q, denom, h)
                          for a, s, q, h in zip(args_l, *hosts_l, homes)]
            ws = _rebuild(stacked, barrier(self._units(idx, args_l, fulls_l, src_l)))
            return fn(c, ws, i), None

        step = _remat(step, self.remat, self.stage)
        return lax.scan(step, carry, (xs, fulls, src, hosts, jnp.arange(xs[0].shape[0])))[0]


# ---------------------------------------------------------------------------------------------
# Stage 3 with prefetch: layer i+1's all_gather is issued while layer i computes (and layer
# i-1's while layer i runs backward). A custom_vjp over the whole scan keeps the residuals to
# the shards and each layer's input carry; gathered weights never outlive their layer + 1.


def _prefetch_scan(units, body, carry, stacked, idx):
    layout, dtype, wire = units.layout, units.dtype, units.wire
    leaves = [layout.leaves[i] for i in idx]
    xs = [units.args[i] for i in idx]  # [L, k] each, in the reduction dtype
    length = xs[0].shape[0]

    # `src`: what the gathers read besides the shards, hpZ's secondary shard: gathered over
    # "replica" once, in the forward, and kept as a residual for the backward's gathers.
    def layer_of(xs, src, i):
        return gather_from(xs, src, i, leaves, layout.shards, dtype, wire)

    body_i = units._layer_fn(body)

    def layer_fn(c, ws, i):
        return body_i(c, _rebuild(stacked, ws), i)

    ws0 = layer_of(xs, units._source(idx, xs), 0)
    fn, consts = jax.closure_convert(layer_fn, carry, ws0, jnp.int32(0))

    @jax.custom_vjp
    def run(carry, xs, consts):
        return _forward(carry, xs, consts)[0]

    # Both loops run all L layers alike; the last iteration of each re-gathers a layer it
    # already has (2 extra layer gathers per step). Peeling that iteration instead costs
    # buffers outside the loop that XLA cannot share with it: 0.6 layers more peak memory
    # measured on an 8-layer GPT, against 1 layer for this form.
    def _forward(carry, xs, consts):
        src = units._source(idx, xs)

        def step(state, i):
            c, ws = state
            ws_next = layer_of(xs, src, jnp.minimum(i + 1, length - 1))  # prefetch
            return (fn(c, ws, i, *consts), ws_next), c

        (c, _), cs = lax.scan(step, (carry, layer_of(xs, src, 0)), jnp.arange(length))
        return c, (cs, src)

    def fwd(carry, xs, consts):
        c, (cs, src) = _forward(carry, xs, consts)
        return c, (cs, xs, src, consts)

    def bwd(res, ct):
        cs, xs, src, consts = res

        def step(state, i):
            ct, ws, ct_k = state
            ws_prev = layer_of(xs, src, jnp.maximum(i - 1, 0))  # prefetch
            c_in = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, False), cs)
            _, vjp = jax.vjp(lambda c, w, k: fn(c, w, i, *k), c_in, ws, consts)
            ct, ct_ws, ct_ki = vjp(ct)
            g = reduce_scatter_units(ct_ws, leaves, layout.shards, xs[0].dtype, wire)
            return (ct, ws_prev, jax.tree.map(jnp.add, ct_k, ct_ki)), g

        init = (ct, layer_of(xs, src, length - 1), jax.tree.map(jnp.zeros_like, consts))
        (ct, _, ct_k), gs = lax.scan(step, init, jnp.arange(length), reverse=True)
        return ct, gs, ct_k

    run.defvjp(fwd, bwd)
    return run(carry, xs, consts)
