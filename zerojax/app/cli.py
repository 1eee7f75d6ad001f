"""`python -m zerojax <command>`: a thin dispatcher; each command lives in its own module."""

from __future__ import annotations

import importlib
import sys

# command -> (module, function, one-line help). Each function takes argv (list[str]) and
# returns an exit code.
COMMANDS = {
    "train": ("zerojax.app.train", "main", "train a GPT preset on the embedded corpus or a file"),
    "sample": ("zerojax.app.sample", "sample_main", "generate text from a trained checkpoint"),
    "estimate": ("zerojax.analysis.estimate_command", "estimate_main",
                 "ZeRO paper memory/comm per device, for Ψ or any GPT shape"),
    "measure": ("zerojax.analysis.commands", "measure_main",
                "memory/comm measured from compiled steps"),
    "plan": ("zerojax.analysis.plan_command", "plan_main", "the cheapest configuration that fits"),
    "export": ("zerojax.checkpoint.export", "export_main",
               "consolidated fp32 params from a checkpoint"),
}


def usage() -> str:
    lines = ["usage: python -m zerojax <command> [options]   (<command> --help for options)", ""]
    lines += [f"  {name:<9} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"zerojax: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)
