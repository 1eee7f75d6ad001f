"""The engine's state between steps (`TrainState`), and the check of a state that a call
brings: anything but a live state of this engine's stage, dtypes, mesh and model is refused
with one StateError naming the first difference and the fix, before anything is traced.

The step runs every iteration, so the check compares the state with an expectation cached once
per layout (tree structure, shapes and dtypes, in Python); it touches no device.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import jax
import numpy as np

from zerojax.errors import StateError, short
from zerojax.precision import LossScale


class TrainState(NamedTuple):
    """The engine's state. N = size of "data"; k = per-device elements of a leaf."""

    step: jax.Array  # i32 [] {replicated}: steps taken
    master: Any  # f32 per leaf [N·k] {data} or [L, N·k] {None, data}; stage 0 replicated
    opt_state: Any  # optax state over `master` (same layout)
    compute: Any  # param_dtype: stages 0–2 logical {replicated}; stage 3 like `master`;
    #               None where it would equal `master` (float32 in stages 0 and 3, no offload)
    # With offload="optimizer", `master`, `opt_state` and `pending` live on the host mesh
    # (offload/meshes.py).
    loss_scale: LossScale
    rng: Any = None  # u32 [2] {replicated}: data of the base key the model's keys derive from
    model_state: Any = None  # the model's state (init_state) {replicated}; None if it has none
    pending: Any = None  # delayed_update: the update the next step applies (delayed.Pending);
    #                      None without delayed_update


# engine -> (its plan when cached, {state path: (shape, dtype)}, state treedef, mesh devices)
_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _expectation(engine):
    cached = _STATES.get(engine)
    if cached is not None and cached[0] is engine.plan:
        return cached[1:]
    abstract = engine.abstract_state()
    flat, treedef = jax.tree.flatten_with_path(abstract)
    want = {jax.tree_util.keystr(p): (tuple(x.shape), x.dtype) for p, x in flat}
    _STATES[engine] = (engine.plan, want, treedef, frozenset(engine.mesh.devices.flat))
    return want, treedef, _STATES[engine][3]


def check_state(engine, state) -> None:
    """`state` must be a live `TrainState` of `engine`'s stage, dtypes, mesh and model."""
    if not isinstance(state, TrainState):
        raise StateError(f"state is {short(state)} ({type(state).__name__}), not a "
                         f"zerojax.TrainState; pass the state that engine.init, init_from, "
                         f"restore or step returned")
    want, treedef, devices = _expectation(engine)
    leaves, got_def = jax.tree.flatten(state)  # the fast path, taken every step
    # Under an outer jax.jit (or a scan of steps) the leaves are tracers: their shapes and
    # dtypes are checked as a concrete state's are; devices and donation are not theirs to say.
    sharding = None if isinstance(state.step, jax.core.Tracer) else \
        getattr(state.step, "sharding", None)
    if sharding is not None and sharding.device_set != devices:
        raise StateError(
            f"state is on devices {sorted(d.id for d in sharding.device_set)}, this engine's "
            f"mesh on {sorted(d.id for d in devices)}: a state of another mesh. To change "
            f"devices, save it and restore it into this engine")
    if got_def == treedef:
        for i, (x, (shape, dtype)) in enumerate(zip(leaves, want.values())):
            if getattr(x, "shape", None) != shape or getattr(x, "dtype", None) != dtype:
                break
            if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) \
                    and x.is_deleted():
                raise StateError(
                    f"state{list(want)[i]} was donated to an earlier engine.step (its buffers "
                    f"are deleted); pass the state that step returned: state, metrics = "
                    f"engine.step(state, batch)")
        else:
            return
    flat = jax.tree.flatten_with_path(state)[0]
    got = {jax.tree_util.keystr(p): _aval(x) for p, x in flat}
    want = {k: f"{_dtype_name(d)}{shape}" for k, (shape, d) in want.items()}
    diffs = []
    field_of = lambda k: k[1:].split("[")[0].split(".")[0]  # ".pending.grads['w']": pending
    for field in type(state)._fields:  # the first difference of each field
        mine = {k: v for k, v in want.items() if field_of(k) == field}
        theirs = {k: v for k, v in got.items() if field_of(k) == field}
        if len(mine) != len(theirs):
            diffs.append(f"state.{field} holds {len(theirs) or 'no'} arrays, this engine's "
                         f"{len(mine) or 'none'}")
            continue
        for (k, v), (j, w) in zip(theirs.items(), mine.items()):
            if (k, v) != (j, w):
                diffs.append(f"state{k} is {v}, this engine's state{j} {w}" if k != j else
                             f"state{k} is {v}, this engine's {w}")
                break
    if not diffs:  # the same arrays in other containers
        diffs.append(f"its tree structure differs ({got_def}, this engine's {treedef})")
    cfg = engine.config
    raise StateError(
        f"state is not a state of this engine (stage {cfg.stage}, {cfg.param_dtype}, "
        f"{engine.replica * engine.data} devices): {'; '.join(diffs)}. A state of another "
        f"stage, dtype, device count or model? To change stage or devices, save it and "
        f"restore it into this engine")


def _dtype_name(dtype) -> str:
    """numpy's name, or a PRNG key's (`key<fry>`: an optimizer's noise key)."""
    return str(dtype) if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else np.dtype(dtype).name


def _aval(x) -> str:
    dtype = getattr(x, "dtype", None)
    name = _dtype_name(dtype) if dtype is not None else type(x).__name__
    return f"{name}{tuple(np.shape(x)) if dtype is not None else ''}"
