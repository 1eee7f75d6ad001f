"""A unit's params in the module between the unit's calls, and every read of them.

The adapters rebuild the user's module for each trace of the loss with the root unit's params
gathered. A unit's params sit in the module too, but the unit's own call gathers them again,
per unit, inside its rematerialized function. What holds their place (`Stand`, one per call
of the loss):

- NNX, a unit instance: the values the root unit's gather gives (`Stand.gathered`). The unit's
  call knows them (by identity) and gathers its own; a read anywhere else (a tied head through
  `attend`, a weight read by another module, a regularizer over `nnx.state`) computes on these
  values, the right ones, and the gradients of both uses sum. Where nothing reads them their
  gather has no use: the compiled step has no collective for it.
- linen, a unit instance: a `Standin` gathered where it is read (`Stand.serve`); linen reads a
  unit's params inside the unit's methods, which the adapter runs as the unit's call.
- a stack of layers (`nn.scan`, `nnx.scan`): a `Standin` that only the scan takes, layer by
  layer; any other read of it is a one-line ModelError naming the param, the method that read
  it and the fix.

A `Standin` holds no values, only a shape and a dtype, so nothing computes on a stand-in value
unnoticed (the adapters' placeholders were NaN arrays once: a tied head read them, and the
loss was NaN from the first step without a word).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src import core as _core
from jax._src import dtypes as _dtypes

from zerojax.adapters.discovery import LOG
from zerojax.adapters.hints import own_code
from zerojax.errors import ModelError

_LOGGED: set = set()  # (adapter, param) pairs whose read outside their unit was logged


@dataclass(frozen=True)
class Entry:
    """What a placeholder stands for: the param's handle and path, its unit's path and class,
    and whether the unit is a stack of layers."""

    handle: Any
    path: str
    unit: tuple
    cls: type
    stack: bool


class Stand:
    """The placeholders of one call of a loss, and what happened to them: each unit called
    whole (`take_call`), scanned layer by layer (`take_scan`) or read (`serve`, `on_read`).
    `note`: what a refusal adds when the adapter chose the unit classes itself."""

    def __init__(self, units, where: str, note: str = ""):
        self.units, self.where, self.note = units, where, note
        self.entries: dict[int, Entry] = {}
        self._keep: list = []  # the placeholders themselves: their ids stay theirs
        self.called: set[tuple] = set()
        self.scanned: set[tuple] = set()
        self.read: set[tuple] = set()
        self.unattributed = False  # a unit class ran on values that are no placeholders
        self.in_scan = 0  # inside a stack's layer (common.scan_through)

    def _add(self, x, handle, unit, cls, sub, stack) -> None:
        path = jax.tree_util.keystr((*map(jax.tree_util.DictKey, unit), *sub))
        self._keep.append(x)
        self.entries[id(x)] = Entry(handle, path, tuple(unit), cls, stack)

    def gathered(self, handles, unit: tuple, cls: type):
        """The unit's params as the root unit's gather gives them (NNX)."""
        flat, tree = jax.tree_util.tree_flatten_with_path(self.units.gather(handles))
        out = []
        for (sub, x), h in zip(flat, jax.tree.leaves(handles)):
            if id(x) in self.entries:  # one array object for two params (plain units)
                x = jnp.array(x, copy=True)
            self._add(x, h, unit, cls, sub, False)
            out.append(x)
        return jax.tree.unflatten(tree, out)

    def standins(self, avals, handles, unit: tuple, cls: type, stack: bool):
        """`Standin`s of `avals`' shapes for the unit's params (see the module's docstring)."""
        flat, tree = jax.tree_util.tree_flatten_with_path(avals)
        out = []
        for (sub, a), h in zip(flat, jax.tree.leaves(handles)):
            x = Standin(tuple(jnp.shape(a)), jnp.result_type(a), self)
            self._add(x, h, unit, cls, sub, stack)
            out.append(x)
        return jax.tree.unflatten(tree, out)

    def entry(self, x) -> Entry | None:
        return self.entries.get(id(x))

    def take_call(self, values) -> list[tuple[int, Any]]:
        """(index, handle) of the placeholders among a unit's `values`, as its call runs it
        whole; none: its values are no placeholders (a layer inside a scan, a module rebuilt
        by an NNX transform)."""
        found = [(i, e) for i, v in enumerate(values) if (e := self.entry(v)) is not None]
        for i, e in found:
            if e.stack and e.unit in self.scanned:
                raise self.refusal(values[i], "run whole by its unit's call after its scan")
            self.called.add(e.unit)
        return [(i, e.handle) for i, e in found]

    def take_scan(self, x):
        """The handle behind `x` when a scan takes it layer by layer (a stack's `Standin`),
        else None (an NNX unit's gathered values scan as they are)."""
        e = self.entry(x)
        if e is None:
            return None
        if not e.stack:
            self.read.add(e.unit)
            return None
        if e.unit in self.called:
            raise self.refusal(x, "scanned layer by layer after its unit's call ran it whole")
        self.scanned.add(e.unit)
        return e.handle

    def serve(self, x: Standin):
        """The values of `x`, read outside its unit's call: gathered there (a unit instance),
        or a ModelError (a stack, whose params only its scan takes)."""
        e = self.entries[id(x)]
        if e.stack:
            raise self.refusal(x, "read whole")
        self._mark_read(e)
        return self.units.gather(e.handle)

    def on_read(self, variable, value):
        """An NNX `on_get_value` hook: records a read of a unit's gathered values."""
        e = self.entry(value)
        if e is not None and not e.stack:
            self._mark_read(e)
        return value

    def _mark_read(self, e: Entry) -> None:
        self.read.add(e.unit)
        if (self.where, e.path) not in _LOGGED:
            _LOGGED.add((self.where, e.path))
            LOG.info("%s: parameter %s of unit %s is read outside the unit's call by %s; it "
                     "computes there on the root unit's gather of it", self.where, e.path,
                     e.cls.__name__, reader())

    def unused(self) -> list[tuple]:
        """The units whose placeholders nothing took or read."""
        seen = self.called | self.scanned | self.read
        return sorted({e.unit for e in self.entries.values() if e.unit not in seen}, key=str)

    def refusal(self, x, how: str) -> ModelError:
        """The one line for a placeholder `x` used in a way zerojax cannot serve."""
        e = self.entries[id(x)]
        at = "/" + "/".join(map(str, e.unit))
        name = e.cls.__name__
        if e.stack:
            what = f"the stack of {name} layers at {at} (one unit per layer, gathered inside " \
                   f"its scan)"
            fix = f"scan the stack on axis 0 of its params (nn.scan's variable_axes={{'params': " \
                  f"0}}, nnx.scan's in_axes 0) and read them inside the layer, or leave {name} " \
                  f"out of units"
        else:
            what = f"unit {name} at {at}"
            fix = f"read it as an array (x[...], jnp.asarray) or inside {name}'s methods, or " \
                  f"leave {name} out of units"
        return ModelError(f"parameter {e.path} of {what} was {how} by {reader()}, outside its "
                          f"unit; {fix}{self.note}")


_ARRAY_ATTRS = frozenset(("T", "mT", "astype", "reshape", "transpose", "swapaxes", "squeeze",
                          "ravel", "flatten", "sum", "mean", "max", "min", "prod", "dot",
                          "clip", "conj", "real", "imag", "at", "take", "var", "std", "all",
                          "any", "argmax", "argmin", "cumsum", "round", "item", "tolist"))
_OPERATORS = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__matmul__", "__rmatmul__", "__truediv__", "__rtruediv__", "__floordiv__",
              "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__rpow__", "__neg__",
              "__pos__", "__abs__", "__lt__", "__le__", "__gt__", "__ge__", "__and__",
              "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__invert__", "__bool__",
              "__float__", "__int__", "__index__", "__iter__")


class Standin:
    """A unit's param without values: its shape and dtype. Every use of its values goes to
    its `Stand` (served, or refused with one line); jax takes it for an array only through
    `jnp.asarray` and the array operators (a jitted function given it refuses)."""

    __slots__ = ("shape", "dtype", "_stand")

    def __init__(self, shape: tuple, dtype, stand: Stand):
        self.shape, self.dtype, self._stand = shape, dtype, stand

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self):
        return f"Standin({jnp.dtype(self.dtype).name}{list(self.shape)})"

    def __jax_array__(self):
        return self._stand.serve(self)

    def __array__(self, *args, **kwargs):
        raise self._stand.refusal(self, "converted to a NumPy array")

    def __getitem__(self, key):
        return self.__jax_array__()[key]

    def __getattr__(self, name):
        if name in _ARRAY_ATTRS:
            return getattr(self.__jax_array__(), name)
        raise AttributeError(name)


def _operator(name):
    def op(self, *args):
        return getattr(self.__jax_array__(), name)(*args)
    op.__name__ = name
    return op


for _name in _OPERATORS:
    setattr(Standin, _name, _operator(_name))


def _passed(x):
    """jax abstracting a `Standin` (a jitted function's argument): it holds no values."""
    raise x._stand.refusal(x, "passed to a jitted jax function")


_core.pytype_aval_mappings[Standin] = _passed
if hasattr(_dtypes, "canonicalize_value_handlers"):
    _dtypes.canonicalize_value_handlers[Standin] = _passed

_LIBRARY = (os.path.dirname(os.path.abspath(jax.__file__)) + os.sep,  # jax's and zerojax's own
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


def _method(obj, name: str) -> bool:
    return isinstance(obj, (nnx.Module, nn.Module)) and (
        name == "__call__" or (not name.startswith("_") and callable(getattr(type(obj), name,
                                                                              None))))


def reader() -> str:
    """The method that is reading a placeholder (the innermost module method on the stack,
    flax's own included: `ScaledEmbed.attend`) and where the model's own code is."""
    method = at = None
    f = sys._getframe(1)
    while f is not None and (method is None or at is None):
        name, file = f.f_code.co_name, f.f_code.co_filename
        if not file.startswith(_LIBRARY):
            if method is None and _method(f.f_locals.get("self"), name):
                method = f"{type(f.f_locals['self']).__name__}.{name}"
            if at is None and own_code(file):
                at = f"{os.path.basename(file)}:{f.f_lineno} ({name})"
        f = f.f_back
    return " at ".join(p for p in (method, at) if p) or "the model"
