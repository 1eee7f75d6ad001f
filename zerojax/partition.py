"""Logical params ⇄ per-leaf flattened, zero-padded, sharded layout; pure shape maths.

A leaf of logical shape `S` becomes `[N·k]` (flattened, zero-padded to a multiple of N) and is
sharded `P("data")`; a stacked layer leaf `[L, *S]` becomes `[L, N·k]` sharded `P(None, "data")`.
Every device holds `k` (or `[L, k]`) elements. Padding is zero and never leaves this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax.mesh import DATA


@dataclass(frozen=True)
class LeafSpec:
    """One parameter leaf: its path, logical shape and whether it is a stacked (scanned) unit."""

    path: str
    shape: tuple[int, ...]
    stacked: bool

    @property
    def unit_shape(self) -> tuple[int, ...]:
        """Shape of one unit: the leaf, or one layer of a stacked leaf."""
        return self.shape[1:] if self.stacked else self.shape

    @property
    def size(self) -> int:
        """Elements in one unit."""
        return math.prod(self.unit_shape)


@dataclass(frozen=True)
class Layout:
    """The layout of a model's params over `shards` devices of "data" (stage 0: replicated;
    hpZ: over all devices, data-major)."""

    leaves: tuple[LeafSpec, ...]
    treedef: jax.tree_util.PyTreeDef
    shards: int
    replicated: bool = False  # stage 0: one unpadded copy per device (shards == 1)
    axes: tuple[str, ...] = (DATA,)  # the mesh axes sharding it; hpZ: ("data", "replica")

    @property
    def axis(self):
        """The axis name (or names, data-major) that collectives over the shards take."""
        return self.axes[0] if len(self.axes) == 1 else self.axes

    def shard_size(self, leaf: LeafSpec) -> int:
        """`k`: elements of one unit that one device holds."""
        return -(-leaf.size // self.shards)

    def flat_shape(self, leaf: LeafSpec) -> tuple[int, ...]:
        """Global shape of the padded flat leaf: `[N·k]` or `[L, N·k]`."""
        p = self.shard_size(leaf) * self.shards
        return (leaf.shape[0], p) if leaf.stacked else (p,)

    def spec(self, leaf: LeafSpec) -> P:
        """PartitionSpec of the padded flat leaf."""
        if self.replicated:
            return P()
        return P(None, self.axis) if leaf.stacked else P(self.axis)

    def specs(self):
        """PartitionSpecs of the flat params, as a pytree like the params."""
        return self.unflatten([self.spec(leaf) for leaf in self.leaves])

    def unflatten(self, leaves):
        """Builds the params pytree from a list of per-leaf values."""
        return jax.tree.unflatten(self.treedef, list(leaves))

    @property
    def num_params(self) -> int:
        """Logical parameter count (no padding)."""
        return sum(math.prod(leaf.shape) for leaf in self.leaves)

    @property
    def padded_params(self) -> int:
        """Parameter count of the padded flat layout, over all devices."""
        return sum(math.prod(self.flat_shape(leaf)) for leaf in self.leaves)

    def to_flat(self, params):
        """Logical params -> padded flat leaves (global view)."""
        xs = jax.tree.leaves(params)
        return self.unflatten(pad_flat(x, leaf, self.shards) for x, leaf in zip(xs, self.leaves))

    def from_flat(self, flat):
        """Padded flat leaves (global view) -> logical params."""
        xs = jax.tree.leaves(flat)
        return self.unflatten(unpad(x, leaf) for x, leaf in zip(xs, self.leaves))


def pad_flat(x: jax.Array, leaf: LeafSpec, shards: int) -> jax.Array:
    """One logical leaf -> `[N·k]` or `[L, N·k]`, zero-padded."""
    lead = (leaf.shape[0],) if leaf.stacked else ()
    x = jnp.reshape(x, (*lead, leaf.size))
    pad = -(-leaf.size // shards) * shards - leaf.size
    if pad:
        x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)])
    return x


def unpad(x: jax.Array, leaf: LeafSpec) -> jax.Array:
    """`[N·k]` / `[L, N·k]` -> the logical leaf (drops the padding)."""
    return jnp.reshape(x[..., : leaf.size], leaf.shape)


def unpad_unit(x: jax.Array, leaf: LeafSpec) -> jax.Array:
    """One gathered unit `[N·k]` -> its logical unit shape."""
    return jnp.reshape(x[: leaf.size], leaf.unit_shape)


def pad_unit(x: jax.Array, leaf: LeafSpec, shards: int) -> jax.Array:
    """One logical unit -> `[N·k]`, zero-padded (the layout a reduce-scatter needs)."""
    x = jnp.reshape(x, (leaf.size,))
    pad = -(-leaf.size // shards) * shards - leaf.size
    return jnp.pad(x, (0, pad)) if pad else x
