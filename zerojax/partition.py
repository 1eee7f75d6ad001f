"""Logical params ⇄ per-leaf flattened, zero-padded, sharded layout; pure shape maths.

A leaf of logical shape `S` becomes `[N·k]` (flattened, zero-padded to a multiple of N) and is
sharded `P("data")`; a stacked layer leaf `[L, *S]` becomes `[L, N·k]` sharded `P(None, "data")`.
Every device holds `k` (or `[L, k]`) elements. Padding is zero and never leaves this module.

A leaf split over the `model` axis (tensor parallelism, DESIGN.md section 8) is first cut into
its M pieces along its split dimension (piece m: the m-th contiguous block of that dimension);
each piece is flattened and padded as above: `[M, N·k]` sharded `P("model", "data")`, stacked
`[L, M, N·k]` sharded `P(None, "model", "data")`, with k = ⌈|S|/M / N⌉. ZeRO shards each model
piece over `data`, so a device holds `k` elements of its own model piece.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax.errors import ConfigError, ModelError
from zerojax.mesh import DATA, MODEL


@dataclass(frozen=True)
class LeafSpec:
    """One parameter leaf: its path, logical shape, whether it is a stacked (scanned) unit,
    and the dimension of one unit that is split over `model` into `pieces` (1: replicated over
    `model`, `split` None)."""

    path: str
    shape: tuple[int, ...]
    stacked: bool
    split: int | None = None  # dimension of `unit_shape` split over "model"
    pieces: int = 1  # M when split, else 1

    @property
    def unit_shape(self) -> tuple[int, ...]:
        """Shape of one unit: the leaf, or one layer of a stacked leaf."""
        return self.shape[1:] if self.stacked else self.shape

    @property
    def size(self) -> int:
        """Elements in one unit."""
        return math.prod(self.unit_shape)

    @property
    def is_split(self) -> bool:
        return self.pieces > 1

    @property
    def piece_shape(self) -> tuple[int, ...]:
        """Shape of one model piece of one unit (the unit itself when not split)."""
        if not self.is_split:
            return self.unit_shape
        s = list(self.unit_shape)
        s[self.split] //= self.pieces
        return tuple(s)

    @property
    def piece_size(self) -> int:
        """Elements in one model piece of one unit."""
        return self.size // self.pieces

    def piece(self) -> LeafSpec:
        """The leaf one model piece is: what a device of the `model` axis gathers over `data`."""
        lead = self.shape[:1] if self.stacked else ()
        return LeafSpec(self.path, (*lead, *self.piece_shape), self.stacked)

    def split_spec(self, lead: int = 0) -> P:
        """PartitionSpec of a logical value of this leaf (`lead` axes before the unit's): the
        split dimension over `model`, the rest whole."""
        if not self.is_split:
            return P()
        dims = [None] * (lead + len(self.unit_shape))
        dims[lead + self.split] = MODEL
        return P(*dims)

    def logical_spec(self) -> P:
        """PartitionSpec of the logical leaf (a stacked one with its layer axis)."""
        return self.split_spec(1 if self.stacked else 0)


def unsplit(leaf: LeafSpec) -> LeafSpec:
    """`leaf` replicated over `model` (as a checkpoint records it)."""
    return dataclasses.replace(leaf, split=None, pieces=1)


@dataclass(frozen=True)
class Layout:
    """The layout of a model's params over `shards` devices of "data" (stage 0: replicated;
    hpZ: over all devices, data-major), each split leaf cut into its `model` pieces first."""

    leaves: tuple[LeafSpec, ...]
    treedef: jax.tree_util.PyTreeDef
    shards: int
    replicated: bool = False  # stage 0: one unpadded copy per device (shards == 1)
    axes: tuple[str, ...] = (DATA,)  # the mesh axes sharding it; hpZ: ("data", "replica")

    @property
    def axis(self):
        """The axis name (or names, data-major) that collectives over the shards take."""
        return self.axes[0] if len(self.axes) == 1 else self.axes

    @property
    def model(self) -> int:
        """M: the pieces of the split leaves (1 when nothing is split)."""
        return max((leaf.pieces for leaf in self.leaves), default=1)

    def shard_size(self, leaf: LeafSpec) -> int:
        """`k`: elements of one unit's model piece that one device holds."""
        return -(-leaf.piece_size // self.shards)

    def flat_shape(self, leaf: LeafSpec) -> tuple[int, ...]:
        """Global shape of the padded flat leaf: `[L?, M?, N·k]`."""
        return (*_lead(leaf), self.shard_size(leaf) * self.shards)

    def spec(self, leaf: LeafSpec) -> P:
        """PartitionSpec of the padded flat leaf (the model axis included)."""
        dims = [None] * (len(leaf.shape[:1]) if leaf.stacked else 0)
        if leaf.is_split:
            dims.append(MODEL)
        return P(*dims, None if self.replicated else self.axis)

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


def manual(spec: P) -> P:
    """`spec` without the `model` axis: what a shard_map manual over the batch axes (and
    automatic over `model`) takes; the model axis travels with the arrays' shardings."""
    def drop(e):
        if e == MODEL:
            return None
        if isinstance(e, tuple):
            rest = tuple(a for a in e if a != MODEL)
            return rest if len(rest) > 1 else (rest[0] if rest else None)
        return e
    return P(*(drop(e) for e in spec))


def _lead(leaf: LeafSpec) -> tuple[int, ...]:
    """The axes before the flat one: the layers of a stacked leaf, the model pieces."""
    return (*leaf.shape[:1 if leaf.stacked else 0], *((leaf.pieces,) if leaf.is_split else ()))


def to_pieces(x: jax.Array, leaf: LeafSpec, lead: int = 0) -> jax.Array:
    """A logical value of the leaf (`lead` axes before the unit's) -> `[*lead, M?, piece]`:
    each model piece flattened."""
    lead_shape = x.shape[:lead]
    if not leaf.is_split:
        return jnp.reshape(x, (*lead_shape, leaf.size))
    a, m = lead + leaf.split, leaf.pieces
    x = jnp.reshape(x, (*x.shape[:a], m, x.shape[a] // m, *x.shape[a + 1:]))
    x = jnp.moveaxis(x, a, lead)
    return jnp.reshape(x, (*lead_shape, m, leaf.piece_size))


def from_pieces(x: jax.Array, leaf: LeafSpec, lead: int = 0) -> jax.Array:
    """Inverse of `to_pieces`: `[*lead, M?, piece]` (unpadded) -> the logical value."""
    lead_shape = x.shape[:lead]
    if not leaf.is_split:
        return jnp.reshape(x, (*lead_shape, *leaf.unit_shape))
    x = jnp.reshape(x, (*lead_shape, leaf.pieces, *leaf.piece_shape))
    x = jnp.moveaxis(x, lead, lead + leaf.split)
    return jnp.reshape(x, (*lead_shape, *leaf.unit_shape))


def _pad_last(x: jax.Array, shards: int) -> jax.Array:
    pad = -x.shape[-1] % shards
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def pad_flat(x: jax.Array, leaf: LeafSpec, shards: int) -> jax.Array:
    """One logical leaf -> `[L?, M?, N·k]`, zero-padded."""
    return _pad_last(to_pieces(x, leaf, 1 if leaf.stacked else 0), shards)


def unpad(x: jax.Array, leaf: LeafSpec) -> jax.Array:
    """`[L?, M?, N·k]` -> the logical leaf (drops the padding)."""
    lead = 1 if leaf.stacked else 0
    return from_pieces(x[..., : leaf.piece_size], leaf, lead)


def unpad_unit(x: jax.Array, leaf: LeafSpec) -> jax.Array:
    """One gathered unit `[M?, N·k]` -> its logical unit shape."""
    return from_pieces(x[..., : leaf.piece_size], leaf)


def pad_unit(x: jax.Array, leaf: LeafSpec, shards: int) -> jax.Array:
    """One logical unit -> `[M?, N·k]`, zero-padded (the layout a reduce-scatter needs)."""
    return _pad_last(to_pieces(x, leaf), shards)


# ---------------------------------------------------------------------------------------------
# The model's plan: which dimension of each leaf is split over "model".


def spec_split(spec, shape: tuple[int, ...], path: str) -> int | None:
    """The dimension of a leaf of `shape` that `spec` (a PartitionSpec naming mesh axes, or
    None) puts on the `model` axis; None when it names `model` nowhere. Other axis names are
    ZeRO's business (the engine shards every leaf over `data` its own way) and ignored."""
    if spec is None:
        return None
    if not isinstance(spec, P):
        raise ModelError(f"the sharding annotation of parameter {path} is {spec!r}, not a "
                         f"jax.sharding.PartitionSpec (or None); give each leaf a "
                         f"PartitionSpec naming mesh axes, e.g. P(None, 'model')")
    if len(spec) > len(shape):
        raise ModelError(f"parameter {path} of shape {shape} has the sharding annotation "
                         f"{spec}, which names {len(spec)} dimensions; give at most "
                         f"{len(shape)}")
    names = lambda e: e if isinstance(e, tuple) else (e,)
    dims = [a for a, e in enumerate(spec) if MODEL in names(e)]
    if len(dims) > 1:
        raise ModelError(f"parameter {path} of shape {shape} has the sharding annotation "
                         f"{spec}, which splits dimensions {dims} over {MODEL!r}; split at "
                         f"most one dimension of a leaf over {MODEL!r}")
    return dims[0] if dims else None


def split_leaves(leaves: tuple[LeafSpec, ...], splits: dict[str, int | None],
                 model: int) -> tuple[LeafSpec, ...]:
    """`leaves` with the model's plan applied: leaf path -> the dimension of the logical leaf
    (a stacked leaf's counting its layer axis) split over the `model` axis of `model`
    devices. ConfigError for a dimension that `model` does not divide, for a stack's layer
    axis, and for `model > 1` with nothing split (no silent replication)."""
    out = []
    for leaf in leaves:
        dim = splits.get(leaf.path)
        if dim is None or model == 1:
            out.append(unsplit(leaf))
            continue
        if leaf.stacked and dim == 0:
            raise ConfigError(f"parameter {leaf.path} of shape {leaf.shape} is a stack of "
                              f"{leaf.shape[0]} layers whose layer axis (dimension 0) is split "
                              f"over {MODEL!r}; split a dimension of the layer instead (e.g. "
                              f"the output features)")
        unit_dim = dim - 1 if leaf.stacked else dim
        n = leaf.shape[dim]
        if n % model:
            raise ConfigError(f"parameter {leaf.path} of shape {leaf.shape} is split over "
                              f"{MODEL!r} on dimension {dim} of size {n}, which {model} model "
                              f"devices do not divide; use a model axis that divides {n} "
                              f"(make_mesh(model=...)), or leave that dimension unsplit in the "
                              f"model's annotation")
        out.append(dataclasses.replace(leaf, split=unit_dim, pieces=model))
    if model > 1 and not any(leaf.is_split for leaf in out):
        raise ConfigError(f"the mesh has a {MODEL!r} axis of {model} devices but the model "
                          f"splits none of its parameters over {MODEL!r} (no annotation names "
                          f"it), so every model device would hold and compute the same: "
                          f"annotate the params (nn.with_partitioning, logical axis rules, "
                          f"NNX sharding metadata, out_sharding= on the arrays, or the model's "
                          f"param_specs()), or build the "
                          f"mesh without model=")
    return tuple(out)


def model_plan(model, leaves: tuple[LeafSpec, ...], treedef, devices: int) -> tuple[LeafSpec, ...]:
    """`leaves` split over a `model` axis of `devices` as `model.param_specs()` says (a
    PartitionSpec or None per param leaf); none split for a model without the method, or
    whose method returns None."""
    specs = getattr(model, "param_specs", None)
    tree = specs() if callable(specs) else None  # None: nothing split
    splits = {}
    if tree is not None:
        try:
            flat = treedef.flatten_up_to(tree)
        except (ValueError, TypeError) as e:
            raise ModelError(f"the model's param_specs() does not match its params' structure "
                             f"({e}); return a PartitionSpec (or None) per param leaf, as init() "
                             f"returns them") from None
        splits = {leaf.path: spec_split(spec, leaf.shape, leaf.path)
                  for leaf, spec in zip(leaves, flat)}
    return split_leaves(tuple(leaves), splits, devices)


def logical_shardings(mesh, leaves: tuple[LeafSpec, ...], treedef, axes=(DATA,)):
    """`like(path, shape, leaf=None)`: the NamedSharding of a logical value (a checkpoint's
    leaf) of `shape` — over `axes` on its unit's first axis that they divide (a local reshape
    of the flat shard), and, for a param `leaf` or a value where a param sits (an optimizer
    moment: its `path` ends with the param's, of its shape), split over "model" as the param
    is; replicated when smaller than the devices of `axes`."""
    n = math.prod(dict(mesh.shape)[a] for a in axes)
    spec = axes[0] if len(axes) == 1 else tuple(axes)
    shapes = jax.tree.unflatten(treedef, [0] * len(leaves))
    by_path = {tuple(p): leaf for (p, _), leaf in zip(jax.tree.flatten_with_path(shapes)[0],
                                                       leaves)}

    def like(path, shape, leaf=None):
        shape = tuple(shape)
        if leaf is None:
            leaf = next((lf for i in range(len(path)) if (lf := by_path.get(tuple(path[i:])))
                         is not None and lf.shape == shape), None)
        split = leaf is not None and leaf.is_split
        if math.prod(shape) < n and not split:
            return jax.sharding.NamedSharding(mesh, P())
        dims = list(leaf.logical_spec()) if split else []
        dims += [None] * (len(shape) - len(dims))
        first = 1 if leaf is not None and leaf.stacked else 0
        for a in [*range(first, len(shape)), *range(first)]:
            if n > 1 and dims[a] is None and shape[a] % n == 0:
                dims[a] = spec
                break
        return jax.sharding.NamedSharding(mesh, P(*dims) if any(d is not None for d in dims)
                                          else P())

    return like
