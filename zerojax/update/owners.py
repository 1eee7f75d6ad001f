"""Whole-matrix optimizer work on owner devices: Muon's Newton–Schulz without replication.

When the optimizer's update needs a whole tensor (a matmul, a transpose: work that no local
rule in interpret.py does on a flat shard), the work that follows from it forms an owner
region: a subgraph computed on one device from the full values of its flat inputs. Regions
that compute the same thing on values of the same shapes (one per matrix of a model: Muon's
orthogonalization of each leaf) form a group whose M instances are spread over the N devices
of the data axis, ⌈M/N⌉ per device:

  in:   one all_to_all: each device sends every owner its part of the owner's matrices;
  work: each owner runs the region batched over its ⌈M/N⌉ matrices (jax.vmap);
  out:  one all_to_all back into the flat layout (or a sum from the owners for a small
        whole value that the rest of the update reads).

A stacked leaf ([L, ...], a scanned stack) whose region treats each layer on its own (checked
by evaluating the region with the layer axis resized) contributes one instance per layer, so
the layers of a stack spread over the devices too. The Newton–Schulz FLOPs per device are
about total/N, and no device holds more than ⌈M/N⌉ full matrices at once.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from zerojax.update.evaluate import NotSeparable, run
from zerojax.update.interpret import Planner
from zerojax.update.program import Op
from zerojax.update.reps import WHOLE, Bcast, Flat, Owned, Partial


@dataclass
class Region:
    rid: int
    entries: list = field(default_factory=list)  # (seq, primitive, params, in keys, out keys)
    flat_in: list[int] = field(default_factory=list)  # Flat keys it assembles on the owner
    exports: list[tuple[int, object, int]] = field(default_factory=list)  # (owned, rep, key)


class Owners:
    """The planner's hooks (interpret.Planner.hooks) that form and emit owner regions."""

    def __init__(self):
        self.regions: dict[int, Region] = {}
        self.parent: dict[int, int] = {}
        self.cache: dict[tuple, int] = {}
        self.seq = itertools.count()
        self.groups: list[tuple[int, int, bool]] = []  # (instances, per device, by layer)

    # ---------------------------------------------------------------- regions

    def find(self, r: int) -> int:
        while self.parent.get(r, r) != r:
            r = self.parent[r]
        return r

    def _new(self) -> Region:
        rid = len(self.parent)
        self.parent[rid] = rid
        self.regions[rid] = Region(rid)
        return self.regions[rid]

    def _depends(self, p: Planner, key: int, rid: int, seen=None) -> bool:
        """Whether `key` is computed from an export of region `rid`."""
        seen = set() if seen is None else seen
        for r in {self.find(r) for r in p.deps.get(key, ())}:
            if r == rid:
                return True
            if r in seen:
                continue
            seen.add(r)
            region = self.regions[r]
            ins = region.flat_in + [k for e in region.entries for k in e[3]]
            if any(self._depends(p, k, rid, seen) for k in ins if k not in self._owned_keys(r)):
                return True
        return False

    def _owned_keys(self, rid):
        return {k for e in self.regions[rid].entries for k in e[4]}

    def _record(self, p: Planner, region: Region, eqn, ins):
        outs = [p.new(v.aval, Owned(region.rid)) for v in eqn.outvars]
        region.entries.append((next(self.seq), eqn.primitive, eqn.params, tuple(ins),
                               tuple(outs)))
        return outs

    def _settle(self, p: Planner, ins):
        """Region inputs: Partial and Bcast values made whole (Owned and Flat kept)."""
        return [p.whole(k) if isinstance(p.rep[k], (Partial, Bcast)) else k for k in ins]

    # ---------------------------------------------------------------- planner hooks

    def assemble(self, p: Planner, eqn, ins):
        """`eqn` needs whole Flat operands: start a region that computes it on the owner."""
        if any(isinstance(p.rep[k], Owned) for k in ins):
            return None
        ins = self._settle(p, ins)
        region = self._new()
        region.flat_in += [k for k in ins if isinstance(p.rep[k], Flat)
                           and k not in region.flat_in]
        return self._record(p, region, eqn, ins)

    def owned(self, p: Planner, eqn, ins):
        """`eqn` reads owned values: (outputs, None) when it joins their region, else (None,
        operands converted so that the planner's rules can take it)."""
        ins = self._settle(p, ins)
        rids = sorted({self.find(p.rep[k].region) for k in ins if isinstance(p.rep[k], Owned)})
        others = [k for k in ins if not isinstance(p.rep[k], Owned)]
        flats = [p.rep[k] for k in others if isinstance(p.rep[k], Flat)]
        cyclic = any(self._depends(p, k, r) for k in others for r in rids)
        if not flats and not cyclic and self._can_merge(p, rids):
            region = self._merge(rids)
            return self._record(p, region, eqn, ins), None
        # Leave the region: owned operands go back to the flat layout (or whole).
        conv = []
        for k in ins:
            if not isinstance(p.rep[k], Owned):
                conv.append(k)
                continue
            want = next((Flat(f.phys, tuple(p.aval[k].shape)) for f in flats
                         if f.phys.size == math.prod(p.aval[k].shape)), None)
            if want is None:  # an export to the flat layout that is made anyway
                want = next((r for (kk, r) in self.cache if kk == k and isinstance(r, Flat)),
                            None)
            conv.append(p.whole(k) if want is None else p.convert(k, want))
        return None, conv

    def _can_merge(self, p, rids) -> bool:
        return all(not self._region_depends(p, a, b) for a in rids for b in rids if a != b)

    def _region_depends(self, p, a, b) -> bool:
        region = self.regions[a]
        ins = region.flat_in + [k for e in region.entries for k in e[3]]
        own = self._owned_keys(a)
        return any(self._depends(p, k, b) for k in ins if k not in own)

    def _merge(self, rids) -> Region:
        root = self.regions[rids[0]]
        for r in rids[1:]:
            other = self.regions.pop(r)
            self.parent[r] = root.rid
            root.entries = sorted(root.entries + other.entries, key=lambda e: e[0])
            root.flat_in += [k for k in other.flat_in if k not in root.flat_in]
            root.exports += other.exports
        return root

    def export(self, p: Planner, k: int, want) -> int:
        """The key of owned `k` in rep `want` (Flat or WHOLE), made when the group is emitted."""
        want = WHOLE if not isinstance(want, Flat) else want
        if (k, want) not in self.cache:
            region = self.regions[self.find(p.rep[k].region)]
            out = p.new(p.aval[k], want)
            p.deps[out] = frozenset({region.rid})
            region.exports.append((k, want, out))
            self.cache[(k, want)] = out
        return self.cache[(k, want)]

    # ---------------------------------------------------------------- grouping and emission

    def finish(self, p: Planner) -> None:
        live = [r for rid, r in self.regions.items() if self.find(rid) == rid and r.exports]
        groups: dict[tuple, list[list[Region]]] = {}
        for region in live:
            layered = self._layered(p, region)
            sig = (layered, self._signature(p, region, layered))
            bins = groups.setdefault(sig, [])
            for members in bins:  # regions of one group must not read each other's results
                if not any(self._region_depends(p, region.rid, m.rid) or
                           self._region_depends(p, m.rid, region.rid) for m in members):
                    members.append(region)
                    break
            else:
                bins.append([region])
        for (layered, _), bins in groups.items():
            for members in bins:
                _emit(p, members, layered, self)

    def _signature(self, p: Planner, region: Region, layered: bool):
        """What the region computes, independent of which leaf it computes it for."""
        local: dict[int, tuple] = {}
        wholes: list[int] = []
        sig = []

        def ref(k):
            if k in local:
                return local[k]
            if k in region.flat_in:
                rep = p.rep[k]
                return ("flat", region.flat_in.index(k), rep.shape, rep.phys.lead,
                        str(p.aval[k].dtype))
            if k in p.consts:
                v = np.asarray(p.consts[k]) if not _extended(p.aval[k]) else None
                return ("const", None if v is None else (v.dtype.str, v.shape, v.tobytes()))
            if k not in wholes:
                wholes.append(k)
            # Layer-split groups share their whole operands; others batch them per instance.
            return ("whole", k if layered else wholes.index(k), tuple(p.aval[k].shape),
                    str(p.aval[k].dtype))

        for _, prim, params, ins, outs in region.entries:
            sig.append((prim.name, _params_key(params), tuple(ref(k) for k in ins),
                        tuple((tuple(p.aval[k].shape), str(p.aval[k].dtype)) for k in outs)))
            for i, k in enumerate(outs):
                local[k] = ("v", len(local), i)
        sig.append(tuple((ref(k), type(r).__name__, getattr(r, "shape", None))
                         for k, r, _ in region.exports))
        return tuple(sig)

    def _layered(self, p: Planner, region: Region) -> bool:
        """Whether each layer of the region's stacked inputs can be its own instance."""
        reps = [p.rep[k] for k in region.flat_in]
        if not reps or not all(r.phys.lead is not None and r.shape[:1] == (r.phys.lead,)
                               for r in reps):
            return False
        L = reps[0].phys.lead
        if any(r.phys.lead != L for r in reps):
            return False
        if any(isinstance(r, Flat) and r.shape[:1] != (L,) for _, r, _ in region.exports):
            return False
        env, axes = {}, {}
        for k in _inputs(region):
            aval = p.aval[k]
            if k in region.flat_in:
                env[k] = jax.ShapeDtypeStruct((1, *aval.shape[1:]), aval.dtype)
                axes[k] = 0
            else:
                env[k] = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
                axes[k] = None
        try:
            out_axes = {}

            def trial(*vals):
                e = dict(zip(env, vals))
                a = dict(axes)
                run(_entries(region), e, p.consts, a, L, 1)
                out_axes.update({k: a.get(k) for k, _, _ in region.exports})
                return [e[k] for k, _, _ in region.exports]

            jax.eval_shape(trial, *env.values())
        except NotSeparable:
            return False
        return all(out_axes[k] == 0 for k, _, _ in region.exports)


def _extended(aval) -> bool:
    return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)


def _params_key(params) -> str:
    parts = []
    for name, v in sorted(params.items()):
        if isinstance(v, jcore.ClosedJaxpr):
            h = hashlib.sha1(str(v.jaxpr).encode())
            for c in v.consts:
                h.update(np.asarray(c).tobytes())
            v = h.hexdigest()
        parts.append(f"{name}={v}")
    return ";".join(parts)


def _entries(region: Region):
    return [(prim, params, ins, outs) for _, prim, params, ins, outs in region.entries]


def _inputs(region: Region) -> list[int]:
    """The keys a region reads from outside, in first-use order."""
    made, out = set(), []
    for _, _, _, ins, outs in region.entries:
        out += [k for k in ins if k not in made and k not in out]
        made.update(outs)
    return out


# ---------------------------------------------------------------------------------------------
# Emission: the exchange in, the batched work, the exchange out


def _emit(p: Planner, members: list[Region], layered: bool, owners: Owners) -> None:
    N, axis = p.shards, p.axis
    first = members[0]
    L = p.rep[first.flat_in[0]].phys.lead if layered else None
    per = L if layered else 1  # instances per region
    M = len(members) * per
    c = -(-M // N)  # instances per owner
    owners.groups.append((M, c, layered))
    ins0 = _inputs(first)
    flat_pos = [i for i, k in enumerate(ins0) if k in first.flat_in]
    d_of = lambda: lax.axis_index(axis)

    # -- in: every Flat input, one exchange per position (fused by the scheduler)
    gathered = []
    for i in flat_pos:
        keys = [_inputs(m)[i] for m in members]
        rep, dtype = p.rep[keys[0]], p.aval[keys[0]].dtype
        phys = rep.phys
        m = phys.k if layered else math.prod(phys.local_shape)  # one instance's elements here

        def pack(*xs, m=m):
            rows = jnp.concatenate([x.reshape(per, m) for x in xs])  # [M, m]
            rows = jnp.pad(rows, [(0, N * c - M), (0, 0)])
            return (rows.reshape(N, c * m),)  # row s: what owner s gets from this device

        send = p.local(pack, keys, [jax.ShapeDtypeStruct((N, c * m), dtype)], [WHOLE])[0]
        recv = p.comm("all_to_all", send, p.aval[send], WHOLE)
        shape = rep.shape[1:] if layered else rep.shape

        def unpack(x, phys=phys, shape=shape):
            # [N, c, (L,) k]: device s's part of each of this owner's c instances
            lead = () if layered or phys.lead is None else (phys.lead,)
            x = x.reshape(N, c, *lead, phys.k)
            x = jnp.moveaxis(x, 0, -2).reshape(c, *lead, N * phys.k)[..., :phys.unit]
            return (x.reshape(c, *shape),)

        gathered.append(p.local(unpack, [recv], [jax.ShapeDtypeStruct((c, *shape), dtype)],
                                [WHOLE])[0])

    # -- the other inputs: shared, or this owner's instances of them
    others = []
    for i, k0 in enumerate(ins0):
        if i in flat_pos:
            continue
        keys = [_inputs(m)[i] for m in members]
        if layered or all(k == k0 for k in keys) or all(k in p.consts for k in keys):
            others.append((i, k0, None))
            continue

        def mine(*xs):
            st = jnp.stack(xs)
            st = jnp.concatenate([st, jnp.broadcast_to(st[:1], (N * c - M, *st.shape[1:]))])
            return (lax.dynamic_slice_in_dim(st, d_of() * c, c),)

        aval = p.aval[k0]
        others.append((i, p.local(mine, keys, [jax.ShapeDtypeStruct((c, *aval.shape),
                                                                   aval.dtype)], [WHOLE])[0], 0))

    # -- the work
    entries = _entries(first)
    out_keys = [k for k, _, _ in first.exports]
    consts = p.consts

    def work(*vals):
        g, rest = vals[:len(gathered)], vals[len(gathered):]
        by_pos = dict(zip(flat_pos, g))
        by_pos.update({i: v for (i, _, _), v in zip(others, rest)})
        args = [by_pos[i] for i in range(len(ins0))]
        if layered:
            env = dict(zip(ins0, args))
            axes = {k: (0 if i in flat_pos else None) for i, k in enumerate(ins0)}
            run(entries, env, consts, axes, L, c)
            return tuple(env[k] for k in out_keys)

        def one(*a):
            env = dict(zip(ins0, a))
            run(entries, env, consts)
            return tuple(env[k] for k in out_keys)

        in_axes = [0 if i in flat_pos else next(ax for j, _, ax in others if j == i)
                   for i in range(len(ins0))]
        return jax.vmap(one, in_axes=in_axes)(*args)

    res_avals = []
    for k in out_keys:
        shape = tuple(p.aval[k].shape)
        res_avals.append(jax.ShapeDtypeStruct((c, *(shape[1:] if layered else shape)),
                                              p.aval[k].dtype))
    results = p.local(work, [*gathered, *[k for _, k, _ in others]], res_avals,
                      [WHOLE] * len(out_keys))

    # -- out: per export position, back to the flat layout or summed from the owners
    for e, (_, want, _) in enumerate(first.exports):
        targets = [m.exports[e][2] for m in members]
        res = results[e]
        if isinstance(want, Flat):
            phys = want.phys
            lead = () if layered or phys.lead is None else (phys.lead,)
            m = phys.k * math.prod(lead)

            def pack_out(x, phys=phys, lead=lead, m=m):
                x = x.reshape(c, *lead, phys.unit)
                pad = phys.k * N - phys.unit
                x = jnp.pad(x, [(0, 0)] * (1 + len(lead)) + [(0, pad)]) if pad else x
                x = x.reshape(c, *lead, N, phys.k)
                return (jnp.moveaxis(x, -2, 0).reshape(N, c * m),)

            send = p.local(pack_out, [res], [jax.ShapeDtypeStruct((N, c * m),
                                                                 p.aval[res].dtype)],
                           [WHOLE])[0]
            recv = p.comm("all_to_all", send, p.aval[send], WHOLE)

            def split(x, phys=phys, m=m):
                x = x.reshape(N * c, m)[:M]
                return tuple(x[j * per:(j + 1) * per].reshape(phys.local_shape)
                             for j in range(len(members)))

            p.ops.append(_op(split, [recv], targets))
        else:
            shape = tuple(p.aval[targets[0]].shape)
            unit = shape[1:] if layered else shape

            def spread(x):
                full = jnp.zeros((N * c, *x.shape[1:]), x.dtype)
                return (lax.dynamic_update_slice_in_dim(full, x, d_of() * c, 0),)

            full = p.local(spread, [res], [jax.ShapeDtypeStruct((N * c, *unit),
                                                               p.aval[res].dtype)], [WHOLE])[0]
            summed = p.comm("psum", full, p.aval[full], WHOLE)

            def split_whole(x, shape=shape):
                x = x[:M]
                return tuple(x[j * per:(j + 1) * per].reshape(shape)
                             for j in range(len(members)))

            p.ops.append(_op(split_whole, [summed], targets))


def _op(fn, ins, outs):
    return Op("local", fn, tuple(ins), tuple(outs))
