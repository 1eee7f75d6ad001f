"""Which device owns which instance of the owner groups (owners.py): the groups that run
together are placed jointly, longest-processing-time first by each instance's estimated FLOPs.

An instance is one matrix (or one layer of a stacked one) of a group. Instances are placed,
largest first, on the least-loaded device, or on a device that keeps the group within ⌈M/N⌉
instances per device where that leaves the busiest device no busier: a group's exchange
buffers stay as small as without balancing when that costs nothing. A model whose
embedding and head are matrices of shapes no other leaf has (groups of one) then runs them on
two devices while the others take more of the hidden matrices, instead of every device
running each group's ⌈M/N⌉ = 1 slot.

The step is one program for every device: the slots that every device fills run
unconditionally, the rest (each device's extra instances) in one `lax.switch` over the
distinct per-device profiles, so each device computes only its own instances and the compiled
per-device cost is the busiest device's load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from jax.extend import core as jcore


@dataclass(frozen=True)
class Placement:
    """One group's instances on the N devices: `slots[d]` the instances device d owns, in its
    slot order (instance j of a group: member j // L, layer j % L of a stacked one)."""

    slots: tuple[tuple[int, ...], ...]
    flops: float = 0.0  # estimated per instance

    @property
    def instances(self) -> int:
        return sum(len(s) for s in self.slots)

    @property
    def per_owner(self) -> int:
        """c: the slots of the exchange buffers (the most instances a device owns)."""
        return max(len(s) for s in self.slots)

    @property
    def common(self) -> int:
        """The slots every device fills (run without a condition)."""
        return min(len(s) for s in self.slots)

    def extra(self, d: int) -> int:
        return len(self.slots[d]) - self.common

    def table(self, pad: int) -> np.ndarray:
        """[N, c]: the instance in each device's slot, `pad` where the slot is empty."""
        c = self.per_owner
        return np.array([list(s) + [pad] * (c - len(s)) for s in self.slots], np.int32)

    def where(self) -> np.ndarray:
        """[M]: the position d·c + t of each instance in the devices' slots."""
        c, out = self.per_owner, np.zeros(self.instances, np.int32)
        for d, s in enumerate(self.slots):
            for t, j in enumerate(s):
                out[j] = d * c + t
        return out

    def joined(self, m: int) -> Placement:
        """The placement over N/m devices whose device d owns devices d·m .. d·m + m - 1's
        instances, in that order (a data index and its model group)."""
        n = len(self.slots) // m
        return Placement(tuple(sum(self.slots[d * m:(d + 1) * m], ()) for d in range(n)),
                         self.flops)

    @property
    def in_order(self) -> bool:
        """Whether instance j sits at position j (the slots are filled in instance order)."""
        return bool(np.all(self.where() == np.arange(self.instances)))


def place(groups: list[tuple[int, float]], shards: int) -> list[Placement]:
    """The placements of groups that run together: (instances M, estimated FLOPs of one)."""
    load = [0.0] * shards
    counts = [[0] * shards for _ in groups]
    order = sorted(((w, -g, j) for g, (m, w) in enumerate(groups) for j in range(m)),
                   reverse=True)  # largest first; a group's instances together, in order
    for w, g, _ in order:
        g = -g
        n, cap = counts[g], -(-groups[g][0] // shards)
        best = min(range(shards), key=lambda d: (load[d], n[d]))
        fair = min((d for d in range(shards) if n[d] < cap), key=lambda d: load[d])
        if load[fair] + w <= max(max(load), load[best] + w):
            best = fair  # no busier than the least-loaded choice, and no extra slot
        n[best] += 1
        load[best] += w
    out = []
    for (m, w), n in zip(groups, counts):
        ids = iter(range(m))
        out.append(Placement(tuple(tuple(next(ids) for _ in range(k)) for k in n), w))
    return out


def loads(placements: list[Placement], shards: int) -> list[float]:
    """Estimated FLOPs of each device's instances."""
    return [sum(len(p.slots[d]) * p.flops for p in placements) for d in range(shards)]


# ---------------------------------------------------------------------------------------------
# FLOPs of recorded primitives


def flops(eqns) -> float:
    """Estimated FLOPs of (primitive, params, input avals, output avals): a dot_general's
    multiply-adds twice, an element per output element of anything else, loops by their trip
    count (a while loop's body once), a cond by its costliest branch."""
    total = 0.0
    for prim, params, ins, outs in eqns:
        name = prim.name
        if name == "dot_general":
            (lc, _), _ = params["dimension_numbers"]
            total += 2 * math.prod(outs[0].shape) * math.prod(ins[0].shape[d] for d in lc)
        elif name == "scan":
            total += params["length"] * _jaxpr(params["jaxpr"])
        elif name == "cond":
            total += max(_jaxpr(b) for b in params["branches"])
        else:
            subs = [v for v in params.values() if isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr))]
            total += sum(map(_jaxpr, subs)) if subs else \
                sum(math.prod(getattr(o, "shape", ())) for o in outs)
    return float(total)


def _jaxpr(j) -> float:
    j = j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j
    return flops((e.primitive, e.params, [v.aval for v in e.invars],
                  [v.aval for v in e.outvars]) for e in j.eqns)
