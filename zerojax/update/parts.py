"""The update as parts that read and write disjoint leaves, each its own program.

The step's update (`step_update`, traced once on logical shapes) is one jaxpr from (gradients,
scalars, optimizer state, master) to (master, optimizer state, compute-dtype shards). Most
optimizers compute each param's new value from that param's own leaves (AdamW, Lion, LAMB's
per-leaf trust ratio, Adafactor's factored moments, Muon's per-matrix Newton-Schulz); a global
norm computed inside the optimizer (`optax.clip_by_global_norm` in the chain) ties every leaf
to every other. `split` finds the finest grouping the jaxpr allows by dead-code elimination:
for each param (and each sharded optimizer-state leaf) the inputs its outputs read; the
replicated state leaves (counts, injected hyperparameters) and the step's scalars are read by
every part and written by one. A part is then the jaxpr with the other parts' outputs dropped,
so it is the same equations and gives the same numbers.

This is the optimizer's own structure (which leaves its computations tie together), so it
lives with the update; ZeRO-Offload runs the parts (offload/host.py, offload/side_by_side.py:
side by side, each from a thread of its own) and chooses Twin-Flow's share of them
(offload/twin_flow.py). An optimizer that ties every leaf to every other, or a model of fewer
than 2 x LEAST params, is one part: the one program.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: no public form in jax 0.10
from jax.extend import core as jcore

PARTS = 8  # the update in about this many parts, by bytes
LEAST = 1 << 24  # params in a part at least (or one group): below, one program costs less


@dataclass(frozen=True)
class Part:
    """A part of the update: its params (indices into the params' leaves), the sharded
    optimizer-state leaves it owns, the replicated ones it writes (indices into the state's
    leaves), and its jaxpr, whose inputs are (the part's gradients, the scalars, every
    replicated state leaf and its own sharded ones in state order, the part's master) and
    outputs (the part's master, its state leaves in state order, the part's shards)."""

    params: tuple[int, ...]
    owned: tuple[int, ...]  # sharded state leaves: read and written by this part only
    writes: tuple[int, ...]  # replicated state leaves this part computes
    closed: jcore.ClosedJaxpr
    inputs: tuple[int, ...]  # into the whole jaxpr's inputs
    outputs: tuple[int, ...]  # into the whole jaxpr's outputs
    on_device: bool = False  # Twin-Flow: updated by the devices, its state in their memory


def split(closed, grouping: Grouping, sizes: list[int], parts: int = PARTS,
          least: int | None = None, device: frozenset[int] = frozenset()) -> list[Part]:
    """`closed`'s update (the jaxpr `grouping` was read from) as at most about `parts` parts
    of similar size (`sizes`: elements per param), each of at least `least` elements (default
    LEAST) or one group of leaves that the update ties together. With `device` (params
    updated on the devices: Twin-Flow), the first part holds exactly those (`on_device`), the
    others the rest; ValueError where a group of leaves the update ties together has some on
    each side."""
    n, s, sharded = grouping.n, grouping.s, grouping.sharded
    m = len(sharded)
    jaxpr = closed.jaxpr
    n_in, n_out = 2 * n + s + m, 2 * n + m
    groups, order, find, writer = grouping.found, grouping.order, grouping.find, grouping.writer
    if not order:
        return []
    mixed = [groups[r] for r in order if 0 < len(set(groups[r]) & device) < len(groups[r])]
    if mixed:
        raise ValueError(f"the update ties params {mixed[0]} together (one computation reads "
                         f"them all), but only some of them are in {sorted(device)}")
    on_device = [r for r in order if groups[r][0] in device]
    hosted = [r for r in order if groups[r][0] not in device]
    runs_ = [[hosted[g] for g in run] for run in runs(
        [sum(sizes[i] for i in groups[r]) for r in hosted], parts,
        LEAST if least is None else least)]
    runs_ = ([on_device] if on_device else []) + runs_
    owner = {r: k for k, run in enumerate(runs_) for r in run}  # group root -> part index
    first_host = 1 if on_device and hosted else 0
    out = []
    for k in range(len(runs_)):
        params = tuple(i for i in range(n) if owner[find(i)] == k)
        owned = tuple(j for j in range(m) if sharded[j] and owner[find(n + j)] == k)
        writes = tuple(j for j in range(m) if not sharded[j] and (
            owner[find(writer[j])] if writer[j] is not None else first_host) == k)
        ins = (*params, *range(n, n + s),
               *(n + s + j for j in range(m) if not sharded[j] or j in owned),
               *(n + s + m + i for i in params))
        outs = (*params, *(n + j for j in sorted((*owned, *writes))),
                *(n + m + i for i in params))
        used = [False] * n_out
        for o in outs:
            used[o] = True
        keep = [False] * n_in
        for i in ins:
            keep[i] = True
        sub, used_in = pe.dce_jaxpr(jaxpr, used, instantiate=keep)
        assert [i for i, u in enumerate(used_in) if u] == list(ins), "a part reads another's"
        out.append(Part(params, owned, writes, jcore.ClosedJaxpr(sub, closed.consts), ins, outs,
                        bool(on_device) and k == 0))
    return out


@dataclass(frozen=True)
class Grouping:
    """The finest groups the update allows: nodes are the params 0..n-1 and the sharded state
    leaves n+j; replicated state leaves and the s scalars are read by every group. `found`:
    the params of each group by its root; `order`: the roots by their first param; `find`: a
    node's root; `writer`: per replicated state leaf, a node of the group that computes it
    (None: any)."""

    n: int
    s: int
    sharded: tuple[bool, ...]
    found: dict
    order: list
    find: Callable[[int], int]
    writer: dict

    @property
    def groups(self) -> list[list[int]]:
        """The params by group, in the order of their first param."""
        return [self.found[r] for r in self.order]

    def owned(self, params: frozenset[int]) -> frozenset[int]:
        """The sharded state leaves of the groups of `params` (whole groups)."""
        roots = {self.find(i) for i in params}
        return frozenset(j for j, sh in enumerate(self.sharded)
                         if sh and self.find(self.n + j) in roots)

    @classmethod
    def of(cls, closed, n: int, s: int, sharded: list[bool]) -> Grouping:
        """`closed`'s grouping: inputs n gradients, s scalars, the state's leaves
        (`sharded[j]`: stored like the params, else replicated), n master leaves; outputs n
        master leaves, the state's leaves, n shards."""
        found, order, find, writer = _grouping(closed, n, s, sharded)
        return cls(n, s, tuple(sharded), found, order, find, writer)


def _grouping(closed, n, s, sharded):
    """(groups of params by root, the roots in order, the root of a node, the node whose group
    computes each replicated state leaf or None): nodes are the params 0..n-1 and the sharded
    state leaves n+j; replicated state leaves and the scalars are read by every group."""
    m = len(sharded)
    jaxpr = closed.jaxpr
    n_in, n_out = 2 * n + s + m, 2 * n + m
    assert len(jaxpr.invars) == n_in and len(jaxpr.outvars) == n_out, (n_in, n_out)

    def node_of_input(i):
        if i < n:
            return i
        if n + s <= i < n + s + m:
            j = i - n - s
            return n + j if sharded[j] else None
        if i >= n + s + m:
            return i - (n + s + m)
        return None

    def reads(outs):
        used = [False] * n_out
        for o in outs:
            used[o] = True
        _, used_in = pe.dce_jaxpr(jaxpr, used)
        return {node_of_input(i) for i, u in enumerate(used_in) if u} - {None}

    parent = list(range(n + m))

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    def union(nodes):
        roots = sorted({find(a) for a in nodes})
        for r in roots[1:]:
            parent[r] = roots[0]
        return roots[0] if roots else None

    for i in range(n):
        union({i, *reads([i, n + m + i])})
    for j in range(m):
        if sharded[j]:
            union({n + j, *reads([n + j])})
    with_params = {find(i) for i in range(n)}
    for j in range(m):  # a sharded leaf that no param reads or writes: with the first group
        if sharded[j] and find(n + j) not in with_params and n:
            union({0, n + j})
    writer = {}  # replicated state leaf -> a node of the group that computes it
    for j in range(m):
        if not sharded[j]:
            writer[j] = union(reads([n + j]))
    found: dict[int, list[int]] = {}
    for a in range(n):
        found.setdefault(find(a), []).append(a)
    order = sorted(found, key=lambda r: found[r][0])
    return found, order, find, writer


def runs(sizes: list[int], parts: int, least: int = 0) -> list[list[int]]:
    """The indices of `sizes` in runs of consecutive ones, each of at most 1/`parts` of their
    sum (or `least`) or a single one larger than that; a run of less than `least` (a bias
    between two large kernels) joins the smaller of its neighbours."""
    budget = max(max(sizes, default=0), sum(sizes) / parts, least)
    out, run, total = [], [], 0
    for i, size in enumerate(sizes):
        if run and total + size > budget:
            out.append(run)
            run, total = [], 0
        run.append(i)
        total += size
    out += [run] if run else []
    size = lambda k: sum(sizes[i] for i in out[k])
    while len(out) > 1 and (small := [k for k in range(len(out)) if size(k) < least]):
        k = small[0]
        j = k - 1 if k == len(out) - 1 or (k > 0 and size(k - 1) <= size(k + 1)) else k + 1
        lo, hi = min(j, k), max(j, k)
        out[lo:hi + 1] = [out[lo] + out[hi]]
    return out
