"""Reading compiled programs: the collectives an HLO module runs, the bytes they send, and the
FLOPs of its matrix products.

Every figure is per device and per execution of the module: each collective is counted as the
bytes one device sends in a ring, each product as its multiply-adds, multiplied by the trip
counts of the loops around it.
"""

from __future__ import annotations

import math
import re

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "other")
_KINDS = {
    "all-gather": "all_gather",
    "all-gather-start": "all_gather",
    "reduce-scatter": "reduce_scatter",
    "all-reduce": "all_reduce",
    "all-reduce-start": "all_reduce",
    "collective-permute": "other",
    "collective-permute-start": "other",
    "all-to-all": "all_to_all",
}
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*(\(.*\)\s*->.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_SHAPE = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([0-9,]*)\]")
_CALLEE = re.compile(r"\b(?:to_apply|calls|body|condition|true_computation|false_computation)"
                     r"=(%?[\w.\-]+)|\b(?:called|branch)_computations=\{([^}]*)\}")


def _dtype_bytes(name: str) -> float:
    if name == "pred":
        return 1
    bits = re.match(r"[a-z]+(\d+)", name)
    return int(bits.group(1)) / 8 if bits else 0


def _split_type(rest: str) -> tuple[str, str]:
    """`type opcode(operands), attrs` -> (type, the rest from the opcode on)."""
    if not rest.startswith("("):
        head, _, tail = rest.partition(" ")
        return head, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[: i + 1], rest[i + 1 :].lstrip()
    return rest, ""


_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?"
                          r"\s*\{([^}]*)\}")


def _groups(attrs: str, devices: int) -> list[list[int]]:
    """The device groups of a collective (explicit lists, the iota form `[G,S]<=[dims]T(perm)`,
    or the named-mesh form `mesh['a'=2,'b'=4], device_ids=(...) {'a'}`: the devices along the
    named axes, read by axis); one group of all devices when none are given."""
    named = _MESH_GROUPS.search(attrs)
    if named:
        return _mesh_groups(*named.groups())
    explicit = re.search(r"replica_groups=\{(\{[^=]*?\})\}", attrs)
    if explicit:
        return [[int(i) for i in g.split(",") if i.strip()]
                for g in re.findall(r"\{([^{}]*)\}", explicit.group(1))]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?",
                     attrs)
    if not iota:
        return [list(range(devices))]
    return _iota(iota.group(3), iota.group(4)).reshape(
        int(iota.group(1)), int(iota.group(2))).tolist()


def _iota(dims: str, perm: str | None):
    """`[dims]T(perm)`: iota over `dims`, transposed by `perm`."""
    import numpy as np

    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    return ids.transpose([int(d) for d in perm.split(",")]) if perm else ids


def _mesh_groups(axes: str, device_ids: str | None, grouped: str) -> list[list[int]]:
    """XLA's `MeshAxesReplicaGroupList`: the mesh's device array (`device_ids` an iota
    `[dims]T(perm)` or a list; row-major ids when absent) with the grouped axes moved last,
    each group one row. A sub-axis `'a':(pre)size` is the middle factor of axis `a` split as
    pre × size × the rest."""
    import numpy as np

    names, sizes = [], []
    for entry in re.findall(r"'?([^,'=]+)'?=(\d+)", axes):
        names.append(entry[0])
        sizes.append(int(entry[1]))
    if device_ids is None:
        ids = np.arange(math.prod(sizes))
    else:
        tiled = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", device_ids)
        ids = _iota(*tiled.groups()) if tiled else np.array(
            [int(i) for i in re.findall(r"\d+", device_ids)])
    refs: dict[int, list[tuple[int, int, int]]] = {}  # mesh dim -> [(pre, size, order)]
    for order, ref in enumerate(re.findall(r"'?([^,':]+)'?(?::\((\d+)\)(\d+))?", grouped)):
        dim = names.index(ref[0].strip())
        full = sizes[dim]
        refs.setdefault(dim, []).append((int(ref[1]), int(ref[2]), order) if ref[1]
                                        else (1, full, order))
    reshape, taken = [], {}  # taken: order -> axis of the reshaped array
    for dim, full in enumerate(sizes):
        done = 1
        for pre, size, order in sorted(refs.get(dim, [])):
            if pre != done:
                reshape.append(pre // done)
                done = pre
            taken[order] = len(reshape)
            reshape.append(size)
            done *= size
        if done != full:
            reshape.append(full // done)
    grouped_axes = [taken[o] for o in sorted(taken)]
    rest = [a for a in range(len(reshape)) if a not in grouped_axes]
    size = math.prod(reshape[a] for a in grouped_axes)
    return ids.reshape(reshape).transpose(rest + grouped_axes).reshape(-1, size).tolist()


def mesh_axis(groups: list[list[int]], replica: int, data: int, model: int = 1) -> str:
    """Which axes of a `replica × data × model` mesh (devices numbered row-major, `model`
    innermost) a collective's groups span: "data", "replica", "model", "all", "none" (groups of
    one) or "other" (any other grouping, e.g. data and model together)."""
    sets = {frozenset(g) for g in groups}
    if all(len(g) == 1 for g in sets):
        return "none"
    ids = list(range(replica * data * model))

    def along(stride: int, size: int) -> set[frozenset]:
        # The groups of one axis: `size` devices `stride` apart, one group per other index.
        starts = [i for i in ids if (i // stride) % size == 0]
        return {frozenset(range(s, s + stride * size, stride)) for s in starts}

    for axis, stride, size in (("model", 1, model), ("data", model, data),
                               ("replica", data * model, replica)):
        if size > 1 and sets <= along(stride, size):
            return axis
    if sets == {frozenset(ids)}:
        return "all"
    return "other"


def axis_bytes(sites: list[dict], replica: int, data: int, model: int = 1) -> dict[str, float]:
    """Bytes one device sends per step of `collective_sites`, by the mesh axes they span
    (`mesh_axis`: "data", "replica", "model", "all", "other"; groups of one send nothing)."""
    out: dict[str, float] = {}
    for site in sites:
        axis = mesh_axis(site["groups"], replica, data, model)
        if axis != "none":
            out[axis] = out.get(axis, 0.0) + site["sent"]
    return out


def _parse_hlo(text: str, types: dict[str, str] | None = None
               ) -> tuple[dict[str, list[tuple[str, str, str]]], str]:
    """Computations of an HLO module: name -> [(opcode, type, attributes)], and the entry;
    `types`, if given, is filled with each instruction's type by its name."""
    comps: dict[str, list[tuple[str, str, str]]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _HEADER.match(line) if not line.startswith((" ", "HloModule")) else None
        if header:
            current = comps.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
            continue
        instr = _INSTR.match(line) if current is not None else None
        if instr:
            typ, rest = _split_type(instr.group(2))
            op = re.match(r"([\w-]+)\(", rest)
            if op:
                attrs = re.sub(r"metadata=\{[^}]*\}", "", rest)
                current.append((op.group(1), typ, attrs))
                if types is not None:
                    types[instr.group(1)] = typ
    return comps, entry


def _trip_count(attrs: str, comps) -> int | None:
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
    if known:
        return int(known.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", attrs)
    instrs = comps.get(cond.group(1), []) if cond else []
    consts = [re.match(r"constant\((-?\d+)\)", rest) for op, _, rest in instrs if op == "constant"]
    consts = [int(m.group(1)) for m in consts if m]
    lt = any(op == "compare" and "direction=LT" in rest for op, _, rest in instrs)
    # `i < K` with i counting from 0: how lax.scan and fori_loop lower.
    return consts[0] if lt and len(consts) == 1 else None


def _multiplicity(comps, entry
                  ) -> tuple[dict[str, int], dict[str, bool], dict[str, bool], int]:
    """How often each computation runs per execution of the module (the sum over call paths
    from the entry of the loops' trip counts), whether it runs inside a while loop, whether
    inside a loop whose body computes matrix products (a layer scan, not a loop of
    collectives), and the count of loops whose trip count is unknown (counted once)."""
    calls: dict[str, list[tuple[str, int, bool]]] = {name: [] for name in comps}
    unknown = 0
    for name, instrs in comps.items():
        for op, _, attrs in instrs:
            if op.endswith(("-done", "-update")):
                continue  # an async pair lists its computation on both halves
            factor = 1
            if op == "while":
                trip = _trip_count(attrs, comps)
                unknown += trip is None
                factor = 1 if trip is None else trip
            for one, many in _CALLEE.findall(attrs):
                for callee in re.findall(r"%?([\w.\-]+)", one or many):
                    if callee in comps:
                        calls[name].append((callee, factor, op == "while"))
    order, seen = [], set()

    def visit(c):
        if c not in seen:
            seen.add(c)
            for callee, _, _ in calls[c]:
                visit(callee)
            order.append(c)

    visit(entry)
    dots = {}
    for c in order:  # callees before callers
        dots[c] = any(op in ("dot", "convolution") for op, _, _ in comps[c]) \
            or any(dots[callee] for callee, _, _ in calls[c])
    mult = dict.fromkeys(comps, 0)
    mult[entry] = 1
    in_loop = dict.fromkeys(comps, False)
    computing = dict.fromkeys(comps, False)
    for c in reversed(order):  # callers before callees: the calls form a DAG
        for callee, factor, loop in calls[c]:
            mult[callee] += mult[c] * factor
            in_loop[callee] |= in_loop[c] or loop
            computing[callee] |= computing[c] or (loop and dots[callee])
    return mult, in_loop, computing, unknown


def matmul_flops(hlo_text: str) -> tuple[float, int]:
    """FLOPs of the matrix products (dot and convolution) of an HLO module, 2 per multiply-add,
    each counted once per trip of the loops around it; and the count of loops whose trip count
    is unknown (their bodies counted once).

    XLA's own `cost_analysis()` counts a while loop's body once, whatever its trip count: a
    step that scans its layers would show one layer's FLOPs.
    """
    types: dict[str, str] = {}
    comps, entry = _parse_hlo(hlo_text, types)
    mult, _, _, unknown = _multiplicity(comps, entry)
    total = 0.0
    for name, instrs in comps.items():
        for op, typ, attrs in instrs:
            if op in ("dot", "convolution") and mult[name]:
                total += mult[name] * _product_flops(op, typ, attrs, types)
    return total, unknown


def _dims(typ: str) -> list[int]:
    shape = _SHAPE.search(typ)
    return [int(d) for d in shape.group(2).split(",") if d] if shape else []


def _operands(rest: str) -> str:
    """The text inside an instruction's operand parentheses."""
    start, depth = rest.index("("), 0
    for i in range(start, len(rest)):
        depth += (rest[i] == "(") - (rest[i] == ")")
        if depth == 0:
            return rest[start + 1: i]
    return rest[start + 1:]


def _product_flops(op: str, typ: str, attrs: str, types: dict[str, str]) -> float:
    """2 × output elements × the multiply-adds behind each: the contracted size of a dot's
    left operand; the kernel's elements per output feature of a convolution."""
    operands = _operands(attrs)
    # Compiled text gives each operand's type inline; unoptimized text only its name.
    shapes = [[int(d) for d in dims.split(",") if d] for _, dims in _SHAPE.findall(operands)]
    if len(shapes) < 2:
        shapes = [_dims(types.get(n, "")) for n in re.findall(r"%?([\w.\-]+)", operands)[:2]]
    lhs, rhs = shapes[:2]
    out = math.prod(_dims(typ))
    if op == "dot":
        found = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", attrs)
        contracted = [int(d) for d in found.group(1).split(",") if d] if found else []
        return 2.0 * out * math.prod(lhs[d] for d in contracted)
    labels = re.search(r"dim_labels=\w*_(\w+)->", attrs)
    o = labels.group(1).index("o") if labels else len(rhs) - 1
    return 2.0 * out * math.prod(rhs) / rhs[o] if rhs else 0.0


def collective_bytes(hlo_text: str, devices: int) -> dict[str, float]:
    """Bytes one device sends per execution of an HLO module, by collective kind (ring model).

    all-gather: (n-1)/n of the output; reduce-scatter: (n-1)/n of the input; all-reduce:
    2(n-1)/n; collective-permute: the buffer; all-to-all: (n-1)/n. n is the replica-group
    size (`devices` when the groups are implicit). Collectives inside while loops count once
    per trip; both branches of a conditional count.
    """
    return collectives(hlo_text, devices)[0]


def collectives(hlo_text: str, devices: int) -> tuple[dict[str, float], int, int]:
    """(bytes by kind, collectives launched, loops whose trip count is unknown and so is 1)."""
    sites, unknown = collective_sites(hlo_text, devices)
    return (*by_kind(sites), unknown)


def by_kind(sites: list[dict]) -> tuple[dict[str, float], int]:
    """(bytes by collective kind and "total", collectives launched) of `collective_sites`."""
    out = dict.fromkeys(COLLECTIVES, 0.0)
    for site in sites:
        out[site["kind"]] += site["sent"]
    out["total"] = sum(out[k] for k in COLLECTIVES)
    return out, sum(site["launches"] for site in sites)


def by_dtype(sites: list[dict]) -> dict[str, dict[str, float]]:
    """Bytes by collective kind and element type of `collective_sites` (e.g. a quantized
    gather's "s8" values and "f32" scales)."""
    out: dict[str, dict[str, float]] = {}
    for site in sites:
        kind = out.setdefault(site["kind"], {})
        for dtype, sent in site["by_dtype"].items():
            kind[dtype] = kind.get(dtype, 0.0) + sent
    return out


def collective_sites(hlo_text: str, devices: int) -> tuple[list[dict], int]:
    """Every collective of an HLO module: its kind, opcode, bytes sent per step (`sent`, and
    `by_dtype`), `launches` per step, device `groups`, whether it runs inside a while loop
    (`in_loop`), inside a loop that also computes matrix products (`beside_compute`: it can
    overlap the loop's other iterations' compute), and whether its reducer was widened by the
    backend (`promoted`); and the count of loops whose trip count is unknown (counted once)."""
    comps, entry = _parse_hlo(hlo_text)
    mult, in_loop, computing, unknown = _multiplicity(comps, entry)
    sites = []
    for name, instrs in comps.items():
        for op, typ, attrs in instrs:
            kind = _KINDS.get(op)
            if kind is None or not mult[name]:
                continue
            shapes = [(dt, _dtype_bytes(dt) * math.prod(int(d) for d in dims.split(",") if d))
                      for dt, dims in _SHAPE.findall(typ)]
            groups = _groups(attrs, devices)
            n = len(groups[0])
            if op == "all-gather-start":  # (operands..., results...): results are n/(n+1)
                share = n / (n + 1)
            elif op == "collective-permute-start":  # (operand, result, contexts...)
                shapes, share = shapes[:1], 1.0
            else:
                share = 1.0
            ratio = {"all-gather": (n - 1) / n, "reduce-scatter": n - 1,
                     "all-reduce": 2 * (n - 1) / n, "all-to-all": (n - 1) / n,
                     "collective-permute": 1}[op.removesuffix("-start")]
            by_dtype: dict[str, float] = {}
            for dt, size in shapes:
                by_dtype[dt] = by_dtype.get(dt, 0.0) + mult[name] * ratio * share * size
            reducer = re.search(r"to_apply=%?([\w.\-]+)", attrs)
            sites.append({"kind": kind, "op": op, "sent": sum(by_dtype.values()),
                          "by_dtype": by_dtype, "launches": mult[name],
                          "groups": groups, "in_loop": in_loop[name],
                          "beside_compute": computing[name],
                          "promoted": bool(reducer and reducer.group(1).endswith("_promoted"))})
    return sites, unknown


def as_requested(sites: list[dict], width: float, name: str) -> list[dict]:
    """Sites of a compiled program with the reductions the backend widened counted at the
    `width` bytes (dtype `name`, e.g. 2, "bf16") the program asked for: XLA:CPU computes a
    bf16/f16 all-reduce in f32 and marks its reducer `..._promoted`."""
    out = []
    for site in sites:
        if site["promoted"] and "f32" in site["by_dtype"] and width < 4:
            by = dict(site["by_dtype"])
            by[name] = by.get(name, 0.0) + by.pop("f32") * width / 4
            site = {**site, "by_dtype": by, "sent": sum(by.values())}
        out.append(site)
    return out
