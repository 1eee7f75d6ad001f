"""`zj.RunLog`: the records `python -m zerojax train` writes, for any script's training loop:
`metrics.jsonl`, TensorBoard event files, a W&B run and `loss.png`, with the step's throughput,
FLOPs, device memory and learning rate added to what `engine.step` returns."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zerojax.analysis import flops as flops_
from zerojax.app.sinks import MetricsWriter

PLOT = "loss.png"
# engine.step's metrics that a record leaves out: the record has skipped_steps instead of the
# step's own flag, and `nonfinite` shows as a non-finite loss.
_OWN = ("loss", "grad_norm", "lr", "loss_scale", "skipped", "nonfinite")


class RunLog:
    """A run's records in `out`, one per step, as `python -m zerojax train` writes them:
    `metrics.jsonl` (one JSON object per step), TensorBoard event files in `tensorboard/`
    (`tensorboard=False`: none), a Weights & Biases run of project `wandb` (with `config`),
    and `loss.png`, redrawn every `plot_every` seconds and at `close`.

    `engine` (optional) gives the FLOPs per step (`zj.step_flops`, once per batch shape), the
    device count and the compute dtype; `peak_tflops` the per-device peak MFU is against
    (default: `zj.peak_tflops` of the device for bfloat16/float16 compute, else no MFU).
    `start`: the step a resumed run continues from: the records after it are dropped (the file
    is replaced, never truncated) and the TensorBoard curves continue from it. Only process 0
    writes; the others keep the records in memory. A write that fails (a full disk) raises a
    `RunFileError` (a ValueError) naming the file and its free space, the file as it was."""

    def __init__(self, out, engine=None, *, start: int = 0, tensorboard: bool = True,
                 wandb: str | None = None, config: dict[str, Any] | None = None,
                 peak_tflops: float | None = None, flops_per_step: float | None = None,
                 title: str | None = None, plot_every: float = 30.0):
        self.out = Path(out)
        self.engine, self.lead = engine, jax.process_index() == 0
        self.writer = MetricsWriter(self.out, int(start), enabled=self.lead,
                                    tensorboard=tensorboard, wandb=wandb, config=config)
        self.devices = engine.mesh.devices.size if engine is not None else jax.device_count()
        if peak_tflops is None and engine is not None:
            peak_tflops = flops_.run_peak(engine.mesh.devices.flat[0],
                                          engine.config.param_dtype)[0]
        self.peak, self.flops_per_step = peak_tflops, flops_per_step
        self._flops: dict = {}  # batch shapes -> model FLOPs of a step
        self.title = title or (f"{type(engine.model).__name__}, stage {engine.config.stage}, "
                               f"{self.devices} devices" if engine is not None else str(out))
        self.plot_every, self._plotted = plot_every, time.perf_counter()
        self.skipped = next((r["skipped_steps"] for r in reversed(self.records)
                             if "skipped_steps" in r), 0)
        self._last = time.perf_counter()

    @property
    def records(self) -> list[dict[str, Any]]:
        """Every record so far (a resumed run's earlier ones first)."""
        return self.writer.records

    def step(self, step: int, metrics: dict, batch=None, *, seconds: float | None = None,
             lr: float | None = None, tokens: int | None = None,
             eval_loss: float | None = None) -> dict[str, Any]:
        """Writes and returns the record of `step` (the steps done: the state's step after
        this one) from `engine.step`'s `metrics`: loss, grad_norm, lr (where the optimizer
        state carries it, `optax.inject_hyperparams`; or `lr=`), tokens/s (also per device),
        the step time, TFLOP/s per device and MFU (with an engine), the loss scale and skipped
        steps (float16), the device memory in use and its peak (max over this process's
        devices, where the backend reports it), `eval_loss` when given, and the model's aux
        metrics.

        Reading the metrics waits for the step to finish. `seconds`: the step's time (default:
        the time since the previous `step` returned, or since the log was made); `tokens`: the
        tokens of the global batch (default: from `batch`, see `batch_tokens`)."""
        values = {k: float(v) for k, v in metrics.items()}  # waits for the step
        dt = time.perf_counter() - self._last if seconds is None else float(seconds)
        rec: dict[str, Any] = {"step": int(step), "loss": values["loss"],
                               "grad_norm": values["grad_norm"]}
        lr = values.get("lr") if lr is None else float(lr)
        if lr is not None:
            rec["lr"] = lr
        n = batch_tokens(batch) if tokens is None and batch is not None else tokens
        if n is not None and dt > 0:
            rec |= {"tokens_per_s": n / dt, "tokens_per_s_per_device": n / dt / self.devices}
        rec["step_time_s"] = dt
        f = self._step_flops(batch)
        if f is not None and dt > 0:
            rec |= flops_.throughput(f, dt, self.devices, self.peak)
        if "loss_scale" in values:  # float16's dynamic loss scaling
            self.skipped += int(values.get("skipped", 0))
            rec |= {"loss_scale": values["loss_scale"], "skipped_steps": self.skipped}
        rec |= device_memory()
        rec |= {k: v for k, v in values.items() if k not in _OWN}
        if eval_loss is not None:
            rec["eval_loss"] = float(eval_loss)
        self._write(rec)
        return rec

    def eval(self, step: int, loss: float) -> dict[str, Any]:
        """Writes and returns a record of an evaluation alone (e.g. at step 0, before
        training); at a training step, pass `eval_loss=` to `step` instead."""
        rec = {"step": int(step), "eval_loss": float(loss)}
        self._write(rec)
        return rec

    def _write(self, rec: dict[str, Any]) -> None:
        self.writer.write(rec)
        now = time.perf_counter()
        if self.lead and now - self._plotted >= self.plot_every:
            self.plot()
        self._last = time.perf_counter()  # the log's own time is no step's

    def _step_flops(self, batch) -> float | None:
        if self.flops_per_step is not None:
            return self.flops_per_step
        if self.engine is None or batch is None:
            return None
        shapes = tuple((np.shape(x), np.result_type(x)) for x in jax.tree.leaves(batch))
        if shapes not in self._flops:
            self._flops[shapes] = flops_.step_flops(self.engine, batch)
        return self._flops[shapes]

    def flush(self) -> None:
        """Makes the records so far durable in every sink (TensorBoard's buffer written);
        call it before saving a checkpoint, as `python -m zerojax train` does."""
        self.writer.flush()

    def plot(self) -> None:
        """Redraws `loss.png` from the records so far (process 0)."""
        from zerojax.app.report import plot_losses

        self._plotted = time.perf_counter()
        if self.lead and self.records:
            plot_losses(self.records, self.out / PLOT, self.title)

    def close(self, failed: bool = False) -> None:
        """Draws `loss.png` a last time and closes the sinks (`failed`: the run stopped on an
        error; W&B marks it so)."""
        try:
            if not failed:
                self.plot()
        finally:
            self.writer.close(failed)

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, kind, error, tb) -> None:
        self.close(failed=kind is not None)


def batch_tokens(batch) -> int:
    """The tokens of a global batch whose leaves are this process's slice: B·T of its token ids
    (an integer leaf [B, T]: `inputs` when it is one, else the first), else its examples B."""
    leaves = jax.tree.leaves(batch)
    first = [batch["inputs"]] if isinstance(batch, dict) and "inputs" in batch else []
    ids = next((x for x in first + leaves if np.ndim(x) == 2
                and np.issubdtype(np.result_type(x), np.integer)), None)
    n = math.prod(np.shape(ids)) if ids is not None else np.shape(leaves[0])[0]
    return int(n) * jax.process_count()


def device_memory() -> dict[str, int]:
    """`memory_bytes` and `peak_memory_bytes` in use on this process's devices (the largest
    of them), where the backend reports them (GPUs, TPUs; not the CPU): {} otherwise."""
    stats = [s for s in (d.memory_stats() for d in jax.local_devices()) if s]
    if not stats or "bytes_in_use" not in stats[0]:
        return {}
    out = {"memory_bytes": max(int(s["bytes_in_use"]) for s in stats)}
    if "peak_bytes_in_use" in stats[0]:
        out["peak_memory_bytes"] = max(int(s.get("peak_bytes_in_use", 0)) for s in stats)
    return out
