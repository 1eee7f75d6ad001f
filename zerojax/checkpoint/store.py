"""Checkpoints in the logical layout: orbax saves that restore onto any mesh and stage
(restore: load.py; record and checksums: record.py; reading arrays: arrays.py; safetensors:
export.py).

A step directory holds two orbax items: "state" (master params and optimizer state in their
logical shapes, no padding, the model state, the step counter, loss scale and base key) and
"meta" (JSON: zerojax
version, model structure with each leaf's units flag, stage, mesh, dtypes, optimizer state
structure, per-leaf checksums, and the user's `extra`). Orbax writes each step into a
temporary directory and renames it when complete, so a killed save leaves no step behind.
Restore reads each stored array straight into its sharding with tensorstore (no event loop
left behind by a failed read), so a damaged file is reported with its leaf.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from zerojax.checkpoint.arrays import STATE
from zerojax.checkpoint.guard import check_keep, check_step, first_nonfinite, writing
from zerojax.checkpoint.record import (
    FORMAT,
    FORMAT_VERSION,
    checksum,
    checksum_by_rows,
    describe,
    leaf_checksums,
    named_leaves,
    parts,
    per_mesh,
)
from zerojax.errors import ArgumentError, CheckpointError
from zerojax.offload.meshes import OnMeshes
from zerojax.state import check_state

META = "meta"
# The target size of a save's data files (a file may reach about twice it). Orbax's OCDBT
# writer holds a data file in host memory until the file is this large: at orbax's 2 GiB a save
# held 0.46-0.90x of its tree beside it, at 32 MiB about 0.25 GB whatever the tree's size
# (docs/checkpoints.md, "A save's host memory is bounded"). Larger leaves go in chunks of this.
DATA_FILE_BYTES = 32 * 2**20
RUN_CHECKPOINTS = "checkpoints"  # where `python -m zerojax train` saves inside its run directory
KEEP: int | None = None  # default number of most recent steps a save keeps; None keeps all

_MANAGERS: dict[str, tuple[ocp.CheckpointManager, int | None]] = {}
_PENDING: dict[str, int] = {}  # directory -> the step its last wait=False save is writing


# ---------------------------------------------------------------- logical layout

# Per engine: its plan, the jitted state -> (logical tree, checksums), the model's leaf dtypes.
# Compiled once per layout, not on every save (a fresh jit would recompile each time).
_SAVERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _saver(engine):
    cached = _SAVERS.get(engine)
    if cached is not None and cached[0] is engine.plan:
        return cached[1:]
    shardings = jax.tree.map(lambda x: x.sharding, engine.logical_target())

    def logical(state):
        tree = engine.logical(state)
        return tree, leaf_checksums(tree)

    if engine.host_mesh is None:
        to_logical = jax.jit(logical, out_shardings=(shardings, None))
    else:
        # Offload: each logical leaf made on the mesh its state leaf lives on, the host's
        # master and optimizer state by the CPU backend, so that a model larger than the
        # devices' memory saves; its checksum read there too.
        on = OnMeshes(engine.logical, jax.tree.map(lambda s: s.spec, shardings), engine.mesh,
                      views=True)

        def to_logical(state):
            tree = on(state)
            return tree, _sums([x for _, _, x in named_leaves(tree)])

    model = jax.eval_shape(engine.model.init, jax.random.key(0))
    dtypes = [jnp.dtype(m.dtype).name for m in jax.tree.leaves(model)]
    _SAVERS[engine] = (engine.plan, to_logical, dtypes)
    return _SAVERS[engine][1:]


_checksums = jax.jit(lambda xs: [checksum(x) for x in xs])
_checksums_by_rows = jax.jit(lambda xs: [checksum_by_rows(x) for x in xs])


def _sums(xs: list) -> list:
    """`checksum` of each array, by a program of the mesh it lives on (`record.per_mesh`)."""
    return per_mesh(_checksums, _checksums_by_rows, xs)


# ---------------------------------------------------------------- directories and saves


def _dir(directory) -> Path:
    """The checkpoint directory `directory` names: itself, or the `checkpoints/` of a training
    run directory (one holding `checkpoints/` and no steps of its own)."""
    path = Path(os.fspath(directory)).absolute()
    run = path / RUN_CHECKPOINTS
    if run.is_dir() and not any(p.name[:1].isdigit() for p in path.iterdir()):
        return run
    return path


def _manager(path: Path, keep: int | None = None, create: bool = False):
    handlers = {STATE: ocp.PyTreeCheckpointHandler(), META: ocp.JsonCheckpointHandler()}
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create,
                                           cleanup_tmp_directories=create)
    return ocp.CheckpointManager(path, options=options, item_handlers=handlers)


def wait_until_finished(directory=None) -> None:
    """Blocks until the asynchronous saves (to `directory`, or to any) are written; a save
    that failed (e.g. a full disk) raises its CheckpointError here."""
    for key, (mngr, _) in list(_MANAGERS.items()):
        if directory is None or key == str(_dir(directory)):
            _wait(key, mngr)


def check_saves(directory=None) -> None:
    """Raises the CheckpointError of an asynchronous save (to `directory`, or to any) that has
    failed by now; returns at once while it is still writing. Cheap enough for every step: a
    training loop that calls it learns of a failed save at the next step, not the next save."""
    for key, (mngr, _) in list(_MANAGERS.items()):
        if key in _PENDING and (directory is None or key == str(_dir(directory))) \
                and not mngr.is_saving_in_progress():
            _wait(key, mngr)


def _wait(key: str, mngr) -> None:
    try:
        with writing(Path(key), _PENDING.pop(key, None)):
            mngr.wait_until_finished()
    except CheckpointError:
        _MANAGERS.pop(key, None)  # orbax's manager would raise its failed save again
        raise


def _wait_at_exit() -> None:
    """A script that ends during a `wait=False` save waits for it; if the save fails (a full
    disk), one line says so instead of a traceback from the exit handler."""
    try:
        wait_until_finished()
    except CheckpointError as e:
        print(f"zerojax: {e}", file=sys.stderr)


atexit.register(_wait_at_exit)


def save(engine, state, directory, step: int | None = None, *, wait: bool = True,
         keep: int | None = None, extra: dict | None = None,
         allow_nonfinite: bool = False) -> int:
    """Saves `state` in the logical layout as step `step` (default: `state.step`); returns it.

    `keep`: a positive integer: after the save, keep only the `keep` most recent steps, the
    new one always among them (default `KEEP`; None keeps every step). `wait=False` returns
    once the arrays are copied (so `state` may be stepped and donated at once);
    `wait_until_finished` blocks on the write.
    `extra`: a JSON-serializable dict (e.g. seed, data config) returned by `read_metadata`.
    A state whose params or optimizer moments hold NaN or inf is refused with a
    CheckpointError naming the first such leaf, before anything is written (a diverged run
    would otherwise rotate its good steps out); `allow_nonfinite=True` saves it anyway.
    """
    import zerojax

    check_state(engine, state)
    path = _dir(directory)
    keep = check_keep(KEEP if keep is None else keep)
    step = int(jax.device_get(state.step)) if step is None else check_step(step)
    for name, v in (("wait", wait), ("allow_nonfinite", allow_nonfinite)):
        if not isinstance(v, bool):
            raise ArgumentError(f"{name}={v!r} must be True or False")
    try:
        extra = json.loads(json.dumps({} if extra is None else dict(extra)))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra= must be a JSON-serializable dict: {e}") from None
    layout, cfg = engine.layout, engine.config
    state = engine.saveable(state)  # delayed_update: nothing pending
    to_logical, dtypes = _saver(engine)
    tree, sums = to_logical(state)
    if not allow_nonfinite:
        bad = first_nonfinite(engine, tree)
        if bad is not None:
            raise CheckpointError(
                f"refusing to save step {step} to {path}: {bad} holds NaN or inf (the run has "
                f"diverged); the steps saved there are left as they are. Restore one of them, "
                f"or pass allow_nonfinite=True to save this state anyway", nonfinite=bad,
                step=step)
    sums = [int(x) for x in jax.device_get(sums)]
    n_params = len(layout.leaves)
    n_opt = n_params + len(jax.tree.leaves(tree["opt_state"]))
    n_state = n_opt + len(jax.tree.leaves(tree.get("model_state")))
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION,
            "zerojax_version": zerojax.__version__, "step": step, "stage": cfg.stage,
            "mesh": {"replica": engine.replica, "data": engine.data},
            "param_dtype": cfg.param_dtype, "dynamic_loss_scale": cfg.dynamic_scale,
            "params": [dict(d, stacked=leaf.stacked, dtype=dtype)
                       for d, leaf, dtype in zip(describe(tree["params"], sums[:n_params]),
                                                 layout.leaves, dtypes, strict=True)],
            "opt_state": {"treedef": str(jax.tree.structure(tree["opt_state"])),
                          "leaves": describe(tree["opt_state"], sums[n_params:n_opt])},
            "model_state": describe(tree.get("model_state"), sums[n_opt:n_state]),
            "scalars": describe(parts(tree)[-1], sums[n_state:]),
            "extra": extra}
    cached = _MANAGERS.get(str(path))
    if cached is None or cached[1] != keep:
        if cached is not None:
            _wait(str(path), cached[0])
        _MANAGERS[str(path)] = cached = (_manager(path, keep, create=True), keep)
    mngr = cached[0]
    _wait(str(path), mngr)
    if step in mngr.all_steps():
        raise CheckpointError(f"step {step} already exists in {path}; pass another step= or "
                              f"save to another directory")
    try:
        with writing(path, step):
            mngr.save(step, args=ocp.args.Composite(
                **{STATE: ocp.args.PyTreeSave(tree, ocdbt_target_data_file_size=DATA_FILE_BYTES),
                   META: ocp.args.JsonSave(meta)}),
                      force=True)
            if wait:
                mngr.wait_until_finished()
    except CheckpointError:
        _MANAGERS.pop(str(path), None)
        raise
    if not wait:
        _PENDING[str(path)] = step
    return step
