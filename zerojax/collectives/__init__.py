"""The collectives of a ZeRO unit: one all_gather / reduce-scatter per unit for all of its
leaves, stage 2's view (replicated forward, reduce-scatter in backward) and stage 3's gather
(all_gather forward, reduce-scatter backward).

Buckets: a unit's leaves travel as one collective. Each device's shards of the unit are
concatenated ([k_1 + … + k_m] = [K]); all_gather gives [N·K], read as [N, K] and split along
K into each leaf's [N, k_i] = its padded [N·k_i]. One collective per unit instead of one per
leaf: fewer, larger messages (291 -> 35 per step on an 8-layer GPT).

ZeRO++ (Wang et al. 2023), chosen per unit by the `Wire` the config gives:
  qwZ  a gather sends block-quantized int8 values and their float32 scales (two all_gathers),
       dequantized to the compute dtype on arrival;
  qgZ  a reduce-scatter becomes an all_to_all of block-quantized int8/int4 pieces (values and
       scales), each device summing the dequantized pieces of its chunk in float32; over
       "data" first, then over "replica" (two hops, each quantized once);
  hpZ  (stage 3, replica × data mesh) the primary shard spans both axes, data-major, so that
       an all_gather over "replica" yields this data index's secondary shard [R·K] (in the
       compute dtype, or as the quantized message under qwZ); the per-layer gathers of the
       forward and of the rematerialized backward read it over "data" alone.

The model axis (tensor parallelism, DESIGN.md section 8): every function here takes a unit's
split leaves through `pieces.per_group`, each device working on its own model piece.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from zerojax.collectives.pieces import (
    LOGICAL,
    STORED,
    barrier,
    model_axis,
    per_group,
    per_group_value,
    vary,
)
from zerojax.collectives.quantize import decode, encode
from zerojax.mesh import DATA, REPLICA
from zerojax.partition import pad_unit, unpad, unpad_unit


@dataclass(frozen=True)
class Wire:
    """How a unit's collectives travel (the ZeRO++ options of `ZeroConfig`); hashable."""

    weights: str | None = None  # qwZ: "int8" gathers of compute params; None: compute dtype
    grads: str | None = None  # qgZ: "int8" / "int4" gradient reductions; None: reduce dtype
    block: int = 256  # elements per quantization block (one float32 scale each)
    replica: int = 1  # hpZ: replicas the primary shard also spans (1: "data" only)

    @property
    def hpz(self) -> bool:
        return self.replica > 1


PLAIN = Wire()


def segments(leaves, n) -> tuple[int, ...]:
    """Elements per leaf in one device's piece of a unit: the quantization segments."""
    return tuple(-(-leaf.size // n) for leaf in leaves)


def split_units(gathered, leaves, shards):
    """A gathered bucket `[N·K]` -> each leaf's logical unit value."""
    if len(leaves) == 1:
        return [unpad_unit(gathered, leaves[0])]
    ks = [-(-leaf.size // shards) for leaf in leaves]
    pieces = lax.split(gathered.reshape(shards, sum(ks)), ks, axis=1)
    return [unpad_unit(p.reshape(-1), leaf) for p, leaf in zip(pieces, leaves)]


def _gather_units(shards, leaves, n, dtype, replicated=False, wire=PLAIN):
    """Several leaves' `[k_i]` shards -> their logical unit values, with one all_gather in
    `dtype` (`replicated`: typed invariant over "data", as replicated state must be), or the
    two of qwZ."""
    kw = {"to": "invarying"} if replicated else {}
    if wire.weights is None:
        flat = barrier(jnp.concatenate([s.astype(dtype) for s in shards]))
        return split_units(lax.all_gather(flat, DATA, axis=0, tiled=True, **kw), leaves, n)
    segs = segments(leaves, n)
    msg = barrier(encode(jnp.concatenate(shards), wire.weights, segs, wire.block))
    v, s = (lax.all_gather(m, DATA, axis=0, **kw) for m in msg)  # [N, K'], [N, blocks]
    return split_units(decode(v, s, wire.weights, segs, wire.block, dtype).reshape(-1), leaves,
                       n)


def gather_units(shards, leaves, n, dtype, replicated=False, wire=PLAIN):
    """`_gather_units` of each model piece on its own device of "model": `[M?, k_i]` shards
    -> logical unit values."""
    return per_group(lambda ls, xs, _: _gather_units(xs, ls, n, dtype, replicated, wire),
                      leaves, [shards], [STORED], LOGICAL)


def gather_layer(stacks, i, leaves, n, dtype, replicated=False, wire=PLAIN):
    """Layer `i` of several stacked `[L, k_i]` shards, gathered as one unit (`gather_units`)."""
    return gather_units([lax.dynamic_index_in_dim(x, i, 0, False) for x in stacks], leaves, n,
                        dtype, replicated, wire)


def reduce_scatter_units(cts, leaves, n, dtype, wire=PLAIN):
    """`_reduce_scatter_units` of each model piece on its own device of "model": logical unit
    cotangents -> this device's `[M?, k_i]` shard of each one's sum."""
    return per_group(lambda ls, cs, _: _reduce_scatter_units(cs, ls, n, dtype, wire), leaves,
                      [cts], [LOGICAL], STORED)


def _reduce_scatter_units(cts, leaves, n, dtype, wire=PLAIN):
    """Several leaves' unit cotangents -> this device's `[k_i]` shard of each one's sum over
    "data" (and "replica" under hpZ), with one reduce-scatter per hop (qgZ: an all_to_all)."""
    padded = [pad_unit(ct, leaf, n).astype(dtype).reshape(n, -1) for ct, leaf in zip(cts, leaves)]
    flat = jnp.concatenate(padded, axis=1).reshape(-1)
    g = reduce_scatter(flat, segments(leaves, n), dtype, wire)  # [N·K] {U} -> [K]
    return lax.split(g, [p.shape[1] for p in padded]) if len(padded) > 1 else [g]


def roundtrip(flat, leaf, n, wire, dtype):
    """A leaf's padded flat master `[L?, N·k]` (global view) -> the logical values in `dtype`
    that qwZ's gather of its N shards gives (as the refresh of stages 1-2 computes them)."""
    k = flat.shape[-1] // n
    rows, segs = flat.reshape(*flat.shape[:-1], n, k), (k,)
    q = decode(*encode(rows, wire.weights, segs, wire.block), wire.weights, segs, wire.block,
               dtype)
    return unpad(q.reshape(flat.shape), leaf)


# ---------------------------------------------------------------------------------------------
# Reductions: one hop is a reduce-scatter over one axis; qgZ makes it an all_to_all of
# quantized pieces and a float32 sum of what arrives.


def hop(flat, axis, n, segs, dtype, fmt, block):
    """`[n·K]` -> this device's `[K]` of the sum over `axis` (`segs`: K's quantization
    segments), in `dtype`."""
    if fmt is None:
        return lax.psum_scatter(flat.astype(dtype), axis, scatter_dimension=0, tiled=True)
    v, s = encode(flat.reshape(n, -1), fmt, segs, block)  # row j: device j's chunk
    v, s = (lax.all_to_all(m, axis, 0, 0, tiled=True) for m in (v, s))  # row j: from device j
    return decode(v, s, fmt, segs, block, jnp.float32).sum(0).astype(dtype)


def reduce_scatter(flat, segs, dtype, wire=PLAIN):
    """A unit's `[N·K]` (N: the devices its primary shard spans) -> this device's `[K]` of the
    sum: over "data", then (hpZ) over "replica"."""
    if not wire.hpz:
        if wire.grads is None:  # the one plain collective, as before ZeRO++
            return lax.psum_scatter(flat.astype(dtype), DATA, scatter_dimension=0, tiled=True)
        return hop(flat, DATA, flat.size // sum(segs), segs, dtype, wire.grads, wire.block)
    r = wire.replica
    d = flat.size // (r * sum(segs))
    part = hop(flat, DATA, d, segs * r, dtype, wire.grads, wire.block)  # [R·K]
    return hop(part, REPLICA, r, segs, dtype, wire.grads, wire.block)


def reduce_scatter_leaf(g, n, wire=PLAIN):
    """Stage 1's per-leaf reduction: `[L?, N·k]` -> this device's `[L?, k]` of the sum over
    "data"."""
    if wire.grads is None:
        return lax.psum_scatter(g, DATA, scatter_dimension=g.ndim - 1, tiled=True)
    k = g.shape[-1] // n
    rows = jnp.moveaxis(g.reshape(*g.shape[:-1], n, k), -2, 0)  # [N, L?, k]
    layers = math.prod(g.shape[:-1])
    out = hop(rows.reshape(-1), DATA, n, (k,) * layers, g.dtype, wire.grads, wire.block)
    return out.reshape(*g.shape[:-1], k)


def all_reduce(g, axes, sizes, wire=PLAIN, gather_dtype=None):
    """The sum of `g` over mesh `axes` (of `sizes` devices), the same on every device.

    Plain: one psum. qgZ: a quantized reduce-scatter per axis, "data" first (the fast links
    inside a node), then all_gathers of the float32 sum in `gather_dtype` (the compute dtype:
    quantizing it again would compound the error)."""
    if wire.grads is None:
        return lax.psum(g, axes)
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    hops = sorted(zip(axes, sizes), key=lambda h: h[0] != DATA)
    flat, size = g.reshape(-1), g.size
    pad = -size % math.prod(sizes)
    flat = jnp.pad(flat, (0, pad)) if pad else flat
    for axis, n in hops:
        flat = hop(flat, axis, n, (flat.size // n,), jnp.float32, wire.grads, wire.block)
    flat = flat.astype(gather_dtype or g.dtype)
    for axis, _ in reversed(hops):
        flat = lax.all_gather(flat, axis, axis=0, tiled=True, to="invarying")
    return flat[:size].reshape(g.shape).astype(g.dtype)


# Stage 2's view: forward is the replicated weights; backward reduce-scatters the cotangents
# onto the shard-shaped stand-ins, so the full gradient of a unit is never kept.
@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _view(fulls, standins, leaves, shards, wire):
    del standins
    return fulls


def _view_fwd(fulls, standins, leaves, shards, wire):
    return fulls, jnp.zeros((), standins[0].dtype)  # the stand-ins share the reduction dtype


def _view_bwd(leaves, shards, wire, token, cts):
    return None, tuple(reduce_scatter_units(cts, leaves, shards, token.dtype, wire))


_view.defvjp(_view_fwd, _view_bwd)


def view(fulls, standins, leaves, n, wire=PLAIN):
    """Stage 2's unit values: `fulls` (the replicated compute params) forward; backward
    reduce-scatters their cotangents onto the `[M?, k_i]` stand-ins (`reduce_scatter_units`,
    each model piece on its own device)."""
    return list(_view(tuple(fulls), tuple(standins), tuple(leaves), n, wire))


# Stage 3's gather: all_gather in compute dtype; its backward reduce-scatters in the dtype of
# the differentiated shard (the reduction dtype), not in the compute dtype.
@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather_sharded(shard, dtype, wire, segs):
    if wire.weights is None:
        return lax.all_gather(shard.astype(dtype), DATA, axis=0, tiled=True)
    v, s = (lax.all_gather(m, DATA, axis=0) for m in encode(shard, wire.weights, segs,
                                                             wire.block))
    return decode(v, s, wire.weights, segs, wire.block, dtype).reshape(-1)


def _gather_sharded_fwd(shard, dtype, wire, segs):
    return gather_sharded(shard, dtype, wire, segs), jnp.zeros((), shard.dtype)


def _gather_sharded_bwd(dtype, wire, segs, token, ct):
    if wire.grads is None:
        g = ct.astype(token.dtype)
        return (lax.psum_scatter(g, DATA, scatter_dimension=0, tiled=True),)  # [N·k] -> [k]
    return (reduce_scatter(ct, segs, token.dtype, wire),)


gather_sharded.defvjp(_gather_sharded_fwd, _gather_sharded_bwd)


# ---------------------------------------------------------------------------------------------
# hpZ: the secondary shard. `secondary` gathers it over "replica" (no gradient flows through
# it); `from_secondary` gathers a unit from it over "data". In the step, the unit's value is
# `gather_secondary(secondary, lift(shard))`: `lift` gives a zero stand-in of the secondary's
# shape in the reduction dtype, onto which `gather_secondary`'s backward reduce-scatters over
# "data"; `lift`'s backward then reduce-scatters that over "replica" onto the shard. So the
# backward's recomputed gather reads the secondary over "data", and the reduction runs in
# the reduction dtype throughout (a compute-dtype secondary would force it into bf16).


def secondary(x, dtype, wire, segs):
    """Primary pieces `[..., K]` -> the secondary shard: this data index's pieces of every
    replica, `[..., R, K]` in `dtype`, or (qwZ) the quantized (values, scales) of them."""
    x = lax.stop_gradient(x)
    if wire.weights is None:
        return lax.all_gather(barrier(x.astype(dtype)), REPLICA, axis=x.ndim - 1)
    msg = barrier(encode(x, wire.weights, segs, wire.block))
    return tuple(lax.all_gather(m, REPLICA, axis=m.ndim - 1) for m in msg)


def from_secondary(src, dtype, wire, segs):
    """One unit's secondary shard (`[R, K]`, or its message) -> the unit `[N·K]`, gathered
    over "data" alone (the pieces arrive data-major: the primary layout's order)."""
    if wire.weights is None:
        return lax.all_gather(src, DATA, axis=0, tiled=True).reshape(-1)  # [D·R, K]
    v, s = (lax.all_gather(m, DATA, axis=0, tiled=True) for m in src)
    return decode(v, s, wire.weights, segs, wire.block, dtype).reshape(-1)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def gather_secondary(src, standin, dtype, wire, segs):
    del standin
    return from_secondary(src, dtype, wire, segs)


def _gather_secondary_fwd(src, standin, dtype, wire, segs):
    return from_secondary(src, dtype, wire, segs), jnp.zeros((), standin.dtype)


def _gather_secondary_bwd(dtype, wire, segs, token, ct):
    d = ct.size // (wire.replica * sum(segs))
    g = hop(ct, DATA, d, segs * wire.replica, token.dtype, wire.grads, wire.block)  # [R·K]
    return None, g


gather_secondary.defvjp(_gather_secondary_fwd, _gather_secondary_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def lift(shard, wire, segs):
    zeros = jnp.zeros((wire.replica * shard.shape[0],), shard.dtype)
    return vary(zeros, tuple(jax.typeof(shard).mat.varying))


def _lift_fwd(shard, wire, segs):
    return lift(shard, wire, segs), None


def _lift_bwd(wire, segs, _, ct):
    return (hop(ct, REPLICA, wire.replica, segs, ct.dtype, wire.grads, wire.block),)


lift.defvjp(_lift_fwd, _lift_bwd)


def _gather_unit(shard, src, leaves, n, dtype, wire=PLAIN):
    segs = segments(leaves, n)
    if wire.hpz:
        full = gather_secondary(src, lift(shard, wire, segs), dtype, wire, segs)
    else:
        full = gather_sharded(shard, dtype, wire, segs)
    return split_units(full, leaves, n)


def gather_unit(shards, src, leaves, n, dtype, wire=PLAIN):
    """Stage 3: a unit's logical values from this device's `[M?, k_i]` shards (differentiated;
    their gradients are the reduced shards) and, under hpZ, its secondary shards `src` (from
    `stack_source`: the unsplit leaves' and the split leaves')."""
    if model_axis():
        return list(_tp_gather(tuple(shards), src, tuple(leaves), n, dtype, wire))
    src = None if src is None else src[0]
    return _gather_unit(jnp.concatenate(shards), src, leaves, n, dtype, wire)


# With a model axis the unit's gather is one custom_vjp around the nested maps (forward: the
# gather of each piece; backward: the reduce-scatter of each piece's cotangent), so that
# differentiation never passes through a nested shard_map.
@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _tp_gather(shards, src, leaves, n, dtype, wire):
    if not wire.hpz:
        return tuple(gather_units(list(shards), leaves, n, dtype, wire=wire))
    return tuple(per_group(lambda ls, s: split_units(
        from_secondary(s, dtype, wire, segments(ls, n)), ls, n), leaves, [], [], LOGICAL,
        shared=src))


def _tp_gather_fwd(shards, src, leaves, n, dtype, wire):
    return _tp_gather(shards, src, leaves, n, dtype, wire), jnp.zeros((), shards[0].dtype)


def _tp_gather_bwd(leaves, n, dtype, wire, token, cts):
    # In the reduction dtype (the shards'), not the compute dtype; under hpZ over "data" and
    # then "replica", as gather_secondary and lift reduce.
    return tuple(reduce_scatter_units(list(cts), leaves, n, token.dtype, wire)), None


_tp_gather.defvjp(_tp_gather_fwd, _tp_gather_bwd)


def _stack_source(xs, leaves, n, dtype, wire):
    return secondary(jnp.concatenate(xs, axis=-1), dtype, wire, segments(leaves, n))


def stack_source(xs, leaves, n, dtype, wire=PLAIN):
    """What a unit's (or a stack's) gathers read besides its `[L?, M?, k_i]` shards: under
    hpZ, (the unsplit leaves' secondary shard, the split leaves' `[L?, M, ...]`); else None."""
    if not wire.hpz:
        return None
    xs = [lax.stop_gradient(x) for x in xs]  # no gradient flows through the secondary
    return per_group_value(lambda ls, xs: _stack_source(xs, ls, n, dtype, wire), leaves, xs,
                           1 if leaves[0].stacked else 0)


def gather_from(xs, src, i, leaves, n, dtype, wire=PLAIN):
    """Layer `i` of a stack, gathered without a gradient rule (prefetch's loops)."""
    if not wire.hpz:
        return gather_layer(xs, i, leaves, n, dtype, wire=wire)
    at = lambda t: jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, False), t)
    return per_group(lambda ls, s: split_units(from_secondary(s, dtype, wire, segments(ls, n)),
                                                ls, n),
                      leaves, [], [], LOGICAL, shared=(at(src[0]), at(src[1])))
