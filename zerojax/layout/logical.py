"""The state in the logical layout, and back: what `Engine.init`, `logical`, `logical_target`
and `from_logical` compute (the engine keeps the entry points and their docs).

A logical tree is what checkpoints hold: {"params", "opt_state", "step", "loss_scale":
{"scale", "good_steps"}, "rng"[, "model_state"][, "delayed": {"params"}]}, original shapes, no
padding, any stage and N, PRNG keys as their raw data. With a delayed update the engine's
`_delay` (the offload wing's) says what the pending update adds; this module only asks it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.collectives import roundtrip
from zerojax.errors import ModelError, StateError
from zerojax.mesh import DATA, REPLICA
from zerojax.partition import LeafSpec, logical_shardings
from zerojax.precision import DTYPES, LossScale, init_loss_scale
from zerojax.state import TrainState
from zerojax.step import on_device


def to_state(engine, params, rng, model_state) -> TrainState:
    """The state (global view, inside jit) of logical `params`: the master, the optimizer's
    initial state and the compute params; `rng` the training keys' raw data."""
    layout, cfg, plan = engine.layout, engine.config, engine.plan
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    master = layout.to_flat(params)
    compute = None
    if plan.stores_compute:
        dtype = DTYPES[cfg.param_dtype]
        src = master if cfg.stage == 3 else params
        compute = jax.tree.map(lambda x: x.astype(dtype), src)
        if cfg.quantize_weights and cfg.stage in (1, 2):
            # The values the refresh's quantized gather gives: a restored or fresh state
            # steps exactly as a continued one.
            compute = layout.unflatten(
                roundtrip(m.astype(dtype) if cfg.offload else m, leaf, layout.shards,
                          plan.wire, dtype)
                for m, leaf in zip(jax.tree.leaves(master), layout.leaves))
    pending = engine._delay.empty_pending(master) if engine._delay else None
    return TrainState(jnp.zeros((), jnp.int32), master, plan.update.init(params), compute,
                      init_loss_scale(cfg.initial_scale), rng, as_arrays(model_state), pending)


def logical(engine, state: TrainState) -> dict:
    """`Engine.logical`: the state in the logical layout (traceable)."""
    lag = None
    if engine._delay:
        if state.pending is not None:
            raise StateError("engine.logical takes a delayed-update state as "
                             "engine.saveable(state) gives it (the pending update applied)")
        lag = engine._delay.lagging(state.compute)
    if engine.config.offload is not None:
        engine._offload.check_logical(state)  # the NVMe tier's: read from its store first
        state = on_device(state)
    tree = {"params": engine.layout.from_flat(state.master),
            "opt_state": key_data(engine.plan.update.logical(state.opt_state)),
            "step": state.step,
            "loss_scale": {"scale": state.loss_scale.scale,
                           "good_steps": state.loss_scale.good_steps},
            "rng": state.rng}
    if state.model_state is not None:
        tree["model_state"] = state.model_state
    if lag is not None:
        tree["delayed"] = {"params": lag}
    return tree


def logical_target(engine, leaves: tuple[LeafSpec, ...] | None = None, treedef=None,
                   delayed: bool | None = None) -> dict:
    """`Engine.logical_target`: `logical`'s tree as ShapeDtypeStructs with shardings."""
    if leaves is None:
        leaves, treedef = engine.layout.leaves, engine.layout.treedef
    leaves = engine._splits(tuple(leaves), treedef)
    mesh, replicated = engine.mesh, NamedSharding(engine.mesh, P())
    # hpZ shards the state over both axes, data-major: so do its logical leaves, else
    # turning one into the other replicates each leaf whole on every device.
    like = logical_shardings(mesh, leaves, treedef, (DATA, REPLICA) if engine.config.hpz
                             else (DATA,))
    params = jax.tree.unflatten(treedef, [
        jax.ShapeDtypeStruct(leaf.shape, jnp.float32, sharding=like((), leaf.shape, leaf))
        for leaf in leaves])
    like_sds = lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                    sharding=like(path, x.shape))
    opt = jax.tree_util.tree_map_with_path(
        like_sds, key_data(jax.eval_shape(engine.optimizer.init, params)))
    whole = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)
    tree = {"params": params, "opt_state": opt, "step": whole(jnp.zeros((), jnp.int32)),
            "loss_scale": jax.tree.map(whole, {"scale": jnp.zeros((), jnp.float32),
                                               "good_steps": jnp.zeros((), jnp.int32)}),
            "rng": whole(abstract_key_data())}
    model_state = abstract_model_state(engine.model)
    if model_state is not None:
        tree["model_state"] = jax.tree.map(whole, model_state)
    if engine._delay is not None if delayed is None else delayed:
        tree["delayed"] = {"params": params}
    return tree


def from_tree(engine, tree: dict, loss_scale: bool = True) -> TrainState:
    """The state (global view, inside jit) of a `logical` tree; `loss_scale=False` starts the
    loss scale afresh."""
    plan = engine.plan
    st = to_state(engine, tree["params"], tree["rng"], tree.get("model_state"))
    ls = LossScale(**tree["loss_scale"]) if loss_scale else st.loss_scale
    opt = jax.tree.map(
        lambda x, a: jax.random.wrap_key_data(x, dtype=a.dtype) if is_key(a) else x,
        tree["opt_state"], plan.update.logical_state)
    st = st._replace(step=tree["step"], loss_scale=ls, opt_state=plan.update.stored(opt))
    # A checkpoint of the delayed phase: the next step runs on the params before the
    # update applied to tree["params"]. Other engines continue from those.
    return engine._delay.with_lagging(st, tree["delayed"]["params"]) \
        if engine._delay and "delayed" in tree else st


def abstract_model_state(model):
    """The model state as ShapeDtypeStructs (None for a model without `init_state`)."""
    if not hasattr(model, "init_state"):
        return None
    return jax.eval_shape(lambda k: as_arrays(model.init_state(k)), jax.random.key(0))


def init_model_state(model, key):
    """`model.init_state(key)` as arrays (None for a model without `init_state`)."""
    return as_arrays(model.init_state(key)) if hasattr(model, "init_state") else None


def is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def key_data(tree):
    """`tree` with typed PRNG keys (an optimizer's noise key) as their raw uint32 data."""
    def data(x):
        if not is_key(x):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.eval_shape(jax.random.key_data, x)
        return jax.random.key_data(x)

    return jax.tree.map(data, tree)


def as_arrays(tree):
    return jax.tree.map(jnp.asarray, tree)


def derived_keys(rng) -> tuple[jax.Array, jax.Array]:
    """(model-state init key, training base key as raw uint32 data) from the init key."""
    key = rng if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(rng)
    return jax.random.fold_in(key, 1), jax.random.key_data(jax.random.fold_in(key, 2))


def abstract_key_data() -> jax.ShapeDtypeStruct:
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))


def check_given(expected, params, model_state, abstract_state) -> None:
    """`Engine.init_from`'s arguments: `params` of the model's structure (`expected`), and a
    given `model_state` of its state's (`abstract_state()`, None for a model without one)."""
    check_same_structure(expected, params)
    if model_state is not None:
        want_state = abstract_state()
        if want_state is None:
            raise ModelError("model_state= was given but the model has no init_state(rng)")
        check_same_structure(want_state, model_state, "model_state")


def check_same_structure(expected, params, what: str = "params") -> None:
    exp = {jax.tree_util.keystr(p): tuple(jnp.shape(x))
           for p, x in jax.tree.flatten_with_path(expected)[0]}
    got = {jax.tree_util.keystr(p): tuple(jnp.shape(x))
           for p, x in jax.tree.flatten_with_path(params)[0]}
    diffs = [f"{k}: expected {exp.get(k, 'absent')}, got {got.get(k, 'absent')}"
             for k in sorted(set(exp) | set(got)) if exp.get(k) != got.get(k)]
    if diffs:
        raise ModelError(f"{what} do not match the model's structure: " + "; ".join(diffs[:10]))
