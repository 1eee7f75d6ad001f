"""A jaxpr over logical arrays, run over flat shards: the machinery behind `update.py`.

A function of logical params (an optax update) is traced once to a jaxpr; `shard_jaxpr` turns
it into a `Program` that computes the same values inside the step's shard_map, where every
param-like value is this device's part of a flattened, zero-padded leaf (partition.py).
Each value of the program has a representation ("rep"):

  Flat(phys, shape)  this device's k elements (or [L, k]) of the padded flat value
  Whole()            the full logical value, the same on every device
  Bcast(shape, dims) the full value is broadcast_in_dim(stored operand, shape, dims)
  Partial()          this device's term of a sum over the data axis

and each primitive a rule: elementwise work on Flat values stays local; a reduction is a
segment reduction of the local elements by their output index (padding excluded) and one
collective (a sum stays Partial through additions and scalings, so a global norm costs one
scalar all-reduce); a broadcast back onto a Flat value is a local index lookup; a reshape of a
Flat value is free (the row-major flat order does not change); everything else (matmuls,
transposes, slices, sorts) assembles its Flat operands (all_gather) and runs whole on every
device. `owners.py` moves whole-matrix work of that kind onto one owner device per matrix.

Collectives are scheduled in rounds: all local work that can run before a collective runs,
then every collective of the round is fused into one per kind and dtype, and so on; so a
chain of per-leaf norms costs one all-reduce, not one per leaf.
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

from zerojax.collectives import vary

# ---------------------------------------------------------------------------------------------
# Layouts and representations


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


# ---------------------------------------------------------------------------------------------
# Ops and programs

COMMS = ("psum", "pmax", "pmin", "gather", "all_to_all")


@dataclass
class Op:
    """`kind` "local" (fn of the inputs, on this device), "sync" (a control-flow op with
    collectives inside) or a collective from COMMS (one input, one output)."""

    kind: str
    fn: Callable | None
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    meta: Any = None  # collectives: their static description (see _run_comms)


@dataclass
class Program:
    """Inputs -> outputs as rounds of local ops and fused collectives."""

    inputs: list[int]
    outputs: list[int]
    consts: dict[int, Any]
    rounds: list[tuple[list[Op], list[Op]]]  # (local and sync ops, collectives)
    axis: str
    shards: int
    whole_ops: list[str] = field(default_factory=list)  # primitives that assembled Flat values

    def __call__(self, *args):
        env = dict(zip(self.inputs, args, strict=True))
        for locals_, comms in self.rounds:
            for op in locals_:
                run_local(op, env, self.consts)
            run_comms(comms, env, self.axis, self.shards)
        return [read(env, self.consts, k) for k in self.outputs]

    @property
    def collectives(self) -> list[Op]:
        return [op for _, comms in self.rounds for op in comms]

    @property
    def syncs(self) -> list[Op]:
        return [op for ops, _ in self.rounds for op in ops if op.kind == "sync"]


def read(env, consts, k):
    return env[k] if k in env else jnp.asarray(consts[k])


def run_local(op: Op, env, consts) -> None:
    outs = op.fn(*[read(env, consts, k) for k in op.ins])
    env.update(zip(op.outs, outs, strict=True))


def run_comms(comms: list[Op], env, axis: str, shards: int) -> None:
    """Every collective of a round: one per kind and dtype, the operands concatenated."""
    groups: dict[tuple, list[Op]] = {}
    for op in comms:
        groups.setdefault((op.kind, jnp.dtype(env[op.ins[0]].dtype)), []).append(op)
    for (kind, _), ops in groups.items():
        xs = [env[op.ins[0]] for op in ops]
        if kind == "all_to_all":
            outs = _fused_all_to_all(xs, axis, shards)
        elif kind == "gather":
            outs = _fused_gather(xs, axis, shards)
        else:
            reduce = {"psum": lax.psum, "pmax": lax.pmax, "pmin": lax.pmin}[kind]
            if len(xs) == 1:
                outs = [reduce(xs[0], axis)]
            else:
                flat = reduce(jnp.concatenate([x.reshape(-1) for x in vary_all(xs)]), axis)
                outs = _split_like(flat, xs)
        for op, y in zip(ops, outs, strict=True):
            env[op.outs[0]] = y


def _split_like(flat, xs):
    sizes = [x.size for x in xs]
    parts = jnp.split(flat, np.cumsum(sizes)[:-1]) if len(xs) > 1 else [flat]
    return [p.reshape(x.shape) for p, x in zip(parts, xs)]


def _fused_gather(xs, axis, shards):
    """Each `[..., k_i]` local part -> the `[..., N·k_i]` whole, in one all_gather."""
    flat = jnp.concatenate([x.reshape(-1) for x in vary_all(xs)]) if len(xs) > 1 \
        else xs[0].reshape(-1)
    g = lax.all_gather(flat, axis, axis=0, tiled=False, to="invarying")  # [N, sum m_i]
    parts = jnp.split(g, np.cumsum([x.size for x in xs])[:-1], axis=1) if len(xs) > 1 else [g]
    out = []
    for p, x in zip(parts, xs):
        p = p.reshape(shards, *x.shape)  # [N, ..., k]
        p = jnp.moveaxis(p, 0, -2)  # [..., N, k]
        out.append(p.reshape(*x.shape[:-1], shards * x.shape[-1]))
    return out


def _fused_all_to_all(xs, axis, shards):
    """Each `[N, m_i]` (row s goes to device s) -> `[N, m_i]` (row s came from device s)."""
    if len(xs) == 1:
        return [lax.all_to_all(xs[0], axis, 0, 0, tiled=True)]
    flat = jnp.concatenate([x.reshape(shards, -1) for x in vary_all(xs)], axis=1)
    y = lax.all_to_all(flat, axis, 0, 0, tiled=True)
    parts = jnp.split(y, np.cumsum([x.shape[1] for x in xs])[:-1], axis=1)
    return [p.reshape(x.shape) for p, x in zip(parts, xs)]


def vary_all(xs):
    """`xs` typed varying over the union of their varying axes (operands of one primitive)."""
    axes = set()
    for x in xs:
        axes |= set(jax.typeof(x).mat.varying)
    return [vary(x, tuple(sorted(axes))) for x in xs]


def bind(prim, params, *xs):
    out = prim.bind(*vary_all(xs) if len(xs) > 1 else xs, **prim.get_bind_params(params))
    return tuple(out) if prim.multiple_results else (out,)


# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# Primitive kinds

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
            return self.comm("psum", k, aval, WHOLE) if self.shards > 1 else self._as(k, WHOLE)
        # Flat: gather the parts, drop the padding.
        g = k
        if self.shards > 1:
            g = self.comm("gather", k, jax.ShapeDtypeStruct(rep.phys.global_shape, aval.dtype),
                          WHOLE)
        return self.local(lambda x: (from_flat(x, rep),), [g], [aval], [WHOLE])[0]

    def _as(self, k, rep, aval=None):
        """`k` under another rep (no data moved): a Flat reshape, a Bcast, a known Whole."""
        aval = self.aval[k] if aval is None else aval
        return self.local(lambda x: (x,), [k], [aval], [rep])[0]

    def flat(self, k: int, want: Flat) -> int:
        """`k` as this device's part in layout `want` (same logical shape)."""
        rep, aval = self.rep[k], self.aval[k]
        if rep == want:
            return k
        if isinstance(rep, Flat) and rep.phys == want.phys:
            return self._as(k, want)  # a reshape: the flat order is the same
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
        if all(isinstance(r, Whole) for r in reps) and name not in CALLS:
            return self.generic(eqn, ins)
        if name in CALLS:
            return self.call(eqn, ins)
        if any(isinstance(r, Owned) for r in reps):
            out, ins = self.hooks.owned(self, eqn, ins)
            if out is not None:
                return out
        rule = RULES.get(name)
        if rule is None and name in ELEMENTWISE:
            rule = Planner.elementwise
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

    # -- rules
    def elementwise(self, eqn, ins):
        prim, params = eqn.primitive, eqn.params
        out_aval = eqn.outvars[0].aval
        out_shape = tuple(out_aval.shape)
        if any(isinstance(self.rep[k], Partial) for k in ins):
            out = self._linear(eqn, ins)
            if out is not None:
                return out
            ins = [self.whole(k) if isinstance(self.rep[k], Partial) else k for k in ins]
        reps = [self.rep[k] for k in ins]
        flats = [r for r in reps if isinstance(r, Flat)]
        run = lambda *xs: bind(prim, params, *xs)
        if flats:
            want = Flat(flats[0].phys, out_shape)
            # Operands of the output's shape (a scalar leaf's too) are taken as their flat
            # parts; a scalar broadcasts as it is; others broadcast their size-1 axes.
            ins = [self.whole(k) if self.aval[k].shape == () != out_shape else
                   self.flat(self._implicit(k, out_shape), want) for k in ins]
            return self.local(run, ins, [out_aval], [want])
        shaped = {reps[i] for i, k in enumerate(ins) if self.aval[k].shape != ()}
        if len(shaped) == 1 and isinstance(b := next(iter(shaped)), Bcast):
            # Every shaped operand is the same broadcast: compute on the stored operands.
            ins = [k if self.aval[k].shape != () else self.whole(k) for k in ins]
            return self.local(run, ins, [out_aval], [b])
        return None

    def _zero(self, k) -> bool:
        v = self.consts.get(k)
        return v is not None and isinstance(v, np.ndarray) and not v.any()

    def _implicit(self, k, shape):
        """`k` seen at `shape`: a binary op's operand may have size-1 axes it broadcasts."""
        own = tuple(self.aval[k].shape)
        if own == shape:
            return k
        aval = jax.ShapeDtypeStruct(shape, self.aval[k].dtype)
        return self._as(self.whole(k), Bcast(shape, tuple(range(len(own))), own), aval)

    def _linear(self, eqn, ins):
        """A sum over devices commutes with + - and with scaling by a whole value."""
        name, reps = eqn.primitive.name, [self.rep[k] for k in ins]
        if name == "add" and any(self._zero(k) for k in ins):  # `sum(...)` starts from 0
            ins = [k for k in ins if not self._zero(k)]
            if len(ins) == 1 and tuple(self.aval[ins[0]].shape) == \
                    tuple(eqn.outvars[0].aval.shape):
                return [self._as(ins[0], PARTIAL, eqn.outvars[0].aval)]
            return None
        partial = [isinstance(r, Partial) for r in reps]
        whole = [isinstance(r, Whole) for r in reps]
        ok = {"all": all(partial),
              "one": sum(partial) == 1 and all(p or w for p, w in zip(partial, whole)),
              "first": partial[0] and all(whole[1:])}.get(LINEAR.get(name, ""), False)
        if name in ("add", "sub") and not all(partial):
            ok = False
        if not ok or self.shards == 1:
            return None
        prim, params = eqn.primitive, eqn.params
        return self.local(lambda *xs: bind(prim, params, *xs), ins,
                          [eqn.outvars[0].aval], [PARTIAL])

    def reduce(self, eqn, ins):
        (k,), name = ins, eqn.primitive.name
        rep, out_aval = self.rep[k], eqn.outvars[0].aval
        axes = tuple(int(a) for a in eqn.params["axes"])
        if isinstance(rep, Partial) and name == "reduce_sum":
            prim, params = eqn.primitive, eqn.params
            return self.local(lambda x: bind(prim, params, x), [k], [out_aval], [PARTIAL])
        if not isinstance(rep, Flat):
            return None
        if self.shards == 1:  # every device holds the whole leaf: reduce it as it is
            prim, params = eqn.primitive, eqn.params
            return self.local(lambda x: bind(prim, params, from_flat(x, rep)), [k],
                              [out_aval], [WHOLE])
        flat, valid = self.index(rep.phys)
        part = self.local(lambda x, f, v: (segment_reduce(x, f, v, rep, axes, name),),
                          [k, flat, valid], [out_aval],
                          [PARTIAL if name == "reduce_sum" else WHOLE])[0]
        if name == "reduce_sum":
            return [part]
        return [self.comm(REDUCTIONS[name], part, out_aval, WHOLE)]

    def dot(self, eqn, ins):
        """A full contraction of two equally laid out values (vdot): a local sum."""
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        a, b = ins
        ra, rb_ = self.rep[a], self.rep[b]
        shape = tuple(self.aval[a].shape)
        n = len(shape)
        full = (tuple(lc) == tuple(rc) == tuple(range(n)) and not lb and not rb
                and tuple(self.aval[b].shape) == shape)
        flat = next((r for r in (ra, rb_) if isinstance(r, Flat)), None)
        if not full or flat is None:
            return None
        want = Flat(flat.phys, shape)
        a, b = self.flat(a, want), self.flat(b, want)
        out_aval, pet = eqn.outvars[0].aval, eqn.params.get("preferred_element_type")
        if self.shards == 1:
            return self.local(lambda x, y: (jnp.sum(x * y, dtype=pet or out_aval.dtype),),
                              [a, b], [out_aval], [WHOLE])

        def local(x, y, *valid):
            xy = x.astype(out_aval.dtype) * y.astype(out_aval.dtype)
            return (jnp.sum(select(valid[0], xy, 0) if valid else xy),)

        valid = [self.index(want.phys)[1]] if want.phys.padded else []
        return self.local(local, [a, b, *valid], [out_aval], [PARTIAL])

    def reshape(self, eqn, ins):
        k = ins[0]
        rep, out_aval = self.rep[k], eqn.outvars[0].aval
        if isinstance(rep, Flat):
            return [self._as(k, Flat(rep.phys, tuple(out_aval.shape)), out_aval)]
        if isinstance(rep, Partial):
            prim, params = eqn.primitive, eqn.params
            return self.local(lambda *xs: bind(prim, params, *xs), ins[:1], [out_aval],
                              [PARTIAL])
        return None

    def broadcast(self, eqn, ins):
        k = ins[0]
        rep, aval, out_aval = self.rep[k], self.aval[k], eqn.outvars[0].aval
        shape, dims = tuple(out_aval.shape), tuple(eqn.params["broadcast_dimensions"])
        if math.prod(aval.shape) == math.prod(shape) and list(dims) == sorted(dims):
            return self.reshape(eqn, ins)  # only size-1 axes added: a reshape
        if isinstance(rep, Whole) and len(ins) == 1:
            return [self._as(k, Bcast(shape, dims, tuple(aval.shape)), out_aval)]
        if isinstance(rep, Bcast):  # a broadcast of a broadcast: compose the dims
            return [self._as(k, Bcast(shape, tuple(dims[d] for d in rep.dims), rep.operand),
                             out_aval)]
        return None

    def cond(self, eqn, ins):
        from zerojax.update.control import plan_cond
        return plan_cond(self, eqn, ins)

    def scan(self, eqn, ins):
        from zerojax.update.control import plan_scan
        return plan_scan(self, eqn, ins)

    def while_(self, eqn, ins):
        from zerojax.update.control import plan_while
        return plan_while(self, eqn, ins)

    # -- the program
    def finish(self, inputs: list[int], outputs: list[int]) -> Program:
        ops = _live(_topological(self.ops), outputs)
        rnd: dict[int, int] = {}
        staged: dict[int, tuple[list, list]] = {}
        for op in ops:
            r = max((rnd.get(k, 0) for k in op.ins), default=0)
            for k in op.outs:
                rnd[k] = r + 1 if op.kind in COMMS else r
            staged.setdefault(r, ([], []))[op.kind in COMMS].append(op)
        rounds = [staged.get(r, ([], [])) for r in range(max(staged, default=-1) + 1)]
        return Program(list(inputs), list(outputs), dict(self.consts), rounds, self.axis,
                       self.shards)


def _topological(ops: list[Op]) -> list[Op]:
    """`ops` in an order where each comes after the ops making its inputs (owner regions are
    emitted after the ops that read them); otherwise in emission order."""
    made = {k: i for i, op in enumerate(ops) for k in op.outs}
    if all(made.get(k, -1) < i for i, op in enumerate(ops) for k in op.ins):
        return ops
    order, done, state = [], set(), {}

    def visit(i):
        stack = [(i, iter(ops[i].ins))]
        state[i] = 1
        while stack:
            j, it = stack[-1]
            nxt = next((made[k] for k in it if k in made and made[k] not in done), None)
            if nxt is None:
                stack.pop()
                done.add(j)
                order.append(ops[j])
            elif state.get(nxt) == 1:
                raise RuntimeError("cycle in the sharded optimizer program")
            else:
                state[nxt] = 1
                stack.append((nxt, iter(ops[nxt].ins)))

    for i in range(len(ops)):
        if i not in done:
            visit(i)
    return order


def _live(ops: list[Op], outputs: list[int]) -> list[Op]:
    """`ops` without those whose outputs nothing reads."""
    need, keep = set(outputs), []
    for op in reversed(ops):
        if any(k in need for k in op.outs):
            keep.append(op)
            need.update(op.ins)
    return keep[::-1]


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


RULES: dict[str, Callable] = {
    **{name: Planner.reduce for name in REDUCTIONS},
    "dot_general": Planner.dot,
    "reshape": Planner.reshape,
    "squeeze": Planner.reshape,
    "expand_dims": Planner.reshape,
    "broadcast_in_dim": Planner.broadcast,
    "cond": Planner.cond,
    "scan": Planner.scan,
    "while": Planner.while_,
}


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
