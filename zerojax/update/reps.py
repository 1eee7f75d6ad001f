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
    """How a flat-sharded value is stored: `[N·k]`, or `[L, N·k]` for a stacked one."""

    lead: int | None  # L of a stacked value; None: one unit
    unit: int  # U: logical elements per unit
    shards: int  # N: devices on the data axis (1: every device holds all of it)

    @property
    def k(self) -> int:
        return -(-self.unit // self.shards)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.k,) if self.lead is None else (self.lead, self.k)

    @property
    def global_shape(self) -> tuple[int, ...]:
        n = self.k * self.shards
        return (n,) if self.lead is None else (self.lead, n)

    @property
    def size(self) -> int:
        return (self.lead or 1) * self.unit

    @property
    def padded(self) -> bool:
        return self.k * self.shards != self.unit

    def unit_phys(self) -> Phys:
        return Phys(None, self.unit, self.shards)


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
    g = d * phys.k + lax.iota(jnp.int32, phys.k)  # [k]
    valid = g < phys.unit
    if phys.lead is not None:
        layer = lax.broadcasted_iota(jnp.int32, phys.local_shape, 0)
        g = layer * phys.unit + lax.broadcast_in_dim(g, phys.local_shape, (1,))  # [L, k]
        valid = lax.broadcast_in_dim(valid, phys.local_shape, (1,))
    return g, valid


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
    lead = () if phys.lead is None else (phys.lead,)
    if math.prod(jnp.shape(x)) == 1:  # one value: every element of the part is it
        return lax.broadcast_in_dim(jnp.reshape(x, ()), phys.local_shape, ())
    x = jnp.reshape(x, (*lead, phys.unit))
    pad = phys.k * phys.shards - phys.unit
    if pad:
        x = lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0)] * len(lead) + [(0, pad, 0)])
    if phys.shards == 1:
        return x
    return lax.dynamic_slice_in_dim(x, d * phys.k, phys.k, axis=len(lead))


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
    """The gathered `[..., N·k]` -> the logical value."""
    return jnp.reshape(x[..., : rep.phys.unit], rep.shape)


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
