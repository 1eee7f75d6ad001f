"""`zj.RunLog`: the records `python -m zerojax train` writes, for any script's training loop:
`metrics.jsonl`, TensorBoard event files, a W&B run and `loss.png`, with the step's throughput,
FLOPs, device and host memory and learning rate added to what `engine.step` returns."""

from __future__ import annotations

import importlib.util
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import psutil

from zerojax.analysis import flops as flops_
from zerojax.app.files import RunFileError, not_a_directory
from zerojax.app.sinks import TAGS, MetricsWriter
from zerojax.errors import ArgumentError, short

PLOT = "loss.png"
# engine.step's metrics that a record leaves out: the record has skipped_steps instead of the
# step's own flag, and `nonfinite` shows as a non-finite loss.
_OWN = ("loss", "grad_norm", "lr", "loss_scale", "skipped", "nonfinite")
# The throughput keys of a step counted from its compiled program (`step_flops` of a model
# without `flops_per_token`): hardware FLOPs and their utilization, HFU.
_PROGRAM = {"tflops_per_device": "program_tflops_per_device", "mfu": "hfu"}
# The keys a record gives a meaning of its own: a model's aux metric of one of these names
# would overwrite it (or be overwritten), so it is refused.
_RECORD_KEYS = frozenset(TAGS) | {"step"}


class RunLog:
    """A run's records in `out`, one per step, as `python -m zerojax train` writes them:
    `metrics.jsonl` (one JSON object per step), TensorBoard event files in `tensorboard/`
    (`tensorboard=False`: none), a Weights & Biases run of project `wandb` (with `config`),
    and `loss.png`, redrawn every `plot_every` seconds and at `close`.

    `engine` (optional) gives the FLOPs per step (`zj.step_flops`, once per batch shape), the
    device count and the compute dtype; `peak_tflops` the per-device peak MFU is against
    (default: `zj.peak_tflops` of the device for bfloat16/float16 compute, else no MFU).
    `start`: the step a resumed run continues from: the records after it are dropped (the file
    is replaced, never truncated) and every sink is made to hold the records up to it. Steps
    must increase: a step at or before the last record's is an `ArgumentError` naming both
    (to write later steps again, reopen the log from the step to go on from). Every argument
    is checked here, with one `ArgumentError` (or `RunFileError` for `out`) naming it. Only
    process 0 writes; the others keep the records in memory. A write that fails (a full disk)
    raises a `RunFileError` (a ValueError) naming the file and its free space, the file as it
    was."""

    def __init__(self, out, engine=None, *, start: int = 0, tensorboard: bool = True,
                 wandb: str | None = None, config: dict[str, Any] | None = None,
                 peak_tflops: float | None = None, flops_per_step: float | None = None,
                 title: str | None = None, plot_every: float = 30.0):
        start = step_number("start", start)
        peak_tflops = _optional("peak_tflops", peak_tflops)
        flops_per_step = _optional("flops_per_step", flops_per_step)
        plot_every = flops_.number("plot_every", plot_every, "RunLog", low=0.0)
        _check_sinks(tensorboard, wandb, config)
        self.out = Path(out) if isinstance(out, (str, Path)) else None
        if self.out is None:
            raise ArgumentError(f"RunLog: out={short(out)} must be a directory path")
        self.engine, self.lead = engine, jax.process_index() == 0
        if self.lead:
            make_run_dir(self.out)
        self.writer = MetricsWriter(self.out, start, enabled=self.lead,
                                    tensorboard=tensorboard, wandb=wandb, config=config)
        self.devices = engine.mesh.devices.size if engine is not None else jax.device_count()
        if peak_tflops is None and engine is not None:
            peak_tflops = flops_.run_peak(engine.mesh.devices.flat[0],
                                          engine.config.param_dtype)[0]
        self.peak, self.flops_per_step = peak_tflops, flops_per_step
        self._over_peak = False  # warned once that the MFU exceeds 100 %
        self._carry: dict[str, Any] = {}  # fields the next step's record carries (`_note`)
        self._flops: dict = {}  # batch shapes -> model FLOPs of a step
        self.title = title or (f"{type(engine.model).__name__}, stage {engine.config.stage}, "
                               f"{self.devices} devices ({mesh_text(engine.mesh)})"
                               if engine is not None else str(out))
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
        devices, where the backend reports it), this process's resident host memory and its
        peak (`host_memory`), `eval_loss` when given, and the model's aux metrics.

        Reading the metrics waits for the step to finish. `seconds`: the step's time (default:
        the time since the previous `step` returned, or since the log was made); `tokens`: the
        tokens of the global batch (default: from `batch`, see `batch_tokens`)."""
        step = step_number("step", step, "RunLog.step")
        values = _metric_values(metrics)  # waits for the step
        if seconds is not None:
            seconds = flops_.number("seconds", seconds, "RunLog.step", low=0.0)
        if tokens is not None:
            tokens = step_number("tokens", tokens, "RunLog.step")
        dt = time.perf_counter() - self._last if seconds is None else seconds
        rec: dict[str, Any] = {"step": step, "loss": values["loss"],
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
            tp = flops_.throughput(f, dt, self.devices, self.peak)
            if tp.get("mfu", 0) > 1 and not self._over_peak:
                self._over_peak = True
                warnings.warn(PeakWarning(over_peak(tp["mfu"], step, self.peak)), stacklevel=2)
            if self._program_flops():  # hardware FLOPs: named so, never as model FLOPs
                tp = {_PROGRAM[k]: v for k, v in tp.items()}
            rec |= tp
        if "loss_scale" in values:  # float16's dynamic loss scaling
            self.skipped += int(values.get("skipped", 0))
            rec |= {"loss_scale": values["loss_scale"], "skipped_steps": self.skipped}
        rec |= device_memory() | host_memory()
        rec |= {k: v for k, v in values.items() if k not in _OWN}
        if eval_loss is not None:
            rec["eval_loss"] = float(eval_loss)
        rec |= self._carry
        self._carry = {}
        self._write(rec)
        return rec

    def _note(self, **fields) -> None:
        """Fields (not scalars: no sink but metrics.jsonl shows them) that the next step's
        record carries: `train`'s note of a resume and the options it changed."""
        self._carry |= fields

    def eval(self, step: int, loss: float) -> dict[str, Any]:
        """Writes and returns a record of an evaluation alone (e.g. at step 0, before
        training); at a training step, pass `eval_loss=` to `step` instead."""
        rec = {"step": step_number("step", step, "RunLog.eval"),
               "eval_loss": _metric_values({"loss": loss}, need=())["loss"]}
        self._write(rec)
        return rec

    def _write(self, rec: dict[str, Any]) -> None:
        self.writer.write(rec)
        now = time.perf_counter()
        if self.lead and now - self._plotted >= self.plot_every:
            self.plot()
        self._last = time.perf_counter()  # the log's own time is no step's

    def _program_flops(self) -> bool:
        return (self.flops_per_step is None and self.engine is not None
                and not flops_.counts_model_flops(self.engine.model))

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
        from zerojax.app.records import plot_losses

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


def mesh_text(mesh) -> str:
    """The mesh's axes as a title shows them: "data 4 × model 2" (axes of size 1 left out,
    but for data)."""
    return " × ".join(f"{a} {n}" for a, n in dict(mesh.shape).items() if n > 1 or a == "data")


class PeakWarning(UserWarning):
    """The MFU exceeds 100 %: the peak it is against is below what the device runs."""


def over_peak(mfu: float, step: int, peak: float) -> str:
    """One line: the MFU of `step` exceeds 100 % of `peak`, and the fix."""
    return (f"MFU {mfu:.1%} at step {step} exceeds 100 %: the peak it is against, {peak:g} "
            f"TFLOP/s per device, is below what the device runs; give the device's dense "
            f"peak (--peak-tflops, RunLog(peak_tflops=))")


def step_number(name: str, value, where: str = "RunLog") -> int:
    """`value` as a step (a non-negative integer, or a 0-d integer array such as
    `state.step`), else one ArgumentError."""
    whole = isinstance(value, (int, np.integer)) or (
        hasattr(value, "dtype") and np.ndim(value) == 0
        and np.issubdtype(np.dtype(value.dtype), np.integer))
    if isinstance(value, bool) or not whole or value < 0:
        raise ArgumentError(f"{where}: {name}={short(value)} must be a non-negative integer")
    return int(value)


def _optional(name: str, value) -> float | None:
    return None if value is None else flops_.number(name, value, "RunLog")


def _check_sinks(tensorboard, wandb, config) -> None:
    if not isinstance(tensorboard, bool):
        raise ArgumentError(f"RunLog: tensorboard={short(tensorboard)} must be True or False")
    if tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise ArgumentError("RunLog: TensorBoard logging (tensorboard=True, the default) needs "
                            "the tensorboardX package: pip install tensorboardX, or pass "
                            "tensorboard=False")
    if wandb is not None and (not isinstance(wandb, str) or not wandb.strip()):
        raise ArgumentError(f"RunLog: wandb={short(wandb)} must name a W&B project, e.g. "
                            f"wandb='zerojax' (or be None)")
    if wandb is not None and importlib.util.find_spec("wandb") is None:
        raise ArgumentError(f"RunLog: wandb={wandb!r} needs the wandb package: pip install "
                            f"'zerojax[wandb]', or drop wandb=")
    if config is not None and not isinstance(config, dict):
        raise ArgumentError(f"RunLog: config={short(config)} must be a dict (or None)")


def make_run_dir(out: Path) -> None:
    """`out` as a directory (made here), else one RunFileError naming it and the fix."""
    where = not_a_directory(out)
    if where:
        raise RunFileError(f"RunLog: out {str(out)!r} {where}; name a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunFileError(f"RunLog: cannot make the run directory {str(out)!r}: "
                           f"{e.strerror or e}") from None


def _metric_values(metrics, need=("loss", "grad_norm")) -> dict[str, float]:
    """`engine.step`'s metrics as floats (reading them waits for the step)."""
    if not isinstance(metrics, dict):
        raise ArgumentError(f"RunLog.step: metrics={short(metrics)} must be the dict "
                            f"engine.step returns")
    missing = [k for k in need if k not in metrics]
    if missing:
        raise ArgumentError(f"RunLog.step: metrics lack {', '.join(map(repr, missing))} (they "
                            f"have {sorted(metrics)}); pass the dict engine.step returns")
    taken = sorted((set(metrics) - set(_OWN)) & _RECORD_KEYS)
    if taken:
        raise ArgumentError(f"RunLog.step: metrics {', '.join(map(repr, taken))} have the "
                            f"name of a key the record computes itself; rename the model's "
                            f"aux metric (e.g. 'aux_{taken[0]}')")
    values = {}
    for k, v in metrics.items():
        try:
            if isinstance(v, (str, bytes)) or np.size(v) != 1:
                raise TypeError
            values[k] = float(np.asarray(v).reshape(()))
        except (TypeError, ValueError):
            raise ArgumentError(f"RunLog.step: metrics[{k!r}]={short(v)} is not one number")\
                from None
    return values


def batch_tokens(batch) -> int:
    """The tokens of a global batch whose leaves are this process's slice: B·T of its token ids
    (an integer leaf [B, T]: `inputs` when it is one, else the first), else its examples B."""
    leaves = jax.tree.leaves(batch)
    first = [batch["inputs"]] if isinstance(batch, dict) and "inputs" in batch else []
    ids = next((x for x in first + leaves if np.ndim(x) == 2
                and np.issubdtype(np.result_type(x), np.integer)), None)
    n = math.prod(np.shape(ids)) if ids is not None else np.shape(leaves[0])[0]
    return int(n) * jax.process_count()


_rss_seen = 0  # host_memory's peak so far


def host_memory() -> dict[str, int]:
    """`host_rss_bytes` and `host_rss_peak_bytes`: this process's resident set in host memory
    now and at its largest so far (the OS's count: with offload, the host state and the host
    update's working memory among the rest; {} where the OS does not say). The peak is the
    kernel's high-water mark, and never below a resident set read before (the two counts are
    kept apart, a few pages out of step)."""
    global _rss_seen
    try:
        rss = psutil.Process().memory_info().rss
    except psutil.Error:
        return {}
    try:
        import resource
    except ImportError:  # not a POSIX system: no peak
        return {"host_rss_bytes": rss}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB (bytes on macOS)
    _rss_seen = max(_rss_seen, rss, peak * (1 if sys.platform == "darwin" else 1024))
    return {"host_rss_bytes": rss, "host_rss_peak_bytes": _rss_seen}


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
