"""Evaluating an owner region's recorded primitives: as they are (batched with jax.vmap over
an owner's matrices), or with the layer axis of a stacked value resized, so that each owner
runs only its layers. Control flow is traced again over the values it gets."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from zerojax.collectives import vary
from zerojax.update.program import vary_all
from zerojax.update.rules import ELEMENTWISE


class NotSeparable(Exception):
    """A region that does not treat the layers of a stacked value independently."""


def _read(env, consts, a):
    if isinstance(a, jcore.Literal):
        return a.val
    if a in env:
        return env[a]
    return jnp.asarray(consts[a])


def run(entries, env, consts, axes=None, L=None, n=None):
    """Binds `entries` over `env`; with `axes` (key -> layer axis), the layer axis of size L
    is resized to n (NotSeparable where a primitive mixes layers). Control flow is traced
    again over the values it gets (its recorded bodies are typed for other operands)."""
    for prim, params, ins, outs in entries:
        vals = [_read(env, consts, a) for a in ins]
        if axes is None:
            res = _retraced(prim, params, vals)
        else:
            in_axes = [None if isinstance(a, jcore.Literal) else axes.get(a) for a in ins]
            res, out_axes = _resized(prim, params, vals, in_axes, L, n, consts)
            for a, ax in zip(outs, out_axes):
                axes[a] = ax
        res = res if prim.multiple_results else [res]
        for a, v in zip(outs, res):
            if not isinstance(a, jcore.DropVar):
                env[a] = v


def eval_closed(closed, args):
    env = dict(zip(closed.jaxpr.constvars, closed.consts))
    env.update(zip(closed.jaxpr.invars, args))
    run([(e.primitive, e.params, e.invars, e.outvars) for e in closed.jaxpr.eqns], env, {})
    return [_read(env, {}, a) for a in closed.jaxpr.outvars]


def _retraced(prim, params, vals):
    """One primitive over `vals`, control flow traced anew."""
    name = prim.name
    sub = params.get("jaxpr", params.get("call_jaxpr"))
    if name in ("pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call"):
        if isinstance(sub, jcore.Jaxpr):
            sub = jcore.ClosedJaxpr(sub, ())
        return eval_closed(sub, vals)
    if name == "scan":
        nc, ncarry = params["num_consts"], params["num_carry"]
        consts, init, xs = vals[:nc], vary_all(vals)[nc:nc + ncarry], vals[nc + ncarry:]

        def step(carry, x):
            out = eval_closed(sub, [*consts, *carry, *x])
            return vary_like(out[:ncarry], carry), out[ncarry:]

        carry, ys = lax.scan(step, list(init), list(xs), length=params["length"],
                             reverse=params["reverse"], unroll=params["unroll"])
        return [*carry, *ys]
    if name == "while":
        ncc, nbc = params["cond_nconsts"], params["body_nconsts"]
        cc, bc, init = vals[:ncc], vals[ncc:ncc + nbc], vary_all(vals)[ncc + nbc:]
        return lax.while_loop(
            lambda c: eval_closed(params["cond_jaxpr"], [*cc, *c])[0],
            lambda c: vary_like(eval_closed(params["body_jaxpr"], [*bc, *c]), c), list(init))
    if name == "cond":
        index, ops = vals[0], vary_all(vals[1:])
        outs = [lambda *a, br=br: vary_all_to(eval_closed(br, a), ops)
                for br in params["branches"]]
        return lax.switch(index, outs, *ops)
    return _bind(prim, params, vals)


def vary_like(xs, like):
    """`xs` typed varying wherever the matching `like` is (a loop carry keeps its type)."""
    return [vary(x, tuple(jax.typeof(y).mat.varying)) for x, y in zip(xs, like)]


def vary_all_to(xs, ops):
    axes = set()
    for y in ops:
        axes |= set(jax.typeof(y).mat.varying)
    return [vary(x, tuple(sorted(axes))) for x in xs]


def _bind(prim, params, vals):
    vals = vary_all(vals) if len(vals) > 1 else vals
    return prim.bind(*vals, **prim.get_bind_params(params))


def _one(axs):
    got = {a for a in axs if a is not None}
    if len(got) > 1:
        raise NotSeparable
    return next(iter(got), None)


def _resized(prim, params, vals, in_axes, L, n, consts):
    """(outputs, their layer axes) of one primitive with the layer axis resized L -> n."""
    name = prim.name
    if all(a is None for a in in_axes) and name not in ("iota", "broadcast_in_dim", "reshape"):
        out = _bind(prim, params, vals)
        k = len(out) if prim.multiple_results else 1
        return out, [None] * k
    params = dict(params)
    if name in ELEMENTWISE:
        a = _one(in_axes)
        for v, ax in zip(vals, in_axes):
            if ax is None and jnp.ndim(v) and jnp.shape(v)[a] != 1:
                raise NotSeparable
        return _bind(prim, params, vals), [a]
    if name == "broadcast_in_dim":
        (a,) = in_axes[:1]
        shape, dims = list(params["shape"]), params["broadcast_dimensions"]
        if a is None:
            if L in shape and L != 1:
                raise NotSeparable
            return _bind(prim, params, vals), [None]
        shape[dims[a]] = n
        params["shape"] = tuple(shape)
        return _bind(prim, params, vals), [dims[a]]
    if name in ("reshape", "squeeze", "expand_dims"):
        (a,) = in_axes[:1]
        shape = list(jnp.shape(vals[0]))
        if a is None:
            return _bind(prim, params, vals), [None]
        if name == "squeeze":
            dims = params["dimensions"]
            if a in dims:
                raise NotSeparable
            return _bind(prim, params, vals), \
                [a - sum(d < a for d in dims)]
        if name != "reshape" or params.get("dimensions") is not None:
            raise NotSeparable
        new = list(params["new_sizes"])
        before = math.prod(shape[:a])
        p_ = next((i for i in range(len(new)) if math.prod(new[:i]) == before and new[i] == L),
                  None)
        if p_ is None or math.prod(new[p_ + 1:]) != math.prod(shape[a + 1:]):
            raise NotSeparable
        new[p_] = n
        params["new_sizes"] = tuple(new)
        return _bind(prim, params, vals), [p_]
    if name == "transpose":
        perm = params["permutation"]
        return _bind(prim, params, vals), [list(perm).index(in_axes[0])]
    if name in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                "reduce_or", "argmax", "argmin"):
        a, axes_ = in_axes[0], tuple(params["axes"])
        if a in axes_:
            raise NotSeparable
        return _bind(prim, params, vals), [a - sum(x < a for x in axes_)]
    if name == "dot_general":
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        al, ar = in_axes
        nl, nr = jnp.ndim(vals[0]), jnp.ndim(vals[1])
        lfree = [d for d in range(nl) if d not in lc and d not in lb]
        rfree = [d for d in range(nr) if d not in rc and d not in rb]
        if al is not None and ar is not None:
            if al not in lb or ar not in rb or list(lb).index(al) != list(rb).index(ar):
                raise NotSeparable
            out = list(lb).index(al)
        elif al is not None:
            if al not in lfree:
                raise NotSeparable
            out = len(lb) + lfree.index(al)
        else:
            if ar not in rfree:
                raise NotSeparable
            out = len(lb) + len(lfree) + rfree.index(ar)
        return _bind(prim, params, vals), [out]
    if name in ("pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call"):
        sub = params.get("jaxpr", params.get("call_jaxpr"))
        env = dict(zip(sub.jaxpr.constvars, sub.consts))
        env.update(zip(sub.jaxpr.invars, vals))
        axes = dict(zip(sub.jaxpr.invars, in_axes))
        run([(e.primitive, e.params, e.invars, e.outvars) for e in sub.jaxpr.eqns], env, {},
             axes, L, n)
        outs = sub.jaxpr.outvars
        return [_read(env, {}, a) for a in outs], \
            [None if isinstance(a, jcore.Literal) else axes.get(a) for a in outs]
    if name == "scan":
        return _scan(params, vals, in_axes, L, n)
    raise NotSeparable


def _scan(params, vals, in_axes, L, n):
    body = params["jaxpr"]
    nc, ncarry = params["num_consts"], params["num_carry"]
    if any(a == 0 for a in in_axes[nc + ncarry:]):
        raise NotSeparable  # scanning over the layer axis itself
    x_axes = [None if a is None else a - 1 for a in in_axes[nc + ncarry:]]
    carry_axes = list(in_axes[nc:nc + ncarry])
    consts = vals[:nc]

    def step(carry, xs):
        env = dict(zip(body.jaxpr.constvars, body.consts))
        env.update(zip(body.jaxpr.invars, [*consts, *carry, *xs]))
        axes = dict(zip(body.jaxpr.invars, [*in_axes[:nc], *carry_axes, *x_axes]))
        run([(e.primitive, e.params, e.invars, e.outvars) for e in body.jaxpr.eqns], env, {},
             axes, L, n)
        outs = body.jaxpr.outvars
        got = [None if isinstance(a, jcore.Literal) else axes.get(a) for a in outs]
        if got[:ncarry] != carry_axes:
            raise NotSeparable
        step.y_axes = got[ncarry:]
        return [_read(env, {}, a) for a in outs[:ncarry]], [_read(env, {}, a) for a in
                                                             outs[ncarry:]]

    carry, ys = lax.scan(step, list(vals[nc:nc + ncarry]), list(vals[nc + ncarry:]),
                         length=params["length"], reverse=params["reverse"],
                         unroll=params["unroll"])
    y_axes = [None if a is None else a + 1 for a in step.y_axes]
    return [*carry, *ys], [*carry_axes, *y_axes]
