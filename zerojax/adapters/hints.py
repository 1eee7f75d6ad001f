"""A model's activation sharding hints inside zerojax's traces, through the logical axis rules.

JAX models place activations in four ways: `jax.lax.with_sharding_constraint` (which
`nn.with_logical_constraint` calls after flax's own rule lookup), `jax.sharding.reshard`,
`out_sharding=` on jax/jnp operations (`jnp.einsum`, `lax.dot_general`, `.at[].get`, ...,
and on NNX layers' calls, which pass it on) and `jax.sharding.auto_axes` (`nnx.Embed`'s
`out_sharding=`). Models written for JAX's explicit-sharding mode name their own mesh axes
("tp", "fsdp") and run under `jax.set_mesh` with Explicit axes. Inside zerojax's step the mesh is
zerojax's: the batch axes are manual and `model` is automatic (the compiler's), where jax takes
no `out_sharding` and no `reshard`.

While a model is traced (`hinted`), every hint goes through `translate`: each name becomes the
mesh axis its `logical_axis_rules` entry gives (a zerojax mesh axis stays itself, the model's
batch axis is a batch axis); only the `model` part is kept, since the batch axes are manual and
a name the rules map to None means "not split". What is kept becomes
`with_sharding_constraint` for the first two forms; an operation's `out_sharding=` is dropped
after the check (the automatic axis takes no output sharding: XLA places the result from its
operands, the weights split as the params' own annotations say); `auto_axes` runs its function
plainly. Without a `model` axis every hint is the identity. A name that nothing maps is a
ModelError naming it, where it was seen, and the rule to add, on every mesh alike.

jax checks `out_sharding=` and `reshard`'s target in one function, `canonicalize_sharding`,
which its modules import by name; that name is replaced in each of them (and `reshard`'s
primitive and `auto_axes`'s mesh lookup in `jax._src.pjit`) while any model is traced, each
wrapper acting only in the thread and dynamic extent of `hinted` and calling jax's own function
otherwise.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import sys
import traceback
from dataclasses import dataclass

import flax
import flax.linen as nn
import jax
from flax.core import meta
from jax import lax
from jax._src import pjit as _pjit
from jax._src import sharding_impls as _impls
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.errors import ModelError
from zerojax.mesh import DATA, MODEL, REPLICA

ALL_AXES = (REPLICA, DATA, MODEL)  # every axis a zerojax mesh may have


@dataclass(frozen=True)
class Hints:
    """How the model being traced names its axes: its logical axis rules, its batch axis."""

    rules: tuple | None
    batch_axis: str | None
    adapter: str  # "from_linen" / "from_nnx", for the fix in an error


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("zerojax_hints", default=None)
_IN_BOX: contextvars.ContextVar = contextvars.ContextVar("zerojax_in_box", default=False)
_CONSTRAINT = lax.with_sharding_constraint
_CANONICAL = _impls.canonicalize_sharding
_RESHARD_P = _pjit.reshard_p
_NEW_MESH = _pjit._get_new_mesh
# The code between the model's own and a hint's check: jax, flax, zerojax, contextlib.
_LIBRARIES = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                   for m in (jax, flax)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    os.path.abspath(contextlib.__file__))


def rule_choices(name: str) -> str:
    """The rules a name that nothing maps may need, as the docs give them."""
    return (f"({name!r}, {MODEL!r}) if it is a tensor-parallel dimension, ({name!r}, {DATA!r}) "
            f"if it shards over the batch devices (FSDP: ZeRO's own), ({name!r}, None) if not "
            f"split")


def model_axis() -> bool:
    return MODEL in jax.sharding.get_abstract_mesh().axis_names


def own_code(filename: str) -> bool:
    """Whether `filename` is the model's own code (not jax's, flax's or zerojax's)."""
    return not filename.startswith(_LIBRARIES)


def _where(api: str) -> str:
    """`api` and the innermost frame of the model's own code that reached it."""
    f = sys._getframe(1)
    while f is not None and not own_code(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return api
    return f"{api} at {os.path.basename(f.f_code.co_filename)}:{f.f_lineno} ({f.f_code.co_name})"


_FOREIGN = re.compile(r"Resource axis: (\S+) of (.*) is not found in mesh")


@contextlib.contextmanager
def foreign_axis_errors():
    """jax's error for a constraint naming an axis the mesh lacks, raised by a function zerojax
    does not see (`from jax.lax import with_sharding_constraint` keeps jax's own), as a
    ModelError naming the hint, where the model wrote it and the fix."""
    try:
        yield
    except ValueError as e:
        m = _FOREIGN.search(str(e))
        if m is None:
            raise
        own = [f for f in traceback.extract_tb(e.__traceback__) if own_code(f.filename)]
        at = f" at {os.path.basename(own[-1].filename)}:{own[-1].lineno} ({own[-1].name})" \
            if own else ""
        raise ModelError(
            f"the sharding hint {m.group(2)} (with_sharding_constraint{at}) names the axis "
            f"{m.group(1)!r}, which zerojax's mesh lacks, through a function zerojax does not "
            f"see: a with_sharding_constraint imported by name (from jax.lax import ...) keeps "
            f"jax's own; call it as jax.lax.with_sharding_constraint, whose names go through "
            f"logical_axis_rules") from None


def translate(spec, api: str, hints: Hints | None = None) -> P:
    """The `model` part of a hint's `spec` (a PartitionSpec in the model's own names) over
    zerojax's mesh: P(..., "model", ...) or P() when no dimension is split over `model`."""
    hints = hints or _ACTIVE.get()
    lookup = dict(reversed(hints.rules or ()))
    kept = []
    for entry in spec:
        names = entry if isinstance(entry, (tuple, list)) else (entry,)
        axes = []
        for n in names:
            if n is None or n is P.UNCONSTRAINED:
                continue
            if n in lookup:
                target = lookup[n]
                axes += list(target) if isinstance(target, (tuple, list)) else [target]
            elif n in ALL_AXES:
                axes.append(n)
            elif n != hints.batch_axis:
                raise ModelError(
                    f"the sharding hint {spec} ({_where(api)}) names the axis {n!r}, which "
                    f"neither logical_axis_rules maps nor zerojax's meshes have {ALL_AXES}; "
                    f"add to {hints.adapter}(logical_axis_rules=...) the rule {rule_choices(n)}")
        kept.append(MODEL if MODEL in axes else None)
    while kept and kept[-1] is None:
        kept.pop()
    return P(*kept)


def _spec_of(sharding, api: str):
    """A hint's PartitionSpec (None for none), or a ModelError for a sharding that names no
    axes (a device placement means nothing inside the step's shard_map)."""
    if sharding is None or isinstance(sharding, P):
        return sharding
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    raise ModelError(f"the sharding hint {sharding!r:.80} ({_where(api)}) is no PartitionSpec "
                     f"or NamedSharding, the only hints zerojax reads inside its step; give "
                     f"the axis names as a jax.sharding.PartitionSpec")


def _constrain(x, spec: P):
    """`x` constrained to `spec` (the model part of a hint) where the step has a model axis."""
    if MODEL not in spec or not model_axis():
        return x
    return _CONSTRAINT(x, spec)


def _constraint(x, shardings, *args, **kwargs):
    """`jax.lax.with_sharding_constraint` while a model is traced."""
    if _ACTIVE.get() is None:
        return _CONSTRAINT(x, shardings, *args, **kwargs)
    if _IN_BOX.get() or shardings is None:  # a box unboxed: see `_unplaced`
        return x

    def one(y, sharding):
        spec = _spec_of(sharding, "with_sharding_constraint")
        return y if spec is None else _constrain(y, translate(spec, "with_sharding_constraint"))

    if isinstance(shardings, (P, NamedSharding)):
        return jax.tree.map(lambda y: one(y, shardings), x)
    return jax.tree.map(one, x, shardings, is_leaf=lambda v: isinstance(v, (P, NamedSharding)))


class _Target:
    """`reshard`'s target while a model is traced: the model part of the hint."""

    def __init__(self, spec: P):
        self.spec = spec

    def update(self, spec):
        return _Target(spec)


def _canonical(sharding, api_name, check_mesh_consistency=True):
    """jax's check of an `out_sharding=` / `reshard` target, while a model is traced."""
    if _ACTIVE.get() is None or sharding is None:
        return _CANONICAL(sharding, api_name, check_mesh_consistency)
    kept = translate(_spec_of(sharding, api_name), api_name)
    return _Target(kept) if api_name == "reshard" else None


class _ReshardP:
    """`reshard`'s primitive: a `_Target` is the translated hint, a constraint at most."""

    def __getattr__(self, name):
        return getattr(_RESHARD_P, name)

    def bind(self, x, *, dst_sharding, **kw):
        if isinstance(dst_sharding, _Target):
            return _constrain(x, dst_sharding.spec)
        return _RESHARD_P.bind(x, dst_sharding=dst_sharding, **kw)


def _new_mesh(axes, axis_type, name, shardings=None):
    """`auto_axes`'s mesh while a model is traced: none (its function runs plainly; its
    `out_sharding` is checked as any other)."""
    if _ACTIVE.get() is None or name != "auto_axes":
        return _NEW_MESH(axes, axis_type, name, shardings)
    for s in jax.tree.leaves(shardings, is_leaf=lambda v: isinstance(v, (P, NamedSharding))):
        translate(_spec_of(s, name), name)
    return None


def _holders():
    """The jax modules that imported `canonicalize_sharding` by name."""
    return [m for n, m in list(sys.modules.items())
            if n.startswith("jax") and getattr(m, "canonicalize_sharding", None) is _CANONICAL]


def _unplaced(unbox):
    """A flax box's `unbox` whose constraint is the identity while a model is traced: a box
    may describe another shape than the value it holds during init (`nn.DenseGeneral` boxes its
    flat 2-D kernel with the names of the reshaped one), and zerojax lays the params out
    itself, from each param's final box."""
    def run(self, *args, **kwargs):
        token = _IN_BOX.set(True)
        try:
            return unbox(self, *args, **kwargs)
        finally:
            _IN_BOX.reset(token)
    return run


_BOXES = (meta.Partitioned, nn.LogicallyPartitioned)
_UNBOX = {c: c.__dict__["unbox"] for c in _BOXES}
_holding: list = []  # the modules patched by `install`


def install():
    """Puts the wrappers in place (process-wide; they act only inside `active`)."""
    _holding[:] = _holders()
    for m in _holding:
        m.canonicalize_sharding = _canonical
    _pjit.reshard_p = _ReshardP()
    _pjit._get_new_mesh = _new_mesh
    lax.with_sharding_constraint = _constraint
    for c in _BOXES:
        c.unbox = _unplaced(_UNBOX[c])


def uninstall():
    for m in _holding:
        m.canonicalize_sharding = _CANONICAL
    _pjit.reshard_p = _RESHARD_P
    _pjit._get_new_mesh = _NEW_MESH
    lax.with_sharding_constraint = _CONSTRAINT
    for c in _BOXES:
        c.unbox = _UNBOX[c]


@contextlib.contextmanager
def active(hints: Hints | None):
    """While active, in this thread, the model's sharding hints go through `translate` (None:
    jax's own behaviour, e.g. in a unit's call that zerojax runs plainly)."""
    token = _ACTIVE.set(hints)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
