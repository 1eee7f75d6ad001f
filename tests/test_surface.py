"""The public surface does not move: every name of `zerojax.__all__` with its signature (a
dataclass's fields and defaults, a class's public methods), and the options of `train --help`
with their defaults, compared with the snapshot `surface.json` beside this file.

A change of the surface is a change of the public contract (DESIGN.md section 2): make it on
purpose, with a deprecation path, then write the snapshot again:
`.venv/bin/python tests/test_surface.py --write`.
"""

import dataclasses
import inspect
import json
import re
import sys
from pathlib import Path

import pytest

SNAPSHOT = Path(__file__).with_name("surface.json")


def _signature(obj) -> str | None:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):  # a builtin without one
        return None


def _members(cls) -> dict:
    """A class's public attributes, its own and inherited from zerojax's classes: a method by
    its signature, a property as "property", a constant by its repr."""
    out = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("zerojax"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in getattr(cls, "__dataclass_fields__", {}) \
                    or name in getattr(cls, "_fields", ()):
                continue
            if isinstance(value, property):
                out[name] = "property"
            elif isinstance(value, (staticmethod, classmethod)):
                out[name] = f"{type(value).__name__} {_signature(value.__func__)}"
            elif callable(value):
                out[name] = _signature(value)
            else:
                out[name] = repr(value)
    return dict(sorted(out.items()))


def _describe(obj) -> dict:
    if inspect.isclass(obj):
        out = {"kind": "class", "bases": [b.__name__ for b in obj.__bases__]}
        if dataclasses.is_dataclass(obj):
            out["fields"] = {
                f.name: [str(f.type), repr(f.default) if f.default is not dataclasses.MISSING
                         else None if f.default_factory is dataclasses.MISSING
                         else f"factory {f.default_factory.__name__}"]
                for f in dataclasses.fields(obj)}
        elif hasattr(obj, "_fields"):  # a NamedTuple
            out["fields"] = list(obj._fields)
        elif not issubclass(obj, BaseException):
            out["signature"] = _signature(obj)
        out["members"] = _members(obj)
        return out
    return {"kind": "function", "signature": _signature(obj)}


def library_surface() -> dict:
    import zerojax

    return {"__all__": list(zerojax.__all__),
            **{name: _describe(getattr(zerojax, name)) for name in zerojax.__all__}}


def train_help(width: int = 200) -> dict:
    """`train --help`'s options: each entry's option strings and metavar, and its default."""
    import io
    import os
    from contextlib import redirect_stdout

    from zerojax.app.options import parse_args

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)  # no option string wraps
    out = io.StringIO()
    try:
        with redirect_stdout(out), pytest.raises(SystemExit):
            parse_args(["--help"])
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    # An entry starts at an option string near the left edge (inside a box when the output
    # is a terminal's); its help goes on in the rows indented under it.
    entries: list[list[str]] = []
    for line in out.getvalue().splitlines():
        row = line.rstrip().removesuffix("│").rstrip()
        if row.lstrip().startswith("│"):
            row = row.lstrip()[1:]
        indent = len(row) - len(row.lstrip())
        if re.match(r"-{1,2}\w", row.lstrip()) and indent <= 3:
            entries.append([row.strip()])
        elif entries and row.strip() and indent > 3:
            entries[-1].append(row.strip())
    options = {}
    for entry in entries:
        head = re.match(r"((?:-{1,2}[\w-]+)(?:, -{1,2}[\w-]+)*)(?: (\S+))?(?:  |$)", entry[0])
        default = re.search(r"\(default: (.*?)\)$", " ".join(" ".join(entry).split()))
        options[head.group(1)] = {"metavar": head.group(2) or "",
                                  "default": default.group(1) if default else None}
    return options


def surface() -> dict:
    return {"library": library_surface(), "train --help": train_help()}


def test_the_public_surface_is_the_snapshot():
    want = json.loads(SNAPSHOT.read_text())
    got = json.loads(json.dumps(surface()))
    options = got["train --help"]
    assert len(options) >= 40 and options["--offload-fraction"]["default"] == "None"
    assert all(o["default"] is not None for k, o in options.items() if k != "-h, --help")
    assert got["library"]["Engine"]["members"]["step"] == "(self, state: 'TrainState', batch) " \
        "-> 'tuple[TrainState, dict[str, jax.Array]]'"
    for part in ("library", "train --help"):
        for name in sorted(set(want[part]) | set(got[part])):
            assert got[part].get(name) == want[part].get(name), (part, name)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_surface.py --write")
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    SNAPSHOT.write_text(json.dumps(surface(), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {SNAPSHOT}")
