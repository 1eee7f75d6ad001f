"""Whole-matrix optimizer work on owner devices: Muon's Newton–Schulz without replication.

When the optimizer's update needs a whole tensor (a matmul, a transpose: work that no local
rule in interpret.py does on a flat shard), the work that follows from it forms an owner
region: a subgraph computed on one device from the full values of its flat inputs. Regions
that compute the same thing on values of the same shapes (one per matrix of a model: Muon's
orthogonalization of each leaf) form a group of M instances. Groups that read none of each
other's results run together as a wave, whose instances are spread over the N devices of the
data axis by their estimated FLOPs (placement.py: largest first, on the least-loaded device),
so a group of one (an embedding, a head: shapes no other leaf has) costs one device its work
while the others take more of the rest:

  in:   one all_to_all per dtype: each device sends every owner its part of the owner's
        matrices;
  work: each owner runs the region over its matrices (jax.vmap), the slots every device
        fills unconditionally, its further ones in a switch over the devices' profiles;
  out:  one all_to_all back into the flat layout (or a sum from the owners for a small
        whole value that the rest of the update reads).

A stacked leaf ([L, ...], a scanned stack) whose region treats each layer on its own (checked
by evaluating the region with the layer axis resized) contributes one instance per layer, so
the layers of a stack spread over the devices too. The Newton–Schulz FLOPs per device are
about total/N (the busiest device's share, `ShardedUpdate.report()["owner_flops"]`), and a
device holds at most its own instances' full matrices at once. exchange.py emits a wave.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.extend import core as jcore

from zerojax.update.evaluate import NotSeparable, run
from zerojax.update.exchange import Group, emit
from zerojax.update.interpret import Planner
from zerojax.update.placement import Placement, flops, place
from zerojax.update.reps import WHOLE, Bcast, Flat, Owned, Partial


@dataclass
class Region:
    rid: int
    entries: list = field(default_factory=list)  # (seq, primitive, params, in keys, out keys)
    flat_in: list[int] = field(default_factory=list)  # Flat keys it assembles on the owner
    exports: list[tuple[int, object, int]] = field(default_factory=list)  # (owned, rep, key)

    def recorded(self):
        """The entries as evaluate.run takes them: (primitive, params, in keys, out keys)."""
        return [(prim, params, ins, outs) for _, prim, params, ins, outs in self.entries]

    def inputs(self) -> list[int]:
        """The keys the region reads from outside, in first-use order."""
        made, out = set(), []
        for _, _, _, ins, outs in self.entries:
            out += [k for k in ins if k not in made and k not in out]
            made.update(outs)
        return out


class Owners:
    """The planner's hooks (interpret.Planner.hooks) that form and emit owner regions."""

    def __init__(self, model: int = 1):
        self.model = model  # M: the devices of a model group share their owner's instances
        self.regions: dict[int, Region] = {}
        self.parent: dict[int, int] = {}
        self.cache: dict[tuple, int] = {}
        self.seq = itertools.count()
        self.groups: list[tuple[int, Placement, bool]] = []  # (wave, placement, by layer)

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
        made = [Group(p, members, layered) for (layered, _), bins in groups.items()
                for members in bins]
        for w, wave in enumerate(self._waves(p, made)):
            costs = [(g.M, self._flops(p, g)) for g in wave]
            if self.model == 1:
                placements, by_device = place(costs, p.shards), None
            else:  # over the D·M devices; a data index owns its model group's instances
                by_device = place(costs, p.shards * self.model)
                placements = [pl.joined(self.model) for pl in by_device]
            self.groups += [(w, pl, g.layered) for g, pl in zip(wave, by_device or placements)]
            emit(p, wave, placements, by_device)

    def _waves(self, p: Planner, groups: list[Group]) -> list[list[Group]]:
        """`groups` in waves, in the order they can run: a wave's groups read none of each
        other's results, so its exchanges fuse and its instances are placed together."""
        of = {m.rid: i for i, g in enumerate(groups) for m in g.members}
        ups: dict[int, set[int]] = {}

        def upstream(rid):  # the regions whose results `rid` reads, through any others
            if rid not in ups:
                region = self.regions[rid]
                own = self._owned_keys(rid)
                direct = {self.find(r) for k in region.flat_in + region.inputs()
                          if k not in own for r in p.deps.get(k, ())} - {rid}
                ups[rid] = set(direct)
                for r in direct:
                    ups[rid] |= upstream(r)
            return ups[rid]

        after = [{of[r] for m in g.members for r in upstream(m.rid) if r in of} - {i}
                 for i, g in enumerate(groups)]
        level = [0] * len(groups)
        for _ in range(len(groups)):
            new = [max((level[j] + 1 for j in a), default=0) for a in after]
            if new == level:
                break
            level = new
        else:  # groups that read each other's results both ways: one wave each, as made
            return [[g] for g in groups]
        return [[g for g, lv in zip(groups, level) if lv == w] for w in range(max(level) + 1)]

    def _flops(self, p: Planner, g: Group) -> float:
        """Estimated FLOPs of one instance of `g` (a layer of a stacked region: its share)."""
        region = g.members[0]
        f = flops((prim, params, [p.aval[k] for k in ins], [p.aval[k] for k in outs])
                  for _, prim, params, ins, outs in region.entries)
        return f / g.per

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
        for k in region.inputs():
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
                run(region.recorded(), e, p.consts, a, L, 1)
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


