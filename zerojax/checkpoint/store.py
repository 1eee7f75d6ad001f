"""Checkpoints in the logical layout: orbax save/restore onto any mesh and stage
(export to safetensors: export.py beside this file).

A step directory holds two orbax items: "state" (master params and optimizer state in their
logical shapes, no padding, plus the step counter and loss scale) and "meta" (JSON: zerojax
version, model structure with each leaf's units flag, stage, mesh, dtypes, optimizer state
structure, per-leaf checksums, and the user's `extra`). Orbax writes each step into a
temporary directory and renames it when complete, so a killed save leaves no step behind.
"""

from __future__ import annotations

import atexit
import json
import os
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.errors import CheckpointError
from zerojax.mesh import DATA
from zerojax.partition import Layout, LeafSpec, pad_flat, unpad
from zerojax.precision import LossScale

FORMAT, FORMAT_VERSION = "zerojax-checkpoint", 1
STATE, META = "state", "meta"
KEEP: int | None = None  # default number of most recent steps a save keeps; None keeps all

_MANAGERS: dict[str, tuple[ocp.CheckpointManager, int | None]] = {}


# ---------------------------------------------------------------- logical layout

# Per engine: its plan, the jitted state -> (logical tree, checksums), the model's leaf dtypes.
# Compiled once per layout, not on every save (a fresh jit would recompile each time).
_SAVERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _saver(engine):
    cached = _SAVERS.get(engine)
    if cached is not None and cached[0] is engine.plan:
        return cached[1:]
    layout = engine.layout
    shardings = jax.tree.map(lambda x: x.sharding, _abstract(engine, layout))

    def logical(state):
        tree = {"params": layout.from_flat(state.master),
                "opt_state": _map_opt(engine.optimizer, layout, unpad, state.opt_state),
                "step": state.step,
                "loss_scale": {"scale": state.loss_scale.scale,
                               "good_steps": state.loss_scale.good_steps}}
        return tree, _sums(tree)

    model = jax.eval_shape(engine.model.init, jax.random.key(0))
    dtypes = [jnp.dtype(m.dtype).name for m in jax.tree.leaves(model)]
    _SAVERS[engine] = (engine.plan, jax.jit(logical, out_shardings=(shardings, None)), dtypes)
    return _SAVERS[engine][1:]



def _is_masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def _map_opt(optimizer, layout: Layout, f, opt_state, non_param=lambda v: v):
    """`f(leaf_value, LeafSpec)` over the optimizer state's param-like leaves."""
    return optax.tree_map_params(
        optimizer, lambda x, leaf: x if _is_masked(x) else f(x, leaf), opt_state,
        layout.unflatten(layout.leaves), transform_non_params=non_param, is_leaf=_is_masked)


def _logical_sharding(mesh, shape, stacked: bool) -> NamedSharding:
    """Over "data" on the unit's first divisible axis (a local reshape of the flat shard)."""
    n = dict(mesh.shape)[DATA]
    first = 1 if stacked else 0
    for a in [*range(first, len(shape)), *range(first)]:
        if n > 1 and shape[a] % n == 0:
            return NamedSharding(mesh, P(*[DATA if i == a else None for i in range(len(shape))]))
    return NamedSharding(mesh, P())


def _abstract(engine, layout: Layout):
    """The logical tree to save or restore, as ShapeDtypeStructs on this engine's mesh."""
    mesh, replicated = engine.mesh, NamedSharding(engine.mesh, P())
    sds = lambda leaf, dtype=jnp.float32: jax.ShapeDtypeStruct(
        leaf.shape, dtype, sharding=_logical_sharding(mesh, leaf.shape, leaf.stacked))
    params = layout.unflatten(sds(leaf) for leaf in layout.leaves)
    opt = jax.eval_shape(engine.optimizer.init, params)
    opt = _map_opt(engine.optimizer, layout, lambda x, leaf: sds(leaf, x.dtype), opt,
                   lambda v: jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                       x.shape, x.dtype, sharding=replicated), v))
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=replicated)
    return {"params": params, "opt_state": opt, "step": scalar(jnp.int32),
            "loss_scale": {"scale": scalar(jnp.float32), "good_steps": scalar(jnp.int32)}}


def _checksum(x) -> jax.Array:
    """Order-free uint32 sum of the bit patterns: the same for any sharding or slab order."""
    x = jnp.asarray(x)
    x = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
    bits = lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    return jnp.sum(bits.astype(jnp.uint32), dtype=jnp.uint32)


def _np_checksum(x: np.ndarray) -> int:
    x = np.ascontiguousarray(x)
    bits = x.view(f"uint{8 * x.dtype.itemsize}").astype(np.uint32, copy=False)
    return int(bits.sum(dtype=np.uint32))


def _sums(tree) -> list[jax.Array]:
    """Checksums of the params and optimizer-state leaves, in record order."""
    return [_checksum(x) for x in jax.tree.leaves([tree["params"], tree["opt_state"]])]


def _keys(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]


def _describe(tree, sums=None) -> list[dict]:
    out = []
    for i, (path, x) in enumerate(jax.tree.flatten_with_path(tree)[0]):
        out.append({"path": jax.tree_util.keystr(path), "keys": _keys(path),
                    "shape": list(jnp.shape(x)), "dtype": jnp.dtype(x.dtype).name})
        if sums is not None:
            out[-1]["checksum"] = sums[i]
    return out


# ---------------------------------------------------------------- save / restore


def _dir(directory) -> Path:
    return Path(os.fspath(directory)).absolute()


def _manager(path: Path, keep: int | None = None, create: bool = False):
    handlers = {STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler()}
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create,
                                           cleanup_tmp_directories=create)
    return ocp.CheckpointManager(path, options=options, item_handlers=handlers)


def wait_until_finished(directory=None) -> None:
    """Blocks until the asynchronous saves (to `directory`, or to any) are written."""
    for key, (mngr, _) in list(_MANAGERS.items()):
        if directory is None or key == str(_dir(directory)):
            mngr.wait_until_finished()


atexit.register(wait_until_finished)


def save(engine, state, directory, step: int | None = None, *, wait: bool = True,
         keep: int | None = None, extra: dict | None = None) -> int:
    """Saves `state` in the logical layout as step `step` (default: `state.step`); returns it.

    `keep`: keep only the most recent `keep` steps (default `KEEP`). `wait=False` returns once
    the arrays are copied (so `state` may be stepped and donated at once);
    `wait_until_finished` blocks on the write.
    `extra`: a JSON-serializable dict (e.g. seed, data config) returned by `read_metadata`.
    """
    import zerojax

    path, keep = _dir(directory), KEEP if keep is None else keep
    step = int(jax.device_get(state.step)) if step is None else int(step)
    try:
        extra = json.loads(json.dumps({} if extra is None else dict(extra)))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra= must be a JSON-serializable dict: {e}") from None
    layout, cfg = engine.layout, engine.config
    to_logical, dtypes = _saver(engine)
    tree, sums = to_logical(state)
    sums = [int(x) for x in jax.device_get(sums)]
    n_params = len(layout.leaves)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION,
            "zerojax_version": zerojax.__version__, "step": step, "stage": cfg.stage,
            "mesh": {"replica": engine.replica, "data": engine.data},
            "param_dtype": cfg.param_dtype, "dynamic_loss_scale": cfg.dynamic_scale,
            "params": [dict(d, stacked=leaf.stacked, dtype=dtype)
                       for d, leaf, dtype in zip(_describe(tree["params"], sums[:n_params]),
                                                 layout.leaves, dtypes, strict=True)],
            "opt_state": {"treedef": str(jax.tree.structure(tree["opt_state"])),
                          "leaves": _describe(tree["opt_state"], sums[n_params:])},
            "extra": extra}
    cached = _MANAGERS.get(str(path))
    if cached is None or cached[1] != keep:
        if cached is not None:
            cached[0].wait_until_finished()
        _MANAGERS[str(path)] = cached = (_manager(path, keep, create=True), keep)
    mngr = cached[0]
    mngr.wait_until_finished()
    if step in mngr.all_steps():
        raise CheckpointError(f"step {step} already exists in {path}; pass another step= or "
                              f"save to another directory")
    mngr.save(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardSave(tree),
                                               META: ocp.args.JsonSave(meta)}), force=True)
    if wait:
        mngr.wait_until_finished()
    return step


def _why(e: Exception) -> str:
    """One line about a read error (tensorstore appends its whole spec in JSON)."""
    return f"{type(e).__name__}: {str(e).split(' [tensorstore_spec=')[0]}".splitlines()[0]


def _open(directory, step: int | None):
    """(manager, step, metadata) of a complete step; clear errors for anything else."""
    path = _dir(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    wait_until_finished(path)
    mngr = _manager(path)
    steps = sorted(mngr.all_steps())
    if not steps:
        partial = sorted(p.name for p in path.iterdir() if "tmp" in p.name)
        raise CheckpointError(f"{path} holds no complete checkpoint step"
                              + (f" (incomplete saves: {', '.join(partial)})" if partial else ""))
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(f"{path} has no complete step {step}; complete steps: {steps}")
    where = path / str(step) / META
    try:
        meta = mngr.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
    except Exception as e:  # orbax raises many types for a missing or garbled file
        raise CheckpointError(f"cannot read checkpoint metadata {where} of step {step}: "
                              f"{_why(e)}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a zerojax checkpoint record (step {step})")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{where} has format version {meta['format_version']}, newer "
                              f"than this zerojax reads ({FORMAT_VERSION}); upgrade zerojax")
    return mngr, step, meta


def read_metadata(directory, step: int | None = None) -> dict:
    """The metadata record of `step` (default: the latest complete step), `extra` included."""
    return _open(directory, step)[2]


def steps(directory) -> list[int]:
    """The complete steps in `directory`, oldest first."""
    path = _dir(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    wait_until_finished(path)
    return sorted(_manager(path).all_steps())


def _diff(kind: str, want: list[dict], got: list[dict]) -> list[str]:
    """"<leaf>: checkpoint <dtype(shape)>, expected <dtype(shape)>" for each differing leaf."""
    fmt = lambda d: f"{d['dtype']}{tuple(d['shape'])}"
    w, g = {d["path"]: fmt(d) for d in want}, {d["path"]: fmt(d) for d in got}
    return [f"{kind}{k}: checkpoint {g.get(k, 'absent')}, expected {w.get(k, 'absent')}"
            for k in sorted(set(w) | set(g)) if w.get(k) != g.get(k)]


def _listing(diffs: list[str], limit: int = 10) -> str:
    more = f"; and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more


def restore(engine, directory, step: int | None = None):
    """The `TrainState` of `step` (default: latest) on this engine's mesh and stage."""
    mngr, step, meta = _open(directory, step)
    where = f"step {step} of {_dir(directory)}"
    model = jax.eval_shape(engine.model.init, jax.random.key(0))
    diffs = _diff("params", _describe(model), meta["params"])
    if diffs:
        raise CheckpointError(f"{where} is of another model (leaves, shapes or dtypes "
                              f"differ): {_listing(diffs)}")
    leaves = tuple(LeafSpec(d["path"], tuple(d["shape"]), bool(d["stacked"]))
                   for d in meta["params"])
    layout = Layout(leaves, jax.tree.structure(model), 1)
    target = _abstract(engine, layout)
    diffs = _diff("opt_state", _describe(target["opt_state"]), meta["opt_state"]["leaves"])
    if diffs:
        raise CheckpointError(f"{where} has another optimizer state (another optimizer or "
                              f"dtype?): {_listing(diffs)}")
    try:
        tree = mngr.restore(step, args=ocp.args.Composite(
            **{STATE: ocp.args.StandardRestore(target)}))[STATE]
    except Exception as e:  # tensorstore and orbax raise many types for damaged files
        raise CheckpointError(f"cannot read the arrays of {where} ({_dir(directory)}/{step}/"
                              f"{STATE}): {_why(e)}") from None
    records = [("params", r) for r in meta["params"]]
    records += [("opt_state", r) for r in meta["opt_state"]["leaves"]]
    sums = jax.device_get(jax.jit(_sums)(tree))
    bad = [kind + r["path"] for (kind, r), s in zip(records, sums, strict=True)
           if r.get("checksum") is not None and r["checksum"] != s]
    if bad:
        raise CheckpointError(f"{where} is corrupted: checksum mismatch in {_listing(bad)}")

    # Only now, with the arrays read and verified, does the engine adopt the recorded units.
    plan = engine.plan
    if plan is None or (plan.layout.leaves, plan.layout.treedef) != (leaves, layout.treedef):
        engine.set_units(leaves, layout.treedef)
    saved_scale = meta.get("dynamic_loss_scale") and engine.config.dynamic_scale

    def build(tree):
        st = engine._to_state(tree["params"])
        opt = _map_opt(engine.optimizer, engine.layout,
                       lambda x, leaf: pad_flat(x, leaf, engine.layout.shards), tree["opt_state"])
        ls = LossScale(**tree["loss_scale"]) if saved_scale else st.loss_scale
        return st._replace(step=tree["step"], opt_state=opt, loss_scale=ls)

    return jax.jit(build, out_shardings=engine.state_shardings())(tree)
