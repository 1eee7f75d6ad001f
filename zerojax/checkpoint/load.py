"""Reading checkpoints back: which step (the latest, or a named one; a renamed or damaged
step), its record checked against the engine, and its arrays read onto the engine's mesh and
verified against their checksums (writing them: store.py)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from zerojax.checkpoint.arrays import read_arrays, stored_arrays
from zerojax.checkpoint.guard import check_step
from zerojax.checkpoint.record import check_record, describe, named_leaves, parts, unparts, why
from zerojax.checkpoint.store import META, _dir, _manager, _sums, wait_until_finished
from zerojax.errors import CheckpointError
from zerojax.partition import LeafSpec


class MisnamedStep(UserWarning):
    """A step directory whose name is not a step number (renamed, e.g. to "best"): it is not
    among the steps that restore, list or export see."""


def misnamed(directory) -> list[str]:
    """The step directories in `directory` whose names are not step numbers, each as "NAME
    (step S by its record)", sorted; a complete step renamed (`mv 20 best`) is no step."""
    out, directory = [], Path(directory)
    if not directory.is_dir():
        return out
    for p in sorted(directory.iterdir()):
        if p.name.isdigit() or "orbax-checkpoint-tmp" in p.name or not p.is_dir() \
                or not (p / META / "metadata").is_file():
            continue
        recorded = _recorded_step(directory, p.name)
        out.append(p.name + (f" (step {recorded} by its record)" if recorded is not None
                             else ""))
    return out


def misnamed_note(directory) -> str | None:
    """What `misnamed` finds, as one sentence (None when nothing)."""
    names = misnamed(directory)
    if not names:
        return None
    return (f"{directory} holds step directories whose names are not step numbers, which no "
            f"restore sees: {', '.join(names)}; rename one to its step number to use it")


def _complete(directory) -> tuple[Path, ocp.CheckpointManager, list[int]]:
    """(checkpoint directory, its manager, its complete steps oldest first); a warning
    (`MisnamedStep`) names the step directories whose names are no step numbers."""
    path = _dir(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    wait_until_finished(path)
    mngr = _manager(path)
    note = misnamed_note(path)
    if note is not None:
        warnings.warn(note, MisnamedStep, stacklevel=3)
    return path, mngr, sorted(mngr.all_steps())


def _pick(path: Path, steps: list[int], step: int | None) -> int:
    step = None if step is None else check_step(step)
    if not steps:
        partial = sorted(p.name for p in path.iterdir() if "tmp" in p.name)
        names = misnamed(path)
        raise CheckpointError(f"{path} holds no complete checkpoint step"
                              + (f" (incomplete saves: {', '.join(partial)})" if partial else "")
                              + (f"; step directories whose names are not step numbers: "
                                 f"{', '.join(names)}; rename one to its step number to use it"
                                 if names else ""))
    if step is None:
        return steps[-1]
    if step not in steps:
        raise CheckpointError(f"{path} has no complete step {step}; complete steps: {steps}")
    return step


def _record(mngr, path: Path, step: int) -> dict:
    """The checked metadata record of a complete step."""
    where = path / str(step) / META
    try:
        meta = mngr.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
    except Exception as e:  # orbax raises many types for a missing or garbled file
        raise CheckpointError(f"cannot read checkpoint metadata {where} of step {step}: "
                              f"{why(e)}") from None
    check_record(meta, f"checkpoint metadata {where} of step {step}")
    if meta["step"] != step:
        raise CheckpointError(
            f"step directory {path / str(step)} holds the record of step {meta['step']}: it was "
            f"renamed (or swapped with another); move it back to {path / str(meta['step'])} "
            f"or delete it")
    return meta


def _open(directory, step: int | None):
    """(manager, step, metadata) of a complete step; clear errors for anything else."""
    path, mngr, complete = _complete(directory)
    step = _pick(path, complete, step)
    return mngr, step, _record(mngr, path, step)


def read_metadata(directory, step: int | None = None) -> dict:
    """The metadata record of `step` (default: the latest complete step), `extra` included.

    `directory`: a checkpoint directory, or a training run directory holding `checkpoints/`."""
    return _open(directory, step)[2]


def steps(directory) -> list[int]:
    """The complete steps in `directory` (or in a run directory's `checkpoints/`), oldest first;
    a step directory whose record names another step (renamed or swapped) is left out."""
    path, _, complete = _complete(directory)
    return [s for s in complete if _recorded_step(path, s) in (s, None)]


def _recorded_step(path: Path, step: int | str) -> int | None:
    """The step the record in `path/step` names; None if it cannot be read (a damaged record,
    which restore reports)."""
    try:
        recorded = json.loads((path / str(step) / META / "metadata").read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return recorded if isinstance(recorded, int) else None


def _diff(kind: str, want: list[dict], got: list[dict]) -> list[str]:
    """"<leaf>: checkpoint <dtype(shape)>, expected <dtype(shape)>" for each differing leaf."""
    fmt = lambda d: f"{d['dtype']}{tuple(d['shape'])}"
    w, g = {d["path"]: fmt(d) for d in want}, {d["path"]: fmt(d) for d in got}
    return [f"{kind}{k}: checkpoint {g.get(k, 'absent')}, expected {w.get(k, 'absent')}"
            for k in sorted(set(w) | set(g)) if w.get(k) != g.get(k)]


def _listing(diffs: list[str], limit: int = 10) -> str:
    more = f"; and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more


# ---------------------------------------------------------------- restore


class _Damaged(CheckpointError):
    """A step whose record or arrays cannot be read or fail their checksums (never escapes)."""


def _match(engine, meta: dict, where: str):
    """(leaves, treedef, logical target tree) for this engine; errors for another model."""
    model = jax.eval_shape(engine.model.init, jax.random.key(0))
    diffs = _diff("params", describe(model), meta["params"])
    if diffs:
        raise CheckpointError(f"{where} is of another model (leaves, shapes or dtypes "
                              f"differ): {_listing(diffs)}")
    leaves = tuple(LeafSpec(d["path"], tuple(d["shape"]), bool(d["stacked"]))
                   for d in meta["params"])
    treedef = jax.tree.structure(model)
    # Saved with delayed_update: the params its next step runs on, which another engine reads
    # (and checks) but continues without.
    delayed = any(d["keys"][:1] == ["delayed"] for d in meta["scalars"])
    target = engine.logical_target(leaves, treedef, delayed=delayed)
    if engine.host_mesh is not None:  # offload: its params and moments read on the host mesh
        target = engine._offload.read_target(target)
    diffs = _diff("opt_state", describe(target["opt_state"]), meta["opt_state"]["leaves"])
    if diffs:
        raise CheckpointError(f"{where} has another optimizer state (another optimizer or "
                              f"dtype?): {_listing(diffs)}")
    diffs = _diff("model_state", describe(target.get("model_state")), meta["model_state"])
    if diffs:
        raise CheckpointError(f"{where} has another model state (init_state's leaves, shapes "
                              f"or dtypes differ): {_listing(diffs)}")
    return leaves, treedef, target


def _load(engine, mngr, path: Path, step: int):
    """(verified logical tree, leaves, treedef, record) of `step` on this engine's mesh.

    Damage (record, array index or arrays unreadable, checksum mismatch) raises `_Damaged`;
    a checkpoint of another model or optimizer raises CheckpointError."""
    where = f"step {step} of {path}"
    try:
        meta = _record(mngr, path, step)
    except CheckpointError as e:
        raise _Damaged(str(e)) from None
    leaves, treedef, target = _match(engine, meta, where)
    entries = named_leaves(target)
    records = [("params", r) for r in meta["params"]]
    records += [("opt_state", r) for r in meta["opt_state"]["leaves"]]
    records += [("model_state", r) for r in meta["model_state"]]
    records += [("", r) for r in meta["scalars"]]
    want, got = [name for _, name, _ in entries], [kind + r["path"] for kind, r in records]
    if want != got:
        raise _Damaged(f"{where}: the record lists the leaves {_listing(got)}, expected "
                       f"{_listing(want)}")
    try:
        arrays = read_arrays(stored_arrays(path, step, where), entries, where)
    except CheckpointError as e:
        raise _Damaged(str(e)) from None
    tree = unparts(jax.tree.unflatten(jax.tree.structure(parts(target)), arrays))
    sums = jax.device_get(_sums([x for _, _, x in named_leaves(tree)]))
    bad = [name for name, (_, r), s in zip(want, records, sums, strict=True)
           if r["checksum"] != s]
    if bad:
        raise _Damaged(f"{where} is corrupted: checksum mismatch in {_listing(bad)}")
    return tree, leaves, treedef, meta


def _intact(engine, mngr, path: Path, step: int) -> bool:
    try:
        _load(engine, mngr, path, step)
    except CheckpointError:
        return False
    return True


def restore(engine, directory, step: int | None = None):
    """The `TrainState` of `step` (default: latest) on this engine's mesh and stage.

    `directory`: a checkpoint directory, or a training run directory holding `checkpoints/`.
    When the latest step is damaged (or its record alone is of another model: edited), the
    CheckpointError names the intact older steps (also as its `intact_steps`, newest first),
    any of which restores with `step=`."""
    path, mngr, complete = _complete(directory)
    chosen = _pick(path, complete, step)
    try:
        tree, leaves, treedef, meta = _load(engine, mngr, path, chosen)
    except CheckpointError as e:  # damaged, or its record is of another model
        older = [s for s in reversed(complete) if s < chosen] if step is None else []
        intact = [s for s in older if _intact(engine, mngr, path, s)]
        if not isinstance(e, _Damaged) and not intact:
            raise  # the whole checkpoint is of another model (or none older is intact)
        if intact:
            more = (f"; intact older steps, newest first: {intact}; restore one with "
                    f"step={intact[0]}")
        else:
            more = f"; no older step is intact either (checked {older})" if older else ""
        raise CheckpointError(f"{e}{more}", intact_steps=intact, damage=str(e)) from None

    # Only now, with the arrays read and verified, does the engine adopt the recorded units.
    saved_scale = meta["dynamic_loss_scale"] and engine.config.dynamic_scale
    return engine._from_logical(tree, leaves, treedef, loss_scale=saved_scale, owned=True)
