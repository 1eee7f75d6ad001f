"""A published model's own axis names and sharding hints, inside zerojax's traces.

A model file may name its batch axis in collectives (`nn.BatchNorm(axis_name="batch")`,
`lax.pmean(x, "batch")`) and place GSPMD sharding hints on its activations. In the step's
shard_map only the mesh's axes are bound, and all of them are manual, so while an adapter
traces the model (`model_axes`):

- every `jax.lax` collective given `batch_axis` runs over the mesh's bound batch axes instead
  (`("replica", "data")`, or `("data",)`): the model's batch axis is the global batch;
- every sharding hint on an activation (`with_sharding_constraint`, `reshard`, `out_sharding=`)
  goes through the model's logical axis rules and keeps only its `model` part (`hints.py`):
  inside the shard_map the batch axes are manual (an array is one device's batch), and
  zerojax lays the params out its own way, but on a mesh with a model axis a hint naming
  "model" is the model's tensor-parallel plan (without a model axis every hint is the identity).

The params' own annotations (boxes with mesh-axis or logical names, NNX sharding metadata)
become the model's `param_specs()` through `mesh_spec`: a logical name goes through the
`logical_axis_rules` (flax's format); only the axes zerojax's meshes have count.

The adapters' own traces outside the step (finding the units, `module.init`) run with those
names bound to one-device axes (`bound_axes`), so a sample call in training mode may reduce
over them. A name that nothing binds is a ModelError naming it and `batch_axis=`.

jax has no axis aliases, so the collectives are wrapped in the `jax.lax` module itself (flax
and user code look them up there at call time); the wrappers act only in the thread and
dynamic extent of `model_axes` and call jax's own functions otherwise.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from zerojax.adapters import hints
from zerojax.adapters.common import LOCK
from zerojax.errors import ModelError
from zerojax.mesh import DATA, MODEL, REPLICA

MESH_AXES = (REPLICA, DATA)  # the batch axes a zerojax mesh may have, outermost first
ALL_AXES = hints.ALL_AXES  # every axis a zerojax mesh may have

_OFF = object()  # _ACTIVE outside model_axes
# While a model is traced: the model's batch axis name (or None); else _OFF.
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("zerojax_model_axes", default=_OFF)
_INSTALLED = [0]  # how many model_axes contexts are open (the patch is installed while > 0)


def _collectives() -> dict:
    """jax.lax's functions that take an `axis_name`: name -> (function, signature)."""
    out = {}
    for name in dir(lax):
        f = getattr(lax, name)
        if name.startswith("_") or not callable(f):
            continue
        try:
            sig = inspect.signature(f)
        except (TypeError, ValueError):  # no signature to read
            continue
        if "axis_name" in sig.parameters:
            out[name] = (f, sig)
    return out


_COLLECTIVES = _collectives()


def check_batch_axis(batch_axis):
    """`batch_axis` if it can name the model's batch axis, else a ModelError."""
    if batch_axis is None:
        return None
    if not isinstance(batch_axis, str) or not batch_axis:
        raise ModelError(f"batch_axis must be the axis name the model's collectives give the "
                         f"batch, a string (e.g. batch_axis='batch'); got {batch_axis!r}")
    if batch_axis in MESH_AXES:
        raise ModelError(f"batch_axis={batch_axis!r} is one of zerojax's mesh axes "
                         f"{MESH_AXES}, which are bound already (a model naming "
                         f"{batch_axis!r} reduces over that axis of the mesh); leave batch_axis "
                         f"out, or give it the model's own name for the batch")
    return batch_axis


def _bound(name) -> bool:
    try:
        _COLLECTIVES["axis_size"][0](name)
    except NameError:
        return False
    return True


def _rename(axis_name, batch_axis):
    """`axis_name` with `batch_axis` replaced by the bound mesh batch axes (when it is not
    bound itself, as it is in the adapters' own traces)."""
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if batch_axis not in names or _bound(batch_axis):
        return axis_name
    mesh = tuple(a for a in MESH_AXES if _bound(a))
    out = []
    for n in names:
        out += [a for a in mesh if a not in out] if n == batch_axis else [n]
    return tuple(out)


def _wrap(name, f, sig):
    def collective(*args, **kwargs):
        batch_axis = _ACTIVE.get()
        if batch_axis is _OFF or batch_axis is None:
            return f(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        bound.arguments["axis_name"] = _rename(bound.arguments["axis_name"], batch_axis)
        return f(*bound.args, **bound.kwargs)

    collective.__name__ = collective.__qualname__ = name
    collective.__doc__ = f.__doc__
    return collective


def check_rules(rules, where: str):
    """`rules` (flax's logical axis rules: (logical name, mesh axis | axes | None) pairs) as a
    tuple, or a ModelError naming a rule whose mesh axis no zerojax mesh has."""
    if rules is None:
        return None
    try:
        rules = tuple((name, target) for name, target in rules)
    except (TypeError, ValueError):
        raise ModelError(f"{where}(logical_axis_rules={rules!r:.60}) must be flax's rules: "
                         f"pairs (logical name, mesh axis or None), e.g. (('mlp', 'model'), "
                         f"('embed', None))") from None
    for name, target in rules:
        for axis in target if isinstance(target, (tuple, list)) else (target,):
            if axis is not None and axis not in ALL_AXES:
                raise ModelError(
                    f"logical_axis_rules maps {name!r} to the mesh axis {axis!r}, which "
                    f"zerojax's meshes lack (they have {ALL_AXES}); map the names a "
                    f"tensor-parallel dimension carries (heads, mlp, vocab, ...) to {MODEL!r} "
                    f"and the rest to None ({DATA!r}/{REPLICA!r} are ZeRO's: the engine shards "
                    f"every param over them its own way)")
    return rules


def mesh_spec(names, rules, strict: str | None = None,
              what: str = "sharding annotation") -> P | None:
    """A param's axis names (logical names, or mesh axes) as a PartitionSpec over zerojax's
    mesh axes: a name in `rules` becomes its rule's axis (the first rule for it), a mesh
    axis name stays, anything else is None (linen's logical names: flax leaves an unmatched
    one unsplit) or, given `strict` (where the names were seen: NNX sharding metadata, whose
    names flax takes as mesh axes after its rules, or a live array's sharding: `what`), a
    ModelError naming it and the rule."""
    if names is None:
        return None
    lookup = dict(reversed(rules or ()))

    def one(a):
        if a in lookup:
            return lookup[a]
        if a is None or a in ALL_AXES:
            return a
        if strict is not None:
            raise ModelError(
                f"{strict}'s {what} {tuple(names)} names the axis {a!r}, which "
                f"neither logical_axis_rules maps nor zerojax's meshes have {ALL_AXES}; add "
                f"to logical_axis_rules= the rule {hints.rule_choices(a)}")
        return None

    out = []
    for n in names:
        if isinstance(n, (tuple, list)):
            axes = []
            for a in n:
                t = one(a)
                axes += [x for x in (t if isinstance(t, (tuple, list)) else (t,)) if x]
            out.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
        else:
            out.append(one(n))
    return P(*out)


def array_spec(x):
    """The plan a live array carries (`jnp.zeros(shape, out_sharding=P("tp"))`, an initializer
    given `out_sharding=`, built under the authors' mesh): its NamedSharding's spec, in that
    mesh's axis names; None where nothing names a split (one device, no names). Any other
    sharding that splits the array is returned as it is, for the caller's refusal."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        return sharding.spec if any(e is not None for e in sharding.spec) else None
    if sharding is None or sharding.is_fully_replicated:
        return None
    return sharding


@contextlib.contextmanager
def model_axes(batch_axis, rules=None, adapter="from_linen"):
    """While active, in this thread: `jax.lax` collectives given `batch_axis` reduce over the
    mesh's bound batch axes, and sharding hints go through `rules`, keeping only their `model`
    part (`hints.py`; `adapter` names the function that takes the rules, for its errors)."""
    token = _ACTIVE.set(batch_axis)
    with LOCK:  # the patch is process-wide; the wrappers check _ACTIVE (this context only)
        if not _INSTALLED[0]:
            for name, (f, sig) in _COLLECTIVES.items():
                setattr(lax, name, _wrap(name, f, sig))
            hints.install()
        _INSTALLED[0] += 1
        try:
            with named_axis_errors(batch_axis), hints.foreign_axis_errors(), \
                    hints.active(hints.Hints(rules, batch_axis, adapter)):
                yield
        finally:
            _INSTALLED[0] -= 1
            if not _INSTALLED[0]:
                for name, (f, _) in _COLLECTIVES.items():
                    setattr(lax, name, f)
                hints.uninstall()
            _ACTIVE.reset(token)


_UNBOUND = re.compile(r"unbound axis name: ([^\s.]+)")


@contextlib.contextmanager
def named_axis_errors(batch_axis):
    """jax's NameError for an axis name nothing binds, as a ModelError that names it and the
    fix."""
    try:
        yield
    except NameError as e:
        m = _UNBOUND.search(str(e))
        if m is None:
            raise
        name = m.group(1)
        if name == batch_axis:
            raise ModelError(
                f"the model reduces over {name!r} (batch_axis) through a function zerojax does "
                f"not see: a collective imported by name (e.g. `from jax.lax import pmean`) "
                f"keeps jax's own function; call it as jax.lax.pmean / lax.pmean") from None
        given = (f" (batch_axis is {batch_axis!r})" if batch_axis is not None else "")
        raise ModelError(
            f"the model names the axis {name!r} in a collective (e.g. nn.BatchNorm(axis_name="
            f"{name!r}) or lax.pmean(x, {name!r})), but zerojax binds only its mesh axes "
            f"{MESH_AXES}{given}; if {name!r} is the model's batch axis, pass "
            f"batch_axis={name!r} to zj.from_linen / zj.from_nnx: its collectives then run "
            f"over the global batch") from None


def bound_axes(fn, batch_axis, rules=None, adapter="from_linen"):
    """`fn(*args)` with the mesh's batch axis names and `batch_axis` bound to axes of one
    device (size-1 `vmap` axes: a reduction over them sees this call's values only) and no
    sharding constraints, for the adapters' own traces outside the step. The computation is
    unchanged: nothing is batched, so every operation runs as it would without the vmaps."""
    names = [n for n in (*MESH_AXES, batch_axis) if n is not None]

    def run(*args):
        f = lambda _: fn(*args)  # noqa: E731
        for name in names:
            f = jax.vmap(f, in_axes=None, axis_size=1, axis_name=name)
        with model_axes(batch_axis, rules, adapter):
            out = f(jnp.zeros(()))
        return jax.tree.map(lambda x: x[(0,) * len(names)], out)

    return run
