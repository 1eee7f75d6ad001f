"""`units.gather` / `units.scan` per ZeRO stage: the only place the stages differ in compute."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zerojax.errors import ModelError
from zerojax.mesh import DATA
from zerojax.partition import pad_unit, unpad_unit


class PlainUnits:
    """Units over real (unsharded) arrays: the single-device reference and plain Flax use.

    `gather` casts to `dtype` (when given); `scan` is `lax.scan` over the layer axis.
    """

    def __init__(self, dtype: Any = None, remat: bool = False):
        self.dtype = dtype
        self.remat = remat

    def gather(self, subtree):
        if self.dtype is None:
            return jax.tree.map(jnp.asarray, subtree)
        return jax.tree.map(lambda x: jnp.asarray(x).astype(self.dtype), subtree)

    def scan(self, body, carry, stacked):
        def step(c, layer):
            return body(c, self.gather(layer)), None

        if self.remat:
            step = jax.checkpoint(step)
        return lax.scan(step, carry, stacked)[0]


# ---------------------------------------------------------------------------------------------
# Handles: what `Model.loss` receives in place of arrays.


class Handle:
    """Stands for one parameter leaf; only `units.gather` / `units.scan` turn it into an array."""

    __slots__ = ("index", "path")

    def __init__(self, index: int, path: str):
        self.index = index
        self.path = path

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


class RecordingUnits:
    """Records, per leaf, how the loss consumes it: 'gather' or 'scan'."""

    def __init__(self, avals, dtype):
        self.avals = avals  # per-leaf ShapeDtypeStruct of the logical params
        self.dtype = dtype
        self.uses: dict[int, set[str]] = {}

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
        return lax.scan(lambda c, p: (body(c, p), None), carry, xs)[0]


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


class ShardUnits:
    """`gather`/`scan` for one stage inside the shard_map step."""

    def __init__(self, stage, layout, args, full, dtype, remat, prefetch=False):
        self.stage = stage
        self.layout = layout  # partition.Layout over the data axis
        self.args = args  # per-leaf differentiated values
        self.full = full  # stage 2: per-leaf replicated compute params (logical); else None
        self.dtype = dtype
        self.remat = remat
        self.prefetch = prefetch

    def _unit(self, i, arg, full):
        """One leaf's unit value (logical unit shape, compute dtype) from its local pieces."""
        leaf = self.layout.leaves[i]
        if self.stage <= 1:
            return arg.astype(self.dtype)
        if self.stage == 2:
            return _view(full, arg, leaf, self.layout.shards)
        return unpad_unit(_gather(arg, self.dtype), leaf)

    def gather(self, subtree):
        hs = _handles(subtree, "gather")
        vals = [self._unit(h.index, self.args[h.index],
                           None if self.full is None else self.full[h.index]) for h in hs]
        return _rebuild(subtree, vals)

    def scan(self, body, carry, stacked):
        hs = _handles(stacked, "scan")
        idx = [h.index for h in hs]
        xs = [self.args[i] for i in idx]
        fulls = [None] * len(idx) if self.full is None else [self.full[i] for i in idx]
        if self.stage == 3 and self.prefetch:
            return _prefetch_scan(self, body, carry, stacked, idx)

        def step(c, layer):
            args_l, fulls_l = layer
            vals = [_barrier(self._unit(i, a, f)) for i, a, f in zip(idx, args_l, fulls_l)]
            return body(c, _rebuild(stacked, vals)), None

        step = _remat(step, self.remat, self.stage)
        return lax.scan(step, carry, (xs, fulls))[0]


def _barrier(x):
    # Keeps XLA from hoisting per-layer casts/gathers out of the loop (DESIGN §5, jax#23543).
    return lax.optimization_barrier(x)


# Stage 2's view: forward is the replicated weight; backward reduce-scatters the cotangent
# onto the shard-shaped stand-in, so the full gradient of a unit is never kept.
@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _view(full, standin, leaf, shards):
    del standin
    return full


def _view_fwd(full, standin, leaf, shards):
    return full, jnp.zeros((), standin.dtype)


def _view_bwd(leaf, shards, token, ct):
    g = pad_unit(ct, leaf, shards).astype(token.dtype)
    g = lax.psum_scatter(g, DATA, scatter_dimension=0, tiled=True)  # [N·k] {U_data} -> [k]
    return None, g


_view.defvjp(_view_fwd, _view_bwd)


# Stage 3's gather: all_gather in compute dtype; its backward reduce-scatters in the dtype of
# the differentiated shard (the reduction dtype), not in the compute dtype.
@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather(shard, dtype):
    return lax.all_gather(shard.astype(dtype), DATA, axis=0, tiled=True)


def _gather_fwd(shard, dtype):
    return _gather(shard, dtype), jnp.zeros((), shard.dtype)


def _gather_bwd(dtype, token, ct):
    g = ct.astype(token.dtype)
    return (lax.psum_scatter(g, DATA, scatter_dimension=0, tiled=True),)  # [N·k] -> [k]


_gather.defvjp(_gather_fwd, _gather_bwd)


# ---------------------------------------------------------------------------------------------
# Stage 3 with prefetch: layer i+1's all_gather is issued while layer i computes (and layer
# i-1's while layer i runs backward). A custom_vjp over the whole scan keeps the residuals to
# the shards and each layer's input carry; gathered weights never outlive their layer + 1.


def _prefetch_scan(units, body, carry, stacked, idx):
    layout, dtype = units.layout, units.dtype
    leaves = [layout.leaves[i] for i in idx]
    xs = [units.args[i] for i in idx]  # [L, k] each, in the reduction dtype
    length = xs[0].shape[0]

    def gather_layer(xs, i):
        return [unpad_unit(lax.all_gather(lax.dynamic_index_in_dim(x, i, 0, False).astype(dtype),
                                          DATA, axis=0, tiled=True), leaf)
                for x, leaf in zip(xs, leaves)]

    def layer_fn(c, ws):
        return body(c, _rebuild(stacked, ws))

    ws0 = gather_layer(xs, 0)
    fn, consts = jax.closure_convert(layer_fn, carry, ws0)

    @jax.custom_vjp
    def run(carry, xs, consts):
        return _forward(carry, xs, consts)[0]

    # Both loops run all L layers alike; the last iteration of each re-gathers a layer it
    # already has (2 extra layer gathers per step). Peeling that iteration instead costs
    # buffers outside the loop that XLA cannot share with it: 0.6 layers more peak memory
    # measured on an 8-layer GPT, against 1 layer for this form.
    def _forward(carry, xs, consts):
        def step(state, i):
            c, ws = state
            ws_next = gather_layer(xs, jnp.minimum(i + 1, length - 1))  # prefetch
            return (fn(c, ws, *consts), ws_next), c

        (c, _), cs = lax.scan(step, (carry, gather_layer(xs, 0)), jnp.arange(length))
        return c, cs

    def fwd(carry, xs, consts):
        c, cs = _forward(carry, xs, consts)
        return c, (cs, xs, consts)

    def bwd(res, ct):
        cs, xs, consts = res

        def step(state, i):
            ct, ws, ct_k = state
            ws_prev = gather_layer(xs, jnp.maximum(i - 1, 0))  # prefetch
            c_in = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, False), cs)
            _, vjp = jax.vjp(lambda c, w, k: fn(c, w, *k), c_in, ws, consts)
            ct, ct_ws, ct_ki = vjp(ct)
            g = [lax.psum_scatter(pad_unit(w, leaf, layout.shards).astype(x.dtype), DATA,
                                  scatter_dimension=0, tiled=True)  # [N·k] -> [k]
                 for w, leaf, x in zip(ct_ws, leaves, xs)]
            return (ct, ws_prev, jax.tree.map(jnp.add, ct_k, ct_ki)), g

        init = (ct, gather_layer(xs, length - 1), jax.tree.map(jnp.zeros_like, consts))
        (ct, _, ct_k), gs = lax.scan(step, init, jnp.arange(length), reverse=True)
        return ct, gs, ct_k

    run.defvjp(fwd, bwd)
    return run(carry, xs, consts)
