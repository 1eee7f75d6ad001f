"""The model axis inside the step: each device's model piece of a split leaf.

The step is manual over the batch axes and automatic over "model" (DESIGN.md section 8). A
collective over "data" of a value whose model pieces are split would make XLA replicate the
pieces over "model" first (the whole weight on every device), so the unit collectives
(collectives/__init__.py) run their "data" work in a nested shard_map manual over "model"
(`model_map`): a device sees only its own model piece of each split leaf and does exactly what
it does for a leaf that is not split (`piece()`), and the pieces leave as logical values split
over "model" on their split dimension. A unit's split and unsplit leaves run as two groups
(`per_group`); the unsplit group runs manual over "model" too, replicated, so that no
collective over "data" reads a value the compiler laid out over "model".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from zerojax.mesh import MODEL


def vary(x, axes):
    """Marks `x` as device-varying over `axes` (a type cast under check_vma, no data moved)."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def barrier(x):
    # Keeps XLA from hoisting per-layer casts/gathers out of the loop (DESIGN §5, jax#23543).
    return lax.optimization_barrier(x)



STORED, LOGICAL = "stored", "logical"  # a split leaf's value as stored ([M, ...]) or logical


def model_axis() -> bool:
    """Whether the computation being traced has an automatic `model` axis (the step on a mesh
    with one)."""
    return MODEL in jax.sharding.get_abstract_mesh().axis_names


def model_map(fn, in_specs, out_specs, differentiated: bool = True):
    """`fn` manual over "model" inside the step (manual over the batch axes already): each
    device sees its own model piece of the split leaves.

    `differentiated` (a map inside the loss: remat and linearize evaluate it partially): traced
    without the varying-axes check, then each output typed as the checked map types it. jax
    0.10's partial evaluation of a checked nested map hoists its input-independent values (the
    literals the check makes varying) with specs naming the outer manual axes, which the
    lowering rejects. Outside differentiation (the update) the map is checked as it is."""
    kw = dict(mesh=jax.sharding.get_abstract_mesh(), in_specs=in_specs, out_specs=out_specs,
              axis_names=frozenset({MODEL}))
    checked = jax.shard_map(fn, check_vma=True, **kw)
    if not differentiated:
        return checked
    unchecked = jax.shard_map(fn, check_vma=False, **kw)

    def run(*args):
        want = jax.eval_shape(checked, *args)
        return jax.tree.map(lambda y, w: vary(y, tuple(sorted(w.manual_axis_type.varying))),
                            unchecked(*args), want)

    return run


def _pieces(leaves):
    return tuple(leaf.piece() for leaf in leaves)


def _spec(kind, leaf, lead):
    if kind == STORED:
        return P(*[None] * lead, MODEL)
    return leaf.split_spec(lead)


def _take(x, kind, lead):
    """A nested map's view of one model piece: a stored value loses its `[1]` model axis."""
    return jnp.squeeze(x, lead) if kind == STORED else x


def _put(x, split, lead):
    return jax.tree.map(lambda a: jnp.expand_dims(a, lead), x) if split else x


def _local_shape(x, split, lead):
    """One model device's shape of a stored `x`: its model axis of size 1."""
    return (*x.shape[:lead], 1, *x.shape[lead + 1:]) if split else x.shape


def per_group(fn, leaves, args, kinds, out_kind, shared=None, lead=0):
    """`fn(leaves, *args, shared)` -> per-leaf values, run once for the unsplit leaves and once
    for the split ones (`args`: per-leaf lists, each `kinds[j]`: STORED (`[M, ...]` at `lead`)
    or LOGICAL (split over "model" on the split dimension); `shared`: (the unsplit group's,
    the split group's) value, the latter STORED at 0; the outputs `out_kind`).

    On a mesh with a model axis both groups run manual over "model": a split leaf's piece on
    its own device, an unsplit one (replicated over "model") as it is. The unsplit group too,
    so that no collective over "data" ever reads a value the compiler laid out over "model"
    (XLA:CPU aborts on a bfloat16 all-reduce of such a value; a split weight's collective
    would move every piece)."""
    shared = (None, None) if shared is None else shared
    out = [None] * len(leaves)
    tp = model_axis()
    for split in (False, True):
        idx = [i for i, leaf in enumerate(leaves) if leaf.is_split == split]
        if not idx:
            continue
        ls = [leaves[i] for i in idx]
        sel = [[a[i] for i in idx] for a in args]
        sh = shared[split]
        if not tp:
            vals = fn(ls, *sel, sh)
        else:
            def body(sel, sh, ls=ls, split=split):
                if split:
                    sel = [[_take(x, kind, lead) for x in a] for a, kind in zip(sel, kinds)]
                    sh = None if sh is None else jax.tree.map(lambda a: a[0], sh)
                    ys = fn(list(_pieces(ls)), *sel, sh)
                    return [y[(slice(None),) * lead + (None,)] if out_kind == STORED else y
                            for y in ys]
                return fn(ls, *sel, sh)
            if split:
                in_specs = ([[_spec(kind, leaf, lead) for leaf in ls] for kind in kinds],
                            None if sh is None else jax.tree.map(lambda _: P(MODEL), sh))
                out_specs = [_spec(out_kind, leaf, lead) for leaf in ls]
            else:
                in_specs = ([[P()] * len(ls) for _ in kinds],
                            None if sh is None else jax.tree.map(lambda _: P(), sh))
                out_specs = [P()] * len(ls)
            vals = model_map(body, in_specs, out_specs)(sel, sh)
        for i, v in zip(idx, vals):
            out[i] = v
    return out


def on_pieces(fn, leaf, x, x_stored: bool, out_stored: bool):
    """`fn(x, leaf)`, on a mesh with a model axis manual over "model" (see `_per_group`): for
    a split leaf `fn(piece of x, leaf.piece())` on each model device. `x` and the result are
    logical values of the leaf (split over "model" on its split dimension) or stored ones
    (`[L?, M?, ...]`), as the flags say."""
    lead = 1 if leaf.stacked else 0
    return per_group(lambda ls, xs, _: [fn(xs[0], ls[0])], [leaf], [[x]],
                      [STORED if x_stored else LOGICAL], STORED if out_stored else LOGICAL,
                      lead=lead)[0]


def per_group_value(fn, leaves, xs, lead):
    """`fn(leaves, xs)` -> one value (a pytree) per group: (the unsplit leaves', the split
    leaves' with each model device's piece stored on a model axis at `lead`), None for an
    empty group. `xs`: the leaves' stored values, their model axis at `lead`."""
    out = []
    for split in (False, True):
        idx = [i for i, leaf in enumerate(leaves) if leaf.is_split == split]
        if not idx:
            out.append(None)
            continue
        ls, sel = [leaves[i] for i in idx], [xs[i] for i in idx]
        if not model_axis():
            out.append(fn(ls, sel))
            continue
        spec = _spec(STORED, None, lead) if split else P()
        body = lambda *a, ls=ls, split=split: _put(
            fn(_pieces(ls) if split else ls, [_take(x, STORED, lead) if split else x
                                               for x in a]), split, lead)
        shapes = jax.eval_shape(body, *[jnp.zeros(_local_shape(x, split, lead), x.dtype)
                                        for x in sel])  # one device's view
        out.append(model_map(body, tuple([spec] * len(sel)),
                             jax.tree.map(lambda _, spec=spec: spec, shapes))(*sel))
    return tuple(out)
