"""`Engine`: init, the jitted shard_map step, and logical params for any ZeRO stage."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.config import ZeroConfig
from zerojax.errors import ConfigError, ModelError
from zerojax.mesh import batch_axes, check_batch, mesh_sizes, put_batch
from zerojax.partition import Layout, LeafSpec
from zerojax.precision import DTYPES, init_loss_scale
from zerojax.step import StepPlan, TrainState, local_eval, local_step, split_loss
from zerojax.units import RecordingUnits, make_handles


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
        self.model, self.optimizer, self.mesh, self.config = model, optimizer, mesh, config
        self.replica, self.data = mesh_sizes(mesh)
        self.axes = batch_axes(mesh)
        self.plan: StepPlan | None = None
        self._step_fn = None
        self._eval_fn = None

    # ---------------------------------------------------------------- layout discovery

    def _discover(self, params_abstract, batch) -> None:
        """Traces the loss once, abstractly, to learn which leaves are scanned or gathered."""
        check_batch(batch, self.mesh, self.config.grad_accum, jax.process_count())
        paths_avals = jax.tree.flatten_with_path(params_abstract)[0]
        treedef = jax.tree.structure(params_abstract)
        avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for _, x in paths_avals]
        paths = [jax.tree_util.keystr(p) for p, _ in paths_avals]
        flat = Layout(tuple(LeafSpec(p, a.shape, False) for p, a in zip(paths, avals)),
                      treedef, 1, True)
        rec = RecordingUnits(avals, DTYPES[self.config.param_dtype])
        local = self.config.grad_accum * self.replica * self.data

        def micro(x):
            n = jnp.shape(x)[0] * jax.process_count() // local
            return jax.ShapeDtypeStruct((n, *jnp.shape(x)[1:]), jnp.result_type(x))

        jax.eval_shape(lambda b: split_loss(self.model.loss(make_handles(flat), b, rec)),
                       jax.tree.map(micro, batch))
        unused = [p for i, p in enumerate(paths) if i not in rec.uses]
        if unused:
            raise ModelError(f"the model's loss never gathers parameter(s) {', '.join(unused)}; "
                             f"pass every parameter through units.gather or units.scan")
        both = [p for i, p in enumerate(paths) if len(rec.uses[i]) > 1]
        if both:
            raise ModelError(f"parameter(s) {', '.join(both)} are used by both units.gather and "
                             f"units.scan; a leaf is either one unit or a stack of layer units")
        self.set_units(tuple(LeafSpec(p, a.shape, rec.uses[i] == {"scan"})
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
        opt_abstract = jax.eval_shape(self.optimizer.init, self.abstract_master())
        is_leaf = lambda x: isinstance(x, (P, optax.MaskedNode))
        opt = optax.tree_map_params(
            self.optimizer, lambda s, spec: s if isinstance(s, optax.MaskedNode) else spec,
            opt_abstract, master, transform_non_params=lambda _: P(), is_leaf=is_leaf)
        compute = None
        if self.plan.stores_compute:
            compute = master if cfg.stage == 3 else layout.unflatten(P() for _ in layout.leaves)
        return TrainState(P(), master, opt, compute, jax.tree.map(lambda _: P(),
                                                                 init_loss_scale(1.0)))

    def state_shardings(self) -> TrainState:
        """NamedShardings of every state leaf on this engine's mesh."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.state_specs(),
                            is_leaf=lambda x: isinstance(x, P))

    def abstract_master(self):
        layout = self.layout
        return layout.unflatten(jax.ShapeDtypeStruct(layout.flat_shape(leaf), jnp.float32)
                                for leaf in layout.leaves)

    def abstract_state(self) -> TrainState:
        """The state as `ShapeDtypeStruct`s with shardings: for AOT compilation without memory."""
        shapes = jax.eval_shape(self._to_state, self.layout.unflatten(
            jax.ShapeDtypeStruct(leaf.shape, jnp.float32) for leaf in self.layout.leaves))
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            shapes, self.state_shardings())

    def _to_state(self, params) -> TrainState:
        layout, cfg = self.layout, self.config
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
        master = layout.to_flat(params)
        compute = None
        if self.plan.stores_compute:
            dtype = DTYPES[cfg.param_dtype]
            src = master if cfg.stage == 3 else params
            compute = jax.tree.map(lambda x: x.astype(dtype), src)
        return TrainState(jnp.zeros((), jnp.int32), master, self.optimizer.init(master), compute,
                          init_loss_scale(cfg.initial_scale))

    def init(self, rng: jax.Array, batch) -> TrainState:
        """Fresh state from `model.init(rng)`; `batch` (arrays or ShapeDtypeStructs) sets units."""
        self._discover(jax.eval_shape(self.model.init, rng), batch)
        build = jax.jit(lambda r: self._to_state(self.model.init(r)),
                        out_shardings=self.state_shardings())
        return build(rng)

    def init_from(self, params, batch) -> TrainState:
        """State from given logical params (e.g. an export, or plain Flax params)."""
        rng = jax.random.key(0)
        expected = jax.eval_shape(self.model.init, rng)
        _check_same_structure(expected, params)
        self._discover(expected, batch)
        build = jax.jit(self._to_state, out_shardings=self.state_shardings())
        return build(params)

    # ---------------------------------------------------------------- the step

    def _compiled_step(self):
        if self._step_fn is None:
            specs = self.state_specs()
            body = jax.shard_map(partial(local_step, self.plan), mesh=self.mesh,
                                 in_specs=(specs, P(self.axes)), out_specs=(specs, P()),
                                 check_vma=True)
            self._step_fn = jax.jit(body, donate_argnums=0)
        return self._step_fn

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step on the global `batch` (this process's slice in multi-process runs).

        Donates `state`. Metrics: "loss", "grad_norm" (global, before clipping), the model's
        aux metrics, and for dynamic loss scaling "loss_scale" and "skipped".
        """
        self.layout  # noqa: B018 -- raises a clear error before init
        check_batch(batch, self.mesh, self.config.grad_accum, jax.process_count())
        return self._compiled_step()(state, put_batch(batch, self.mesh))

    def evaluate(self, state: TrainState, batch) -> dict[str, jax.Array]:
        """Mean loss (and the model's aux metrics) on `batch`, computed sharded like the step."""
        self.layout  # noqa: B018 -- raises a clear error before init
        check_batch(batch, self.mesh, 1, jax.process_count())
        if self._eval_fn is None:
            body = jax.shard_map(partial(local_eval, self.plan), mesh=self.mesh,
                                 in_specs=(self.state_specs(), P(self.axes)), out_specs=P(),
                                 check_vma=True)
            self._eval_fn = jax.jit(body)
        return self._eval_fn(state, put_batch(batch, self.mesh))

    def lower(self, state=None, batch=None):
        """`jax.jit(...).lower` of the step, for abstract or concrete inputs."""
        state = self.abstract_state() if state is None else state
        return self._compiled_step().lower(state, batch)

    def params(self, state: TrainState) -> Any:
        """Logical fp32 master params: original shapes, padding removed."""
        layout = self.layout
        return jax.jit(layout.from_flat)(state.master)

    def save(self, state: TrainState, directory, step: int | None = None, *, wait: bool = True,
             keep: int | None = None, extra: dict | None = None) -> int:
        """Saves `state` in the logical layout (any stage, any N); see `zerojax.checkpoint.save`."""
        from zerojax import checkpoint  # orbax is imported only by those who checkpoint
        return checkpoint.save(self, state, directory, step, wait=wait, keep=keep, extra=extra)

    def restore(self, directory, step: int | None = None) -> TrainState:
        """The saved state of `step` (default: latest) on this engine's mesh and stage."""
        from zerojax import checkpoint
        return checkpoint.restore(self, directory, step)


def _check_same_structure(expected, params) -> None:
    exp = {jax.tree_util.keystr(p): tuple(jnp.shape(x))
           for p, x in jax.tree.flatten_with_path(expected)[0]}
    got = {jax.tree_util.keystr(p): tuple(jnp.shape(x))
           for p, x in jax.tree.flatten_with_path(params)[0]}
    diffs = [f"{k}: expected {exp.get(k, 'absent')}, got {got.get(k, 'absent')}"
             for k in sorted(set(exp) | set(got)) if exp.get(k) != got.get(k)]
    if diffs:
        raise ModelError("params do not match the model's structure: " + "; ".join(diffs[:10]))
