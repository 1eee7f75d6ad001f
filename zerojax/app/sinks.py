"""Where a run's records go: `metrics.jsonl` always, TensorBoard event files and a Weights &
Biases run when enabled. `MetricsWriter` hands each record to every enabled sink, so they all
hold the same values, under the tags of `TAGS`.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from zerojax.app.files import RunFileError, cannot_write, replace_file
from zerojax.app.report import MetricsLog

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
    "memory_bytes": "perf/device_memory_bytes_in_use",
    "peak_memory_bytes": "perf/device_memory_peak_bytes_in_use",
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
    """Event files in `directory` (tensorboardX). A run from step 0 removes the event files a
    previous run left there, as `metrics.jsonl` is rewritten; a resume from step `start` writes
    a new file whose steps go on from `start + 1` and which purges the old files' steps past
    `start` (`purge_step`), so each curve holds every step once."""

    def __init__(self, directory: Path, start: int, earlier: list[dict[str, Any]]):
        from tensorboardX import SummaryWriter

        # It warns of every NaN it writes (--allow-nonfinite); metrics.jsonl holds them too.
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
        directory.mkdir(parents=True, exist_ok=True)
        old = sorted(directory.glob("events.out.tfevents.*"))
        if not start:
            for f in old:
                f.unlink()
        # A suffix per start: two writers within one second would otherwise share a file name.
        self.writer = SummaryWriter(str(directory), purge_step=start + 1 if old and start
                                    else None, flush_secs=10, filename_suffix=f".from{start}")
        events = self.writer._get_file_writer().event_writer._ev_writer
        self.file = events._py_recordio_writer = _Guarded(events._py_recordio_writer)
        if start and not old:  # the run wrote no events before (--no-tensorboard): its records
            for r in earlier:
                self.write(r)

    def write(self, record: dict[str, Any]) -> None:
        self._check()
        for tag, v in scalars(record).items():
            self.writer.add_scalar(tag, v, record["step"])

    def close(self, failed: bool = False) -> None:
        self.writer.close()
        if not failed:
            self._check()

    def _check(self) -> None:
        if self.file.error is not None:
            raise RunFileError(cannot_write(Path(self.file.path), self.file.error,
                                            kept="metrics.jsonl holds every record"))


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
    """A Weights & Biases run in `out/wandb/` of `project`, with `config`. A resume continues
    the run whose id `out/wandb_run_id` keeps (W&B keeps the first value it got for a step);
    a first W&B run of a resumed run gets the earlier records first."""

    def __init__(self, out: Path, project: str, start: int, earlier: list[dict[str, Any]],
                 config: dict[str, Any]):
        import wandb

        id_file = out / WANDB_ID
        resumed = start > 0 and id_file.is_file()
        self.run = wandb.init(project=project, dir=str(out), config=config, resume="allow",
                              id=id_file.read_text().strip() if resumed else None,
                              name=out.name)
        replace_file(id_file, (self.run.id + "\n").encode())
        if start and not resumed:
            for r in earlier:
                self.write(r)

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


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
        self.log.write(record)
        for sink in self.sinks:
            sink.write(record)

    def close(self, failed: bool = False) -> None:
        """Flushes and closes every sink (`failed`: the run stopped on an error)."""
        for sink in self.sinks:
            sink.close(failed)
        self.sinks = []
