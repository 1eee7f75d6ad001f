"""cond, scan and while over flat shards (interpret.py): each body is planned as a program of
its own, over the reps its operands have; loop carries take the reps a fixed point gives.
The planner is seen as `rules.Planning` (a body is planned by its `body`): interpret.py
imports this module, never the reverse.

A Flat operand stays Flat inside a body (MultiSteps' accumulators, apply_if_finite's inner
state), a stacked Flat value scanned over its layers gives each iteration its layer's part,
and a body's Flat outputs stack back into a stacked Flat value. A body with collectives inside
runs them inline (a "sync" op: all devices take the same branch, since the predicate is
whole).
"""

from __future__ import annotations

import functools

from jax import lax

from zerojax.collectives import vary
from zerojax.update.program import Program
from zerojax.update.reps import WHOLE, Bcast, Flat, Partial, join
from zerojax.update.rules import Planning

_MAX_FIXED_POINT = 8


def _sub(p: Planning, closed, in_reps, out_reps=None) -> tuple[Program, list]:
    prog, natural, sub = p.body(closed, in_reps, out_reps)
    prog.whole_ops = sub.whole_ops
    return prog, [WHOLE if isinstance(r, Partial) else r for r in natural]


def _claimed(p: Planning, eqn, ins, *progs: Program):
    """A body that assembles whole tensors: the owner hooks take the whole op instead (its
    work then runs once per matrix, on the matrix's owner), else it runs as planned."""
    whole = [name for prog in progs for name in prog.whole_ops]
    if whole and p.hooks is not None:
        out = p.hooks.assemble(p, eqn, ins)
        if out is not None:
            return out
    p.whole_ops.extend(whole)
    return None


def _settled(p: Planning, ks: list[int]) -> list[int]:
    """Operands of a control-flow op: no Partial crosses its boundary."""
    return [p.whole(k) if isinstance(p.rep[k], Partial) else k for k in ks]


def _kind(*progs: Program) -> str:
    return "sync" if any(prog.collectives or prog.syncs for prog in progs) else "local"


def _typed(p: Planning, reps, xs):
    """Flat values typed as varying over the data axis (hpZ: both axes), as every path must
    give them."""
    if p.shards == 1:
        return tuple(xs)
    axes = p.axis if isinstance(p.axis, tuple) else (p.axis,)
    return tuple(vary(x, axes) if isinstance(r, Flat) else x for r, x in zip(reps, xs))


def plan_cond(p: Planning, eqn, ins):
    index, ops = p.whole(ins[0]), _settled(p, ins[1:])
    in_reps = [p.rep[k] for k in ops]
    branches = eqn.params["branches"]
    naturals = [_sub(p, br, in_reps)[1] for br in branches]
    out_reps = [functools.reduce(join, rs) for rs in zip(*naturals)]
    progs = [_sub(p, br, in_reps, out_reps)[0] for br in branches]
    if (out := _claimed(p, eqn, [index, *ops], *progs)) is not None:
        return out
    fns = [lambda *xs, prog=prog: _typed(p, out_reps, prog(*xs)) for prog in progs]

    def run(i, *xs):
        return tuple(lax.switch(i, fns, *_typed(p, in_reps, xs)))

    return p.local(run, [index, *ops], [v.aval for v in eqn.outvars], out_reps,
                   kind=_kind(*progs))


def _stack(rep, length):
    """The rep of a scan's stacked output from its body's rep."""
    if isinstance(rep, Flat) and rep.phys.lead is None:
        return Flat(rep.phys.stacked(length), (length, *rep.shape))
    return WHOLE


def _unstack(p: Planning, k, length):
    """(key, body rep) of a scanned-over operand."""
    rep = p.rep[k]
    if isinstance(rep, Flat) and rep.phys.lead == length and rep.shape[:1] == (length,):
        return k, Flat(rep.phys.unit_phys(), rep.shape[1:])
    return p.whole(k), WHOLE


def _carry_fixed_point(p, body, fixed_reps, carry_reps, after, ncarry):
    """Carry reps that the body gives back: join until nothing changes."""
    for _ in range(_MAX_FIXED_POINT):
        natural = _sub(p, body, [*fixed_reps, *carry_reps, *after])[1]
        joined = [join(a, b) for a, b in zip(carry_reps, natural[:ncarry])]
        joined = [r if not isinstance(r, Bcast) or r == c else WHOLE
                  for r, c in zip(joined, carry_reps)]
        if joined == carry_reps:
            return carry_reps, natural[ncarry:]
        carry_reps = joined
    carry_reps = [WHOLE] * ncarry
    return carry_reps, _sub(p, body, [*fixed_reps, *carry_reps, *after])[1][ncarry:]


def plan_scan(p: Planning, eqn, ins):
    prm = eqn.params
    nc, ncarry, length = prm["num_consts"], prm["num_carry"], prm["length"]
    ins = _settled(p, ins)
    consts, init, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
    xs, x_reps = zip(*[_unstack(p, k, length) for k in xs]) if xs else ((), ())
    c_reps = [p.rep[k] for k in consts]
    carry_reps, y_reps = _carry_fixed_point(p, prm["jaxpr"], c_reps,
                                            [p.rep[k] for k in init], list(x_reps), ncarry)
    y_reps = [r if isinstance(r, Flat) and r.phys.lead is None else WHOLE for r in y_reps]
    prog = _sub(p, prm["jaxpr"], [*c_reps, *carry_reps, *x_reps], [*carry_reps, *y_reps])[0]
    if (out := _claimed(p, eqn, [*consts, *init, *ins[nc + ncarry:]], prog)) is not None:
        return out
    init = [p.convert(k, r) for k, r in zip(init, carry_reps)]

    def run(*vals):
        cs, carry, x = vals[:nc], vals[nc:nc + ncarry], vals[nc + ncarry:]

        def body(carry, xsl):
            out = _typed(p, [*carry_reps, *y_reps], prog(*cs, *carry, *xsl))
            return out[:ncarry], out[ncarry:]

        carry, ys = lax.scan(body, _typed(p, carry_reps, carry), tuple(x), length=length,
                             reverse=prm["reverse"], unroll=prm["unroll"])
        return (*carry, *ys)

    out_reps = [*carry_reps, *[_stack(r, length) for r in y_reps]]
    return p.local(run, [*consts, *init, *xs], [v.aval for v in eqn.outvars], out_reps,
                   kind=_kind(prog))


def plan_while(p: Planning, eqn, ins):
    prm = eqn.params
    ncc, nbc = prm["cond_nconsts"], prm["body_nconsts"]
    ins = _settled(p, ins)
    cc, bc, init = ins[:ncc], ins[ncc:ncc + nbc], ins[ncc + nbc:]
    cc_reps, bc_reps = [p.rep[k] for k in cc], [p.rep[k] for k in bc]
    carry_reps, _ = _carry_fixed_point(p, prm["body_jaxpr"], bc_reps,
                                       [p.rep[k] for k in init], [], len(init))
    body = _sub(p, prm["body_jaxpr"], [*bc_reps, *carry_reps], carry_reps)[0]
    cond = _sub(p, prm["cond_jaxpr"], [*cc_reps, *carry_reps], [WHOLE])[0]
    if (out := _claimed(p, eqn, ins, body, cond)) is not None:
        return out
    init = [p.convert(k, r) for k, r in zip(init, carry_reps)]
    n1, n2 = ncc, ncc + nbc

    def run(*vals):
        ccv, bcv, carry = vals[:n1], vals[n1:n2], vals[n2:]
        return tuple(lax.while_loop(
            lambda c: cond(*ccv, *c)[0],
            lambda c: _typed(p, carry_reps, body(*bcv, *c)),
            _typed(p, carry_reps, carry)))

    return p.local(run, [*cc, *bc, *init], [v.aval for v in eqn.outvars], carry_reps,
                   kind=_kind(body, cond))

