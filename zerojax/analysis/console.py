"""What the analysis commands share: an argparse parser that shows defaults and exits 2 with
one line, byte-size and list arguments, rich tables, the assumptions block, and progress."""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Any

from zerojax.analysis.estimate_args import STAGES
from zerojax.analysis.tables import table


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (None, flags off)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.required:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    def __init__(self, **kw):
        super().__init__(formatter_class=HelpFormatter, **kw)

    def error(self, message):  # one clear line on stderr, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgtp]?i?b?)?\s*$", re.I)


def parse_bytes(text: str) -> int:
    """'80GB' (1e9), '80GiB' (2**30), '8e10', '512MB' -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size; write e.g. 80GB, 80GiB or 8e10")
    unit = (m.group(2) or "").lower().rstrip("b")
    base = 1024 if unit.endswith("i") else 1000
    power = "kmgtp".find(unit[:1]) + 1 if unit else 0
    return int(float(m.group(1)) * base**power)


def size_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_arg(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return int(text)


def non_negative_arg(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} must be a non-negative integer")
    return int(text)


def ints_arg(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated integers") from None


def stages_arg(text: str) -> tuple[int, ...]:
    stages = STAGES if text == "all" else ints_arg(text)
    if not set(stages) <= set(STAGES):
        raise argparse.ArgumentTypeError(f"{text!r}: stages are 0, 1, 2, 3 (or all)")
    return stages


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    from rich.console import Console

    # Piped output keeps a row on one line (a terminal's width wraps it).
    Console(width=None if sys.stdout.isatty() else 1_000).print(table(title, rows))


def print_assumptions(title: str, facts: dict[str, str]) -> None:
    from rich.console import Console

    # stderr: stdout carries only the table or the JSON.
    console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 200)
    console.print(title, soft_wrap=True)
    for key, value in facts.items():
        console.print(f"  {key + ':':<18}{value}", soft_wrap=True, markup=False)


class Progress:
    """Which configuration is compiling, on stderr: a rich bar on a terminal, else a line each.

    Used as `progress` of `plan` and by `measure`; a 7B step takes tens of seconds to compile.
    """

    def __init__(self, total: int):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.console = Console(stderr=True, highlight=False)
        self.start, self.total = time.monotonic(), total
        self.bar = None
        if self.console.is_terminal:
            self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeElapsedColumn(), console=self.console,
                                transient=True)
            self.task = self.bar.add_task("starting", total=total)
            self.bar.start()

    def __call__(self, label: str, phase: str, index: int, total: int | None = None) -> None:
        if total is not None and total != self.total:  # the planner added offload candidates
            self.total = total
            if self.bar is not None:
                self.bar.update(self.task, total=total)
        if phase == "done":
            if self.bar is not None:
                self.bar.advance(self.task)
            return
        text = f"{label}: {phase} {index}/{self.total}"
        if self.bar is not None:
            self.bar.update(self.task, description=text)
        else:
            self.console.print(f"{text} ({time.monotonic() - self.start:.0f} s)", soft_wrap=True,
                               markup=False)

    def close(self) -> float:
        """Stops the bar; returns the seconds since the start."""
        if self.bar is not None:
            self.bar.stop()
        return time.monotonic() - self.start
