"""The engine's logical view of its state: the layout checkpoints hold (original shapes, no
padding, any stage and N), and the state made from it on the engine's mesh and stage."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.errors import StateError
from zerojax.mesh import DATA, REPLICA
from zerojax.partition import LeafSpec, logical_shardings
from zerojax.precision import LossScale
from zerojax.state import TrainState
from zerojax.step import on_device
from zerojax.update.delayed import lagging, with_lagging


class LogicalView:
    """`Engine`'s methods between its state and the logical layout (save, restore, export)."""

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
                "rng": whole(abstract_key_data())}
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


def abstract_key_data() -> jax.ShapeDtypeStruct:
    """The raw data of a PRNG key, abstract (the engine keeps its keys as data)."""
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
