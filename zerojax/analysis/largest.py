"""`largest`: the biggest GPT shape whose estimated peak fits a memory budget, per stage, with
or without optimizer offload (its state in host memory or on disk), from formulas alone (the
model-state estimator plus an activation estimate); largest_command.py prints it."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

from zerojax.analysis.accounting import ADAM_BYTES, state_estimate
from zerojax.analysis.estimate_args import STAGES, EstimateError
from zerojax.analysis.planning import MARGIN

# The share of the host's memory `largest` keeps free, as the planner keeps MARGIN of the
# device's: the host peak counts the state and the update's shards alone, and the host also
# holds the operating system and its page cache, the training process's runtime (its Python,
# jax's and the accelerator's libraries, compiled programs: 0.65-0.73 GB resident for a CPU
# `train` of nano before its state, more with CUDA's libraries) and the data pipeline, none of
# which an estimate of the state can know; and a process over the host's memory is killed
# without a word, where a device's peak over its memory is an error.
HOST_MARGIN = 0.10

# GPT-3's shapes (Brown et al. 2020, table 2.1; 16 heads of 128 for 1.3B, whose table row is not
# a whole head width) with d_ff = 4d, beside the presets; vocabulary and sequence length of the
# 1b/7b presets. Depths and widths of GPT-NeoX-20B and LLaMA-33B/65B (with d_ff = 4d), and a
# 4B between 2.7B and 6.7B, fill the gaps. (GPT-3 6.7B is the 7b preset.)
_GPT3_SHAPES = {"gpt3-125m": (12, 768, 12), "gpt3-350m": (24, 1024, 16),
                "gpt3-760m": (24, 1536, 16), "gpt3-1.3b": (24, 2048, 16),
                "gpt3-2.7b": (32, 2560, 32), "gpt-4b": (36, 3072, 24),
                "gpt3-13b": (40, 5120, 40), "neox-20b": (44, 6144, 48),
                "gpt-33b": (60, 6656, 52), "gpt-65b": (80, 8192, 64),
                "gpt3-175b": (96, 12288, 96)}
FAMILY_PRESETS = ("gpt2-small", "1b", "7b")


def gpt_family(vocab_size: int = 32000, seq_len: int = 2048) -> dict[str, Any]:
    """The GPT shapes `largest` searches (name -> `GPTConfig`), fewest params first: the presets
    of `FAMILY_PRESETS` and GPT-3's table (with `vocab_size` and `seq_len`)."""
    from zerojax.models.gpt import GPT, PRESETS, GPTConfig

    shapes = {name: PRESETS[name] for name in FAMILY_PRESETS}
    for name, (layers, d, heads) in _GPT3_SHAPES.items():
        shapes[name] = GPTConfig(vocab_size=vocab_size, seq_len=seq_len, d_model=d,
                                 n_heads=heads, n_layers=layers, d_ff=4 * d)
    return dict(sorted(shapes.items(), key=lambda kv: GPT(kv[1]).num_params()))


def nearest_shape(num_params: float, family: dict[str, Any] | None = None) -> tuple[str, Any]:
    """The shape of `family` (default `gpt_family()`) whose parameter count is nearest
    `num_params` (by ratio)."""
    import math

    from zerojax.models.gpt import GPT

    return min((gpt_family() if family is None else family).items(),
               key=lambda kv: abs(math.log(GPT(kv[1]).num_params() / num_params)))


@functools.lru_cache(maxsize=256)
def state_per_param(optimizer, cfg) -> float:
    """Bytes per param of the state `optimizer` allocates for the GPT `cfg` (read from its
    init on abstract params: nothing is allocated)."""
    import jax

    from zerojax.analysis.measurement import state_size
    from zerojax.models.gpt import GPT

    return state_size(optimizer, jax.eval_shape(GPT(cfg).init, jax.random.key(0))).per_param


def _itemsize(param_dtype: str) -> int:
    import numpy as np

    from zerojax.precision import DTYPES

    if param_dtype not in DTYPES:
        raise EstimateError(f"param_dtype={param_dtype!r} is not supported; use one of "
                            f"{sorted(DTYPES)}")
    return np.dtype(DTYPES[param_dtype]).itemsize


def activation_bytes(cfg, batch_per_device: int, param_dtype: str = "bfloat16",
                     remat: bool = True, model: int = 1) -> dict[str, float]:
    """Estimated per-device activation bytes of one GPT training step, by part.

    One layer's activations: Korthikanti et al. 2022's `b·T·d·(34 + 5·a·T/d)` bytes for 2-byte
    values (scaled to `param_dtype`); over a `model` axis of M devices (tensor parallelism,
    their eq. 2) `b·T·d·(10 + 24/M + 5·a·T/(d·M))`: the attention and MLP insides are split,
    the LayerNorms' and residuals' inputs are not. It counts the T×T attention scores, which
    XLA's attention keeps and cuDNN's flash attention does not, and dropout masks GPT does not
    have: an upper bound. With remat every layer keeps only its input (not split) and one layer
    is recomputed at a time; without, every layer keeps all of its activations. The head adds
    the logits in compute dtype and their float32 log-softmax and gradient (split over the
    vocabulary). `batch_per_device` is the sequences of one data-parallel device.
    """
    size = _itemsize(param_dtype)
    if isinstance(batch_per_device, bool) or not isinstance(batch_per_device, int) \
            or batch_per_device < 1:
        raise EstimateError(f"batch_per_device={batch_per_device!r} must be an integer >= 1")
    if isinstance(model, bool) or not isinstance(model, int) or model < 1:
        raise EstimateError(f"model={model!r} must be an integer >= 1")
    b, T, d, L, M = batch_per_device, cfg.seq_len, cfg.d_model, cfg.n_layers, model
    layer = b * T * d * (10 + 24 / M + 5 * cfg.n_heads * T / (d * M)) * size / 2
    layers = L * b * T * d * size + layer if remat else L * layer
    logits = b * T * cfg.vocab_size / M * (size + 8)
    return {"layers": layers, "logits": logits, "total": layers + logits}


@dataclasses.dataclass(frozen=True)
class Fit:
    """The estimated per-device peak of one GPT shape at one stage: model state (params, grads,
    optimizer: `state_estimate`) + activations (`activation_bytes`) + stage 3's gathered unit
    (its compute params and their gradient, for the largest unit). With offload, `state` and
    `peak` are device bytes and the master and optimizer state are `host` bytes, or with the
    NVMe tier `on_disk` bytes."""

    name: str
    num_params: int
    stage: int
    remat: bool
    state: float
    activations: float
    gathered: float
    peak: float
    offload: str | None = None
    host: float = 0.0  # offload: master + optimizer state (+ pending) in host memory, per device
    transfer: float = 0.0  # offload: host<->device bytes per step, per device
    optimizer_state_bytes: float = ADAM_BYTES  # per param, master excluded
    host_peak: float = 0.0  # offload: host + the update's gradient and compute shards
    pending: float = 0.0  # delayed update: its gradient shard, in `host`
    # offload: what XLA:GPU's pinned-host pool holds, the gradient shard on its way to the
    # host mesh (the state lives in the CPU backend's memory)
    pinned: float = 0.0
    # offload_device="nvme": the master and optimizer state in the store, per device (not in
    # `host`, which holds the `ring` of I/O buffers instead)
    on_disk: float = 0.0
    ring: float = 0.0

    @property
    def offloaded(self) -> float:
        """The offloaded state, in host memory or on disk: master, optimizer state, pending."""
        return self.host - self.ring + self.on_disk

    def over(self, device_memory: float, host_memory: float | None = None,
             pinned: float | None = None, disk: float | None = None) -> list[str]:
        """The memories this shape's estimate does not fit: "device", "host" (its
        `host_peak` over `host_memory`), "pinned-host limit" (its `pinned` over `pinned`),
        "disk" (its `on_disk` over `disk`)."""
        out = ["device"] if self.peak > device_memory else []
        if host_memory is not None and self.host_peak > host_memory:
            out.append("host")
        if pinned is not None and self.pinned > pinned:
            out.append("pinned-host limit")
        if disk is not None and self.on_disk > disk:
            out.append("disk")
        return out

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def estimate_fit(name: str, cfg, devices: int, stage: int, batch_per_device: int,
                 param_dtype: str = "bfloat16", remat: bool = True,
                 offload: str | None = None, optimizer_state_bytes: float = ADAM_BYTES,
                 delayed_update: int | None = None, offload_device: str = "cpu") -> Fit:
    """`Fit` of the GPT `cfg` (called `name`) on `devices` at `stage`, with an optimizer state
    of `optimizer_state_bytes` per param (default: Adam's 8); `delayed_update` (with offload):
    the pending update's bytes; `offload_device="nvme"`: the state on disk
    (`accounting.estimate`)."""
    from zerojax.models.gpt import GPT

    psi = GPT(cfg).num_params()
    mem = state_estimate(psi, devices, stage, param_dtype, offload=offload,
                         optimizer_state_bytes=optimizer_state_bytes,
                         delayed_update=delayed_update, offload_device=offload_device)
    state = mem.total
    act = activation_bytes(cfg, batch_per_device, param_dtype, remat)["total"]
    # Stage 3 gathers one unit at a time: the largest is a layer or the vocabulary table.
    unit = max(cfg.layer_params, cfg.vocab_size * cfg.d_model)
    gathered = 2 * unit * _itemsize(param_dtype) if stage == 3 and devices > 1 else 0
    pinned = psi * _itemsize(param_dtype) / devices if offload else 0.0
    return Fit(name, psi, stage, remat, state, act, gathered, state + act + gathered, offload,
               mem.host, mem.transfer, optimizer_state_bytes, mem.host_peak, mem.pending,
               pinned, mem.on_disk, mem.ring)


def largest(devices: int, device_memory: float, *, batch_per_device: int = 1,
            param_dtype: str = "bfloat16", stages=STAGES, remat=(True, False),
            family: dict[str, Any] | None = None, offload: str | None = None,
            host_memory: float | None = None, pinned: float | None = None,
            optimizer=None, delayed_update: int | None = None,
            host_margin: float = HOST_MARGIN, offload_device: str = "cpu",
            disk: float | None = None) -> list[dict[str, Any]]:
    """Per (stage, remat): the largest shape of `family` (default `gpt_family()`) whose
    estimated peak fits `device_memory`, and the next larger one, which does not.

    The optimizer state per param is read from `optimizer`'s init on each shape (None: Adam's
    8 bytes, which is what AdamW's init gives on every shape).

    With `offload` ("optimizer"), stage 0 (which cannot offload) is skipped and the peak is
    device memory; `host_memory`, if given, less `host_margin` of it (`HOST_MARGIN`), must
    also hold each device's host peak (`Fit.host_peak`: the state and the in-place update's
    gradient and compute shards), and
    `pinned` (XLA:GPU's pinned-host pool) the gradient shard on its way there (`Fit.pinned`).
    `delayed_update` (with `offload`) adds the pending update: its gradient shard to the
    host, the next compute shard to the device peak. `offload_device="nvme"` (with `offload`):
    the master and optimizer state on disk, where `disk` (bytes per device, if given) must hold
    each device's share of the store (`Fit.on_disk`); the host peak is then the ring of I/O
    buffers and the update's shards.
    Rows: {"stage", "remat", "offload", "fits": Fit | None, "next": Fit | None, "binds": the
    memories the next larger shape does not fit (`Fit.over`)}. Arithmetic only.
    """
    family = gpt_family() if family is None else family
    k = {n: ADAM_BYTES if optimizer is None else state_per_param(optimizer, c)
         for n, c in family.items()}
    if host_memory is not None:
        host_memory *= 1 - host_margin
    rows = []
    for stage, rm in itertools.product(stages, remat):
        if offload is not None and stage == 0:
            continue
        fits = [estimate_fit(n, c, devices, stage, batch_per_device, param_dtype, rm, offload,
                             k[n], delayed_update, offload_device) for n, c in family.items()]
        ok = [f for f in fits if not f.over(device_memory, host_memory, pinned, disk)]
        best = max(ok, key=lambda f: f.num_params) if ok else None
        bigger = [f for f in fits if f not in ok
                  and (best is None or f.num_params > best.num_params)]
        nxt = min(bigger, key=lambda f: f.num_params) if bigger else None
        rows.append({"stage": stage, "remat": rm, "offload": offload, "fits": best,
                     "next": nxt,
                     "binds": nxt.over(device_memory, host_memory, pinned, disk) if nxt
                     else []})
    return rows


TWIN_STEP = 0.05  # Twin-Flow's host share, chosen in steps of this


def twin_flow_fraction(fit: Fit, device_memory: float, step: float = TWIN_STEP,
                       margin: float = MARGIN) -> float:
    """Twin-Flow's choice for an offloaded `fit`: the least `offload_fraction` (a multiple of
    `step`, at least `step`) whose devices' share of the offloaded state (master, optimizer
    state, a pending gradient; in host memory or on disk) fits beside the estimated device
    peak in `device_memory` less `margin` of it (the planner's `MARGIN`: the room the estimate
    leaves out). The devices update their share at their memory's bandwidth, so the less the
    host keeps, the less its update and the moves cost; 1.0 where no room is left."""
    if fit.offloaded <= 0:
        return 1.0
    room = max(device_memory * (1 - margin) - fit.peak, 0.0)
    least = math.ceil(round((1 - room / fit.offloaded) / step, 9)) * step
    return round(min(1.0, max(step, least)), 9)
