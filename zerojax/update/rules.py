"""The rule of each kind of data primitive, over flat shards (interpret.py walks the jaxpr).

Elementwise work on Flat values stays local; a reduction is a segment reduction of the local
elements by their output index (padding excluded) and one collective (a sum stays Partial
through additions and scalings, so a global norm costs one scalar all-reduce); a full
contraction of two equally laid out values is a local sum; a reshape of a Flat value is free
(the row-major flat order does not change); a broadcast stays lazy (Bcast). A rule gives the
output keys, or None: the planner then runs the primitive whole (or the owner hooks take it).

A rule sees the planner as `Planning`: what it reads and calls, so that this module and
control.py need not import interpret.py, which imports them (one way).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.update.program import Program, bind
from zerojax.update.reps import (
    PARTIAL,
    WHOLE,
    Bcast,
    Flat,
    Partial,
    Phys,
    Rep,
    Whole,
    from_flat,
    segment_reduce,
    select,
)

ELEMENTWISE = frozenset("""
abs acos acosh add and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt ceil clamp
complex conj convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp
exp2 expm1 floor ge gt igamma igamma_grad_a igammac imag integer_pow is_finite le lgamma log
log1p logistic lt max min mul ne neg nextafter not or polygamma population_count pow real
reduce_precision regularized_incomplete_beta rem round rsqrt select_n shift_left
shift_right_arithmetic shift_right_logical sign sin sinh sqrt square sub tan tanh xor zeta
random_gamma_grad
""".split())
# Linear in a Partial operand (the others Whole): a sum over devices commutes with them.
LINEAR = {"add": "all", "sub": "all", "neg": "all", "mul": "one", "div": "first"}
REDUCTIONS = {"reduce_sum": "psum", "reduce_max": "pmax", "reduce_min": "pmin",
              "reduce_and": "pmin", "reduce_or": "pmax"}

class Planning(Protocol):
    """The planner (interpret.Planner) as a rule sees it."""

    shards: int
    axis: Any
    rep: dict[int, Rep]
    aval: dict[int, Any]
    consts: dict[int, Any]
    whole_ops: list[str]
    hooks: Any

    def local(self, fn, ins, avals, reps, kind: str = "local") -> list[int]: ...
    def comm(self, kind, x: int, aval, rep, meta=None) -> int: ...
    def device(self) -> int: ...
    def index(self, phys: Phys) -> tuple[int, int]: ...
    def whole(self, k: int) -> int: ...
    def flat(self, k: int, want: Flat) -> int: ...
    def convert(self, k: int, want: Rep) -> int: ...
    def as_rep(self, k: int, rep: Rep, aval=None) -> int: ...
    def body(self, closed, in_reps, out_reps=None) -> tuple[Program, list, Any]: ...


def elementwise(p: Planning, eqn, ins):
    prim, params = eqn.primitive, eqn.params
    out_aval = eqn.outvars[0].aval
    out_shape = tuple(out_aval.shape)
    if any(isinstance(p.rep[k], Partial) for k in ins):
        out = _linear(p, eqn, ins)
        if out is not None:
            return out
        ins = [p.whole(k) if isinstance(p.rep[k], Partial) else k for k in ins]
    reps = [p.rep[k] for k in ins]
    flats = [r for r in reps if isinstance(r, Flat)]
    run = lambda *xs: bind(prim, params, *xs)
    if flats:
        want = Flat(flats[0].phys, out_shape)
        # Operands of the output's shape (a scalar leaf's too) are taken as their flat
        # parts; a scalar broadcasts as it is; others broadcast their size-1 axes.
        ins = [p.whole(k) if p.aval[k].shape == () != out_shape else
               p.flat(_implicit(p, k, out_shape), want) for k in ins]
        return p.local(run, ins, [out_aval], [want])
    shaped = {reps[i] for i, k in enumerate(ins) if p.aval[k].shape != ()}
    if len(shaped) == 1 and isinstance(b := next(iter(shaped)), Bcast):
        # Every shaped operand is the same broadcast: compute on the stored operands.
        ins = [k if p.aval[k].shape != () else p.whole(k) for k in ins]
        return p.local(run, ins, [out_aval], [b])
    return None


def identity(p: Planning, eqn, ins):
    """A sharding annotation (e.g. the `reshard` that `jnp.where` adds when traced under
    the step's mesh): no value changes, so its operands pass through as they are."""
    del eqn
    return list(ins)


def _zero(p: Planning, k) -> bool:
    v = p.consts.get(k)
    return v is not None and isinstance(v, np.ndarray) and not v.any()


def _implicit(p: Planning, k, shape):
    """`k` seen at `shape`: a binary op's operand may have size-1 axes it broadcasts."""
    own = tuple(p.aval[k].shape)
    if own == shape:
        return k
    aval = jax.ShapeDtypeStruct(shape, p.aval[k].dtype)
    return p.as_rep(p.whole(k), Bcast(shape, tuple(range(len(own))), own), aval)


def _linear(p: Planning, eqn, ins):
    """A sum over devices commutes with + - and with scaling by a whole value."""
    name, reps = eqn.primitive.name, [p.rep[k] for k in ins]
    if name == "add" and any(_zero(p, k) for k in ins):  # `sum(...)` starts from 0
        ins = [k for k in ins if not _zero(p, k)]
        if len(ins) == 1 and tuple(p.aval[ins[0]].shape) == \
                tuple(eqn.outvars[0].aval.shape):
            return [p.as_rep(ins[0], PARTIAL, eqn.outvars[0].aval)]
        return None
    partial = [isinstance(r, Partial) for r in reps]
    whole = [isinstance(r, Whole) for r in reps]
    ok = {"all": all(partial),
          "one": sum(partial) == 1 and all(a or w for a, w in zip(partial, whole)),
          "first": partial[0] and all(whole[1:])}.get(LINEAR.get(name, ""), False)
    if name in ("add", "sub") and not all(partial):
        ok = False
    if not ok or p.shards == 1:
        return None
    prim, params = eqn.primitive, eqn.params
    return p.local(lambda *xs: bind(prim, params, *xs), ins,
                   [eqn.outvars[0].aval], [PARTIAL])


def reduce(p: Planning, eqn, ins):
    (k,), name = ins, eqn.primitive.name
    rep, out_aval = p.rep[k], eqn.outvars[0].aval
    axes = tuple(int(a) for a in eqn.params["axes"])
    if isinstance(rep, Partial) and name == "reduce_sum":
        prim, params = eqn.primitive, eqn.params
        return p.local(lambda x: bind(prim, params, x), [k], [out_aval], [PARTIAL])
    if not isinstance(rep, Flat):
        return None
    if p.shards == 1:  # every device holds the whole leaf: reduce it as it is
        prim, params = eqn.primitive, eqn.params
        return p.local(lambda x: bind(prim, params, from_flat(x, rep)), [k],
                       [out_aval], [WHOLE])
    flat, valid = p.index(rep.phys)
    part = p.local(lambda x, f, v: (segment_reduce(x, f, v, rep, axes, name),),
                   [k, flat, valid], [out_aval],
                   [PARTIAL if name == "reduce_sum" else WHOLE])[0]
    if name == "reduce_sum":
        return [part]
    return [p.comm(REDUCTIONS[name], part, out_aval, WHOLE)]


def dot(p: Planning, eqn, ins):
    """A full contraction of two equally laid out values (vdot): a local sum."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    a, b = ins
    ra, rb_ = p.rep[a], p.rep[b]
    shape = tuple(p.aval[a].shape)
    n = len(shape)
    full = (tuple(lc) == tuple(rc) == tuple(range(n)) and not lb and not rb
            and tuple(p.aval[b].shape) == shape)
    flat = next((r for r in (ra, rb_) if isinstance(r, Flat)), None)
    if not full or flat is None:
        return None
    want = Flat(flat.phys, shape)
    a, b = p.flat(a, want), p.flat(b, want)
    out_aval, pet = eqn.outvars[0].aval, eqn.params.get("preferred_element_type")
    if p.shards == 1:
        return p.local(lambda x, y: (jnp.sum(x * y, dtype=pet or out_aval.dtype),),
                       [a, b], [out_aval], [WHOLE])

    def local(x, y, *valid):
        xy = x.astype(out_aval.dtype) * y.astype(out_aval.dtype)
        return (jnp.sum(select(valid[0], xy, 0) if valid else xy),)

    valid = [p.index(want.phys)[1]] if want.phys.padded else []
    return p.local(local, [a, b, *valid], [out_aval], [PARTIAL])


def reshape(p: Planning, eqn, ins):
    k = ins[0]
    rep, out_aval = p.rep[k], eqn.outvars[0].aval
    if isinstance(rep, Flat):
        return [p.as_rep(k, Flat(rep.phys, tuple(out_aval.shape)), out_aval)]
    if isinstance(rep, Partial):
        prim, params = eqn.primitive, eqn.params
        return p.local(lambda *xs: bind(prim, params, *xs), ins[:1], [out_aval],
                       [PARTIAL])
    return None


def broadcast(p: Planning, eqn, ins):
    k = ins[0]
    rep, aval, out_aval = p.rep[k], p.aval[k], eqn.outvars[0].aval
    shape, dims = tuple(out_aval.shape), tuple(eqn.params["broadcast_dimensions"])
    if math.prod(aval.shape) == math.prod(shape) and list(dims) == sorted(dims):
        return reshape(p, eqn, ins)  # only size-1 axes added: a reshape
    if isinstance(rep, Whole) and len(ins) == 1:
        return [p.as_rep(k, Bcast(shape, dims, tuple(aval.shape)), out_aval)]
    if isinstance(rep, Bcast):  # a broadcast of a broadcast: compose the dims
        return [p.as_rep(k, Bcast(shape, tuple(dims[d] for d in rep.dims), rep.operand),
                         out_aval)]
    return None


RULES: dict[str, Callable] = {
    **{name: reduce for name in REDUCTIONS},
    "dot_general": dot,
    "reshape": reshape,
    "squeeze": reshape,
    "expand_dims": reshape,
    "broadcast_in_dim": broadcast,
    **{name: identity for name in ("reshard", "sharding_constraint", "mesh_cast")},
}
