"""A wave of owner groups as ops: the exchange in, each device's instances, the exchange out.

A group (owners.py) is M instances of one region; placement.py says which device owns which.
Per group and flat input, a send buffer [N, c·m] (row s: this device's part of owner s's c
slots) goes out in one all_to_all per dtype for the whole wave. Every device then runs, in one
local op, the slots that all devices fill, batched (jax.vmap, or a stacked region with its
layer axis resized), and its own further instances in one `lax.switch` over the devices'
profiles; the results go back into the flat layout by an all_to_all per export (all in one
round, so the scheduler fuses them into one per dtype), or, for a small whole value, by a psum
of each owner's share.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from zerojax.collectives.pieces import model_map
from zerojax.mesh import MODEL
from zerojax.update.evaluate import run, vary_all_to
from zerojax.update.placement import Placement
from zerojax.update.program import Op, vary_all
from zerojax.update.reps import WHOLE, Flat, from_pieces, to_pieces


class Group:
    """What one owner group computes: its members (regions of equal signature), the keys each
    reads and exports, and how one instance runs."""

    def __init__(self, p, members, layered: bool):
        self.members, self.layered = members, layered
        first = members[0]
        self.L = p.rep[first.flat_in[0]].phys.lead if layered else None
        self.per = self.L if layered else 1  # instances per member
        self.M = len(members) * self.per
        self.ins0 = first.inputs()
        self.flat_pos = [i for i, k in enumerate(self.ins0) if k in first.flat_in]
        self.entries = first.recorded()
        self.out_keys = [k for k, _, _ in first.exports]
        self.exports = [want for _, want, _ in first.exports]
        self.consts = p.consts

    def keys_at(self, i: int) -> list[int]:
        """Each member's input at position i."""
        return [m.inputs()[i] for m in self.members]

    def targets(self, e: int) -> list[int]:
        """Each member's key of export e."""
        return [m.exports[e][2] for m in self.members]

    def run(self, args, axes, n: int) -> tuple:
        """The region over `n` instances: `args` by input position, `axes` 0 where an argument
        holds one value per instance (None: shared)."""
        if self.layered:
            env = dict(zip(self.ins0, args))
            run(self.entries, env, self.consts, dict(zip(self.ins0, axes)), self.L, n)
            return tuple(env[k] for k in self.out_keys)

        def one(*a):
            env = dict(zip(self.ins0, a))
            run(self.entries, env, self.consts)
            return tuple(env[k] for k in self.out_keys)

        return tuple(jax.vmap(one, in_axes=list(axes))(*args))


def emit(p, wave: list[Group], placements: list[Placement],
         by_device: list[Placement] | None = None) -> None:
    """The ops of `wave` (groups that read none of each other's results) on `p`, each group's
    instances where `placements` put them (over the data axis). With a model axis of M,
    `by_device` places them over the D·M devices (device d·M + j: data index d, model index
    j), `placements` being their union per data index."""
    ins = [_exchange_in(p, g, pl) for g, pl in zip(wave, placements)]
    # One exchange in per dtype for the whole wave: a group whose region starts earlier (an
    # embedding transposed before its normalization) waits for the others' inputs.
    got = iter(_all_to_all(p, [k for a in ins for k, _, un in a if un is not None]))
    args = [[(k, ax) if un is None else (p.local(un[0], [next(got)], [un[1]], [WHOLE])[0], ax)
             for k, ax, un in a] for a in ins]
    results = _work(p, wave, placements, args) if by_device is None else \
        _work_shared(p, wave, placements, by_device, args)
    for g, pl, res in zip(wave, placements, results):
        _exchange_out(p, g, pl, res)


def _all_to_all(p, sends: list[int]) -> list[int]:
    """Each `[N, m_i]` send buffer (row s to device s) exchanged: one all_to_all per dtype."""
    by_dtype: dict = {}
    for i, k in enumerate(sends):
        by_dtype.setdefault(jnp.dtype(p.aval[k].dtype), []).append(i)
    out = [None] * len(sends)
    for dtype, idx in by_dtype.items():
        keys = [sends[i] for i in idx]
        widths = [p.aval[k].shape[1] for k in keys]
        one = keys[0] if len(keys) == 1 else p.local(
            lambda *xs: (jnp.concatenate(vary_all(xs), axis=1),), keys,
            [jax.ShapeDtypeStruct((p.shards, sum(widths)), dtype)], [WHOLE])[0]
        recv = p.comm("all_to_all", one, p.aval[one], WHOLE)
        parts = [recv] if len(keys) == 1 else p.local(
            lambda x, widths=widths: tuple(jnp.split(x, np.cumsum(widths)[:-1], axis=1)),
            [recv], [p.aval[k] for k in keys], [WHOLE] * len(keys))
        for i, k in zip(idx, parts):
            out[i] = k
    return out


def _exchange_in(p, g: Group, pl: Placement) -> list[tuple]:
    """Per input position: (key, its instance axis: 0 or None, None) for a value at hand (a
    shared one, or this device's whole values per slot); (send buffer, 0, (unpack, aval)) for
    a flat input, whose exchange emit() makes."""
    c = pl.per_owner
    out = []
    for i, k0 in enumerate(g.ins0):
        keys = g.keys_at(i)
        if i in g.flat_pos:
            out.append(_send(p, g, pl, keys))
        elif g.layered or all(k == k0 for k in keys) or all(k in p.consts for k in keys):
            out.append((k0, None, None))
        else:  # one whole value per instance: this device's (empty slots: instance 0's)
            tbl = pl.table(0)

            def mine(d, *xs, tbl=tbl):
                return (jnp.take(jnp.stack(xs), jnp.asarray(tbl)[d], axis=0),)

            aval = p.aval[k0]
            out.append((p.local(mine, [p.device(), *keys],
                                [jax.ShapeDtypeStruct((c, *aval.shape), aval.dtype)],
                                [WHOLE])[0], 0, None))
    return out


def _send(p, g: Group, pl: Placement, keys) -> tuple:
    """One flat input: (this device's send buffer [N, c·m], 0, (unpack: the received buffer
    -> every slot of this owner whole [c, *shape], its aval))."""
    N, M, c, per = p.shards, g.M, pl.per_owner, g.per
    rep, dtype = p.rep[keys[0]], p.aval[keys[0]].dtype
    phys = rep.phys
    # one instance's elements here (a layer of a stack: its [M?, k])
    m = math.prod(phys.local_shape) // (phys.lead if g.layered else 1)

    def pack(*xs):
        rows = jnp.concatenate([x.reshape(per, m) for x in xs])  # [M, m]
        if pl.in_order:
            rows = jnp.pad(rows, [(0, N * c - M), (0, 0)])
        else:  # row M: zeros for the empty slots
            rows = jnp.pad(rows, [(0, 1), (0, 0)])[pl.table(M).reshape(-1)]
        return (rows.reshape(N, c * m),)  # row s: what owner s gets from this device

    send = p.local(pack, keys, [jax.ShapeDtypeStruct((N, c * m), dtype)], [WHOLE])[0]
    shape = rep.shape[1:] if g.layered else rep.shape

    def unpack(x):
        # [N, c, (L,) (M,) k]: device s's part of each of this owner's c slots
        lead = () if g.layered or phys.lead is None else (phys.lead,)
        x = x.reshape(N, c, *lead, *phys.mid, phys.k)
        x = jnp.moveaxis(x, 0, -2).reshape(c, *lead, *phys.mid, N * phys.k)[..., :phys.piece]
        return (from_pieces(x, phys).reshape(c, *shape),)

    return send, 0, (unpack, jax.ShapeDtypeStruct((c, *shape), dtype))


class _Slots:
    """The wave's arguments as one local op reads them, and the region of a group over a range
    of this owner's slots."""

    def __init__(self, p, wave, args):
        self.p, self.wave, self.args = p, wave, args
        self.spans, self.keys = [], []
        for a in args:
            self.spans.append((len(self.keys), len(a)))
            self.keys += [k for k, _ in a]

    def by_group(self, vals):
        return [vals[s:s + n] for s, n in self.spans]

    def unit(self, g, e):  # an export's value for one instance
        shape = tuple(self.p.aval[g.out_keys[e]].shape)
        return shape[1:] if g.layered else shape

    def run(self, g, a, vals, lo, hi):
        """The region over slots lo..hi-1: outputs [hi - lo, ...]."""
        if hi == lo:
            return tuple(vary_all_to([jnp.zeros((0, *self.unit(g, e)), self.p.aval[k].dtype)
                                      for e, k in enumerate(g.out_keys)], vals))
        sliced = [v if ax is None else v[lo:hi] for v, (_, ax) in zip(vals, a)]
        return g.run(sliced, [ax for _, ax in a], hi - lo)

    def results(self, flat):
        out, i = [], 0
        for g in self.wave:
            out.append(flat[i:i + len(g.out_keys)])
            i += len(g.out_keys)
        return out


def _work(p, wave, placements, args) -> list[list[int]]:
    """One local op: every group's common slots, then this device's further instances (a
    switch over the distinct per-device profiles). Per group, its exports' keys [c, ...]."""
    N = p.shards
    profile = [tuple(pl.extra(d) for pl in placements) for d in range(N)]
    profiles = sorted(set(profile))
    which = np.array([profiles.index(q) for q in profile], np.int32)
    tops = [max(q[i] for q in profiles) for i in range(len(wave))]  # extra slots per group
    w = _Slots(p, wave, args)
    spans, unit, slots = w.spans, w.unit, w.run

    def fn(d, *vals):
        per_group = [vals[s:s + n] for s, n in spans]
        common = [slots(g, a, v, 0, pl.common)
                  for g, a, v, pl in zip(wave, args, per_group, placements)]
        if len(profiles) == 1:
            return tuple(x for outs in common for x in outs)

        def branch(q):
            def b(*vals):
                per_group = [vals[s:s + n] for s, n in spans]
                outs = []
                for g, a, v, pl, e, top in zip(wave, args, per_group, placements, q, tops):
                    for x in slots(g, a, v, pl.common, pl.common + e):
                        outs.append(jnp.pad(x, [(0, top - e)] + [(0, 0)] * (x.ndim - 1)))
                return tuple(vary_all_to(outs, vals))
            return b

        extra = iter(lax.switch(jnp.asarray(which)[d], [branch(q) for q in profiles], *vals))
        out = []
        for outs, pl in zip(common, placements):
            for x in outs:  # the common slots, then this device's further ones
                out.append(jnp.concatenate(vary_all([x, next(extra)]))[:pl.per_owner])
        return tuple(out)

    res_avals = [jax.ShapeDtypeStruct((pl.per_owner, *unit(g, e)), p.aval[k].dtype)
                 for g, pl in zip(wave, placements) for e, k in enumerate(g.out_keys)]
    return w.results(p.local(fn, [p.device(), *w.keys], res_avals, [WHOLE] * len(res_avals)))


def _work_shared(p, wave, placements, by_device, args) -> list[list[int]]:
    """`_work` on a mesh with a model axis: each of the D·M devices runs its own instances
    (`by_device`, one switch over the distinct per-device profiles), manual over "model", and
    one all_gather over "model" per export joins a data index's instances in its slot order.
    Manual, because the devices of one data index take different branches: no collective over
    "model" that the compiler would insert may sit inside a branch."""
    m = len(by_device[0].slots) // p.shards
    # device v = d·M + j runs slots [start, start + count) of data index d's slot list
    starts = [[sum(len(pl.slots[v - v % m + i]) for i in range(v % m)) for v in
               range(len(pl.slots))] for pl in by_device]
    profile = [tuple((st[v], len(pl.slots[v])) for st, pl in zip(starts, by_device))
               for v in range(len(by_device[0].slots))]
    profiles = sorted(set(profile))
    which = np.array([profiles.index(q) for q in profile], np.int32)
    cv = [max(len(s) for s in pl.slots) for pl in by_device]  # rows per device and group
    # data index d's slot t: row j·cv + (t - start) of the gathered [M·cv] rows
    tables = [np.array([[j * c + t for j in range(m) for t in range(len(pl.slots[d * m + j]))]
                        + [0] * (dpl.per_owner - len(dpl.slots[d])) for d in range(p.shards)],
                       np.int32) for pl, dpl, c in zip(by_device, placements, cv)]
    w = _Slots(p, wave, args)

    def fn(d, *vals):
        def branch(q):
            def b(*vals):
                outs = []
                for g, a, v, (start, count), c in zip(wave, args, w.by_group(vals), q, cv):
                    for x in w.run(g, a, v, start, start + count):
                        outs.append(jnp.pad(x, [(0, c - count)] + [(0, 0)] * (x.ndim - 1)))
                return tuple(vary_all_to(outs, vals))
            return b

        me = d * m + lax.axis_index(MODEL)
        mine = iter(lax.switch(jnp.asarray(which)[me], [branch(q) for q in profiles], *vals))
        out = []
        for g, tbl in zip(wave, tables):
            for _ in g.out_keys:
                rows = lax.all_gather(next(mine), MODEL, axis=0, tiled=True, to="invarying")
                out.append(jnp.take(rows, jnp.asarray(tbl)[d], axis=0))
        return tuple(out)

    res_avals = [jax.ShapeDtypeStruct((pl.per_owner, *w.unit(g, e)), p.aval[k].dtype)
                 for g, pl in zip(wave, placements) for e, k in enumerate(g.out_keys)]
    run = lambda *vals: model_map(fn, tuple(P() for _ in vals), tuple(P() for _ in res_avals),
                                  differentiated=False)(*vals)
    return w.results(p.local(run, [p.device(), *w.keys], res_avals, [WHOLE] * len(res_avals)))


def _exchange_out(p, g: Group, pl: Placement, results: list[int]) -> None:
    """Per export: the owners' results back into the flat layout (one all_to_all), or a small
    whole value summed from the owners (each slot is one owner's)."""
    N, M, c, per = p.shards, g.M, pl.per_owner, g.per
    for e, want in enumerate(g.exports):
        targets, res = g.targets(e), results[e]
        if isinstance(want, Flat):
            phys = want.phys
            lead = () if g.layered or phys.lead is None else (phys.lead,)
            m = phys.k * math.prod(lead) * phys.pieces

            def pack_out(x, phys=phys, lead=lead):
                x = to_pieces(x.reshape(c, *lead, phys.unit), phys)  # [c, (L,) (M,) U/M]
                pad = phys.k * N - phys.piece
                x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x
                x = x.reshape(c, *lead, *phys.mid, N, phys.k)
                return (jnp.moveaxis(x, -2, 0).reshape(N, -1),)

            send = p.local(pack_out, [res], [jax.ShapeDtypeStruct((N, c * m),
                                                                 p.aval[res].dtype)],
                           [WHOLE])[0]
            recv = p.comm("all_to_all", send, p.aval[send], WHOLE)

            def split(x, phys=phys, m=m):
                x = x.reshape(N * c, m)
                x = x[:M] if pl.in_order else x[pl.where()]  # instance order
                return tuple(x[j * per:(j + 1) * per].reshape(phys.local_shape)
                             for j in range(len(g.members)))

            p.ops.append(Op("local", split, (recv,), tuple(targets)))
        else:
            shape = tuple(p.aval[targets[0]].shape)
            unit = shape[1:] if g.layered else shape
            tbl = pl.table(M)

            def spread(d, x, unit=unit, tbl=tbl):
                full = jnp.zeros((M + 1, *unit), x.dtype)  # row M: the empty slots
                return (full.at[jnp.asarray(tbl)[d]].set(x)[:M],)

            full = p.local(spread, [p.device(), res],
                           [jax.ShapeDtypeStruct((M, *unit), p.aval[res].dtype)], [WHOLE])[0]
            summed = p.comm("psum", full, p.aval[full], WHOLE)

            def split_whole(x, shape=shape):
                return tuple(x[j * per:(j + 1) * per].reshape(shape)
                             for j in range(len(g.members)))

            p.ops.append(Op("local", split_whole, (summed,), tuple(targets)))
