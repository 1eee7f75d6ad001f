"""`from_nnx`: an unmodified Flax NNX module as a zerojax model.

The module is split once into its graph, its `nnx.Param`s (the trained params), its RNG
streams and the rest (the model state: BatchNorm statistics and other non-trained
variables). Every step rebuilds the module functionally (`nnx.merge`) with the root unit's
params gathered, fresh keys from `units.rng()` and the state from `units.state`. A unit
instance holds the root's gather of its params (`placeholders.Stand.gathered`: a read of them
outside the unit, a tied head's `attend`, computes on the right values); its `__call__`
gathers its own and runs the instance, both inside one rematerialized function
(`common.unit_call`). A stack (`nnx.vmap`'s layers) holds stand-ins only `nnx.scan` takes.

`loss_fn(model, batch, rngs)` gets an `nnx.Rngs` of the step's keys (by keyword, to a
parameter named `rngs` only) for call-time dropout (`model(x, rngs=rngs)`). Params laid out
on an explicit-axes mesh (NNX's eager sharding of `nnx.with_partitioning` hints under
`jax.set_mesh`) are taken as plain arrays: zerojax lays them out its own way; their metadata
stays with the module that `merge` returns.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import flax.linen
import jax
import numpy as np
from flax import nnx
from flax.nnx.transforms import iteration

from zerojax.adapters.axes import (
    array_spec,
    check_batch_axis,
    check_rules,
    mesh_spec,
    model_axes,
)
from zerojax.adapters.common import (
    JaxWith,
    at_path,
    check_unit_classes,
    fresh_key,
    put_paths,
    scan_through,
    split_paths,
    takes_rngs,
    training,
    unit_call,
)
from zerojax.adapters.discovery import Found, chosen, is_stack, own, pick_units
from zerojax.adapters.placeholders import Stand
from zerojax.errors import ModelError

# While a loss is traced: its placeholders (`placeholders.Stand`); else None.
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("zerojax_nnx_units", default=None)
_UNIT_CLASSES: dict[type, type] = {}


def _split(module):
    """(graphdef, params, rng streams, model state) of an NNX module."""
    return nnx.split(module, nnx.Param, nnx.RngState, ...)


class NNXModel:
    """An NNX module trained by zerojax (see `from_nnx`)."""

    def __init__(self, module: nnx.Module, loss_fn: Callable, units=None, rngs=("dropout",),
                 batch_axis: str | None = None, logical_axis_rules=None):
        if not isinstance(module, nnx.Module):
            raise ModelError(f"from_nnx needs an nnx.Module, got {type(module).__name__}; "
                             f"for a linen module use zj.from_linen")
        self.loss_fn = loss_fn
        self.classes = pick_units(_submodules(module), "from_nnx") if units is None \
            else check_unit_classes(units)
        self._note = chosen("from_nnx", self.classes) if units is None else ""
        self.rng_names = tuple(rngs)
        self.batch_axis = check_batch_axis(batch_axis)
        self.rules = check_rules(logical_axis_rules, "from_nnx") if logical_axis_rules \
            is not None else (tuple(flax.linen.get_logical_axis_rules()) or None)
        self._loss_takes_rngs = takes_rngs(loss_fn, "loss_fn(model, batch)")
        self.graphdef, params, self._rngs, state = _split(module)
        self._array_specs = {jax.tree_util.keystr(p): array_spec(x) for p, x in
                             jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]}
        self._params = jax.tree.map(_unpinned, nnx.to_pure_dict(params))
        self._state = jax.tree.map(_unpinned, nnx.to_pure_dict(state))
        self._state_def = state
        self._params_def = params
        nodes = {tuple(p): n for p, n in nnx.iter_graph(module) if isinstance(n, self.classes)}
        self.unit_paths = _outermost([p for p in nodes if p])
        self._unit_cls = {p: type(nodes[p]) for p in self.unit_paths}
        # A unit whose params look like nnx.vmap's layers is a stack: only nnx.scan takes them.
        self._stacks = {p for p in self.unit_paths if is_stack(
            map(jax.numpy.shape, jax.tree.leaves(at_path(self._params, p))))}
        if self.classes and not self.unit_paths and not isinstance(module, self.classes):
            names = ", ".join(c.__name__ for c in self.classes)
            raise ModelError(f"the model has no instance of the unit class(es) {names}; "
                             f"name classes of its submodules, or units=() for one unit")
        if jax.tree.leaves(self._state):
            self.init_state = self._init_state

    def init(self, rng: jax.Array) -> dict:
        """The module's own params (it was initialized when constructed; `rng` is unused)."""
        del rng
        return self._params

    def _init_state(self, rng: jax.Array) -> dict:
        del rng
        return self._state

    def loss(self, params, batch, units):
        parts, root = split_paths(params, self.unit_paths)
        if jax.tree.leaves(root):
            root = units.gather(root)
        # A unit's params in the module: the root's gather of them (any read outside the
        # unit computes on the right values), or, for a stack, stand-ins only nnx.scan takes
        # (placeholders.py). A unit's call gathers its own; nnx.scan over a stack becomes
        # units.scan.
        stand = Stand(units, "from_nnx", self._note)
        for path in self.unit_paths:
            cls = self._unit_cls[path]
            parts[path] = stand.standins(at_path(self._params, path), parts[path], path, cls,
                                         True) if path in self._stacks \
                else stand.gathered(parts[path], path, cls)
        module = self._module(put_paths(root, parts), self._fresh_rngs(units),
                              units.state if self._state else None)
        module.train() if training(units) else module.eval()
        for path in self.unit_paths:
            node = _node(module, path)
            object.__setattr__(node, "__class__", _unit_class(type(node)))
            for _, v in nnx.iter_graph(node):
                if isinstance(v, nnx.Param) and stand.entry(v.get_raw_value()) is not None:
                    v.set_metadata(on_get_value=stand.on_read)
        keys = {"rngs": self._call_rngs(units)} if self._loss_takes_rngs else {}
        token = _ACTIVE.set(stand)
        try:
            with scan_through(stand, iteration, "jax", JaxWith), \
                    model_axes(self.batch_axis, self.rules, "from_nnx"):
                out = self.loss_fn(module, batch, **keys)
        finally:
            _ACTIVE.reset(token)
        unused = stand.unused()
        if unused and not stand.unattributed:
            names = ", ".join("".join(f"/{k}" for k in path) for path in unused)
            raise ModelError(f"unit(s) {names} were not run: neither called, scanned by "
                             f"nnx.scan, nor read; call them, or leave their class out of "
                             f"units{self._note}")
        if self._state:
            units.set_state(nnx.to_pure_dict(_split(module)[3]))
        return out

    def _fresh_rngs(self, units):
        if not jax.tree.leaves(self._rngs) or fresh_key(units) is None:
            return jax.tree.map(lambda x: x, self._rngs)  # new Variables, of this trace
        # A new key per stream every step (and evaluation): keys kept in the module would be
        # constants of the compiled step (the same dropout mask every step).
        return jax.tree.map(lambda x: _keys(units.rng(), x.shape) if _is_key(x)
                            else jax.numpy.zeros_like(x), self._rngs)

    def _call_rngs(self, units) -> nnx.Rngs:
        """`loss_fn`'s `rngs=`: streams "default" and those of `from_nnx(rngs=)`, keyed by
        the step (fixed per evaluation in `engine.evaluate`). Units without keys (a bare
        `PlainUnits()`) get fixed keys: NNX modules read their stream even when deterministic."""
        key = fresh_key(units)
        if key is None:
            keys = jax.random.split(jax.random.key(0), 1 + len(self.rng_names))
            return nnx.Rngs(default=keys[0], **dict(zip(self.rng_names, keys[1:])))
        return nnx.Rngs(default=key, **{n: units.rng() for n in self.rng_names})

    def _module(self, params: dict, rngs, state: dict | None) -> nnx.Module:
        p = jax.tree.map(lambda x: x, self._params_def)
        nnx.replace_by_pure_dict(p, params)
        s = jax.tree.map(lambda x: x, self._state_def)
        if state is not None:
            nnx.replace_by_pure_dict(s, state)
        return nnx.merge(self.graphdef, p, rngs, s)

    def param_specs(self) -> dict:
        """The params' tensor-parallel plan from their sharding metadata (`nnx.with_partitioning`
        names, mesh axes or logical names through the logical axis rules); where no metadata
        names a param's split, from the sharding of the array the model built (its authors'
        `out_sharding=`, through the same rules); none: replicated."""
        def spec(path, s):
            name = jax.tree_util.keystr(path)
            if s:
                return mesh_spec(tuple(s), self.rules, strict=f"parameter {name}")
            s = self._array_specs.get(name)
            if s is not None and not isinstance(s, jax.sharding.PartitionSpec):
                raise ModelError(
                    f"parameter {name}'s array is split by {type(s).__name__}, which names no "
                    f"mesh axes zerojax can follow; give it sharding metadata (e.g. "
                    f"nnx.with_partitioning, kernel_metadata={{'out_sharding': P(...)}}) or "
                    f"build it under jax.set_mesh(mesh) with out_sharding=P(...)")
            return None if s is None else mesh_spec(
                tuple(s), self.rules, strict=f"parameter {name}", what="array, sharded as")

        specs = nnx.to_pure_dict(nnx.get_partition_spec(self._params_def))
        return jax.tree_util.tree_map_with_path(
            spec, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))

    def merge(self, params: dict, model_state: dict | None = None) -> nnx.Module:
        """A new module like the user's with `params` (e.g. `engine.params(state)`) and
        `model_state` (e.g. `engine.model_state(state)`) in it."""
        return self._module(params, jax.tree.map(lambda x: x, self._rngs), model_state)

    @staticmethod
    def _unit_call(call, module, args, kwargs):
        stand = _ACTIVE.get()
        gdef, params, rest = nnx.split(module, nnx.Param, ...)
        pure = nnx.to_pure_dict(params, lambda v: v.get_raw_value())
        values = jax.tree.leaves(pure)
        taken = stand.take_call(values)
        if not taken:  # a layer inside a units.scan, or a module an NNX transform rebuilt:
            stand.unattributed |= not stand.in_scan  # its params are values already
            return call(module, *args, **kwargs)
        # The unit's placeholders are gathered in its call; any other param it holds (the
        # root's, shared with it) goes in as the value it has.
        handles = [h for _, h in taken]

        def full_params(gathered):
            flat = list(values)
            for (i, _), g in zip(taken, gathered):
                flat[i] = g
            return jax.tree.unflatten(jax.tree.structure(pure), flat)

        # NNX objects among the arguments (call-time `rngs`) go in as state and come back
        # updated (their counters), as the module's own variables do.
        call_args = (args, kwargs)
        has_nodes = any(isinstance(x, (nnx.Pytree, nnx.Variable)) for x in jax.tree.leaves(
            call_args, is_leaf=lambda x: isinstance(x, (nnx.Pytree, nnx.Variable))))
        a_def, a_vars, a_rest = nnx.split(call_args, nnx.Variable, ...) if has_nodes else (
            None, {}, call_args)

        def fn(gathered, a_vars, a_rest, rest):
            p = jax.tree.map(lambda x: x, params)
            nnx.replace_by_pure_dict(p, full_params(gathered))
            inner = nnx.merge(gdef, p, rest)
            args, kwargs = nnx.merge(a_def, a_vars, a_rest) if has_nodes else a_rest
            token = _ACTIVE.set(None)  # the unit's own call, and its submodules', run plainly
            try:
                out = inner(*args, **kwargs)
            finally:
                _ACTIVE.reset(token)
            a_vars = nnx.state((args, kwargs), nnx.Variable) if has_nodes else {}
            return out, nnx.split(inner, nnx.Param, ...)[2], a_vars

        out, rest, a_vars = unit_call(stand.units, fn, handles, a_vars, a_rest, rest)
        nnx.update(module, rest)
        if has_nodes:
            nnx.update(call_args, a_vars)
        return out


def _submodules(module) -> list[Found]:
    """Every submodule of `module` that holds params; "stacked" when the module is the
    model's own and its params look like `nnx.vmap`'s layers (`discovery.is_stack`)."""
    out = []
    for path, node in nnx.iter_graph(module):
        if not path or not isinstance(node, nnx.Module):
            continue
        shapes = [jax.numpy.shape(x) for x in jax.tree.leaves(nnx.state(node, nnx.Param))]
        direct = any(isinstance(v, nnx.Param) for v in vars(node).values())
        if shapes and (direct or own(type(node))):  # not a container of flax's (nnx.List)
            out.append(Found(tuple(path), type(node), sum(int(np.prod(s)) for s in shapes),
                             own(type(node)) and is_stack(shapes)))
    return out


def _unpinned(x):
    """`x`, or a copy on one device when its type carries a sharding on an explicit-axes mesh
    (NNX's eager sharding under `jax.set_mesh`): the engine's init computes on the plain
    array and lays it out over its own mesh. An abstract one (`nnx.eval_shape`) loses it."""
    mesh = getattr(getattr(x, "sharding", None), "mesh", None)
    types = getattr(mesh, "axis_types", ())
    if isinstance(x, jax.ShapeDtypeStruct) and jax.sharding.AxisType.Explicit in types:
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    if jax.sharding.AxisType.Explicit not in types or not x.is_fully_addressable:
        return x
    device = min(x.devices(), key=lambda d: d.id)
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(device))


def _keys(key, shape):
    """`key`, or keys of `shape` split from it (a stream stacked by `nnx.vmap`)."""
    return jax.random.split(key, shape) if shape else key


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(jax.numpy.result_type(x), jax.dtypes.prng_key)


def _outermost(paths: list[tuple]) -> list[tuple]:
    """Unit paths that are not inside another unit (a unit's submodules belong to it)."""
    order = lambda p: (len(p), [(isinstance(k, str), k) for k in p])  # noqa: E731 -- 0 < 2 < 10
    paths = sorted(set(paths), key=order)
    out: list[tuple] = []
    for p in paths:
        if not any(p[: len(q)] == q for q in out):
            out.append(p)
    return out


def _node(module, path):
    for k in path:
        module = module[k] if isinstance(k, int) else getattr(module, k)
    return module


def _unit_class(cls: type) -> type:
    """`cls` with a `__call__` that runs the instance as one ZeRO unit while a loss is traced."""
    if cls not in _UNIT_CLASSES:
        call = cls.__call__

        def __call__(self, *args, **kwargs):
            if _ACTIVE.get() is None:
                return call(self, *args, **kwargs)
            return NNXModel._unit_call(call, self, args, kwargs)

        _UNIT_CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": __call__,
                                                         "__module__": cls.__module__})
    return _UNIT_CLASSES[cls]


def from_nnx(module: nnx.Module, loss_fn: Callable[..., Any], units=None, rngs=("dropout",),
             batch_axis: str | None = None, logical_axis_rules=None) -> NNXModel:
    """A zerojax model from an NNX module and `loss_fn(module, batch) -> loss | (loss, aux)`.

    Every instance of a class in `units` is one ZeRO unit (gathered before its call, freed
    after, gathered again in backward); the remaining params form one root unit. A unit's
    params read outside its call (a tied head through `attend`, another module, the loss)
    compute there on the root's gather of them; a stack's are read only by its `nnx.scan`
    (else a ModelError). Without `units=` the model's layer class is found
    (`discovery.pick_units`: an `nnx.vmap` stack's, else the model's own repeated class whose
    instances hold the most params) and logged on the "zerojax" logger; `units=()`: the whole
    model is one unit. The module's `nnx.BatchStat`s and other non-param variables
    are the model state; its RNG streams draw fresh keys from the engine every step.
    `loss_fn(module, batch, rngs)`: a parameter named `rngs` gets an `nnx.Rngs` of the step's
    keys (streams "default" and those named in `rngs=`, by keyword) for call-time dropout; the
    loss's other parameters past the first two keep their defaults (one without a default is a
    ModelError: bind it with `functools.partial`). `batch_axis`: the axis name the model's own
    collectives give the batch (e.g. `nnx.BatchNorm(axis_name="batch")`); they then run over
    the global batch. `logical_axis_rules`: flax's rules for logical names in the params'
    sharding metadata, or, for a param without it, in the sharding of the array the model built
    (its authors' `out_sharding=`) (default: the rules in force here); a name mapped to "model"
    is split over a mesh's model axis (docs/tensor-parallel.md). Build the module with eager
    sharding off (`nnx.use_eager_sharding(False)`), under `jax.set_mesh(zj.make_mesh(...))`, or
    under its authors' mesh.
    """
    return NNXModel(module, loss_fn, units, rngs, batch_axis, logical_axis_rules)

