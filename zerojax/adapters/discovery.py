"""Which module classes `from_nnx` / `from_linen` make ZeRO units when `units=` is not given.

The unit class is the model's layer class: the block a stack is made of (`nn.scan`,
`nnx.vmap`), else the model's own repeated class whose instances hold the most params (its
blocks, not its norms: five `RMSNorm`s hold less than two `Mamba2Block`s). A stack is what a
Flax transform built, never one table: linen sees it (the layer's call gets a slice of the
stacked params); NNX keeps no trace of `nnx.vmap`, so there a stack is a module of the model's
own whose two or more params all carry one leading axis of two or more (`is_stack`), which one
`(vocab, embed)` table or a bias-free projection never is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

LOG = logging.getLogger("zerojax")


@dataclass(frozen=True)
class Found:
    """One submodule instance that holds params: its path, class, params and whether its
    params are a stack of layers (`nn.scan`, `nnx.vmap`)."""

    path: tuple
    cls: type
    params: int
    stacked: bool


def is_stack(shapes) -> bool:
    """Whether params of `shapes` (one module's) look like `nnx.vmap`'s layers: two or more
    leaves, each of rank two or more, all with one leading axis of two or more."""
    shapes = list(shapes)
    leads = {s[0] if len(s) >= 2 else None for s in shapes}
    return len(shapes) >= 2 and len(leads) == 1 and None not in leads and min(leads) >= 2


def own(cls: type) -> bool:
    """Whether `cls` is the model's own (not one of flax's layers)."""
    return not cls.__module__.startswith("flax.")


def chosen(where: str, classes: tuple[type, ...]) -> str:
    """What a refusal adds when `where` chose the unit classes itself: which, and how to name
    others."""
    names = ", ".join(c.__name__ for c in classes)
    return (f" ({where} chose units=({names}) itself: pass units=(...) to name the model's "
            f"layer classes, units=() for the whole model as one unit)")


def pick_units(found: list[Found], where: str) -> tuple[type, ...]:
    """The unit classes `where` chooses without `units=`: the classes of the stacked layers
    when a stack holds more params than any repeated block; else the model's own class,
    repeated at least twice, whose instances outside every other such instance hold the most
    params; else flax's layer class of that kind; else none (the whole model is one unit).
    `found` leaves out flax's containers (`nnx.List`, `nn.Sequential`: no params of their
    own). Logged on the "zerojax" logger."""
    def reason(classes, why):
        names = ", ".join(c.__name__ for c in classes) or "none"
        LOG.info("%s: units=(%s) chosen: %s; pass units= to choose yourself (units=() for "
                 "the whole model as one unit)", where, names, why)
        return classes

    def inside(f, fs):  # f lies within another instance of fs
        return any(g.path != f.path and f.path[:len(g.path)] == g.path for g in fs)

    layers = [f for f in found if f.stacked]
    stacks = [f for f in layers if not inside(f, layers)]
    by_class: dict[type, list[Found]] = {}
    for f in found:
        by_class.setdefault(f.cls, []).append(f)
    repeated = {c: fs for c, fs in by_class.items() if len(fs) >= 2}

    def best(classes):  # ((params held by its outer instances, instances), class)
        every = [f for c in classes for f in repeated[c]] + stacks
        held = {c: (sum(f.params for f in repeated[c] if not inside(f, every)),
                    len(repeated[c])) for c in classes}
        return max(((v, c) for c, v in held.items() if v[0]), default=None,
                   key=lambda vc: vc[0])

    block = best([c for c in repeated if own(c)])
    if stacks and (block is None or sum(f.params for f in stacks) >= block[0][0]):
        return reason(tuple(dict.fromkeys(f.cls for f in stacks)),
                      "the stacked layers (one unit per layer)")
    if block is not None:
        (params, count), cls = block
        return reason((cls,), f"the model's block, {count} instances holding {params} params")
    layer = best(list(repeated))
    if layer is not None:
        (params, count), cls = layer
        return reason((cls,), f"the layer repeated {count} times, holding {params} params")
    return reason((), "no repeated block; the whole model is one unit")
