"""`python -m zerojax train` killed with SIGKILL (mid-training, mid-save, right after a
checkpoint commits) and resumed: every sink ends with exactly the records of `metrics.jsonl`,
each step once and in order, as TensorBoard's own reader and W&B's own reader see them."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FAST_COMPILE
from helpers import by_tag, tensorboard_scalars, wandb_history

from zerojax.app.data import embedded_corpus

ROOT = Path(__file__).resolve().parents[1]
STEPS = 60


def _run(out: Path, home: Path, data: Path, resume: bool) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS=FAST_COMPILE,
               WANDB_MODE="offline", WANDB_SILENT="true")
    env |= {v: str(home) for v in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR",
                                   "WANDB_DATA_DIR")}
    args = ["--model", "test", "--batch", "4", "--seq-len", "16", "--devices", "2",
            "--eval-every", "3", "--eval-batches", "1", "--save-every", "4", "--steps",
            str(STEPS), "--data", str(data), "--out", str(out), "--wandb", "zerojax-tests",
            "--quiet", *(["--resume"] if resume else [])]
    return subprocess.Popen([sys.executable, "-m", "zerojax", "train", *args], cwd=out.parent,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines[:-1]]  # the last may be half written


def _saved(out: Path) -> list[int]:
    ckpt = out / "checkpoints"
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.is_dir() \
        else []


def _saving(out: Path) -> set[str]:
    """orbax's temporary step directories: a save being written."""
    ckpt = out / "checkpoints"
    return {p.name for p in ckpt.iterdir() if "tmp" in p.name} if ckpt.is_dir() else set()


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the state to kill at never came"
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)


def _check_sinks(out: Path) -> None:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == list(range(len(steps))), steps  # every step once, in order
    assert tensorboard_scalars(out) == by_tag(records)
    (run,) = wandb_history(out)
    assert run["history"] == by_tag(records, np.float64)


@pytest.mark.slow
def test_sigkill_at_three_points_then_resume_every_sink_holds_metrics_jsonl(tmp_path):
    data = tmp_path / "tokens64.npy"
    np.save(data, (embedded_corpus(2**16) % 64).astype(np.uint16))
    out, home = tmp_path / "run", tmp_path / "wandb-home"
    # Mid-training: past checkpoint 4, between saves, and before any periodic flush.
    proc = _run(out, home, data, resume=False)
    _kill_when(proc, lambda: 4 in _saved(out) and max(_steps(out), default=0) >= 6)
    kills = [max(_steps(out))]
    # Right after a checkpoint commits: its step directory has appeared.
    proc = _run(out, home, data, resume=True)
    first = max(_saved(out))
    _kill_when(proc, lambda: max(_saved(out)) > first)
    kills.append(max(_saved(out)))
    # Mid-save: orbax's temporary step directory is there, the step not yet committed.
    left = _saving(out)  # a killed save's leftovers are not this process's save
    proc = _run(out, home, data, resume=True)
    _kill_when(proc, lambda: bool(_saving(out) - left))
    kills.append(max(_saved(out)))
    assert (kills[0] >= 6 and kills[1] > 4), kills
    proc = _run(out, home, data, resume=True)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    _check_sinks(out)
    assert max(_steps(out) + [json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
                              ["step"]]) == STEPS
    # The three killed processes' W&B run directories, set aside by the resumes.
    assert len(list((out / "wandb" / "superseded").iterdir())) == 3


@pytest.mark.slow
def test_sigkill_in_the_first_save_then_a_fresh_run_leaves_one_wandb_run(tmp_path):
    """Killed while its first checkpoint is being written, a run has nothing to resume: run
    again without --resume, it starts afresh, and its sinks hold its own records only, W&B's
    too (the killed run's offline directory set aside, so `wandb sync` uploads one run)."""
    data = tmp_path / "tokens64.npy"
    np.save(data, (embedded_corpus(2**16) % 64).astype(np.uint16))
    out, home = tmp_path / "run", tmp_path / "wandb-home"
    proc = _run(out, home, data, resume=False)
    _kill_when(proc, lambda: bool(_saving(out)))
    assert not _saved(out) and (out / "wandb_run_id").is_file()
    killed = (out / "wandb_run_id").read_text().strip()
    proc = _run(out, home, data, resume=False)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    _check_sinks(out)
    assert (out / "wandb_run_id").read_text().strip() != killed
    (moved,) = (out / "wandb" / "superseded").iterdir()
    assert moved.name.endswith(killed)
