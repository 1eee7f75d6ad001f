"""`Engine`: init, the jitted shard_map step, and logical params for any ZeRO stage.

The engine holds the public entry points and sets up jit; it asks the rest: layout/ learns the
units (discover.py) and converts the state to and from the logical layout (logical.py); the
offload wing (zerojax/offload/, entered only by an engine that offloads) says where a hosted
state lives and runs its step; the checkpoint wing saves and restores (entered by save and
restore).
"""

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
from zerojax.layout import logical
from zerojax.layout.discover import discover, step_plan
from zerojax.mesh import (
    batch_axes,
    check_batch,
    check_batch_like,
    check_key,
    check_mesh,
    eval_parts,
    mesh_sizes,
    model_size,
    naming_the_batch,
    put_batch,
    put_global,
    remember_batch,
)
from zerojax.partition import Layout, LeafSpec, manual, model_plan
from zerojax.precision import init_loss_scale
from zerojax.state import TrainState, check_state
from zerojax.step import StepPlan, local_eval, local_step
from zerojax.update import as_transformation


class Engine:
    """Trains `model` with `optimizer` under ZeRO `config.stage` on `mesh`."""

    def __init__(self, model, optimizer: optax.GradientTransformation, mesh,
                 config: ZeroConfig | None = None, *, owners: bool = True):
        """`owners`: whole-matrix optimizer work (Muon's Newton–Schulz) runs on one owner
        device per matrix (False: on every device, as a baseline to compare with)."""
        config = ZeroConfig() if config is None else config
        if not isinstance(config, ZeroConfig):
            raise ConfigError(f"config must be a zerojax.ZeroConfig, got {type(config).__name__}")
        for name in ("init", "loss"):
            if not callable(getattr(model, name, None)):
                raise ModelError(f"model {type(model).__name__} has no {name}() method; a "
                                 f"zerojax model defines init(rng) and loss(params, batch, units)")
        optimizer = as_transformation(optimizer)
        check_mesh(mesh)
        self.model, self.optimizer, self.mesh, self.config = model, optimizer, mesh, config
        self.owners = bool(owners)
        self.replica, self.data = mesh_sizes(mesh)
        self.model_parallel = model_size(mesh)
        config.check_mesh(self.replica)
        self.axes = batch_axes(mesh)  # the step is manual over these; "model" is automatic
        self.plan: StepPlan | None = None  # its programs: `_jitted`, made once per plan
        # offload: where its state lives and its programs on the device and host meshes
        # (offload/host.py; nvme: disk.py); the same object runs delayed_update's
        self._offload = None
        if config.offload is not None:
            from zerojax.offload.disk import offload_of  # the offload wing, when asked for
            self._offload = offload_of(self)  # in host memory, or on disk (nvme)
        self._delay = self._offload if config.delayed_update is not None else None

    # ---------------------------------------------------------------- layout discovery

    # Traces the loss once, abstractly, to learn which leaves are scanned or gathered
    # (layout/discover.py).
    _discover = discover

    def _splits(self, leaves: tuple[LeafSpec, ...], treedef) -> tuple[LeafSpec, ...]:
        """`leaves` split over the mesh's `model` axis as the model's `param_specs()` says."""
        return model_plan(self.model, leaves, treedef, self.model_parallel)

    def set_units(self, leaves: tuple[LeafSpec, ...], treedef) -> None:
        """Adopts a known unit layout (e.g. recorded in a checkpoint) without tracing the loss;
        the leaves are split over the mesh's `model` axis as the model's annotations say."""
        self.plan = step_plan(self, leaves, treedef)

    @property
    def host_mesh(self):
        """With offload="optimizer": the mesh of the host's CPU devices that holds the master,
        the optimizer state and a pending update (the mesh itself on a machine of CPU
        devices); None without offload."""
        return None if self._offload is None else self._offload.mesh

    @property
    def host_update(self) -> str | None:
        """With offload="optimizer", how the host runs the update: "fused" (a zerojax.adamw's
        one pass per leaf, offload/fused.py), "nvme" (that pass streamed over the store) or
        "xla: <why not fused>" (the step's planned program); None without offload."""
        return None if self._offload is None else self._offload.host_update()

    def host_part(self, state) -> tuple:
        """The parts of `state` (or of its abstract twin) that live on `host_mesh`: (master,
        optimizer state, pending update), the leaves Twin-Flow keeps on the devices None; ()
        without offload."""
        return () if self._offload is None else self._offload.hosted(state)

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
        opt = self.plan.update.specs()
        compute = None
        if self.plan.stores_compute:
            compute = master if cfg.stage == 3 else layout.unflatten(
                leaf.logical_spec() for leaf in layout.leaves)
        model_state = jax.tree.map(lambda _: P(), self._abstract_model_state())
        return TrainState(P(), master, opt, compute,
                          jax.tree.map(lambda _: P(), init_loss_scale(1.0)), P(), model_state,
                          self._delay.pending_specs(master) if self._delay else None)

    def _abstract_model_state(self):
        """The model state as ShapeDtypeStructs (None for a model without `init_state`)."""
        return logical.abstract_model_state(self.model)

    def _manual_specs(self) -> TrainState:
        """`state_specs` as the step's shard_map takes them: the batch axes only (the model
        axis travels with the arrays' shardings)."""
        return jax.tree.map(manual, self.state_specs(), is_leaf=lambda x: isinstance(x, P))

    def state_shardings(self) -> TrainState:
        """NamedShardings of every state leaf; with offload="optimizer" the master, optimizer
        state (and pending update) are on the host mesh (offload/meshes.py), the rest on this
        engine's mesh."""
        shardings = self.view_shardings()
        return shardings if self._offload is None else self._offload.state_shardings(shardings)

    def view_shardings(self) -> TrainState:
        """NamedShardings of every state leaf on this engine's mesh, an offloaded master and
        optimizer state in its "pinned_host" memory: how the programs that read a whole
        offloaded state on the devices (restore, the checkpoint layout) take it; init builds
        each part on its own mesh (`HostOffload.built`)."""
        shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.state_specs(),
                                 is_leaf=lambda x: isinstance(x, P))
        # (Twin-Flow's share of the leaves stays in device memory: offload/twin_flow.py)
        return shardings if self._offload is None else self._offload.view_shardings(shardings)

    def abstract_state(self) -> TrainState:
        """The state as `ShapeDtypeStruct`s with shardings: for AOT compilation without memory."""
        shapes = jax.eval_shape(self._to_state, self.layout.unflatten(
            jax.ShapeDtypeStruct(leaf.shape, jnp.float32) for leaf in self.layout.leaves),
            logical.abstract_key_data(), self._abstract_model_state())
        out = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                           shapes, self.state_shardings())
        return out if self._offload is None else self._offload.abstract(out)  # nvme: on disk

    def _to_state(self, params, rng, model_state) -> TrainState:
        return logical.to_state(self, params, rng, model_state)

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
            state_key, train_key = logical.derived_keys(r)
            return self._to_state(self.model.init(r), train_key,
                                  logical.init_model_state(self.model, state_key))

        return self._built("init", build, rng)

    def init_from(self, params, batch, *, rng: jax.Array | None = None,
                  model_state: Any = None) -> TrainState:
        """State from given logical params (e.g. an export, or plain Flax params).

        `rng` (default `jax.random.key(0)`) derives the training keys as in `init`;
        `model_state` defaults to `model.init_state(fold_in(rng, 1))`."""
        rng = jax.random.key(0) if rng is None else rng
        check_key(rng)
        expected = jax.eval_shape(self.model.init, jax.random.key(0))
        logical.check_given(expected, params, model_state, self._abstract_model_state)
        with naming_the_batch(batch):
            self._discover(expected, batch)
        remember_batch(self, batch)

        def build(params, r, model_state):
            state_key, train_key = logical.derived_keys(r)
            if model_state is None:
                model_state = logical.init_model_state(self.model, state_key)
            return self._to_state(params, train_key, model_state)

        # The given params 1/N per device, as a checkpoint's logical leaves are: a replicated
        # argument would put a whole fp32 copy on every device (or host device).
        homes = jax.tree.map(lambda x: x.sharding, self.logical_target()["params"])
        return self._built("init_from", build, params, rng, model_state,
                           homes=(homes, None, None))

    def _built(self, name, build, *args, homes=None) -> TrainState:
        """The state `build(*args)` makes, jitted once per plan, each part where it lives; `homes`:
        per argument, the shardings on this engine's mesh to read it from (None: replicated)."""
        homes = (None,) * len(args) if homes is None else homes
        if self._offload is None:
            args = put_global(args, homes, self.mesh)
            return self._jitted(name, lambda: jax.jit(
                build, out_shardings=self.state_shardings()))(*args)
        return self._offload.built(build, args, homes)

    # ---------------------------------------------------------------- the step

    def _compiled_step(self):
        def make():
            specs = self._manual_specs()
            body = jax.shard_map(partial(local_step, self.plan), mesh=self.mesh,
                                 in_specs=(specs, P(self.axes)), out_specs=(specs, P()),
                                 axis_names=frozenset(self.axes), check_vma=True)
            # The state's memory kinds are pinned, not inferred: a host computation's scalar
            # output (an optimizer's step count) may otherwise come back typed as device.
            # keep_unused: a state leaf the update never reads (an optimizer's placeholder) is
            # still an argument, so that the arguments keep the memory kinds of the state.
            return jax.jit(body, donate_argnums=0, keep_unused=True,
                           out_shardings=(self.state_shardings(), None))

        return self._jitted("step", make)

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
        if self._offload:
            return self._offload.step(state, put_batch(batch, self.mesh))
        return self._compiled_step()(state, put_batch(batch, self.mesh))

    def evaluate(self, state: TrainState, batch) -> dict[str, jax.Array]:
        """The mean loss (and the model's aux metrics) over the examples of `batch`, computed
        sharded like the step, on a batch of any size and any sizes of its other axes.

        The largest part of the batch that the devices divide runs as one sharded batch; the
        rest (fewer examples than devices) runs one example per device, the devices left over
        holding a copy that counts for nothing. Each device's mean is weighted by its number
        of real examples, so for a loss that is the mean over the device-local examples (the
        model protocol's contract) the result is the mean over exactly `batch`'s examples.
        Another shape (another sequence length, another remainder) compiles its own program
        once; it is cached for the next batch of that shape."""
        self.layout  # noqa: B018 -- raises a clear error before init
        check_state(self, state)
        pc = jax.process_count()
        n = check_batch(batch, self.mesh, 1, pc, divisible=False)
        check_batch_like(self, batch, sizes=False)
        specs = self._manual_specs()
        if self._offload:  # the step's params are on the devices (a pending update applied)
            state, specs = self._offload.evaluated(state), self._offload.device_part(specs)
        run = self._jitted("evaluate", lambda: jax.jit(jax.shard_map(
            partial(local_eval, self.plan), mesh=self.mesh,
            in_specs=(specs, P(self.axes), P(self.axes), P()), out_specs=P(),
            axis_names=frozenset(self.axes), check_vma=True)))
        parts = eval_parts(batch, n // pc, self.replica * self.data // pc, pc)
        sums = [run(state, put_batch(part, self.mesh), put_batch(real, self.mesh), offset)
                for part, real, offset in parts]
        return {k: sum(s[k] for s in sums) / n for k in sums[0]}

    def lower(self, state=None, batch=None):
        """`jax.jit(...).lower` of the step, for abstract or concrete inputs; with offload, of
        its program on the devices (the host's update: `lower_host_update`)."""
        if state is not None:
            check_state(self, state)
        state = self.abstract_state() if state is None else state
        if self._offload:
            return self._offload.lower(state, batch)
        return self._compiled_step().lower(state, batch)

    def lower_host_update(self, state=None):
        """With offload: `jax.jit(...).lower` of the update the host's CPU devices run each
        step on the donated master and optimizer state."""
        if self._offload is None:
            raise ConfigError("lower_host_update() is for an engine with offload='optimizer'")
        if state is not None:
            check_state(self, state)
        return self._offload.lower_update(self.abstract_state() if state is None else state)

    def params(self, state: TrainState) -> Any:
        """Logical fp32 master params: original shapes, padding removed."""
        layout = self.layout
        check_state(self, state)
        master = state.master if self._offload is None else self._offload.read("master", state)
        return self._jitted("params", lambda: jax.jit(layout.from_flat))(master)

    def model_state(self, state: TrainState) -> Any:
        """The logical model state (None for a model without `init_state`)."""
        self.layout  # noqa: B018 -- raises a clear error before init
        check_state(self, state)
        return state.model_state

    def optimizer_state(self, state: TrainState) -> Any:
        """The optimizer state as single-device optax has it for the logical params (e.g. for
        `optax.contrib.schedule_free_eval_params`)."""
        check_state(self, state)
        opt_state = state.opt_state if self._offload is None else \
            self._offload.read("opt_state", state)
        return self._jitted("optimizer_state", lambda: jax.jit(self.plan.update.logical))(
            opt_state)

    def _jitted(self, name, make):
        """A jitted helper made once per plan: a fresh `jax.jit(lambda ...)` per call traces
        and lowers again each time (0.2-0.5 s a call for a small model)."""
        cache = self.__dict__.setdefault("_jit_cache", {})
        if name not in cache or cache[name][0] is not self.plan:
            cache[name] = (self.plan, make())
        return cache[name][1]

    # ---------------------------------------------------------------- the logical layout

    def logical(self, state: TrainState) -> dict:
        """The state in the logical layout (traceable): {"params", "opt_state", "step",
        "loss_scale": {"scale", "good_steps"}, "rng"[, "model_state"]}, as checkpoints hold
        it: original shapes, no padding, any stage and N; PRNG keys as their raw data.
        With offload, of the state as `saveable` gives it; with delayed_update, the params
        and optimizer state there have the pending update applied, and the compute params the
        next step runs on are "delayed"/"params" (offload/delayed.py)."""
        return logical.logical(self, state)

    def saveable(self, state: TrainState) -> TrainState:
        """`state` as `logical` reads it: with delayed_update, its pending update applied (in
        the host's own program: applied inside the save's program, the update's outputs were
        seen with other bits by the checksums than by the arrays written, on XLA:CPU). With
        offload its leaves stay where they live (nvme: read from the store onto the host
        mesh), and a save makes each logical leaf there."""
        return state if self._offload is None else self._offload.saveable(state)

    def logical_target(self, leaves: tuple[LeafSpec, ...] | None = None, treedef=None,
                       delayed: bool | None = None) -> dict:
        """`logical`'s tree as ShapeDtypeStructs with shardings on this engine's mesh (large
        leaves 1/N per device), for the units `leaves` (default: this engine's); `delayed`:
        with the "delayed" params (default: whether this engine delays its updates)."""
        return logical.logical_target(self, leaves, treedef, delayed)

    def from_logical(self, tree: dict, leaves: tuple[LeafSpec, ...] | None = None,
                     treedef=None, *, loss_scale: bool = True) -> TrainState:
        """The TrainState of a `logical` tree on this engine's mesh and stage, adopting the
        units `leaves` (e.g. as a checkpoint records them); `loss_scale=False` starts the loss
        scale afresh."""
        return self._from_logical(tree, leaves, treedef, loss_scale=loss_scale)

    def _from_logical(self, tree, leaves=None, treedef=None, *, loss_scale: bool = True,
                      owned: bool = False) -> TrainState:
        """`from_logical`; `owned`: the tree's arrays are this call's to free as it goes (a
        restore's, freshly read)."""
        if leaves is not None and (self.plan is None or (self.layout.leaves, self.layout.treedef)
                                   != (leaves, treedef)):
            self.set_units(leaves, treedef)

        def build(tree):
            return logical.from_tree(self, tree, loss_scale)

        if self._offload is not None:  # each part made on the mesh it lives on
            return self._offload.from_logical(build, tree, loss_scale, owned)
        return self._jitted(("from_logical", loss_scale), lambda: jax.jit(
            build, out_shardings=self.state_shardings()))(tree)

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
