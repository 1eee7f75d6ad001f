"""The folders are the architecture: the core imports no wing, and every wing is a package."""

import ast
from pathlib import Path

import zerojax

PKG = Path(zerojax.__file__).parent
WINGS = ("adapters", "analysis", "app", "checkpoint", "models")


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


CORE_PACKAGES = ("collectives", "update")  # core modules in several files


def test_core_imports_no_wing():
    core = [p for p in PKG.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    core += [p for name in CORE_PACKAGES for p in (PKG / name).glob("*.py")]
    assert len(core) >= 9, sorted(p.name for p in core)
    bad = {p.name: _wings(_imports(p, top_level=True)) for p in core}
    assert not {k: v for k, v in bad.items() if v}, bad
    # The one way down: Engine.save / Engine.restore enter the checkpoint wing when called.
    lazy = {p.name: _wings(_imports(p, top_level=False)) for p in core}
    assert {k: v for k, v in lazy.items() if v} == {"engine.py": ["zerojax.checkpoint"]}, lazy


def test_wings_are_packages_and_the_top_stays_small():
    for wing in WINGS:
        assert (PKG / wing / "__init__.py").is_file(), wing
    packages = sorted(p.parent.name for p in PKG.glob("*/__init__.py"))
    assert packages == sorted(WINGS + CORE_PACKAGES), packages
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 12, top


def test_checkpoint_reachable_from_the_package():
    assert callable(zerojax.checkpoint.save) and callable(zerojax.checkpoint.export)
