"""The command line's own one-line errors: a value of the wrong kind for its option
(`--model-parallel two`), and what tyro's parser refuses (an unknown option, a missing value),
which it would report in a box of many lines."""

from __future__ import annotations

import contextlib
import io
import re
import types
import typing


def check_values(argv: list[str], options: type, error: type[Exception]) -> None:
    """Each `--option VALUE` of `argv` must be of its kind in the dataclass `options`: an
    integer, a number or one of its choices; else one `error` naming it (not the parser's
    boxed report)."""
    fields = typing.get_type_hints(options)
    i = 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        kind = fields.get(name.replace("-", "_"))
        if kind is None or _options_of(kind) is bool:
            continue
        if not eq:
            if i >= len(argv) or argv[i].startswith("--"):
                raise error(f"--{name} needs a value; see --help")
            value, i = argv[i], i + 1
        _check_value(f"--{name}", value, kind, error)


def _options_of(kind):
    """The type of an option, None aside: `int | None` -> int."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return kind


def _check_value(option: str, value: str, kind, error: type[Exception]) -> None:
    optional = type(None) in typing.get_args(kind)
    if optional and value == "None":
        return
    kind = _options_of(kind)
    if typing.get_origin(kind) is typing.Annotated:
        kind = _options_of(typing.get_args(kind)[0])
    if typing.get_origin(kind) is typing.Literal:
        choices = [str(c) for c in typing.get_args(kind)]
        if value not in choices:
            raise error(f"{option}={value!r} is not one of {', '.join(choices)}"
                             + (" (or None)" if optional else ""))
    elif kind in (int, float):
        try:
            kind(value)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise error(f"{option}={value!r} must be {what}"
                             + (" (or None)" if optional else "")) from None


def one_line_errors(parse, error: type[Exception]):
    """`parse()` (tyro), its boxed report of a malformed command line (an unknown option, a
    missing value) turned into one `error`; --help still prints and exits."""
    text = io.StringIO()
    try:
        with contextlib.redirect_stderr(text):
            return parse()
    except SystemExit as e:
        if not e.code:
            raise
        # The box's title, then the message up to a rule (UTF-8 or ASCII drawing).
        plain = re.sub(r"\x1b\[[0-9;]*m", "", text.getvalue())
        lines = [line.strip(" │╭╮╰╯") for line in plain.splitlines()]
        lines = [line for line in lines if line][1:]  # the title aside
        message = []
        for line in lines:
            rule = not line.strip("-─ ")
            if (rule and message) or line.startswith("For full helptext"):
                break
            if not rule:
                message.append(line)
        raise error(" ".join(message or ["malformed command line"]) + "; see --help") \
            from None
