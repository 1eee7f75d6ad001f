"""How a value of the update lives on the devices (its rep), and the index arithmetic of the
flat layout: which logical element each local element is, and the local parts of whole values.

  Flat(phys, shape)  this device's k elements (or [L, k]) of the padded flat value
  Whole()            the full logical value, the same on every device
  Bcast(shape, dims) the full value is broadcast_in_dim(stored operand, shape, dims)
  Partial()          this device's term of a sum over the data axis
  Owned(region)      the full value, only on its owner device (owners.py)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax


@dataclass(frozen=True)
class Phys:
    """How a flat-sharded value is stored: `[N·k]`, `[L, N·k]` for a stacked one, and with the
    `model` axis before the flat one for a value split over "model": `[L?, M, N·k]`.

    A split unit is read as `[outer, M, block]` (its split dimension cut into M contiguous
    blocks); model piece m is `[:, m, :]`, flattened, padded and sharded over the data axis.
    """

    lead: int | None  # L of a stacked value; None: one unit
    unit: int  # U: logical elements per unit
    shards: int  # N: devices on the data axis (1: every device holds all of it)
    pieces: int = 1  # M: model pieces of a unit (1: not split over "model")
    block: int = 0  # elements of one piece's contiguous run (split: the split dim's block size
    #                 times the elements of the dims after it); 0 when not split

    @property
    def piece(self) -> int:
        """Logical elements of one model piece of a unit."""
        return self.unit // self.pieces

    @property
    def k(self) -> int:
        return -(-self.piece // self.shards)

    @property
    def mid(self) -> tuple[int, ...]:
        """The axes between the layer axis and the flat one: `(M,)` when split."""
        return (self.pieces,) if self.pieces > 1 else ()

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (*self._lead, *self.mid, self.k)

    @property
    def global_shape(self) -> tuple[int, ...]:
        return (*self._lead, *self.mid, self.k * self.shards)

    @property
    def _lead(self) -> tuple[int, ...]:
        return () if self.lead is None else (self.lead,)

    @property
    def size(self) -> int:
        return (self.lead or 1) * self.unit

    @property
    def padded(self) -> bool:
        return self.k * self.shards != self.piece

    def unit_phys(self) -> Phys:
        return Phys(None, self.unit, self.shards, self.pieces, self.block)

    def stacked(self, length: int) -> Phys:
        return Phys(length, self.unit, self.shards, self.pieces, self.block)


def leaf_phys(leaf, shards: int) -> Phys:
    """The Phys of a parameter leaf (`partition.LeafSpec`) over `shards` data devices."""
    lead = leaf.shape[0] if leaf.stacked else None
    if not leaf.is_split:
        return Phys(lead, leaf.size, shards)
    inner = math.prod(leaf.unit_shape[leaf.split + 1:])
    return Phys(lead, leaf.size, shards, leaf.pieces,
                leaf.unit_shape[leaf.split] // leaf.pieces * inner)


@dataclass(frozen=True)
class Flat:
    phys: Phys
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Whole:
    pass


@dataclass(frozen=True)
class Bcast:
    shape: tuple[int, ...]
    dims: tuple[int, ...]
    operand: tuple[int, ...]  # the stored operand's shape


@dataclass(frozen=True)
class Partial:
    pass


@dataclass(frozen=True)
class Owned:
    """The full value, computed only on its owner device, by an owner region (owners.py)."""

    region: int


WHOLE, PARTIAL = Whole(), Partial()
Rep = Flat | Whole | Bcast | Partial | Owned


def join(a: Rep, b: Rep) -> Rep:
    """The rep both of two control-flow paths can give (a loop carry, a cond output)."""
    if a == b:
        return a
    if isinstance(a, Flat) and isinstance(b, Flat):
        return WHOLE  # two layouts of one value: rare; assemble both
    if isinstance(a, Flat):
        return a
    if isinstance(b, Flat):
        return b
    return WHOLE


# Local index arithmetic of a Flat value


def flat_index(phys: Phys, d):
    """(the logical flat index of each local element, whether it is not padding), on the
    device at position `d` of the data axis. Every value of one layout shares them."""
    g = d * phys.k + lax.iota(jnp.int32, phys.k)  # [k]: the index within a model piece
    valid = g < phys.piece
    if phys.pieces > 1:  # piece m of [outer, M, block] -> the unit's index
        shape = (phys.pieces, phys.k)
        m = lax.broadcasted_iota(jnp.int32, shape, 0)
        g = lax.broadcast_in_dim(g, shape, (1,))
        b = jnp.int32(phys.block)
        g = lax.div(g, b) * jnp.int32(phys.pieces * phys.block) + m * b + lax.rem(g, b)
        valid = lax.broadcast_in_dim(valid, shape, (1,))
    if phys.lead is not None:
        shape = phys.local_shape
        layer = lax.broadcasted_iota(jnp.int32, shape, 0)
        dims = tuple(range(1, len(shape)))
        g = layer * phys.unit + lax.broadcast_in_dim(g, shape, dims)  # [L, M?, k]
        valid = lax.broadcast_in_dim(valid, shape, dims)
    return g, valid


def to_pieces(x, phys: Phys):
    """`[*lead, U]` -> `[*lead, M?, U/M]`: each model piece's elements in a row."""
    if phys.pieces == 1:
        return x
    lead = x.shape[:-1]
    x = jnp.reshape(x, (*lead, phys.unit // (phys.pieces * phys.block), phys.pieces, phys.block))
    x = jnp.moveaxis(x, -2, len(lead))
    return jnp.reshape(x, (*lead, phys.pieces, phys.piece))


def from_pieces(x, phys: Phys):
    """Inverse of `to_pieces`: `[*lead, M?, U/M]` -> `[*lead, U]`."""
    if phys.pieces == 1:
        return x
    lead = x.shape[:-2]
    x = jnp.reshape(x, (*lead, phys.pieces, phys.unit // (phys.pieces * phys.block), phys.block))
    x = jnp.moveaxis(x, len(lead), -2)
    return jnp.reshape(x, (*lead, phys.unit))


def pad_global(x, phys: Phys):
    """A whole logical value -> its padded flat global form `[L?, M?, N·k]`."""
    lead = () if phys.lead is None else (phys.lead,)
    x = to_pieces(jnp.reshape(x, (*lead, phys.unit)), phys)
    pad = phys.k * phys.shards - phys.piece
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def unravel(flat, shape):
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    return [lax.rem(lax.div(flat, jnp.int32(s)), jnp.int32(n)) if n > 1 else None
            for s, n in zip(strides, shape)]


def ravel(idx, shape):
    out = None
    for i, n in zip(idx, shape):
        out = (i if out is None else out * n + i) if i is not None else \
            (None if out is None else out * n)
    return out


def select(valid, x, fill):
    """`x` where `valid`, else the scalar `fill`."""
    return lax.select(valid, x, lax.full_like(x, fill))


def to_flat(x, rep: Flat, d):
    """A whole logical value -> the part of it on the device at position `d`."""
    phys = rep.phys
    if math.prod(jnp.shape(x)) == 1:  # one value: every element of the part is it
        return lax.broadcast_in_dim(jnp.reshape(x, ()), phys.local_shape, ())
    lead = () if phys.lead is None else (phys.lead,)
    x = to_pieces(jnp.reshape(x, (*lead, phys.unit)), phys)
    pad = phys.k * phys.shards - phys.piece
    if pad:
        x = lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0)] * (x.ndim - 1) + [(0, pad, 0)])
    if phys.shards == 1:
        return x
    return lax.dynamic_slice_in_dim(x, d * phys.k, phys.k, axis=x.ndim - 1)


def bcast_to_flat(operand, b: Bcast, rep: Flat, flat, valid):
    """broadcast_in_dim(operand, shape, dims) -> this device's part, by index lookup."""
    if operand.size == 1:
        return lax.broadcast_in_dim(jnp.reshape(operand, ()), rep.phys.local_shape, ())
    multi = unravel(select(valid, flat, 0) if rep.phys.padded else flat, b.shape)
    # An operand axis of size 1 is broadcast along its output axis.
    idx = ravel([multi[d] if n > 1 else None for d, n in zip(b.dims, operand.shape)],
                operand.shape)
    return jnp.reshape(operand, (-1,))[idx]


def from_flat(x, rep: Flat):
    """The gathered `[L?, M?, N·k]` -> the logical value."""
    return jnp.reshape(from_pieces(x[..., : rep.phys.piece], rep.phys), rep.shape)


def segment_reduce(x, flat, valid, rep: Flat, axes, name):
    """Reduction `name` over `axes` of this device's elements (padding excluded)."""
    if name in ("reduce_and", "reduce_or"):
        x = x.astype(jnp.int32)
    floating = jnp.issubdtype(x.dtype, jnp.floating)
    fill = {"reduce_sum": 0, "reduce_and": 1, "reduce_or": 0,
            "reduce_max": -jnp.inf if floating else jnp.iinfo(x.dtype).min,
            "reduce_min": jnp.inf if floating else jnp.iinfo(x.dtype).max}[name]
    x = select(valid, x, fill) if rep.phys.padded else x
    shape = rep.shape
    keep = [a for a in range(len(shape)) if a not in axes]
    combine = {"reduce_sum": jnp.sum, "reduce_max": jnp.max, "reduce_min": jnp.min,
               "reduce_and": jnp.min, "reduce_or": jnp.max}[name]
    if not keep:
        out = combine(x)
    else:
        out_shape = tuple(shape[a] for a in keep)
        nseg = math.prod(out_shape)
        multi = unravel(select(valid, flat, 0) if rep.phys.padded else flat, shape)
        seg = ravel([multi[a] for a in keep], out_shape)
        seg = jnp.zeros_like(flat) if seg is None else seg
        if rep.phys.padded:
            seg = select(valid, seg, nseg)
        segment = {"reduce_sum": jax.ops.segment_sum, "reduce_max": jax.ops.segment_max,
                   "reduce_min": jax.ops.segment_min, "reduce_and": jax.ops.segment_min,
                   "reduce_or": jax.ops.segment_max}[name]
        out = segment(x.reshape(-1), seg.reshape(-1), num_segments=nseg + 1)[:nseg]
        out = out.reshape(out_shape)
    if name in ("reduce_and", "reduce_or"):
        out = out.astype(jnp.bool_)
    return out
