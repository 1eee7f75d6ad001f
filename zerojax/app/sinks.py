"""Where a run's records go: `metrics.jsonl` always, TensorBoard event files and a Weights &
Biases run when enabled. `MetricsWriter` hands each record to every enabled sink, so they all
hold the same values, under the tags of `TAGS`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from zerojax.app.files import RunFileError, cannot_write, replace_file
from zerojax.app.records import MetricsLog
from zerojax.errors import ArgumentError

# Record key -> tag, grouped as MaxText's TensorBoard scalars are.
TAGS = {
    "loss": "learning/loss",
    "grad_norm": "learning/grad_norm",
    "lr": "learning/current_learning_rate",
    "loss_scale": "learning/loss_scale",
    "skipped_steps": "learning/skipped_steps",
    "step_time_s": "perf/step_time_seconds",
    "tokens_per_s": "perf/tokens_per_sec",
    "tokens_per_s_per_device": "perf/per_device_tokens_per_sec",
    "tflops_per_device": "perf/per_device_tflops_per_sec",
    "mfu": "perf/mfu",
    # A model without a FLOP formula is counted from its compiled program: hardware FLOPs,
    # whose utilization is HFU (remat's recompute counts), under tags of their own.
    "program_tflops_per_device": "perf/per_device_program_tflops_per_sec",
    "hfu": "perf/hfu",
    "memory_bytes": "perf/device_memory_bytes_in_use",
    "peak_memory_bytes": "perf/device_memory_peak_bytes_in_use",
    "host_rss_bytes": "perf/host_memory_rss_bytes",
    "host_rss_peak_bytes": "perf/host_memory_peak_rss_bytes",
    "eval_loss": "eval/loss",
}
TENSORBOARD = "tensorboard"  # OUT/tensorboard holds the event files
WANDB_ID = "wandb_run_id"  # OUT/wandb_run_id: the W&B run a resume continues


def tag(key: str) -> str:
    """The tag of a record's key: `TAGS`'s, or `metrics/KEY` for a model's own (aux) metric."""
    return TAGS.get(key, f"metrics/{key}")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A record's numeric values by tag (its step aside)."""
    return {tag(k): float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardSink:
    """Event files in `directory` (tensorboardX), rewritten from `metrics.jsonl` at every start.

    A killed run's event files hold an unknown part of its records (the writer flushes every
    10 s and at each checkpoint, and a kill may land between), so a start writes a new file
    that replays `earlier` (the records a resume keeps), then removes the old files: whatever
    the killed process had flushed, each curve holds exactly the records of `metrics.jsonl`.
    The new file opens with a restart event at step 0 (`purge_step`), so a TensorBoard that
    had read the old files drops their steps too. Only when `earlier` lacks the steps up to
    `start` are the old files kept (less `start`'s later steps); a write that fails leaves
    them as they were."""

    def __init__(self, directory: Path, start: int, earlier: list[dict[str, Any]]):
        from tensorboardX import SummaryWriter

        # It warns of every NaN it writes (--allow-nonfinite); metrics.jsonl holds them too.
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            old = sorted(directory.glob("events.out.tfevents.*"))
        except OSError as e:  # OUT/tensorboard is a file, or cannot be made
            raise RunFileError(f"cannot write TensorBoard event files in {directory}: "
                               f"{_why(e, directory)}; move it away, or turn TensorBoard "
                               f"off (--no-tensorboard; RunLog(tensorboard=False))") from None
        # metrics.jsonl lacks steps up to `start` (deleted, or cut short): the old files are
        # the better record, so they stay, their steps after `start` dropped (purged) instead.
        keep = bool(start) and not (earlier and earlier[-1]["step"] >= start)
        purge = (start + 1 if keep else 0) if old else None
        # A suffix per start: two writers within one second would otherwise share a file name.
        self.writer = SummaryWriter(str(directory), purge_step=purge, flush_secs=10,
                                    filename_suffix=f".from{start}")
        events = self.writer._get_file_writer().event_writer._ev_writer
        self.file = events._py_recordio_writer = _Guarded(events._py_recordio_writer)
        try:
            for r in [] if keep else earlier:
                self.write(r)
            self.flush()
        except RunFileError:  # a full disk: the old files stay as they were, alone
            self.writer.close()
            Path(self.file.path).unlink(missing_ok=True)
            raise
        for f in [] if keep else old:  # only once the new file holds every record
            if f.name != Path(self.file.path).name:
                f.unlink(missing_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        self._check()
        for tag, v in scalars(record).items():
            self.writer.add_scalar(tag, v, record["step"])

    def flush(self) -> None:
        """Writes what is buffered to the event file (at each checkpoint)."""
        self.writer.flush()
        self._check()

    def close(self, failed: bool = False) -> None:
        self.writer.close()
        if not failed:
            self._check()

    def _check(self) -> None:
        if self.file.error is not None:
            raise RunFileError(cannot_write(Path(self.file.path), self.file.error,
                                            kept="metrics.jsonl holds every record"))


def _why(e: OSError, path: Path) -> str:
    if path.exists() and not path.is_dir():
        return "it is a file, not a directory"
    return e.strerror or str(e)


class _Guarded:
    """tensorboardX's event file, whose writes (on tensorboardX's own thread) stop at the first
    that fails (a full disk) instead of raising there: the sink raises it on the run's thread,
    once, and the file is closed, so no unwritten buffer is flushed at exit."""

    def __init__(self, inner):
        self.inner, self.path, self.error = inner, inner.path, None

    def _guard(self, name: str, *args) -> None:
        if self.error is not None:
            return
        try:
            getattr(self.inner, name)(*args)
        except OSError as e:
            self.error = e
            with contextlib.suppress(OSError):
                self.inner.close()  # the file is closed even when its last flush fails

    def write(self, data) -> None:
        self._guard("write", data)

    def flush(self) -> None:
        self._guard("flush")

    def close(self) -> None:
        self._guard("close")


class WandbSink:
    """A Weights & Biases run in `out/wandb/` of `project`, with `config`.

    A resume continues the run whose id `out/wandb_run_id` keeps and replays the records it
    keeps (`earlier`, from `metrics.jsonl`) before its own: a killed process may have written
    any part of its history, so the resumed process's run file is written to hold the whole
    run. Offline, the killed processes' run directories of that id move to
    `out/wandb/superseded/`, so `out/wandb` holds one run file with every record once (what
    `wandb sync` uploads). Online, the run's server already holds the steps up to its last
    one (`run.starting_step`), which W&B will not rewrite: only the records from there are
    replayed. A fresh start (step 0) where a run left its id (a run killed before its first
    checkpoint, which `train` starts again without --resume) makes a run of its own and moves
    that run's local directories aside too: `metrics.jsonl` and the TensorBoard files start
    again as well, and `wandb sync` would upload both."""

    def __init__(self, out: Path, project: str, start: int, earlier: list[dict[str, Any]],
                 config: dict[str, Any]):
        import wandb

        id_file = out / WANDB_ID
        last = id_file.read_text().strip() or None if id_file.is_file() else None
        if last is not None:
            supersede_wandb_runs(out / "wandb", last)
        run_id = last if start else None
        self.run = wandb.init(project=project, dir=str(out), config=config, resume="allow",
                              id=run_id, name=out.name)
        replace_file(id_file, (self.run.id + "\n").encode())
        first = self.run.starting_step  # offline: 0; online: the step after the server's last
        for r in earlier:
            if r["step"] >= first:
                self.write(r)

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=record["step"])

    def flush(self) -> None:
        """Nothing to do: a resume replays what the run file lacks from `metrics.jsonl`."""

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def supersede_wandb_runs(directory: Path, run_id: str) -> list[Path]:
    """Moves the local run directories of W&B run `run_id` (`offline-run-DATE-ID`,
    `run-DATE-ID`) to `directory/superseded/`: a resumed process writes the whole run again,
    a fresh one a run of its own."""
    moved = []
    runs = sorted(directory.glob(f"*run-*-{run_id}")) if directory.is_dir() else []
    for path in runs:
        if path.is_dir() and not path.is_symlink():
            dest, n = directory / "superseded" / path.name, 1
            while dest.exists():
                dest, n = dest.with_name(f"{path.name}.{n}"), n + 1
            dest.parent.mkdir(exist_ok=True)
            os.replace(path, dest)
            moved.append(dest)
    return moved


class MetricsWriter:
    """A run's records, one per step, to `metrics.jsonl` (`MetricsLog`) and to TensorBoard and
    W&B when enabled; `enabled=False` (processes other than 0) keeps them in memory only.

    `wandb`: a project name; `config`: what W&B shows as the run's config."""

    def __init__(self, out: Path, start: int, *, enabled: bool = True,
                 tensorboard: bool = True, wandb: str | None = None,
                 config: dict[str, Any] | None = None):
        self.log = MetricsLog(out / "metrics.jsonl", start, enabled=enabled)
        self.sinks: list[TensorBoardSink | WandbSink] = []
        if enabled and tensorboard:
            self.sinks.append(TensorBoardSink(out / TENSORBOARD, start, self.log.records))
        if enabled and wandb:
            self.sinks.append(WandbSink(out, wandb, start, self.log.records, config or {}))

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.log.records

    def write(self, record: dict[str, Any]) -> None:
        """Writes `record` to every sink; its step must follow the last record's (a resume
        from step S drops the records after S first, so it goes on from S + 1)."""
        last = self.log.records[-1]["step"] if self.log.records else None
        if last is not None and record["step"] <= last:
            raise ArgumentError(
                f"step {record['step']} after step {last}: {self.log.path.name} takes each "
                f"step once, in increasing order (an evaluation at a training step goes in "
                f"that step's record, `eval_loss=`); to write steps after S again, reopen the "
                f"log from S (RunLog(out, start=S)), which drops the later records")
        self.log.write(record)
        for sink in self.sinks:
            sink.write(record)

    def flush(self) -> None:
        """Makes every record so far durable in every sink (`metrics.jsonl` always is):
        called at each checkpoint, so a checkpoint's steps are in every sink."""
        for sink in self.sinks:
            sink.flush()

    def close(self, failed: bool = False) -> None:
        """Flushes and closes every sink (`failed`: the run stopped on an error)."""
        for sink in self.sinks:
            sink.close(failed)
        self.sinks = []
