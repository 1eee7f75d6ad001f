"""A jaxpr over logical arrays, planned over flat shards: the planner and its walk.

A function of logical params (the step's update) is traced once to a jaxpr; `shard_jaxpr`
turns it into a `Program` (program.py) that computes the same values inside the step's
shard_map, where every param-like value is this device's part of a flattened, zero-padded
leaf. Each value has a rep (reps.py), each primitive a rule: the data primitives' in rules.py
(elementwise, reductions, dot, reshape, broadcast), cond, scan and while in control.py (each
body planned as a program of its own); a broadcast back onto a Flat value is a local index
lookup (`Planner.flat`); everything else (matmuls, transposes, slices, sorts) goes to the owner
hooks (owners.py), or, where there are none (stage 0, inside a loop body), assembles its Flat
operands (all_gather) and runs whole on every device. The rule modules see the planner as
`rules.Planning` and import nothing from here: the dependency runs one way.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from zerojax.update.control import plan_cond, plan_scan, plan_while
from zerojax.update.program import Op, Program, bind, schedule
from zerojax.update.reps import (
    WHOLE,
    Bcast,
    Flat,
    Owned,
    Partial,
    Phys,
    Rep,
    Whole,
    bcast_to_flat,
    flat_index,
    from_flat,
    select,
    to_flat,
)
from zerojax.update.rules import ELEMENTWISE, RULES, elementwise

CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
         "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
         "custom_vjp_call_jaxpr": "fun_jaxpr", "remat": "jaxpr", "checkpoint": "jaxpr"}


# ---------------------------------------------------------------------------------------------
# The planner: jaxpr -> ops


_keys = itertools.count()


@dataclass
class Planner:
    """Plans a jaxpr over reps into ops; `finish` schedules them into a Program."""

    shards: int
    axis: str
    ops: list[Op] = field(default_factory=list)
    rep: dict[int, Rep] = field(default_factory=dict)
    aval: dict[int, Any] = field(default_factory=dict)
    consts: dict[int, Any] = field(default_factory=dict)
    whole_ops: list[str] = field(default_factory=list)  # primitives that assembled a Flat value
    hooks: Any = None  # owners.py: takes over whole-matrix work
    deps: dict[int, frozenset] = field(default_factory=dict)  # key -> owner regions it reads
    cached: dict = field(default_factory=dict)  # the device and index keys

    # -- keys
    def new(self, aval, rep: Rep) -> int:
        k = next(_keys)
        self.aval[k], self.rep[k] = aval, rep
        return k

    def const(self, value, aval=None) -> int:
        if aval is None:
            aval = jax.ShapeDtypeStruct(np.shape(value), jnp.result_type(value))
        k = self.new(aval, WHOLE)
        extended = jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)
        self.consts[k] = value if extended else np.asarray(value, aval.dtype)
        return k

    def local(self, fn, ins, avals, reps, kind="local") -> list[int]:
        outs = [self.new(a, r) for a, r in zip(avals, reps, strict=True)]
        self._add(Op(kind, fn, tuple(ins), tuple(outs)))
        return outs

    def comm(self, kind, x: int, aval, rep, meta=None) -> int:
        out = self.new(aval, rep)
        self._add(Op(kind, None, (x,), (out,), meta))
        return out

    def _add(self, op: Op) -> None:
        self.ops.append(op)
        deps = frozenset().union(*(self.deps.get(k, frozenset()) for k in op.ins))
        if deps:
            for k in op.outs:
                self.deps[k] = deps

    # -- this device's position and each layout's local indices, computed once
    def device(self) -> int:
        if "device" not in self.cached:
            n, axis = self.shards, self.axis
            self.cached["device"] = self.local(
                lambda: (lax.axis_index(axis) if n > 1 else jnp.int32(0),), [],
                [jax.ShapeDtypeStruct((), jnp.int32)], [WHOLE])[0]
        return self.cached["device"]

    def index(self, phys: Phys) -> tuple[int, int]:
        """Keys of (each local element's logical flat index, its validity) in `phys`."""
        if phys not in self.cached:
            shape = jax.ShapeDtypeStruct(phys.local_shape, jnp.int32)
            self.cached[phys] = tuple(self.local(
                lambda d: flat_index(phys, d), [self.device()],
                [shape, jax.ShapeDtypeStruct(phys.local_shape, jnp.bool_)], [WHOLE, WHOLE]))
        return self.cached[phys]

    def masked(self, k: int, fill=0) -> int:
        """Flat `k` with its padding set to `fill`."""
        rep = self.rep[k]
        if not rep.phys.padded:
            return k
        valid = self.index(rep.phys)[1]
        return self.local(lambda x, v: (select(v, x, fill),), [k, valid], [self.aval[k]],
                          [rep])[0]

    # -- conversions
    def whole(self, k: int) -> int:
        """`k` as a Whole value."""
        rep, aval = self.rep[k], self.aval[k]
        if isinstance(rep, Whole):
            return k
        if isinstance(rep, Owned):
            return self.hooks.export(self, k, WHOLE)
        if isinstance(rep, Bcast):
            return self.local(lambda x: (lax.broadcast_in_dim(x, rep.shape, rep.dims),), [k],
                              [aval], [WHOLE])[0]
        if isinstance(rep, Partial):
            return self.comm("psum", k, aval, WHOLE) if self.shards > 1 else self.as_rep(k, WHOLE)
        # Flat: gather the parts, drop the padding.
        g = k
        if self.shards > 1:
            g = self.comm("gather", k, jax.ShapeDtypeStruct(rep.phys.global_shape, aval.dtype),
                          WHOLE)
        return self.local(lambda x: (from_flat(x, rep),), [g], [aval], [WHOLE])[0]

    def as_rep(self, k, rep, aval=None):
        """`k` under another rep (no data moved): a Flat reshape, a Bcast, a known Whole."""
        aval = self.aval[k] if aval is None else aval
        return self.local(lambda x: (x,), [k], [aval], [rep])[0]

    def flat(self, k: int, want: Flat) -> int:
        """`k` as this device's part in layout `want` (same logical shape)."""
        rep, aval = self.rep[k], self.aval[k]
        if rep == want:
            return k
        if isinstance(rep, Flat) and rep.phys == want.phys:
            return self.as_rep(k, want)  # a reshape: the flat order is the same
        if isinstance(rep, Owned):
            return self.hooks.export(self, k, want)
        if isinstance(rep, Bcast):
            if math.prod(rep.operand) == 1:
                return self.local(lambda x: (bcast_to_flat(x, rep, want, None, None),), [k],
                                  [aval], [want])[0]
            flat, valid = self.index(want.phys)
            return self.local(lambda x, f, v: (bcast_to_flat(x, rep, want, f, v),),
                              [k, flat, valid], [aval], [want])[0]
        k = self.whole(k)
        if math.prod(aval.shape) == 1:
            return self.local(lambda x: (to_flat(x, want, None),), [k], [aval], [want])[0]
        return self.local(lambda x, d: (to_flat(x, want, d),), [k, self.device()], [aval],
                          [want])[0]

    def convert(self, k: int, want: Rep) -> int:
        if isinstance(want, Flat):
            return self.flat(k, want)
        if isinstance(want, Bcast):
            return k if self.rep[k] == want else self.whole(k)
        return self.whole(k)

    # -- the walk
    def plan(self, jaxpr, consts: list[int], args: list[int]) -> list[int]:
        env: dict = {}
        for v, k in zip(jaxpr.constvars, consts, strict=True):
            env[v] = k
        for v, k in zip(jaxpr.invars, args, strict=True):
            env[v] = k

        def get(v):
            if isinstance(v, jcore.Literal):
                return self.const(v.val, v.aval)
            return env[v]

        for eqn in jaxpr.eqns:
            ins = [get(v) for v in eqn.invars]
            outs = self.eqn(eqn, ins)
            for v, k in zip(eqn.outvars, outs, strict=True):
                if not isinstance(v, jcore.DropVar):
                    env[v] = k
        return [get(v) for v in jaxpr.outvars]

    def eqn(self, eqn, ins: list[int]) -> list[int]:
        name = eqn.primitive.name
        reps = [self.rep[k] for k in ins]
        # Whole operands give a whole result, except a broadcast: it stays lazy (Bcast), so a
        # `zeros_like(param)` never exists whole on a device.
        if all(isinstance(r, Whole) for r in reps) and name not in CALLS and \
                name != "broadcast_in_dim":
            return self.generic(eqn, ins)
        if name in CALLS:
            return self.call(eqn, ins)
        if any(isinstance(r, Owned) for r in reps):
            out, ins = self.hooks.owned(self, eqn, ins)
            if out is not None:
                return out
        rule = CONTROL.get(name) or RULES.get(name)
        if rule is None and name in ELEMENTWISE:
            rule = elementwise
        if rule is not None:
            out = rule(self, eqn, ins)
            if out is not None:
                return out
        return self.generic(eqn, ins)

    def generic(self, eqn, ins):
        """Any primitive on whole values, as it is."""
        if any(isinstance(self.rep[k], Flat) for k in ins):
            if self.hooks is not None:
                out = self.hooks.assemble(self, eqn, ins)
                if out is not None:
                    return out
            self.whole_ops.append(eqn.primitive.name)
        ins = [self.whole(k) for k in ins]
        prim, params = eqn.primitive, eqn.params
        return self.local(lambda *xs: bind(prim, params, *xs), ins,
                          [v.aval for v in eqn.outvars], [WHOLE] * len(eqn.outvars))

    def call(self, eqn, ins):
        sub = eqn.params[CALLS[eqn.primitive.name]]
        if isinstance(sub, jcore.ClosedJaxpr):
            consts = [self.const(c) for c in sub.consts]
            return self.plan(sub.jaxpr, consts, ins)
        return self.plan(sub, [], ins)

    def body(self, closed, in_reps, out_reps=None):
        """A control-flow body planned as a program of its own over `in_reps` (control.py):
        shard_jaxpr's (program, natural reps, planner), without owner hooks."""
        return shard_jaxpr(closed, in_reps, out_reps, shards=self.shards, axis=self.axis)

    # -- the program
    def finish(self, inputs: list[int], outputs: list[int]) -> Program:
        return schedule(self.ops, inputs, outputs, self.consts, self.axis, self.shards)


CONTROL: dict[str, Callable] = {"cond": plan_cond, "scan": plan_scan, "while": plan_while}


def shard_jaxpr(closed, in_reps: list[Rep], out_reps: list[Rep | None] | None = None, *,
                shards: int, axis: str, hooks=None) -> tuple[Program, list[Rep], Planner]:
    """`closed` (a ClosedJaxpr over logical values) as a Program over `in_reps`.

    Returns the program (outputs converted to `out_reps` where given), the reps the outputs
    had before conversion (what a fixed point over loop-carried state reads), and the planner
    (for its report)."""
    p = Planner(shards, axis, hooks=hooks)
    ins = [p.new(v.aval, r) for v, r in zip(closed.jaxpr.invars, in_reps, strict=True)]
    consts = [p.const(c) for c in closed.consts]
    outs = p.plan(closed.jaxpr, consts, ins)
    natural = [p.rep[k] for k in outs]
    if out_reps is not None:
        outs = [k if r is None else p.convert(k, r) for k, r in zip(outs, out_reps, strict=True)]
    else:  # owned outputs leave as whole values
        outs = [p.whole(k) if isinstance(p.rep[k], Owned) else k for k in outs]
    if hooks is not None:
        hooks.finish(p)
    return p.finish(ins, outs), natural, p
