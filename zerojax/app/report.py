"""What a training run shows: the start-up table and its rows, and the progress (what it
writes: records.py)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from zerojax.analysis.accounting import (
    ADAM_BYTES,
    MASTER_BYTES,
    MemoryEstimate,
    comm_estimate,
    format_bytes,
    shares_master,
    state_estimate,
)
from zerojax.app.presets import STATE, TITLE
from zerojax.app.records import tflops_text
from zerojax.precision import DTYPES


def make_console(quiet: bool) -> Console:
    """Rich console; off a terminal (log files) lines are not wrapped at 80 columns."""
    console = Console(quiet=quiet, highlight=False)
    if not console.is_terminal:
        console.width = 120
    return console


def state_bytes_per_device(state, device: jax.Device) -> int:
    """Bytes of `device`'s addressable shards of every array in `state` (measured, not
    modelled)."""
    total = 0
    for leaf in jax.tree.leaves(state):
        for shard in getattr(leaf, "addressable_shards", ()):
            if shard.device == device:
                total += shard.data.nbytes
    return total


def state_bytes_split(engine, state, device: jax.Device) -> tuple[int, int]:
    """(bytes of `device`'s shards of `state`, of which in host memory): with offload the
    master, optimizer state and pending update count on `device`'s twin on the engine's host
    mesh (on a machine of CPU devices, the device itself), but for Twin-Flow's share, which
    counts on `device` with the rest."""
    hosted = engine.host_part(state)
    if not hosted:
        return state_bytes_per_device(state, device), 0
    (at,) = [i for i, d in np.ndenumerate(engine.mesh.devices) if d == device]
    host = state_bytes_per_device(hosted, engine.host_mesh.devices[at])
    on_host = {id(x) for x in jax.tree.leaves(hosted)}
    rest = [x for x in jax.tree.leaves(state) if id(x) not in on_host]
    return state_bytes_per_device(rest, device) + host, host


def host_share(engine) -> float | None:
    """With offload, the share of the params (by count) whose master and optimizer state the
    host holds, as Twin-Flow applied `offload_fraction` (whole groups of leaves, as the update
    ties them: `offload/twin_flow.py`); None without offload."""
    state = engine.abstract_state()
    hosted = engine.host_part(state)
    if not hosted:
        return None
    on_host = jax.tree.leaves(hosted[0], is_leaf=lambda x: x is None)  # None: the devices'
    sizes = [math.prod(leaf.shape) for leaf in engine.layout.leaves]
    return sum(n for n, x in zip(sizes, on_host, strict=True) if x is not None) / sum(sizes)


def startup_table(rows: list[tuple[str, str]], title: str) -> Table:
    """A two-column table of start-up facts."""
    table = Table(title=title, show_header=False, title_justify="left", box=None,
                  padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    return table


def host_update_text(kind: str) -> str:
    """`Engine.host_update` as the start-up table says it."""
    if kind == "fused":
        return "AdamW as one fused pass per leaf on every host core (in place)"
    if kind == "nvme":
        return ("AdamW as one fused pass per leaf streamed from and to the NVMe store (reads "
                "ahead, writes behind)")
    return f"the optimizer's XLA program on the host ({kind.removeprefix('xla: ')})"


@dataclasses.dataclass(frozen=True)
class RunEstimate:
    """A run's per-device model state by formula, and what that state holds."""

    memory: MemoryEstimate  # `state_estimate`: grads included, though the state holds none
    param_dtype: str
    shared_master: bool  # the compute params are the fp32 master (no separate copy)
    offload: str | None = None  # master and optimizer state in host memory (`memory.host`)
    optimizer: str = "adamw"  # a name of `presets.OPTIMIZERS`
    state_bytes: float = ADAM_BYTES  # the optimizer state per param (from its init)
    grad_dtype: str | None = None  # the reduced gradients' dtype (None: param_dtype)

    @property
    def state(self) -> float:
        """What the engine keeps between steps: everything but the gradients (and hpZ's
        secondary copy)."""
        return self.memory.state

    def as_dict(self) -> dict[str, Any]:
        return {**self.memory.as_dict(), "state": self.state, "param_dtype": self.param_dtype,
                "shared_master": self.shared_master, "offload": self.offload,
                "optimizer": self.optimizer, "optimizer_state_bytes": self.state_bytes}

    @property
    def held(self) -> str:
        """What the optimizer state holds, e.g. "Adam moments"."""
        return STATE.get(self.optimizer, f"{self.optimizer} state")


def memory_rows(estimate: RunEstimate, measured: int, measured_host: int = 0,
                disk: dict | None = None) -> list[tuple[str, str]]:
    """Per-device model-state bytes: the estimate by component and the measured state arrays
    (`measured` counts every array; `measured_host` those in host memory); `disk`: an NVMe
    run's store (`offload.disk.disk_io`), whose master and moments are on disk."""
    m, dtype, fmt = estimate.memory, estimate.param_dtype, format_bytes
    share = MASTER_BYTES / (MASTER_BYTES + estimate.state_bytes)  # the master's part of K
    if estimate.offload and disk is not None:
        master = (m.host - m.pending) * share
        ring = 12 * disk["buffer_size"] * disk["buffer_count"]
        return [
            ("memory/device", f"{fmt(estimate.state)} estimated in device memory = {dtype} "
                              f"params {fmt(m.params)}"),
            ("memory/disk", f"{fmt(m.host - m.pending)} estimated on disk (nvme) = float32 "
                            f"master {fmt(master)} + {estimate.held} "
                            f"{fmt(m.host - master - m.pending)}; {fmt(disk['store_bytes'])} "
                            f"measured: this process's store in {disk['path']} "
                            f"({disk['shards']} shard(s), each leaf's arrays padded to 4 KiB; "
                            f"{'O_DIRECT' if disk['direct'] else 'buffered'})"),
            ("memory/host", f"{fmt(ring)} of I/O buffers per shard (kept between steps) "
                            f"({disk['buffer_count']} × {disk['buffer_size']:,} elements of "
                            f"master and moments) + the gradient and compute shards while a "
                            f"step runs; {fmt(measured_host)} measured (the counts)"),
            ("", f"+ grads {fmt(m.grads)} ({estimate.grad_dtype or dtype}) only while a step "
                 f"runs; {fmt(m.transfer)} host<->device per step"),
        ]
    if estimate.offload:
        master = (m.host - m.pending) * share
        return [
            ("memory/device", f"{fmt(estimate.state)} estimated in device memory = {dtype} "
                              f"params {fmt(m.params)}"
                              + (f" + Twin-Flow's share of the master and {estimate.held} "
                                 f"{fmt(m.optimizer)}" if m.optimizer else "")),
            ("memory/host", f"{fmt(m.host)} estimated in host memory (offload) = float32 "
                            f"master {fmt(master)} + {estimate.held} "
                            f"{fmt(m.host - master - m.pending)}"
                            + (f" + the pending gradient {fmt(m.pending)} (delayed "
                               f"update)" if m.pending else "")),
            ("", f"{fmt(measured - measured_host)} device + {fmt(measured_host)} host measured: "
                 f"this device's shards of the state"),
            ("", f"+ grads {fmt(m.grads)} ({estimate.grad_dtype or dtype}) only while a step "
                 f"runs; {fmt(m.transfer)} host<->device per step"),
        ]
    if estimate.shared_master:
        held = (f"{dtype} params {fmt(m.params)} (the master) + {estimate.held} "
                f"{fmt(m.optimizer)}")
    else:
        master = m.optimizer * share
        held = (f"{dtype} params {fmt(m.params)} + float32 master {fmt(master)} + "
                f"{estimate.held} {fmt(m.optimizer - master)}")
    return [
        ("memory/device", f"{fmt(estimate.state)} estimated = {held}"),
        ("", f"{fmt(measured)} measured: this device's shards of the state"),
        ("", f"+ grads {fmt(m.grads)} ({estimate.grad_dtype or dtype})"
             + (f" + hpZ's secondary copy {fmt(m.secondary)}" if m.secondary else "")
             + " only while a step runs"),
    ]


class Reporter:
    """Progress display: a rich bar on a terminal, a line every `every` steps otherwise."""

    def __init__(self, console: Console, total: int, start: int, enabled: bool = True):
        self.console, self.total, self.enabled = console, total, enabled
        self.every = max(1, (total - start) // 10)
        self.start = start
        self.recent: list[float] = []  # step times, for the ETA; the first (compile) is left out
        self.progress = None
        if enabled and console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("{task.fields[tflops]}"), TextColumn("eval {task.fields[eval]}"),
                TextColumn("eta"), TimeRemainingColumn(), TimeElapsedColumn(), console=console,
                transient=False)
            self.task = self.progress.add_task("train", total=total, completed=start,
                                               loss="-", tps="-", tflops="", eval="-")
            self.progress.start()

    def status(self, message: str) -> None:
        if self.enabled:
            self.console.print(message)

    def update(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = record["step"]
        if step > self.start + 1:
            self.recent = (self.recent + [record["step_time_s"]])[-20:]
        loss = f"{record['loss']:.4f}"
        tps = f"{record['tokens_per_s']:,.0f}"
        ev = f"{record['eval_loss']:.4f}" if "eval_loss" in record else None
        tflops = tflops_text(record)
        if self.progress is not None:
            fields = {"loss": loss, "tps": tps, "tflops": tflops} | ({"eval": ev} if ev else {})
            self.progress.update(self.task, completed=step, **fields)
            return
        if (step - self.start) % self.every and step != self.total and ev is None:
            return
        eta = sum(self.recent) / max(len(self.recent), 1) * (self.total - step)
        line = (f"step {step:>{len(str(self.total))}}/{self.total}  loss {loss}  "
                f"grad_norm {record['grad_norm']:.3f}  lr {record['lr']:.2e}  {tps} tok/s  "
                + (f"{tflops}  " if tflops else "") + f"eta {_clock(eta)}")
        self.console.print(line + (f"  eval {ev}" if ev else ""), soft_wrap=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def estimate_for(num_params: int, devices: int, stage: int, cfg,
                 state_bytes: float = ADAM_BYTES, split_params: int | None = None,
                 applied: float | None = None) -> RunEstimate:
    """This run's per-device model-state bytes by formula (`state_estimate`) for its optimizer
    (`cfg.optimizer`, default adamw) whose state takes `state_bytes` per param; with
    `cfg.model_parallel` > 1 the `split_params` are divided over data × model; `applied`: the
    host's share as Twin-Flow applied it (`host_share`), else `cfg.offload_fraction`'s."""
    offload = getattr(cfg, "offload", None)
    memory = state_estimate(num_params, devices, stage, cfg.param_dtype, replica=cfg.replica,
                            offload=offload, optimizer_state_bytes=state_bytes,
                            hpz=getattr(cfg, "hpz", False),
                            quantize_weights=getattr(cfg, "quantize_weights", None),
                            quantize_grads=getattr(cfg, "quantize_grads", None),
                            model=getattr(cfg, "model_parallel", 1), split_params=split_params,
                            delayed_update=getattr(cfg, "delayed_update", None),
                            offload_fraction=applied or getattr(cfg, "offload_fraction",
                                                                None) or 1.0)
    grad_dtype = "float32" if getattr(cfg, "quantize_grads", None) else None
    return RunEstimate(memory, cfg.param_dtype, shares_master(cfg.param_dtype, stage, offload),
                       offload, getattr(cfg, "optimizer", None) or "adamw", state_bytes,
                       grad_dtype)


def host_need(cfg, model, optimizer, devices, process: int) -> tuple[float, RunEstimate | None]:
    """With offload, before anything is allocated: the host memory this process's devices'
    shares of the state need while the update runs (`MemoryEstimate.host_peak` of each of
    them), and the run's estimate; (0, None) without offload. Where a model axis splits
    the params, all of them are taken as split: the least the run can need."""
    if cfg.offload is None:
        return 0.0, None
    from zerojax.analysis.measurement import state_size

    size = state_size(optimizer, jax.eval_shape(model.init, jax.random.key(0)))
    split = size.num_params if getattr(cfg, "model_parallel", 1) > 1 else None
    estimate = estimate_for(size.num_params, len(devices), cfg.stage, cfg, size.per_param,
                            split)
    mine = sum(d.process_index == process for d in devices)
    return estimate.memory.host_peak * mine, estimate


def startup_rows(cfg, model, num_params: int, devices, mesh, data: str, start: int,
                 applied: float | None = None) -> list[tuple[str, str]]:
    """The facts a run prints before it starts (`applied`: `host_share`)."""
    c = model.cfg
    per_device = cfg.batch // (len(devices) // getattr(cfg, "model_parallel", 1))
    processes = len({d.process_index for d in devices})
    shape = " × ".join(f"{k}={v}" for k, v in mesh.shape.items())
    sched = (f"cosine to {cfg.lr * cfg.min_lr_ratio:.2g}" if cfg.schedule == "cosine"
             else "constant")
    return [
        ("model", f"{cfg.model}: {num_params:,} params ({c.n_layers} layers, d={c.d_model}, "
                  f"{c.n_heads} heads, context {c.seq_len}, vocab {c.vocab_size})"),
        ("devices", f"{len(devices)} × {devices[0].platform} in {processes} process(es)"),
        ("mesh", shape),
        ("ZeRO", f"stage {cfg.stage}, {cfg.param_dtype} compute, "
                 f"{'remat' if cfg.remat else 'no remat'}"
                 + (", prefetch" if cfg.prefetch else "")
                 + offload_text(cfg, applied)
                 + zeropp_text(cfg)
                 + (f", clip {cfg.clip_norm:g}" if cfg.clip_norm else "")
                 + (f", grad_accum {cfg.grad_accum}" if cfg.grad_accum > 1 else "")),
        ("batch", f"{cfg.batch} × {cfg.seq_len} tokens = {cfg.batch * cfg.seq_len:,} "
                  f"tokens/step ({per_device} sequences per "
                  f"{'data-parallel ' if getattr(cfg, 'model_parallel', 1) > 1 else ''}device)"),
        ("optimizer", f"{TITLE[cfg.optimizer]} lr {cfg.lr:g}, {cfg.warmup} warm-up steps, "
                      f"{sched}, weight decay {cfg.weight_decay:g}"),
        ("data", data),
        ("steps", f"{cfg.steps}" + (f" (resuming at {start})" if start else "")),
        ("out", cfg.out),
    ]


def offload_text(cfg, applied: float | None = None) -> str:
    """The offload options of a run, as the start-up table's ZeRO row lists them; `applied`:
    the host's share as Twin-Flow applied the asked `offload_fraction` (`host_share`)."""
    if not cfg.offload:
        return ""
    asked = getattr(cfg, "offload_fraction", None) or 1.0
    share = asked if applied is None else applied
    k = getattr(cfg, "delayed_update", None)
    where = "host memory" if share == 1 else (
        f"Twin-Flow: {share:{'g' if applied is None else '.2g'}} of it in host memory, the "
        f"rest on the devices")
    if abs(share - asked) >= 5e-3:
        where += (f"; {asked:g} asked, the devices take whole groups of leaves as the update "
                  f"ties them")
    if getattr(cfg, "offload_device", "cpu") == "nvme":
        where = f"NVMe: the master and moments in a store in {cfg.nvme_path}"
    delayed = ("" if k is None else ", delayed update from the first step" if k == 0 else
               f", delayed update after {k} ordinary step{'s' * (k != 1)}")
    return f", offload {cfg.offload} ({where}){delayed}"


def zeropp_text(cfg) -> str:
    """The ZeRO++ options of a run, as the start-up table's ZeRO row lists them."""
    return ((f", qwZ {cfg.quantize_weights} gathers" if getattr(cfg, "quantize_weights", None)
             else "")
            + (f", qgZ {cfg.quantize_grads} reductions" if getattr(cfg, "quantize_grads", None)
               else "")
            + (", hpZ" if getattr(cfg, "hpz", False) else ""))


def split_params(engine) -> int:
    """Params of `engine`'s layout split over the model axis."""
    return sum(leaf.size * (leaf.shape[0] if leaf.stacked else 1)
               for leaf in engine.layout.leaves if leaf.is_split)


def _leaf_name(path: str) -> str:
    """`['blocks']['attn']['qkv']['kernel']` -> `blocks.attn.qkv.kernel`."""
    return ".".join(part.strip("'\"") for part in path.strip("[]").split("]["))


def model_rows(engine) -> list[tuple[str, str]]:
    """What a model axis splits: the split leaves (and the dimension), the replicated ones,
    and how their bytes fall per device; none without a model axis."""
    m = engine.model_parallel
    if m == 1:
        return []
    leaves = engine.layout.leaves
    count = lambda ls: sum(x.size * (x.shape[0] if x.stacked else 1) for x in ls)
    split = [x for x in leaves if x.is_split]
    kept = [x for x in leaves if not x.is_split]
    n = engine.data * engine.replica
    return [
        ("model axis", f"model={m}: each layer's matmuls split over {m} devices (Megatron: an "
                       f"all-reduce of activations after attention and after the MLP, forward "
                       f"and backward); ZeRO over the {n} data-parallel devices"),
        ("split", f"{count(split):,} params in {len(split)} leaves, 1/{m} per model device: "
                  + ", ".join(f"{_leaf_name(x.path)} (dim {x.split})" for x in split)),
        ("replicated", f"{count(kept):,} params in {len(kept)} leaves, whole on every model "
                       f"device: " + ", ".join(_leaf_name(x.path) for x in kept)),
    ]


def comm_rows(cfg, num_params: int, devices: int, split_params: int | None = None,
              shape=None) -> list[tuple[str, str]]:
    """Bytes one device sends per step by collective (`comm_estimate`), values and scales
    apart, and by mesh axis where there is a model axis (Megatron's all-reduces from the GPT
    `shape`); only for a run with a ZeRO++ option or a model axis (the plain table stays as
    it was)."""
    m = getattr(cfg, "model_parallel", 1)
    if not zeropp_text(cfg) and m == 1:
        return []
    from zerojax.analysis.tensor import Activations

    size = np.dtype(DTYPES[cfg.param_dtype]).itemsize
    kw = {k: getattr(cfg, k, None) for k in ("quantize_weights", "quantize_grads")}
    acts = (Activations.of(shape, cfg.batch * cfg.seq_len, devices // m, cfg.remat)
            if shape is not None and m > 1 else None)
    c = comm_estimate(num_params, devices, cfg.stage, grad_bytes=size, param_bytes=size,
                      replica=cfg.replica, hpz=getattr(cfg, "hpz", False), model=m,
                      split_params=split_params, activations=acts, **kw)
    parts = []
    for name, total, scales in (("all_gather", c.all_gather, c.all_gather_scales),
                                ("reduce_scatter", c.reduce_scatter, 0.0),
                                ("all_to_all", c.all_to_all, c.all_to_all_scales),
                                ("all_reduce", c.all_reduce, 0.0)):
        if total:
            parts.append(f"{name} {format_bytes(total)}"
                         + (f" (scales {format_bytes(scales)})" if scales else ""))
    axes = (" = " + " + ".join(f"over {axis} {format_bytes(v)}" for axis, v in c.axes.items())
            if m > 1 else "")
    return [("comm/device", f"{format_bytes(c.total)} per step estimated = " + " + ".join(parts)
             + axes)]
