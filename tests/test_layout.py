"""The folders are the architecture (DESIGN.md section 4): the core imports no wing, every wing
is a package, `offload/` uses `update/` and never the reverse, and no import runs back up."""

import ast
import functools
from pathlib import Path

import zerojax

PKG = Path(zerojax.__file__).parent
WINGS = ("adapters", "analysis", "app", "checkpoint", "models", "offload")


def _imports(path: Path, top_level: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in (tree.body if top_level else ast.walk(tree)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def _wings(names: set[str]) -> list[str]:
    return sorted(m for m in names if any(m.startswith(f"zerojax.{w}") for w in WINGS))


CORE_PACKAGES = ("collectives", "layout", "update")  # core modules in several files


def test_core_imports_no_wing():
    core = [p for p in PKG.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    core += [p for name in CORE_PACKAGES for p in (PKG / name).glob("*.py")]
    assert len(core) >= 9, sorted(p.name for p in core)
    where = lambda p: str(p.relative_to(PKG))
    bad = {where(p): _wings(_imports(p, top_level=True)) for p in core}
    assert not {k: v for k, v in bad.items() if v}, bad
    # The ways in: Engine.save / Engine.restore enter the checkpoint wing when called, and an
    # engine with offload="optimizer" the offload wing when made (RUNS_UP says why).
    lazy = {where(p): _wings(_imports(p, top_level=False)) for p in core}
    assert {k: v for k, v in lazy.items() if v} == {"engine.py": [
        "zerojax.checkpoint", "zerojax.offload.disk", "zerojax.offload.disk.offload_of"]}, lazy


def test_wings_are_packages_and_the_top_stays_small():
    for wing in WINGS:
        assert (PKG / wing / "__init__.py").is_file(), wing
    packages = sorted(p.parent.name for p in PKG.glob("*/__init__.py"))
    assert packages == sorted(WINGS + CORE_PACKAGES), packages
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 12, top


def test_every_module_stays_readable():
    """A module says one concern: at most 450 lines, the engine, which only delegates, 400."""
    lines = {str(p.relative_to(PKG)): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    assert lines["engine.py"] <= 400, lines["engine.py"]
    assert not {k: n for k, n in lines.items() if n > 450}, lines


def test_checkpoint_reachable_from_the_package():
    assert callable(zerojax.checkpoint.save) and callable(zerojax.checkpoint.export)


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__)."""
    out = {}
    for path in PKG.rglob("*.py"):
        parts = ["zerojax", *path.relative_to(PKG).with_suffix("").parts]
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _runtime_imports(tree):
    """The import statements that can run: at any depth (inside functions too), but not under
    `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


@functools.cache
def import_graph() -> dict[str, frozenset[str]]:
    """Module -> the package modules it imports, lazily or not. `from a import b` names a.b
    where that is a module, else a. A module's import of a package it lies in (`import zerojax`
    inside zerojax.checkpoint.store) is no edge: Python runs a package's __init__ before any
    module inside it, so the import orders nothing; a package's __init__ importing its own
    modules (re-exports) is an edge like any other, downward."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names)
        graph[name] = frozenset(t for t in targets if t in mods and t != name
                                and not name.startswith(t + "."))
    return graph


def find_cycle(graph) -> list[str] | None:
    """One circle of `graph` as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v):
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_the_import_graph_has_no_circle():
    """Every module of zerojax, lazy imports inside functions included: no circle, so that a
    module's dependencies can be read (and tested) without the modules that use it."""
    graph = import_graph()
    assert len(graph) >= 40 and "zerojax.state" in graph["zerojax.engine"]
    assert "zerojax.checkpoint" in graph["zerojax.engine"]  # a lazy import counts
    assert "zerojax" not in graph["zerojax.checkpoint.store"]  # its own package does not
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_find_cycle_finds_a_lazy_circle():
    """The check can fail: the circle state validation once made from mesh.py (a lazy import
    of TrainState) back through step.py."""
    graph = dict(import_graph())
    graph["zerojax.mesh"] = graph["zerojax.mesh"] | {"zerojax.step"}
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1], cycle
    assert {"zerojax.mesh", "zerojax.step"} <= set(cycle), cycle


# The layers, bottom up: an import goes to its own layer or one below, never up. The core (the
# top-level modules and its packages) at the bottom; the offload wing on update/ and the rest
# of the core (DESIGN.md section 4, section 7: every tier below the device), the reference
# models and the Flax adapters beside it; the checkpoint wing, which saves a state wherever it
# lives (offload's programs over two meshes); analysis; the command line; the package itself.
LAYERS = {"core": 0, "offload": 1, "models": 1, "adapters": 1, "checkpoint": 2, "analysis": 3,
          "app": 4, "package": 5}

# The imports that run up, each kept for a reason (importer prefix, imported prefix).
RUNS_UP = {
    # The Engine is the public entry point of every wing (DESIGN.md section 4: it asks the
    # wings): save and restore enter the checkpoint wing, an engine with offload the offload
    # wing, lazily, when called, so that orbax is imported by those who checkpoint only.
    ("zerojax.engine", "zerojax.checkpoint"): "Engine.save / Engine.restore",
    ("zerojax.engine", "zerojax.offload.disk"): "Engine(...) with offload='optimizer'",
    # The measure, plan and estimate commands take the command line's named optimizers
    # (`--optimizer`, app/presets.py) as train does: they are command-line modules that live
    # in analysis/ beside what they run.
    ("zerojax.analysis", "zerojax.app.presets"): "--optimizer NAME of measure, plan, estimate",
}


def layer(module: str) -> str:
    """The layer of a module of the package: its wing, "core", or "package" (the package's
    own __init__ and __main__, which gather the public names and start the command line)."""
    parts = module.split(".")
    if module in ("zerojax", "zerojax.__main__"):
        return "package"
    return parts[1] if len(parts) > 1 and parts[1] in WINGS else "core"


def runs_up(graph) -> list[tuple[str, str]]:
    """The edges of `graph` that run up a layer and are not in RUNS_UP."""
    kept = lambda a, b: any((a == x or a.startswith(x + ".")) and (b == y or b.startswith(y + "."))
                            for x, y in RUNS_UP)
    return sorted((a, b) for a, targets in graph.items() for b in targets
                  if LAYERS[layer(b)] > LAYERS[layer(a)] and not kept(a, b))


def test_no_import_runs_back_up():
    """Every module's imports, lazy ones included, go to its own layer or below, but for the
    named exceptions (RUNS_UP), each of which is still there (else it goes from the list)."""
    graph = import_graph()
    assert runs_up(graph) == []
    for x, y in RUNS_UP:
        assert any(a.startswith(x) and b.startswith(y) for a, t in graph.items() for b in t), \
            (x, y)


def test_the_wings_use_the_core_and_offload_uses_update():
    graph = import_graph()
    for wing in WINGS:
        used = {layer(b) for a, t in graph.items() if layer(a) == wing for b in t}
        assert "core" in used, wing
    offload = {b for a, t in graph.items() if layer(a) == "offload" for b in t}
    assert {"zerojax.update", "zerojax.update.parts"} <= offload, sorted(offload)


def test_update_never_imports_offload():
    """The optimizer over the shards serves the offload wing and knows nothing of it: no
    module of update/ imports offload/, lazily or not; and the check fails where one does."""
    graph = import_graph()
    into = lambda g: sorted((a, b) for a, t in g.items() if a.startswith("zerojax.update")
                            for b in t if b.startswith("zerojax.offload"))
    assert into(graph) == []
    assert len([m for m in graph if m.startswith("zerojax.update")]) >= 10
    bad = dict(graph)
    bad["zerojax.update.parts"] = bad["zerojax.update.parts"] | {"zerojax.offload.side_by_side"}
    assert into(bad) == [("zerojax.update.parts", "zerojax.offload.side_by_side")]
    assert ("zerojax.update.parts", "zerojax.offload.side_by_side") in runs_up(bad)
