"""What the Flax adapters share: running one unit (gather + call) under remat, trees by path."""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zerojax.errors import ModelError

LOCK = threading.RLock()  # the patches of flax's scan and of jax.lax are process-wide


@contextlib.contextmanager
def scan_through(stand, owner, attr: str, proxy):
    """While active, `owner.<attr>` is `proxy(scan)`: a flax transform's `lax.scan` over a
    stack's stand-ins (`placeholders.Stand.take_scan`) runs as `units.scan` over their handles,
    the gathered layer in place of each stand-in's slice; any other scan runs as before (an NNX
    unit's gathered values it takes count as read)."""
    if not stand.entries:
        yield
        return
    units = stand.units

    def scan(f, init, xs, length=None, reverse=False, unroll=1, **kw):
        flat, tree = jax.tree.flatten(xs)
        hs = [stand.take_scan(x) for x in flat]
        if not any(h is not None for h in hs):
            return lax.scan(f, init, xs, length=length, reverse=reverse, unroll=unroll, **kw)
        if reverse:
            raise ModelError(f"a unit stack scanned with reverse=True is not supported; scan "
                             f"it forward{stand.note}")
        n = next(x for x, h in zip(flat, hs) if h is not None).shape[0]

        def layer_f(c, xs_l):  # a unit called in here runs on its gathered layer
            stand.in_scan += 1
            try:
                return f(c, xs_l)
            finally:
                stand.in_scan -= 1

        layer = lambda xs_l, i: [w if h is not None else lax.dynamic_index_in_dim(x, i, 0, False)
                                 for x, w, h in zip(flat, xs_l, hs)]
        y_avals = jax.eval_shape(lambda c: layer_f(c, jax.tree.unflatten(tree, [
            jnp.zeros(x.shape[1:], x.dtype) if h is not None else x[0]
            for x, h in zip(flat, hs)]))[1], init)
        axes = _vma(init)  # the per-layer outputs vary at most as the carry does
        ys0 = jax.tree.map(lambda a: _vary(jnp.zeros((n, *a.shape), a.dtype), axes), y_avals)

        def body(carry, ws):
            c, i, ys = carry
            it = iter(ws)
            xs_l = [next(it) if h is not None else None for h in hs]
            c, y = layer_f(c, jax.tree.unflatten(tree, layer(xs_l, i)))
            ys = jax.tree.map(
                lambda b, v: lax.dynamic_update_index_in_dim(b, _vary(v, axes), i, 0), ys, y)
            return c, i + 1, ys

        c, _, ys = units.scan(body, (init, jnp.int32(0), ys0), [h for h in hs if h is not None])
        return c, ys

    with LOCK:
        saved = getattr(owner, attr)
        setattr(owner, attr, proxy(scan))
        try:
            yield
        finally:
            setattr(owner, attr, saved)


def _vma(tree) -> tuple[str, ...]:
    """The mesh axes any leaf of `tree` varies over."""
    axes = set()
    for leaf in jax.tree.leaves(tree):
        axes |= _varying(leaf)
    return tuple(sorted(axes))


def _varying(x) -> set[str]:
    mat = getattr(jax.typeof(x), "mat", None)  # absent outside shard_map
    return set(getattr(mat, "varying", ()))


def _vary(x, axes):
    """`x` typed device-varying over `axes` (a cast under check_vma; no data moves)."""
    missing = tuple(a for a in axes if a not in _varying(x))
    return lax.pcast(x, missing, to="varying") if missing else x


class LaxWith:
    """`jax.lax` with another `scan`."""

    def __init__(self, scan):
        self.scan = scan

    def __getattr__(self, name):
        return getattr(lax, name)


class JaxWith:
    """`jax` whose `lax` has another `scan`."""

    def __init__(self, scan):
        self.lax = LaxWith(scan)

    def __getattr__(self, name):
        return getattr(jax, name)


def check_unit_classes(units: Any) -> tuple[type, ...]:
    """`units` as a tuple of classes, or a ModelError naming the bad entry."""
    units = tuple(units) if isinstance(units, (tuple, list)) else (units,)
    for u in units:
        if not isinstance(u, type):
            raise ModelError(f"units must name module classes (e.g. units=(Block,)), got {u!r}")
    return units


def unit_call(units, fn, handles, *args):
    """`fn(units.gather(handles), *args)`: one ZeRO unit's call.

    In stage 3 the gather and the call are one function whose backward gathers the weights
    again: forward keeps only the unit's inputs (with `remat=False` also its matrix products'
    outputs, as `units.scan`'s layers), never its gathered weights. Elsewhere (the replicated
    stages, plain and recording units) the call is direct, rematerialized when the units say
    `remat`, as `units.scan` does per layer. Non-array leaves of `args` stay static.
    """
    leaves, tree = jax.tree.flatten(args)
    dyn = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]

    def run(dyn_leaves):
        full = list(leaves)
        for i, x in zip(dyn, dyn_leaves):
            full[i] = x
        return fn(units.gather(handles), *jax.tree.unflatten(tree, full))

    xs = [leaves[i] for i in dyn]
    stage = getattr(units, "stage", None)
    if stage == 3:
        return _regathered(run, xs, keep_dots=not getattr(units, "remat", True))
    if stage is not None and getattr(units, "remat", False):
        return jax.checkpoint(run)(xs)
    return run(xs)


def _regathered(f, xs, keep_dots: bool = False):
    """`f(xs)`, recomputed (gathers included) in backward; `keep_dots`: the outputs of its
    matrix products kept from forward (`dots_with_no_batch_dims_saveable`) and only the rest
    recomputed: a layer whose plan splits its activations over `model` runs its projections'
    all-reduces once, not again in backward (docs/performance.md, "Where Gemma3's time goes")."""
    f_c, consts = jax.closure_convert(f, xs)  # the unit's shards are among the consts
    saving = jax.checkpoint(f_c, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)

    @jax.custom_vjp
    def call(xs, consts):
        return f_c(xs, *consts)

    def fwd(xs, consts):
        if keep_dots:
            return jax.vjp(saving, xs, *consts)  # the residuals: inputs, shards, saved dots
        return f_c(xs, *consts), (xs, consts)

    def bwd(res, ct):
        # The backward's gathers must depend on the cotangent: XLA drops remat's optimization
        # barriers and would merge (CSE) them with the forward's identical gathers, keeping
        # every unit's gathered weights alive from forward to backward.
        zero = _zero_from(ct)
        later = lambda c: c + zero.astype(c.dtype) if _is_float(c) else c  # noqa: E731
        if keep_dots:
            vjp = jax.tree.map(later, res)
        else:
            xs, consts = res
            _, vjp = jax.vjp(lambda xs, *k: f_c(xs, *k), xs, *map(later, consts))
        ct_xs, *ct_consts = vjp(ct)
        return ct_xs, ct_consts

    call.defvjp(fwd, bwd)
    return call(xs, consts)


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _zero_from(ct) -> jax.Array:
    """A zero that XLA cannot compute before `ct` exists (x * 0 is not folded for floats)."""
    floats = [x for x in jax.tree.leaves(ct) if _is_float(x) and x.size]
    if not floats:
        return jnp.zeros((), jnp.float32)
    return floats[0].reshape(-1)[0].astype(jnp.float32) * 0


def at_path(tree: dict, path: tuple) -> Any:
    """The subtree of nested dicts `tree` at `path`."""
    for k in path:
        tree = tree[k]
    return tree


def split_paths(tree: dict, paths) -> tuple[dict, dict]:
    """`tree` -> (its subtrees at `paths` keyed by path, the rest with those subtrees removed)."""
    parts = {p: at_path(tree, p) for p in paths}

    def rest(node, prefix):
        if prefix in parts:
            return None
        if not isinstance(node, dict):
            return node
        out = {k: rest(v, (*prefix, k)) for k, v in node.items()}
        return {k: v for k, v in out.items() if v is not None and not _empty(v)}

    return parts, rest(tree, ())


def put_paths(rest: dict, parts: dict) -> dict:
    """Inverse of `split_paths`."""
    out = _copy(rest)
    for path, sub in parts.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        if path:
            node[path[-1]] = sub
        else:
            out = sub
    return out


def _empty(x) -> bool:
    return isinstance(x, dict) and not x


def _copy(tree):
    return {k: _copy(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def training(units) -> bool:
    return bool(getattr(units, "training", True))


def fresh_key(units):
    """`units.rng()`, or None from units that have no key (e.g. a bare `PlainUnits()`)."""
    try:
        return units.rng()
    except ModelError:
        return None


def takes_rngs(loss_fn, call: str) -> bool:
    """Whether `loss_fn` takes the step's keys: a parameter named `rngs` besides the first two,
    which the adapter passes by keyword. Other parameters keep their defaults; one without a
    default is a ModelError naming it (`call`: how the adapter calls `loss_fn`)."""
    try:
        params = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): the two-argument form
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise ModelError(f"loss_fn{inspect.signature(loss_fn)} cannot be called as {call}; "
                         f"give it those two positional parameters")
    # Only `rngs` gets the keys: handed to any third parameter, they gave a flag such as
    # `deterministic=False` a dict (truthy), silently turning dropout off.
    extra = [p for p in params if p not in positional[:2]
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    keys = any(p.name == "rngs" and p.kind != p.POSITIONAL_ONLY for p in extra)
    for p in extra:
        if p.default is p.empty and not (keys and p.name == "rngs"):
            raise ModelError(
                f"loss_fn's parameter {p.name!r} has no default: zerojax calls {call}, "
                f"passing the step's keys only to a parameter named rngs (by keyword); bind "
                f"{p.name} first, e.g. functools.partial(loss_fn, {p.name}=...)")
    return keys
