"""`Engine`: init, the jitted shard_map step, and logical params for any ZeRO stage."""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.config import ZeroConfig
from zerojax.errors import ConfigError, ModelError
from zerojax.mesh import (
    batch_axes,
    check_batch,
    check_batch_like,
    check_key,
    check_mesh,
    check_state,
    mesh_sizes,
    naming_the_batch,
    put_batch,
    remember_batch,
)
from zerojax.partition import Layout, LeafSpec
from zerojax.precision import DTYPES, init_loss_scale
from zerojax.step import (
    DEVICE,
    StepPlan,
    TrainState,
    device_key,
    example_keys,
    local_eval,
    local_step,
    split_loss,
    to_memory,
)
from zerojax.units import RecordingUnits, make_handles

HOST_MEMORY = "pinned_host"  # where offload="optimizer" keeps master and optimizer state


class Engine:
    """Trains `model` with `optimizer` under ZeRO `config.stage` on `mesh`."""

    def __init__(self, model, optimizer: optax.GradientTransformation, mesh,
                 config: ZeroConfig | None = None):
        config = ZeroConfig() if config is None else config
        if not isinstance(config, ZeroConfig):
            raise ConfigError(f"config must be a zerojax.ZeroConfig, got {type(config).__name__}")
        for name in ("init", "loss"):
            if not callable(getattr(model, name, None)):
                raise ModelError(f"model {type(model).__name__} has no {name}() method; a "
                                 f"zerojax model defines init(rng) and loss(params, batch, units)")
        if not isinstance(optimizer, optax.GradientTransformation):
            raise ConfigError(f"optimizer must be an optax.GradientTransformation, got "
                              f"{type(optimizer).__name__}")
        check_mesh(mesh)
        self.model, self.optimizer, self.mesh, self.config = model, optimizer, mesh, config
        self.replica, self.data = mesh_sizes(mesh)
        self.axes = batch_axes(mesh)
        self.plan: StepPlan | None = None
        self._step_fn = None
        self._eval_fn = None

    # ---------------------------------------------------------------- layout discovery

    def _discover(self, params_abstract, batch) -> None:
        """Traces the loss once, abstractly, to learn which leaves are scanned or gathered.

        The trace runs inside a shard_map over this engine's mesh, as the step does, so a
        model may name the batch axes in a collective (`lax.pmean(x, batch_axes(mesh))`)."""
        check_batch(batch, self.mesh, self.config.grad_accum, jax.process_count())
        paths_avals = jax.tree.flatten_with_path(params_abstract)[0]
        treedef = jax.tree.structure(params_abstract)
        avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for _, x in paths_avals]
        paths = [jax.tree_util.keystr(p) for p, _ in paths_avals]
        flat = Layout(tuple(LeafSpec(p, a.shape, False) for p, a in zip(paths, avals)),
                      treedef, 1, True)
        devices = self.replica * self.data
        local = self.config.grad_accum * devices
        recs = []

        def micro(x):  # one micro-batch per device, as a global batch
            n = jnp.shape(x)[0] * jax.process_count() // local
            return jax.ShapeDtypeStruct((n * devices, *jnp.shape(x)[1:]), jnp.result_type(x))

        def trace(b, rng, model_state):
            m = jax.tree.leaves(b)[0].shape[0]
            ex_key, first = example_keys(rng, 0, self.axes, m)
            rec = RecordingUnits(avals, DTYPES[self.config.param_dtype],
                                 key=jax.random.fold_in(device_key(rng, 0, self.axes), 0),
                                 state=model_state, example_key=ex_key,
                                 rows=first + jnp.arange(m))
            recs.append(rec)
            split_loss(self.model.loss(make_handles(flat), b, rec))
            return ()

        body = jax.shard_map(trace, mesh=self.mesh, in_specs=(P(self.axes), P(), P()),
                             out_specs=(), check_vma=False)
        jax.eval_shape(body, jax.tree.map(micro, batch), _abstract_key_data(),
                       self._abstract_model_state())
        rec = recs[-1]
        unused = [p for i, p in enumerate(paths) if i not in rec.uses]
        if unused:
            # As plain JAX would: the gradient of an unused parameter is zero.
            warnings.warn(f"the model's loss never gathers parameter(s) {', '.join(unused)}; "
                          f"they get a zero gradient (pass them through units.gather or "
                          f"units.scan to train them)", stacklevel=3)
        both = [p for i, p in enumerate(paths) if len(rec.uses.get(i, ())) > 1]
        if both:
            raise ModelError(f"parameter(s) {', '.join(both)} are used by both units.gather and "
                             f"units.scan; a leaf is either one unit or a stack of layer units")
        self.set_units(tuple(LeafSpec(p, a.shape, rec.uses.get(i) == {"scan"})
                             for i, (p, a) in enumerate(zip(paths, avals))), treedef)

    def set_units(self, leaves: tuple[LeafSpec, ...], treedef) -> None:
        """Adopts a known unit layout (e.g. recorded in a checkpoint) without tracing the loss."""
        stage0 = self.config.stage == 0
        layout = Layout(tuple(leaves), treedef, 1 if stage0 else self.data, replicated=stage0)
        self.plan = StepPlan(self.model, self.optimizer, layout, self.config, self.axes,
                             self.replica, self.data)
        self._step_fn = None
        self._eval_fn = None

    @property
    def layout(self) -> Layout:
        if self.plan is None:
            raise RuntimeError("call engine.init(rng, batch) or engine.init_from(params, batch) "
                               "first: the engine learns the model's units from one batch")
        return self.plan.layout

    # ---------------------------------------------------------------- state and shardings

    def state_specs(self) -> TrainState:
        """PartitionSpecs of every state leaf."""
        layout, cfg = self.layout, self.config
        master = layout.specs()
        opt = map_opt_params(self.optimizer, layout, lambda _, leaf: layout.spec(leaf),
                             self._abstract_opt_state(), lambda _: P())
        compute = None
        if self.plan.stores_compute:
            compute = master if cfg.stage == 3 else layout.unflatten(P() for _ in layout.leaves)
        model_state = jax.tree.map(lambda _: P(), self._abstract_model_state())
        return TrainState(P(), master, opt, compute,
                          jax.tree.map(lambda _: P(), init_loss_scale(1.0)), P(), model_state)

    def _abstract_opt_state(self):
        """The optimizer state of the master params, abstractly, once its mask and labels
        functions are known to treat the flat shards as they treat the logical params."""
        layout = self.layout
        logical = layout.unflatten(jax.ShapeDtypeStruct(leaf.shape, jnp.float32)
                                   for leaf in layout.leaves)
        master = self.abstract_master()
        _check_mask_functions(self.optimizer, logical, master)
        return jax.eval_shape(self.optimizer.init, master)

    def _abstract_model_state(self):
        """The model state as ShapeDtypeStructs (None for a model without `init_state`)."""
        if not hasattr(self.model, "init_state"):
            return None
        return jax.eval_shape(lambda k: _as_arrays(self.model.init_state(k)), jax.random.key(0))

    def state_shardings(self) -> TrainState:
        """NamedShardings of every state leaf on this engine's mesh; with offload="optimizer"
        the master and optimizer state are in "pinned_host" memory, the rest on the device."""
        is_spec = lambda x: isinstance(x, P)
        on = lambda kind: lambda s: NamedSharding(self.mesh, s, memory_kind=kind)
        specs = self.state_specs()
        shardings = jax.tree.map(on(None), specs, is_leaf=is_spec)
        if self.config.offload is None:
            return shardings
        host = lambda t: jax.tree.map(on(HOST_MEMORY), t, is_leaf=is_spec)
        return shardings._replace(master=host(specs.master), opt_state=host(specs.opt_state))

    def abstract_master(self):
        layout = self.layout
        return layout.unflatten(jax.ShapeDtypeStruct(layout.flat_shape(leaf), jnp.float32)
                                for leaf in layout.leaves)

    def abstract_state(self) -> TrainState:
        """The state as `ShapeDtypeStruct`s with shardings: for AOT compilation without memory."""
        shapes = jax.eval_shape(self._to_state, self.layout.unflatten(
            jax.ShapeDtypeStruct(leaf.shape, jnp.float32) for leaf in self.layout.leaves),
            _abstract_key_data(), self._abstract_model_state())
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            shapes, self.state_shardings())

    def _to_state(self, params, rng, model_state) -> TrainState:
        layout, cfg = self.layout, self.config
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
        master = layout.to_flat(params)
        compute = None
        if self.plan.stores_compute:
            dtype = DTYPES[cfg.param_dtype]
            src = master if cfg.stage == 3 else params
            compute = jax.tree.map(lambda x: x.astype(dtype), src)
        return TrainState(jnp.zeros((), jnp.int32), master, self.optimizer.init(master), compute,
                          init_loss_scale(cfg.initial_scale), rng, _as_arrays(model_state))

    def _init_state(self, key):
        return _as_arrays(self.model.init_state(key)) if hasattr(self.model, "init_state") \
            else None

    def init(self, rng: jax.Array, batch) -> TrainState:
        """Fresh state from `model.init(rng)`; `batch` (arrays or ShapeDtypeStructs) sets units.

        `rng` itself initializes the params (as `model.init(rng)` does); the model state is
        initialized with `fold_in(rng, 1)` and the training keys derive from `fold_in(rng, 2)`.
        """
        check_key(rng)
        with naming_the_batch(batch):
            self._discover(jax.eval_shape(self.model.init, rng), batch)
        remember_batch(self, batch)

        def build(r):
            state_key, train_key = _derived_keys(r)
            return self._to_state(self.model.init(r), train_key, self._init_state(state_key))

        return jax.jit(build, out_shardings=self.state_shardings())(rng)

    def init_from(self, params, batch, *, rng: jax.Array | None = None,
                  model_state: Any = None) -> TrainState:
        """State from given logical params (e.g. an export, or plain Flax params).

        `rng` (default `jax.random.key(0)`) derives the training keys as in `init`;
        `model_state` defaults to `model.init_state(fold_in(rng, 1))`."""
        rng = jax.random.key(0) if rng is None else rng
        check_key(rng)
        expected = jax.eval_shape(self.model.init, jax.random.key(0))
        _check_same_structure(expected, params)
        if model_state is not None:
            want = self._abstract_model_state()
            if want is None:
                raise ModelError("model_state= was given but the model has no init_state(rng)")
            _check_same_structure(want, model_state, "model_state")
        with naming_the_batch(batch):
            self._discover(expected, batch)
        remember_batch(self, batch)

        def build(params, r, model_state):
            state_key, train_key = _derived_keys(r)
            if model_state is None:
                model_state = self._init_state(state_key)
            return self._to_state(params, train_key, model_state)

        return jax.jit(build, out_shardings=self.state_shardings())(params, rng, model_state)

    # ---------------------------------------------------------------- the step

    def _compiled_step(self):
        if self._step_fn is None:
            specs = self.state_specs()
            body = jax.shard_map(partial(local_step, self.plan), mesh=self.mesh,
                                 in_specs=(specs, P(self.axes)), out_specs=(specs, P()),
                                 check_vma=True)
            # The state's memory kinds are pinned, not inferred: a host computation's scalar
            # output (an optimizer's step count) may otherwise come back typed as device.
            self._step_fn = jax.jit(body, donate_argnums=0,
                                    out_shardings=(self.state_shardings(), None))
        return self._step_fn

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step on the global `batch` (this process's slice in multi-process runs).

        Donates `state`. Metrics: "loss", "grad_norm" (global, before clipping), "nonfinite"
        (1 if a gradient held NaN or inf, in every precision, else 0), the model's aux metrics,
        and for dynamic loss scaling "loss_scale" and "skipped".
        """
        self.layout  # noqa: B018 -- raises a clear error before init
        check_state(self, state)
        check_batch(batch, self.mesh, self.config.grad_accum, jax.process_count())
        check_batch_like(self, batch)
        return self._compiled_step()(state, put_batch(batch, self.mesh))

    def evaluate(self, state: TrainState, batch) -> dict[str, jax.Array]:
        """Mean loss (and the model's aux metrics) on `batch`, computed sharded like the step."""
        self.layout  # noqa: B018 -- raises a clear error before init
        check_state(self, state)
        check_batch(batch, self.mesh, 1, jax.process_count())
        check_batch_like(self, batch)
        if self._eval_fn is None:
            body = jax.shard_map(partial(local_eval, self.plan), mesh=self.mesh,
                                 in_specs=(self.state_specs(), P(self.axes)), out_specs=P(),
                                 check_vma=True)
            self._eval_fn = jax.jit(body)
        return self._eval_fn(state, put_batch(batch, self.mesh))

    def lower(self, state=None, batch=None):
        """`jax.jit(...).lower` of the step, for abstract or concrete inputs."""
        if state is not None:
            check_state(self, state)
        state = self.abstract_state() if state is None else state
        return self._compiled_step().lower(state, batch)

    def params(self, state: TrainState) -> Any:
        """Logical fp32 master params: original shapes, padding removed."""
        layout, offload = self.layout, self.config.offload is not None
        check_state(self, state)
        return jax.jit(lambda m: layout.from_flat(to_memory(m, DEVICE) if offload else m))(
            state.master)

    def model_state(self, state: TrainState) -> Any:
        """The logical model state (None for a model without `init_state`)."""
        self.layout  # noqa: B018 -- raises a clear error before init
        check_state(self, state)
        return state.model_state

    def save(self, state: TrainState, directory, step: int | None = None, *, wait: bool = True,
             keep: int | None = None, extra: dict | None = None,
             allow_nonfinite: bool = False) -> int:
        """Saves `state` in the logical layout (any stage, any N); see `zerojax.checkpoint.save`.

        A state whose params or optimizer moments hold NaN or inf is refused (CheckpointError
        naming the first such leaf) unless `allow_nonfinite=True`."""
        from zerojax import checkpoint  # orbax is imported only by those who checkpoint
        return checkpoint.save(self, state, directory, step, wait=wait, keep=keep, extra=extra,
                               allow_nonfinite=allow_nonfinite)

    def restore(self, directory, step: int | None = None) -> TrainState:
        """The saved state of `step` (default: latest) on this engine's mesh and stage."""
        from zerojax import checkpoint
        return checkpoint.restore(self, directory, step)


def map_opt_params(optimizer, layout: Layout, f, opt_state, non_param=lambda v: v):
    """`f(x, LeafSpec)` over the optimizer state's param-like leaves (MaskedNodes kept),
    `non_param(x)` over the others."""
    masked = lambda x: isinstance(x, optax.MaskedNode)
    try:
        return optax.tree_map_params(
            optimizer, lambda x, leaf: x if masked(x) else f(x, leaf), opt_state,
            layout.unflatten(layout.leaves), transform_non_params=non_param, is_leaf=masked)
    except Exception:  # optax calls init on a placeholder, which a labels function may not
        pass  # take (e.g. a dict comprehension over the params): match the leaves by path.
    params = jax.tree.flatten_with_path(layout.unflatten(layout.leaves))[0]
    by_path = {tuple(p): leaf for p, leaf in params}

    def one(path, x):
        if masked(x):
            return x
        for i in range(len(path) + 1):  # a copy of the params ends in a param's path
            leaf = by_path.get(tuple(path[i:]))
            if leaf is not None and jnp.shape(x) in (layout.flat_shape(leaf), leaf.shape):
                return f(x, leaf)
        return non_param(x)

    return jax.tree_util.tree_map_with_path(one, opt_state, is_leaf=masked)


def _mask_functions(optimizer) -> list:
    """The masks and labels given as functions (optax.masked's `mask`, multi_transform's
    `param_labels`), found in the closures of the optimizer's functions."""
    out, seen, todo = [], set(), [optimizer]
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if isinstance(f, optax.GradientTransformation):
            todo += [f.init, f.update]
        elif isinstance(f, (tuple, list)):
            todo += list(f)
        elif isinstance(f, dict):
            todo += list(f.values())
        elif getattr(f, "__code__", None) is not None and f.__closure__:
            for name, cell in zip(f.__code__.co_freevars, f.__closure__):
                try:
                    v = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if name in ("mask", "param_labels") and callable(v) and \
                        not isinstance(v, optax.GradientTransformation):
                    out.append(v)
                elif callable(v) or isinstance(v, (tuple, list, dict)):
                    todo.append(v)
    return out


def _check_mask_functions(optimizer, logical, master) -> None:
    """The engine hands the optimizer flat shards; a mask or labels function must give on
    them what it gives on the logical params (it may go by names, not by shapes)."""
    fix = ("pass the mask or labels as a pytree built from the logical params instead, e.g. "
           "mask=fn(jax.eval_shape(model.init, jax.random.key(0)))")
    for fn in _mask_functions(optimizer):
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            want, got = fn(logical), fn(master)
            same = jax.tree.structure(want) == jax.tree.structure(got) and all(
                np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)))
        except Exception as e:  # whatever a user's function raises
            raise ConfigError(f"the optimizer's mask/labels function {name} failed on the "
                              f"engine's flat sharded params ({type(e).__name__}: {e}); "
                              f"{fix}") from None
        if not same:
            raise ConfigError(f"the optimizer's mask/labels function {name} gives other "
                              f"results on the engine's flat sharded params than on the logical "
                              f"params (does it read shapes?); {fix}")


def _as_arrays(tree):
    return jax.tree.map(jnp.asarray, tree)


def _derived_keys(rng) -> tuple[jax.Array, jax.Array]:
    """(model-state init key, training base key as raw uint32 data) from the init key."""
    key = rng if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(rng)
    return jax.random.fold_in(key, 1), jax.random.key_data(jax.random.fold_in(key, 2))


def _abstract_key_data() -> jax.ShapeDtypeStruct:
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))


def _check_same_structure(expected, params, what: str = "params") -> None:
    exp = {jax.tree_util.keystr(p): tuple(jnp.shape(x))
           for p, x in jax.tree.flatten_with_path(expected)[0]}
    got = {jax.tree_util.keystr(p): tuple(jnp.shape(x))
           for p, x in jax.tree.flatten_with_path(params)[0]}
    diffs = [f"{k}: expected {exp.get(k, 'absent')}, got {got.get(k, 'absent')}"
             for k in sorted(set(exp) | set(got)) if exp.get(k) != got.get(k)]
    if diffs:
        raise ModelError(f"{what} do not match the model's structure: " + "; ".join(diffs[:10]))
