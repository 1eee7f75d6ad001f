"""`from_linen`: an unmodified Flax linen module as a zerojax model.

Each `apply` runs `module.apply` with the root unit's params gathered and, in place of every
unit's params, stand-ins (`placeholders.Standin`: shapes, no values), under
`nn.intercept_methods`: a call of any method of a unit instance (`attend` as `__call__`)
gathers its params and runs the instance as its own `apply`, both inside one rematerialized
function (`common.unit_call`); a read of them anywhere else is gathered there. A unit stacked
by `nn.scan` gets stand-ins of its stacked shape that only its scan takes; flax's scan loop
over them (`flax.core.axes_scan`) is replaced, for that call only, by `units.scan`, which hands
flax's layer body the gathered layer in their place.

Params boxed with sharding hints (`nn.with_partitioning`, `nn.with_logical_partitioning`) are
trained as plain arrays, which linen's `apply` takes as it takes its boxes; `merge` boxes them
again. The model's own axis names and hints: see `axes.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import axes_scan, meta

from zerojax.adapters.axes import bound_axes, check_batch_axis, check_rules, mesh_spec, model_axes
from zerojax.adapters.common import (
    LaxWith,
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
from zerojax.adapters.discovery import Found, chosen, own, pick_units
from zerojax.adapters.placeholders import Stand
from zerojax.errors import ModelError


class LinenModel:
    """A linen module trained by zerojax (see `from_linen`)."""

    def __init__(self, module: nn.Module, loss_fn: Callable, sample_args, units=None,
                 rngs=("dropout",), batch_axis: str | None = None, sample_kwargs=None,
                 logical_axis_rules=None):
        if not isinstance(module, nn.Module):
            raise ModelError(f"from_linen needs a flax.linen Module, got {type(module).__name__}"
                             f"; for an NNX module use zj.from_nnx")
        self.module, self.loss_fn = module, loss_fn
        self.batch_axis = check_batch_axis(batch_axis)
        # The rules given, else those in force where the model is built (nn.logical_axis_rules)
        self.rules = check_rules(logical_axis_rules, "from_linen") if logical_axis_rules \
            is not None else (tuple(nn.get_logical_axis_rules()) or None)
        self._loss_takes_rngs = takes_rngs(loss_fn, "loss_fn(apply, batch)")
        sample_args = sample_args if isinstance(sample_args, tuple) else (sample_args,)
        if not isinstance(sample_kwargs, (dict, type(None))):
            raise ModelError(f"sample_kwargs={sample_kwargs!r} must be a dict of the keyword "
                             f"arguments of one call, e.g. {{'train': False}}")
        # engine.init runs module.init for real, which needs arrays.
        self.sample_args, self.sample_kwargs = jax.tree.map(
            lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x,
            (sample_args, dict(sample_kwargs or {})))
        self.classes = () if units is None else check_unit_classes(units)
        self.rng_names = tuple(rngs)
        self.boxes = jax.eval_shape(self._boxed_variables, jax.random.key(0))  # as module.init
        abstract = unbox(self.boxes)
        if "params" not in abstract:
            raise ModelError(f"{type(module).__name__}.init(...) made no params; check "
                             f"sample_args, the arguments of one call of the module")
        self.state_cols = tuple(c for c in abstract if c != "params")
        self.abstract = abstract["params"]
        if units is None:
            self.classes = pick_units(self._submodules(abstract), "from_linen")
        self.note = chosen("from_linen", self.classes) if units is None else ""
        self.instances, self.stacks = self._find_units(abstract)
        if self.state_cols:
            self.init_state = self._init_state

    def _boxed_variables(self, rng):
        # "params" gets `rng` itself, as `module.init(rng, ...)` does. The batch axis names
        # are bound: a sample call in training mode may reduce over them.
        rngs = {"params": rng, **{n: jax.random.fold_in(rng, i + 1)
                                  for i, n in enumerate(self.rng_names)}}
        init = bound_axes(lambda: dict(self.module.init(rngs, *self.sample_args,
                                                        **self.sample_kwargs)),
                          self.batch_axis, self.rules)
        return init()

    def _variables(self, rng):
        return unbox(self._boxed_variables(rng))

    def init(self, rng: jax.Array) -> dict:
        return self._variables(rng)["params"]

    def _init_state(self, rng: jax.Array) -> dict:
        return {c: v for c, v in self._variables(rng).items() if c != "params"}

    def _run(self, abstract, intercept) -> None:
        """One abstract call of the module on the sample arguments under `intercept`."""
        def run(variables):
            rngs = {n: jax.random.key(0) for n in self.rng_names}
            with nn.intercept_methods(intercept):
                self.module.apply(variables, *self.sample_args, rngs=rngs,
                                  mutable=list(self.state_cols), **self.sample_kwargs)

        jax.eval_shape(bound_axes(run, self.batch_axis, self.rules), abstract)

    def _submodules(self, abstract) -> list[Found]:
        """Every submodule instance the sample call runs that holds params."""
        seen: dict[tuple, Found] = {}

        def record(next_fun, args, kwargs, ctx):
            m = ctx.module
            path = m.path
            if path and path not in seen and type(m).__module__ != nn.transforms.__name__:
                mine = m.variables.get("params", {})
                full = at_path(abstract["params"], path) if jax.tree.leaves(mine) else {}
                pairs = list(zip(map(jnp.shape, jax.tree.leaves(full)),
                                 map(jnp.shape, jax.tree.leaves(mine))))
                stacked = bool(pairs) and pairs[0][0] != pairs[0][1]
                # a stack scanned over another axis than 0 cannot be a unit (see Apply)
                container = not own(type(m)) and all(isinstance(v, dict) for v in mine.values())
                if container:  # flax's nn.Sequential: no params of its own
                    pass
                elif pairs and (not stacked or all(f[1:] == s and f[0] == pairs[0][0][0]
                                                   for f, s in pairs)):
                    seen[path] = Found(path, type(m), sum(int(np.prod(f)) for f, _ in pairs),
                                       stacked)
                elif pairs:
                    moved.add(path)
            return next_fun(*args, **kwargs)

        moved: set[tuple] = set()
        self._run(abstract, record)
        return [f for p, f in seen.items() if not any(p[:len(q)] == q for q in moved)]

    def _find_units(self, abstract) -> tuple[list[tuple], dict[tuple, Any]]:
        """Paths of the unit instances called directly, and of those stacked by `nn.scan`
        (with the stacked params' abstract values)."""
        found: dict[tuple, Any] = {}
        self.unit_cls: dict[tuple, type] = {}
        depth = [0]

        def record(next_fun, args, kwargs, ctx):
            top = _is_unit(ctx.module, self.classes) and not depth[0]
            if top and ctx.module.path not in found:
                found[ctx.module.path] = ctx.module.variables.get("params", {})
                self.unit_cls[ctx.module.path] = type(ctx.module)
            depth[0] += top
            try:
                return next_fun(*args, **kwargs)
            finally:
                depth[0] -= top

        self._run(abstract, record)
        if self.classes and not found:
            names = ", ".join(c.__name__ for c in self.classes)
            raise ModelError(f"the model calls no instance of the unit class(es) {names}; "
                             f"name classes of its submodules, or units=() for one unit")
        instances, stacks = [], {}
        for path, seen in found.items():
            full = at_path(abstract["params"], path)
            if jax.tree.map(jnp.shape, full) == jax.tree.map(jnp.shape, seen):
                instances.append(path)
            else:
                stacks[path] = full
        return instances, stacks

    def loss(self, params, batch, units):
        apply = Apply(self, params, units)
        with model_axes(self.batch_axis, self.rules), nn.logical_axis_rules(self.rules or ()):
            if self._loss_takes_rngs:
                return self.loss_fn(apply, batch, rngs=apply.fresh_rngs())
            return self.loss_fn(apply, batch)

    def param_specs(self) -> dict:
        """The params' tensor-parallel plan from their boxes: `nn.with_partitioning`'s mesh axes
        and `nn.with_logical_partitioning`'s logical names through the logical axis rules (the
        box's own, else `from_linen`'s, else those in force at construction); an unboxed param
        is replicated. A stack's layer axis is the box's first name."""
        def spec(box):
            if isinstance(box, nn.LogicallyPartitioned):
                return mesh_spec(box.names, self.rules or (tuple(box.rules or ()) or None))
            if isinstance(box, nn.Partitioned):
                return mesh_spec(box.names, self.rules)
            return None
        return jax.tree.map(spec, self.boxes["params"], is_leaf=_is_box)

    def merge(self, params: dict, model_state: dict | None = None) -> dict:
        """The linen variables `{"params": params, **model_state}` for `module.apply`, boxed
        as `module.init` boxes them (`nn.with_partitioning` hints and the like)."""
        variables = {"params": params, **(model_state or {})}
        return rebox({c: self.boxes[c] for c in variables}, variables)


class Apply:
    """`apply(*args, **kwargs)`: `module.apply` with this step's params, rngs and state.

    `apply.training` is `units.training` (True in `engine.step`, False in `engine.evaluate`),
    for the module's `train` / `deterministic` argument. `rngs=` (a dict of keys by stream)
    overrides the step's keys for the streams it names.
    """

    def __init__(self, model: LinenModel, params, units):
        self.model, self.params, self.units = model, params, units
        self.training = training(units)
        self._inside = False  # in a unit's own apply, whose calls run plainly
        self._streams: tuple = ()  # the rng streams of the apply being run
        self._stand = None  # the placeholders of the apply being run (placeholders.Stand)

    def fresh_rngs(self) -> dict:
        """A fresh key for each stream in `from_linen(..., rngs=)`: the step's keys (in
        `engine.evaluate` too, fixed per evaluation); empty from units without keys."""
        keys = {n: fresh_key(self.units) for n in self.model.rng_names}
        return {n: k for n, k in keys.items() if k is not None}

    def __call__(self, *args, method=None, rngs=None, **kwargs):
        model, units = self.model, self.units
        parts, root = split_paths(self.params, [*model.instances, *model.stacks])
        if jax.tree.leaves(root):
            root = units.gather(root)
        # In place of a unit's params, stand-ins (placeholders.py): a unit's call gathers
        # them, a read elsewhere gathers it there; flax's scan over a stack becomes units.scan.
        stand = self._stand = Stand(units, "from_linen", model.note)
        for path in model.instances:
            parts[path] = stand.standins(at_path(model.abstract, path), parts[path], path,
                                         model.unit_cls[path], False)
        for path in model.stacks:
            parts[path] = stand.standins(model.stacks[path], parts[path], path,
                                         model.unit_cls[path], True)
        variables = {"params": put_paths(root, parts)}
        state = units.state if model.state_cols else None
        variables.update(state or {})
        if rngs is not None and not isinstance(rngs, dict):
            rngs = {"params": rngs}  # as module.apply takes one key
        rngs = {**self.fresh_rngs(), **(rngs or {})}
        self._streams = tuple(rngs)
        with scan_through(stand, axes_scan, "lax", LaxWith), \
                nn.intercept_methods(self._intercept):
            out = model.module.apply(variables, *args, rngs=rngs, method=method,
                                     mutable=list(model.state_cols) or False, **kwargs)
        if not set(model.stacks) <= stand.scanned:
            # Else the model computed on the stand-ins.
            raise ModelError(f"a unit stacked by nn.scan must take its params on axis 0, "
                             f"unmoved (variable_axes={{'params': 0}}); or leave its class out "
                             f"of units{model.note}")
        if state is None:
            return out
        out, new = out
        units.set_state({c: new[c] for c in model.state_cols})
        return out

    def _intercept(self, next_fun, args, kwargs, ctx):
        m = ctx.module
        if (self._inside or m.path not in self.model.instances
                or not _is_unit(m, self.model.classes)):
            return next_fun(*args, **kwargs)
        cols = {c: v for c, v in m.variables.items() if c != "params"}
        mutable = [c for c in cols if m.is_mutable_collection(c)]
        rngs = {n: m.make_rng(n) for n in self._streams if m.has_rng(n)}
        unbound = m.clone(parent=None)
        method = ctx.method_name

        def fn(params, args, kwargs, cols, rngs):
            self._inside = True
            try:
                out = unbound.apply({"params": params, **cols}, *args, rngs=rngs,
                                    method=method, mutable=mutable or False, **kwargs)
            finally:
                self._inside = False
            return out if mutable else (out, {})

        params = m.variables["params"]
        values = jax.tree.leaves(params)
        taken = dict(self._stand.take_call(values))
        if len(taken) < len(values):  # no stand-ins of this unit: values flax computed
            return next_fun(*args, **kwargs)
        handles = jax.tree.unflatten(jax.tree.structure(params), [taken[i] for i in
                                                                   range(len(values))])
        out, new = unit_call(self.units, fn, handles, args, kwargs, cols, rngs)
        for c in mutable:
            for name, v in new[c].items():
                m.put_variable(c, name, v)
        return out


def _is_box(x) -> bool:
    return isinstance(x, meta.AxisMetadata)


def _unboxed(box):
    """A box's value, without the sharding constraint `Partitioned.unbox` applies under a mesh
    (it would name axes zerojax's mesh lacks, or its manual axes)."""
    try:
        value = box.unbox(apply_constraint=False)
    except TypeError:  # an AxisMetadata without the option
        value = box.unbox()
    return _unboxed(value) if _is_box(value) else value


def unbox(tree):
    """`tree` with every flax `AxisMetadata` box replaced by its value."""
    return jax.tree.map(lambda x: _unboxed(x) if _is_box(x) else x, tree, is_leaf=_is_box)


def rebox(boxes, tree):
    """`tree` (unboxed) in the boxes of `boxes` (a tree like it, as `module.init` made it)."""
    return jax.tree.map(lambda b, x: b.replace_boxed(x) if _is_box(b) else x, boxes, tree,
                        is_leaf=_is_box)


def _is_unit(module, classes) -> bool:
    # nn.scan(Block) etc. subclass Block; their own call is the transform, not the unit.
    return isinstance(module, classes) and type(module).__module__ != nn.transforms.__name__


def from_linen(module: nn.Module, loss_fn: Callable[..., Any], sample_args, units=None,
               rngs=("dropout",), batch_axis: str | None = None,
               sample_kwargs: dict | None = None, logical_axis_rules=None) -> LinenModel:
    """A zerojax model from a linen module and `loss_fn(apply, batch) -> loss | (loss, aux)`.

    `apply(*args, **kwargs)` is `module.apply` with this step's params, a fresh key for each
    stream in `rngs` (in `engine.evaluate` too, fixed per evaluation), and the model state
    (every collection `module.init` makes besides "params", e.g. "batch_stats") mutable.
    A parameter of `loss_fn` named `rngs` gets those keys as a dict (by keyword), for
    `apply(..., rngs=rngs)`; its other parameters past the first two keep their defaults (one
    without a default is a ModelError: bind it with `functools.partial`).
    `sample_args`, `sample_kwargs`: the positional and keyword arguments of one call of the
    module, for `module.init` (arrays or `jax.ShapeDtypeStruct`s; `sample_kwargs={"train":
    False}` for a required keyword-only flag). Every instance of a class in `units` is one
    ZeRO unit; one stacked by `nn.scan` is one unit per layer; the remaining params form one
    root unit. Without `units=` the model's layer class is found (`discovery.pick_units`: the
    `nn.scan` stacks', else the model's own repeated class whose instances hold the most
    params) and logged on the "zerojax" logger; `units=()` makes the whole model one unit.
    `batch_axis`: the axis name the model's own collectives give the batch (e.g.
    `nn.BatchNorm(axis_name="batch")`); they then run over the global batch.
    `logical_axis_rules`: flax's rules for the logical names of `nn.with_logical_partitioning`
    and `nn.with_logical_constraint` (default: those in force here, `nn.logical_axis_rules`);
    a name mapped to "model" is split over a mesh's model axis (tensor parallelism, see
    docs/tensor-parallel.md), names mapped to "data", "replica" or None are left to ZeRO.
    """
    return LinenModel(module, loss_fn, sample_args, units, rngs, batch_axis, sample_kwargs,
                      logical_axis_rules)
