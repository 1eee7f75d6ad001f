"""Tables as the commands print them (rich), and as text for the results' `str()`."""

from __future__ import annotations

from typing import Any


def table(title: str, rows: list[dict[str, Any]]):
    """A rich table of `rows` (dicts with the same keys, the columns) under `title`."""
    from rich.table import Table

    t = Table(title=title)
    for key in rows[0] if rows else []:
        t.add_column(key, justify="left" if key in ("reason", "config") else "right")
    for row in rows:
        t.add_row(*(str(v) for v in row.values()))
    return t


def render_table(title: str, rows: list[dict[str, Any]]) -> str:
    """The table `print_table` prints to a pipe, as text (what `str()` of a result gives)."""
    import io

    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=1_000, color_system=None, highlight=False).print(table(title, rows))
    return out.getvalue()
