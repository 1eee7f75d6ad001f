"""`units.gather` / `units.scan` for each ZeRO stage: the only place stages differ in forward/backward."""

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
