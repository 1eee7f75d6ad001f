"""Programs of the update: local ops and collectives, scheduled in rounds (each round's
collectives fused into one per kind and dtype), and how they run inside the step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zerojax.collectives import vary

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


def schedule(ops: list[Op], inputs, outputs, consts, axis: str, shards: int) -> Program:
    """`ops` (any order their inputs allow) as a Program of rounds: the local work that needs
    no further collective, then every collective that work feeds, fused."""
    ops = _live(_topological(ops), outputs)
    rnd: dict[int, int] = {}
    staged: dict[int, tuple[list, list]] = {}
    for op in ops:
        r = max((rnd.get(k, 0) for k in op.ins), default=0)
        for k in op.outs:
            rnd[k] = r + 1 if op.kind in COMMS else r
        staged.setdefault(r, ([], []))[op.kind in COMMS].append(op)
    rounds = [staged.get(r, ([], [])) for r in range(max(staged, default=-1) + 1)]
    return Program(list(inputs), list(outputs), dict(consts), rounds, axis, shards)
