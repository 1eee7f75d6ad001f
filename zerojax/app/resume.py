"""What a resumed `zerojax train` run checks and reports: the metrics file (a cut-off last
record, a missing file), the steps a `--resume-step` supersedes, the saved options and the
schedule re-planned from them, and which intact steps to pick when the latest is damaged."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from zerojax.app.files import replace_file
from zerojax.app.options import TrainConfig, UsageError, checkpoint_steps
from zerojax.app.recipe import make_schedule


def intact_hint(error: BaseException, flag_: str, verb: str = "resume") -> str:
    """`error`'s message, plus the intact steps to pick instead when it names some."""
    intact = list(getattr(error, "intact_steps", None) or [])
    if not intact:
        return str(error)
    return (f"{getattr(error, 'damage', None) or error}; intact older steps: "
            f"{', '.join(map(str, intact))}; {verb} from one with {flag_} {intact[0]}")


def drop_cut_off_record(path: Path) -> str | None:
    """Removes a last line of `metrics.jsonl` that is not JSON (a crash or a full disk cut it
    off) and says so; a bad line before the last is an error."""
    if not path.is_file():
        return None
    lines = path.read_bytes().splitlines(keepends=True)
    bad = [i for i, line in enumerate(lines) if line.strip() and not _is_record(line)]
    if not bad:
        return None
    if bad != [len(lines) - 1]:
        raise UsageError(f"{str(path)!r} line {bad[0] + 1} is not a JSON record; fix or "
                         f"delete that line, then resume again")
    replace_file(path, b"".join(lines[:-1]))
    return (f"{path.name}: dropped a cut-off last record ({len(lines[-1])} bytes) that an "
            f"interrupted write left")


def missing_metrics_note(path: Path, start: int) -> str | None:
    """On a resume from step `start`: a note when `metrics.jsonl` is missing or ends before
    `start` (it then holds only part of the run's steps), else None."""
    if start == 0:
        return None
    if not path.is_file():
        return (f"{path.name} was missing: it holds only the steps from {start + 1} on (steps "
                f"1-{start} were trained before this resume)")
    steps = [r["step"] for r in map(_record_of, path.read_bytes().splitlines())
             if r is not None and isinstance(r.get("step"), int)]
    last = max(steps, default=0)
    if last < start:
        return (f"{path.name} ends at step {last}, before step {start} where this run "
                f"resumes: steps {last + 1}-{start} are not in it")
    return None


def _record_of(line: bytes) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _is_record(line: bytes) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and "step" in record


def supersede_steps(ckpt: Path, after: int) -> tuple[list[int], Path]:
    """Moves the checkpoint steps past `after` to OUT/superseded/ (a resumed run writes its
    own steps there); returns them and where they went."""
    later = [s for s in checkpoint_steps(ckpt) if s > after]
    dest = ckpt.parent / "superseded"
    for step in later:
        target, n = dest / str(step), 1
        while target.exists():  # an earlier resume already put a step of this number there
            target, n = dest / f"{step}.{n}", n + 1
        dest.mkdir(exist_ok=True)
        os.replace(ckpt / str(step), target)
    return later, dest


# How a process runs, not what it trains: never among a resume's changed options.
RESUME_OPTIONS = ("resume", "resume_step", "config")


def resume_changes(saved: dict[str, Any], cfg: TrainConfig) -> dict[str, list]:
    """The options a resume changes from the run its checkpoint saved (`saved`: its
    `train_config`): {option: [saved, now]}, every option the checkpoint records but those of
    `RESUME_OPTIONS`."""
    now = dataclasses.asdict(cfg)
    return {k: [saved[k], v] for k, v in now.items()
            if k in saved and k not in RESUME_OPTIONS and saved[k] != v}


def saved_config(train_config: dict[str, Any]) -> TrainConfig:
    """The TrainConfig a checkpoint's `train_config` record describes (unknown keys dropped)."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in train_config.items() if k in known})


def schedule_note(old: TrainConfig, cfg: TrainConfig, start: int) -> str | None:
    """When a resume changes the learning-rate schedule: its lr for the next step, before and
    after (the schedule is re-planned over the new --steps, not kept)."""
    keys = ["lr", "warmup", "schedule", "min_lr_ratio"]
    if "cosine" in (old.schedule, cfg.schedule):
        keys.append("steps")
    if all(getattr(old, k) == getattr(cfg, k) for k in keys):
        return None
    was, now = float(make_schedule(old)(start)), float(make_schedule(cfg)(start))
    return (f"schedule re-planned for {cfg.steps} steps (saved: {old.steps}): lr at step "
            f"{start + 1} {was:.2e} → {now:.2e}")
