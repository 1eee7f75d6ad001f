"""`Engine`: init, the jitted shard_map step, and logical params for any ZeRO stage."""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.collectives import roundtrip
from zerojax.config import ZeroConfig
from zerojax.errors import ConfigError, ModelError, StateError
from zerojax.mesh import (
    DATA,
    REPLICA,
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
from zerojax.partition import Layout, LeafSpec, logical_shardings, manual, model_plan
from zerojax.precision import DTYPES, LossScale, init_loss_scale
from zerojax.state import TrainState, check_state
from zerojax.step import (
    StepPlan,
    device_key,
    example_keys,
    local_eval,
    local_step,
    on_device,
    split_loss,
)
from zerojax.units import RecordingUnits, make_handles
from zerojax.update import ShardedUpdate, StepUpdate, as_transformation, takes_value
from zerojax.update.delayed import empty_pending, lagging, pending_specs, with_lagging
from zerojax.update.host import HostOffload

HOST_MEMORY = "pinned_host"  # an offloaded master and optimizer state on the devices' mesh


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
        self.plan: StepPlan | None = None
        self._step_fn = None
        self._eval_fn = None
        # offload: its programs on the device and host meshes (update/host.py); the same
        # object runs delayed_update's, and says which one a state's next step runs
        self._offload = HostOffload(self) if config.offload is not None else None
        self._delay = self._offload if config.delayed_update is not None else None

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
        # The plan's refusals (nothing split on a model axis, a split M does not divide) need
        # no trace: made here, before it, as the leaves would be split were none stacked.
        self._splits(flat.leaves, treedef)
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
                             out_specs=(), axis_names=frozenset(self.axes), check_vma=False)
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

    def _splits(self, leaves: tuple[LeafSpec, ...], treedef) -> tuple[LeafSpec, ...]:
        """`leaves` split over the mesh's `model` axis as the model's `param_specs()` says."""
        return model_plan(self.model, leaves, treedef, self.model_parallel)

    def set_units(self, leaves: tuple[LeafSpec, ...], treedef) -> None:
        """Adopts a known unit layout (e.g. recorded in a checkpoint) without tracing the loss;
        the leaves are split over the mesh's `model` axis as the model's annotations say."""
        stage0 = self.config.stage == 0
        cfg = self.config
        leaves = self._splits(tuple(leaves), treedef)
        if cfg.hpz:  # hpZ: the primary shard over every device, data-major (collectives.py)
            layout = Layout(tuple(leaves), treedef, self.data * self.replica,
                            axes=(DATA, REPLICA))
        else:
            layout = Layout(tuple(leaves), treedef, 1 if stage0 else self.data,
                            replicated=stage0)
        how = StepUpdate(cfg.clip_norm, DTYPES[cfg.param_dtype] if cfg.offload else None,
                         takes_value(self.optimizer))
        update = ShardedUpdate(self.optimizer, layout, how, axis=layout.axis, owners=self.owners)
        self.plan = StepPlan(self.model, self.optimizer, update, layout, cfg, self.axes,
                             self.replica, self.data)
        self._step_fn = None
        self._eval_fn = None

    @property
    def host_mesh(self):
        """With offload="optimizer": the mesh of the host's CPU devices that holds the master,
        the optimizer state and a pending update (the mesh itself on a machine of CPU
        devices); None without offload."""
        return None if self._offload is None else self._offload.mesh

    @property
    def host_update(self) -> str | None:
        """With offload="optimizer", how the host runs the update: "fused" (a zerojax.adamw's
        one pass per leaf, update/fused.py) or "xla: <why not fused>" (the step's planned
        program); None without offload."""
        if self._offload is None:
            return None
        self.layout  # noqa: B018 -- raises a clear error before init
        fused, why = self._offload.fused()
        return "fused" if fused is not None else f"xla: {why}"

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
                          pending_specs(master) if self._delay else None)

    def _manual_specs(self) -> TrainState:
        """`state_specs` as the step's shard_map takes them: the batch axes only (the model
        axis travels with the arrays' shardings)."""
        return jax.tree.map(manual, self.state_specs(), is_leaf=lambda x: isinstance(x, P))

    def _abstract_model_state(self):
        """The model state as ShapeDtypeStructs (None for a model without `init_state`)."""
        if not hasattr(self.model, "init_state"):
            return None
        return jax.eval_shape(lambda k: _as_arrays(self.model.init_state(k)), jax.random.key(0))

    def state_shardings(self) -> TrainState:
        """NamedShardings of every state leaf; with offload="optimizer" the master, optimizer
        state (and pending update) are on the host mesh (update/offload.py), the rest on this
        engine's mesh."""
        shardings = self.view_shardings()
        if self._offload is None:
            return shardings
        specs = self.state_specs()
        return shardings._replace(**{f: self._offload.homes(f, getattr(specs, f))
                                     for f in ("master", "opt_state", "pending")})

    def view_shardings(self) -> TrainState:
        """NamedShardings of every state leaf on this engine's mesh, an offloaded master and
        optimizer state in its "pinned_host" memory: how the programs that read a whole
        offloaded state on the devices (restore, the checkpoint layout) take it; init builds
        each part on its own mesh (`HostOffload.built`)."""
        is_spec = lambda x: isinstance(x, P)
        on = lambda kind: lambda s: NamedSharding(self.mesh, s, memory_kind=kind)
        specs = self.state_specs()
        shardings = jax.tree.map(on(None), specs, is_leaf=is_spec)
        if self.config.offload is None:
            return shardings
        # (Twin-Flow's share of the leaves stays in device memory)
        host = lambda f, t: self._offload.by_home(f, t, on(HOST_MEMORY), on(None))
        shardings = shardings._replace(master=host("master", specs.master),
                                       opt_state=host("opt_state", specs.opt_state))
        if self._delay:  # the pending gradient waits in host memory, beside the master
            shardings = shardings._replace(pending=shardings.pending._replace(
                grads=host("master", specs.pending.grads)))
        return shardings

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
            if cfg.quantize_weights and cfg.stage in (1, 2):
                # The values the refresh's quantized gather gives: a restored or fresh state
                # steps exactly as a continued one.
                compute = layout.unflatten(
                    roundtrip(m.astype(dtype) if cfg.offload else m, leaf, layout.shards,
                              self.plan.wire, dtype)
                    for m, leaf in zip(jax.tree.leaves(master), layout.leaves))
        return TrainState(jnp.zeros((), jnp.int32), master, self.plan.update.init(params), compute,
                          init_loss_scale(cfg.initial_scale), rng, _as_arrays(model_state),
                          empty_pending(master, self.plan.reduced_dtype) if self._delay else None)

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

        return self._built(build, rng)

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

        # The given params 1/N per device, as a checkpoint's logical leaves are: a replicated
        # argument would put a whole fp32 copy on every device (or host device).
        homes = jax.tree.map(lambda x: x.sharding, self.logical_target()["params"])
        return self._built(build, params, rng, model_state, homes=(homes, None, None))

    def _built(self, build, *args, homes=None) -> TrainState:
        """The state `build(*args)` makes, jitted, each part where it lives; `homes`: per
        argument, the shardings on this engine's mesh to read it from (None: replicated)."""
        homes = (None,) * len(args) if homes is None else homes
        if self._offload is None:
            args = put_global(args, homes, self.mesh)
            return jax.jit(build, out_shardings=self.state_shardings())(*args)
        return self._offload.built(build, args, homes)

    # ---------------------------------------------------------------- the step

    def _compiled_step(self):
        if self._step_fn is None:
            specs = self._manual_specs()
            body = jax.shard_map(partial(local_step, self.plan), mesh=self.mesh,
                                 in_specs=(specs, P(self.axes)), out_specs=(specs, P()),
                                 axis_names=frozenset(self.axes), check_vma=True)
            # The state's memory kinds are pinned, not inferred: a host computation's scalar
            # output (an optimizer's step count) may otherwise come back typed as device.
            # keep_unused: a state leaf the update never reads (an optimizer's placeholder) is
            # still an argument, so that the arguments keep the memory kinds of the state.
            self._step_fn = jax.jit(body, donate_argnums=0, keep_unused=True,
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
        if self._delay:  # evaluates the params with the pending update applied
            state = state._replace(compute=self._delay.applied_compute(state))
        specs = self._manual_specs()
        if self._offload:  # the step's params are on the devices; the rest is not read
            state, specs = self._offload.device_part(state), self._offload.device_part(specs)
        if self._eval_fn is None:
            body = jax.shard_map(partial(local_eval, self.plan), mesh=self.mesh,
                                 in_specs=(specs, P(self.axes), P(self.axes), P()),
                                 out_specs=P(), axis_names=frozenset(self.axes), check_vma=True)
            self._eval_fn = jax.jit(body)
        parts = eval_parts(batch, n // pc, self.replica * self.data // pc, pc)
        sums = [self._eval_fn(state, put_batch(part, self.mesh), put_batch(real, self.mesh),
                              offset) for part, real, offset in parts]
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
        layout, offload = self.layout, self.config.offload is not None
        check_state(self, state)
        master = self._delay.applied(state)[0] if self._delay else state.master
        if offload:  # read on the devices, as without offload
            master = self._offload.to_devices(master, self._device_memory(
                self.view_shardings().master))
        return self._jitted("params", lambda: jax.jit(layout.from_flat))(master)

    def model_state(self, state: TrainState) -> Any:
        """The logical model state (None for a model without `init_state`)."""
        self.layout  # noqa: B018 -- raises a clear error before init
        check_state(self, state)
        return state.model_state

    def optimizer_state(self, state: TrainState) -> Any:
        """The optimizer state as single-device optax has it for the logical params (e.g. for
        `optax.contrib.schedule_free_eval_params`)."""
        offload = self.config.offload is not None
        check_state(self, state)
        opt_state = self._delay.applied(state)[1] if self._delay else state.opt_state
        if offload:
            opt_state = self._offload.to_devices(opt_state, self._device_memory(
                self.view_shardings().opt_state))
        return self._jitted("optimizer_state", lambda: jax.jit(self.plan.update.logical))(
            opt_state)

    @staticmethod
    def _device_memory(shardings):
        """`shardings` in device memory."""
        return jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)

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
        next step runs on are "delayed"/"params" (update/delayed.py)."""
        lag = None
        if self._delay:
            if state.pending is not None:
                raise StateError("engine.logical takes a delayed-update state as "
                                 "engine.saveable(state) gives it (the pending update applied)")
            lag = lagging(self.plan, state.compute)
        if self.config.offload is not None:
            state = on_device(state)
        tree = {"params": self.layout.from_flat(state.master),
                "opt_state": _key_data(self.plan.update.logical(state.opt_state)),
                "step": state.step,
                "loss_scale": {"scale": state.loss_scale.scale,
                               "good_steps": state.loss_scale.good_steps},
                "rng": state.rng}
        if state.model_state is not None:
            tree["model_state"] = state.model_state
        if lag is not None:
            tree["delayed"] = {"params": lag}
        return tree

    def saveable(self, state: TrainState) -> TrainState:
        """`state` as `logical` reads it: with delayed_update, its pending update applied (in
        the host's own program: applied inside the save's program, the update's outputs were
        seen with other bits by the checksums than by the arrays written, on XLA:CPU). With
        offload its leaves stay where they live: a save makes each logical leaf there."""
        return self._delay.settled(state) if self._delay else state

    def logical_target(self, leaves: tuple[LeafSpec, ...] | None = None, treedef=None,
                       delayed: bool | None = None) -> dict:
        """`logical`'s tree as ShapeDtypeStructs with shardings on this engine's mesh (large
        leaves 1/N per device), for the units `leaves` (default: this engine's); `delayed`:
        with the "delayed" params (default: whether this engine delays its updates)."""
        if leaves is None:
            leaves, treedef = self.layout.leaves, self.layout.treedef
        leaves = self._splits(tuple(leaves), treedef)
        mesh, replicated = self.mesh, NamedSharding(self.mesh, P())
        # hpZ shards the state over both axes, data-major: so do its logical leaves, else
        # turning one into the other replicates each leaf whole on every device.
        like = logical_shardings(mesh, leaves, treedef, (DATA, REPLICA) if self.config.hpz
                                 else (DATA,))
        params = jax.tree.unflatten(treedef, [
            jax.ShapeDtypeStruct(leaf.shape, jnp.float32, sharding=like((), leaf.shape, leaf))
            for leaf in leaves])
        like_sds = lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                        sharding=like(path, x.shape))
        opt = jax.tree_util.tree_map_with_path(
            like_sds, _key_data(jax.eval_shape(self.optimizer.init, params)))
        whole = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)
        tree = {"params": params, "opt_state": opt, "step": whole(jnp.zeros((), jnp.int32)),
                "loss_scale": jax.tree.map(whole, {"scale": jnp.zeros((), jnp.float32),
                                                   "good_steps": jnp.zeros((), jnp.int32)}),
                "rng": whole(_abstract_key_data())}
        model_state = self._abstract_model_state()
        if model_state is not None:
            tree["model_state"] = jax.tree.map(whole, model_state)
        if self._delay is not None if delayed is None else delayed:
            tree["delayed"] = {"params": params}
        return tree

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
        if leaves is not None and (self.plan is None or (self.layout.leaves,
                                                         self.layout.treedef) != (leaves,
                                                                                  treedef)):
            self.set_units(leaves, treedef)

        def build(tree):
            st = self._to_state(tree["params"], tree["rng"], tree.get("model_state"))
            ls = LossScale(**tree["loss_scale"]) if loss_scale else st.loss_scale
            opt = jax.tree.map(
                lambda x, a: jax.random.wrap_key_data(x, dtype=a.dtype) if _is_key(a) else x,
                tree["opt_state"], self.plan.update.logical_state)
            st = st._replace(step=tree["step"], loss_scale=ls,
                             opt_state=self.plan.update.stored(opt))
            # A checkpoint of the delayed phase: the next step runs on the params before the
            # update applied to tree["params"]. Other engines continue from those.
            return with_lagging(self.plan, st, tree["delayed"]["params"]) \
                if self._delay and "delayed" in tree else st

        if self._offload is not None:  # each part made on the mesh it lives on
            return self._offload.from_logical(build, tree, loss_scale, owned)
        return jax.jit(build, out_shardings=self.state_shardings())(tree)

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



def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_data(tree):
    """`tree` with typed PRNG keys (an optimizer's noise key) as their raw uint32 data."""
    def data(x):
        if not _is_key(x):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.eval_shape(jax.random.key_data, x)
        return jax.random.key_data(x)

    return jax.tree.map(data, tree)


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
