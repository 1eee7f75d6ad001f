"""`ZeroConfig`: the frozen, hashable description of how a step is sharded and computed."""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

import numpy as np

from zerojax.errors import ConfigError
from zerojax.precision import dtype_name

STAGES = (0, 1, 2, 3)
OFFLOADS = ("optimizer",)
OFFLOAD_DEVICES = ("cpu", "nvme")  # DeepSpeed's offload_optimizer.device
NVME_BUFFER_SIZE, NVME_BUFFER_COUNT = 1 << 20, 4  # the NVMe ring: measured (docs/nvme.md)
NVME_UNIT = 1024  # float32 per O_DIRECT 4 KiB: a buffer holds a whole number of them
WEIGHT_FORMATS = ("int8",)  # qwZ
GRAD_FORMATS = ("int8", "int4")  # qgZ
QUANT_BLOCK = 256  # elements per quantization block: a float32 scale adds 1/64 byte each
# The delayed update's recommended start (ZeRO-Offload's "after a few dozen steps"): an earlier
# one is legal, and warned of (`delay_advice`).
DELAY_AFTER = 40


class DelayWarning(UserWarning):
    """A delayed update that starts where a step run on stale params can spike the loss."""


@dataclass(frozen=True)
class ZeroConfig:
    """How the engine shards and computes a step.

    stage: 0 (DDP), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters).
    param_dtype: compute dtype of params and gradients ("float32", "bfloat16", "float16");
        master params and optimizer moments are always float32.
    reduce_dtype: dtype of the gradient reduction; None (default) reduces in `param_dtype`,
        as FSDP2 does; "float32" reduces bf16/fp16 gradients in fp32 (twice the bytes).
    grad_accum: micro-batches per step (the device batch is split `grad_accum` ways).
    clip_norm: global-norm clipping threshold (the true norm over all shards); None: off.
    remat: recompute each scanned layer in backward (`jax.checkpoint`). In stages 2/3 with
        remat=False, matmul outputs are saved and everything else, the gathers included,
        is recomputed, so no gathered weight is ever a saved residual.
    loss_scale: "dynamic", a fixed float, or None; None means "dynamic" for float16 and
        no scaling otherwise.
    prefetch: stage 3 only: gather layer i+1 while layer i computes.
    offload: None (default) or "optimizer" (ZeRO-Offload, stages 1-3): the fp32 master shard
        and the optimizer state live in pinned host memory, the optimizer update runs on the
        host, and only the updated compute-dtype shard comes back to the device.
    delayed_update: None (default) or K >= 0, with offload="optimizer": ZeRO-Offload's
        delayed parameter update (DPU). Steps 0..K-1 are ordinary; from step K on, each step's
        forward and backward run on the params before the previous step's update, while the
        host computes that update (docs/training.md, "Delayed parameter update"). K below 40
        is legal and warned of (`DelayWarning`): the early steps are the fast-moving ones.
    offload_fraction: with offload="optimizer", the share of the params (by count) whose
        master and optimizer state live on the host and are updated there; 1.0 (default):
        all of them. Below 1, DeepSpeed's Twin-Flow: the other params' state stays in device
        memory and the devices update it (whole leaves, as the update's own computations
        group them: an optimizer whose chain holds a global norm cannot be split; clip with
        `clip_norm`), while the host updates its share (docs/stages.md).
    offload_device: with offload="optimizer", where the host's share of the master and
        optimizer state lives: "cpu" (default: host memory) or "nvme" (ZeRO-Infinity: in files
        under `nvme_path`, streamed through the host's update every step; docs/nvme.md).
    nvme_path: with offload_device="nvme", the directory of this process's store (on a fast
        local disk); a working copy, never a checkpoint.
    nvme_buffer_size, nvme_buffer_count: the NVMe update's ring: elements per buffer (a
        multiple of 1024; each buffer holds that many of master, mu and nu) and buffers per
        device shard (>= 2).
    quantize_weights: ZeRO++ qwZ, stages 1-3: None, or "int8": every all_gather of compute
        params (stage 3's per-layer gathers, forward and backward; the refresh of stages 1-2)
        sends block-quantized int8 values and a float32 scale per block, dequantized to
        `param_dtype` on arrival. The master and the optimizer never see quantized values.
    quantize_grads: ZeRO++ qgZ: None, "int8" or "int4" (two per byte): the gradient
        reduce-scatter becomes an all_to_all of block-quantized pieces, summed in float32
        after dequantization (so the reduced gradient is float32); "data" first, then
        "replica". Stage 0's all-reduce: the same, then an all_gather in `param_dtype`.
    quant_block: elements per quantization block (default 256; int4 needs an even number).
    hpz: ZeRO++ hpZ, stage 3 on a replica × data mesh: the master, optimizer state and
        compute shard are sharded over all R·D devices, and each step keeps a secondary copy
        of the params sharded over "data" only (Ψ·pb/D per device while the step runs), so
        the per-layer gathers of forward and backward stay within "data".
    """

    stage: int = 0
    param_dtype: str = "float32"
    grad_accum: int = 1
    clip_norm: float | None = None
    remat: bool = True
    loss_scale: str | float | None = None
    reduce_dtype: str | None = None
    prefetch: bool = False
    loss_scale_init: float = 2.0**15
    loss_scale_interval: int = 2000
    offload: str | None = None
    quantize_weights: str | None = None
    quantize_grads: str | None = None
    quant_block: int = QUANT_BLOCK
    hpz: bool = False
    delayed_update: int | None = None
    offload_fraction: float = 1.0
    offload_device: str = "cpu"
    nvme_path: str | None = None
    nvme_buffer_size: int = NVME_BUFFER_SIZE
    nvme_buffer_count: int = NVME_BUFFER_COUNT

    def __post_init__(self):
        stage = _integer("stage", self.stage)
        if stage not in STAGES:
            raise ConfigError(f"stage={self.stage!r} is not a ZeRO stage; use one of {STAGES}")
        object.__setattr__(self, "stage", stage)
        object.__setattr__(self, "param_dtype", dtype_name(self.param_dtype))
        if self.reduce_dtype is not None:
            object.__setattr__(self, "reduce_dtype", dtype_name(self.reduce_dtype))
        accum = _integer("grad_accum", self.grad_accum, "a positive integer")
        if accum < 1:
            raise ConfigError(f"grad_accum={self.grad_accum!r} must be a positive integer")
        object.__setattr__(self, "grad_accum", accum)
        for name in ("remat", "prefetch"):
            object.__setattr__(self, name, _boolean(name, getattr(self, name)))
        if self.clip_norm is not None:
            object.__setattr__(self, "clip_norm", _positive(
                "clip_norm", self.clip_norm, "a positive number, or None to disable clipping"))
        ls = self.loss_scale
        if ls is not None and ls != "dynamic":
            object.__setattr__(self, "loss_scale", _positive(
                "loss_scale", ls, "'dynamic', a positive finite number, or None"))
        object.__setattr__(self, "loss_scale_init", _positive(
            "loss_scale_init", self.loss_scale_init, "a positive finite number (the first "
            "dynamic loss scale, e.g. 2.0**15)"))
        interval = _integer("loss_scale_interval", self.loss_scale_interval, "an integer >= 1")
        if interval < 1:
            raise ConfigError(f"loss_scale_interval={self.loss_scale_interval!r} must be >= 1")
        object.__setattr__(self, "loss_scale_interval", interval)
        if self.prefetch and self.stage != 3:
            raise ConfigError(f"prefetch=True needs stage=3 (got stage={self.stage}); prefetch "
                              f"overlaps the per-layer parameter gather, which only stage 3 has")
        if self.offload is not None and self.offload not in OFFLOADS:
            raise ConfigError(f"offload={self.offload!r} is not an offload mode; use one of "
                              f"{OFFLOADS} or None")
        if self.offload is not None and self.stage == 0:
            raise ConfigError(f"offload={self.offload!r} needs stage 1, 2 or 3 (got stage=0); "
                              f"stage 0 keeps a full optimizer copy per device, so there is "
                              f"no shard to offload")
        self._check_delayed()
        self._check_fraction()
        self._check_nvme()
        self._check_zeropp()

    def _check_delayed(self) -> None:
        """`delayed_update`: an integer K >= 0, with the optimizer offloaded."""
        k = self.delayed_update
        if k is None:
            return
        k = _integer("delayed_update", k, "an integer K >= 0 (the ordinary steps before the "
                     "delay starts), or None")
        if k < 0:
            raise ConfigError(f"delayed_update={k} must be an integer K >= 0 (the ordinary "
                              f"steps before the delay starts), or None")
        object.__setattr__(self, "delayed_update", k)
        if self.offload != "optimizer":
            raise ConfigError(f"delayed_update={k} needs offload='optimizer' (got offload="
                              f"{self.offload!r}): the delay lets the host's update of one "
                              f"step run while the device computes the next; add "
                              f"offload='optimizer', or drop delayed_update")
        advice = delay_advice(k)
        if advice:
            warnings.warn(advice, DelayWarning, stacklevel=4)  # ZeroConfig(...)'s caller

    def _check_fraction(self) -> None:
        """`offload_fraction`: a number in (0, 1], below 1 with the optimizer offloaded."""
        f = self.offload_fraction
        if isinstance(f, (bool, np.bool_)) or not isinstance(
                f, (int, float, np.integer, np.floating)) or not 0 < f <= 1:
            raise ConfigError(f"offload_fraction={f!r} must be a number in (0, 1]: the host's "
                              f"share of the params' update (1.0: all of it)")
        object.__setattr__(self, "offload_fraction", float(f))
        if f < 1 and self.offload != "optimizer":
            raise ConfigError(f"offload_fraction={f} needs offload='optimizer' (got offload="
                              f"{self.offload!r}): it splits the offloaded update between the "
                              f"host and the devices; add offload='optimizer', or drop "
                              f"offload_fraction")

    def _check_nvme(self) -> None:
        """`offload_device`, `nvme_path` and the NVMe ring's sizes."""
        dev = self.offload_device
        if not isinstance(dev, str) or dev not in OFFLOAD_DEVICES:
            raise ConfigError(f"offload_device={dev!r} is not an offload device; use one of "
                              f"{OFFLOAD_DEVICES}")
        path = self.nvme_path
        if path is not None:
            if not isinstance(path, (str, os.PathLike)) or not str(path):
                raise ConfigError(f"nvme_path={path!r} must be a directory's path (a str or "
                                  f"Path), or None")
            object.__setattr__(self, "nvme_path", os.fspath(path))
        size = _integer("nvme_buffer_size", self.nvme_buffer_size,
                        f"a positive multiple of {NVME_UNIT} (elements per buffer)")
        if size <= 0 or size % NVME_UNIT:
            raise ConfigError(f"nvme_buffer_size={size} must be a positive multiple of "
                              f"{NVME_UNIT} elements (O_DIRECT's 4 KiB of float32); the "
                              f"default is {NVME_BUFFER_SIZE}")
        count = _integer("nvme_buffer_count", self.nvme_buffer_count, "an integer >= 2")
        if count < 2:
            raise ConfigError(f"nvme_buffer_count={count} must be >= 2 (one buffer updated "
                              f"while another is read or written); the default is "
                              f"{NVME_BUFFER_COUNT}")
        object.__setattr__(self, "nvme_buffer_size", size)
        object.__setattr__(self, "nvme_buffer_count", count)
        if dev == "nvme":
            if self.offload != "optimizer":
                raise ConfigError(f"offload_device='nvme' needs offload='optimizer' (got "
                                  f"offload={self.offload!r}): the disk holds the offloaded "
                                  f"optimizer state; add offload='optimizer'")
            if path is None:
                raise ConfigError("offload_device='nvme' needs nvme_path: the directory of "
                                  "this process's store, on a fast local disk (e.g. "
                                  "nvme_path='/local_nvme/zerojax')")
        elif path is not None:
            raise ConfigError(f"nvme_path={path!r} needs offload_device='nvme' (got "
                              f"offload_device={dev!r}); add offload_device='nvme', or drop "
                              f"nvme_path")

    def _check_zeropp(self) -> None:
        """The ZeRO++ options (qwZ, qgZ, hpZ) and how they combine with the others."""
        qw, qg = self.quantize_weights, self.quantize_grads
        if qw is not None and (not isinstance(qw, str) or qw not in WEIGHT_FORMATS):
            raise ConfigError(f"quantize_weights={qw!r} is not a weight format; use 'int8' "
                              f"(qwZ) or None")
        if qg is not None and (not isinstance(qg, str) or qg not in GRAD_FORMATS):
            raise ConfigError(f"quantize_grads={qg!r} is not a gradient format; use one of "
                              f"{GRAD_FORMATS} (qgZ) or None")
        block = _integer("quant_block", self.quant_block,
                         f"an integer >= 8 (the default is {QUANT_BLOCK})")
        if block < 8:
            raise ConfigError(f"quant_block={block!r} must be an integer >= 8 (one float32 "
                              f"scale per block: smaller blocks send more scale than values); "
                              f"the default is {QUANT_BLOCK}")
        object.__setattr__(self, "quant_block", block)
        if qg == "int4" and block % 2:
            raise ConfigError(f"quant_block={block} is odd, but quantize_grads='int4' packs two "
                              f"values per byte, so a block must fill whole bytes; use an even "
                              f"block such as {block + 1}")
        if qw is not None and self.stage == 0:
            raise ConfigError(f"quantize_weights={qw!r} needs stage 1, 2 or 3 (got stage=0): "
                              f"stage 0 gathers no params; use quantize_grads to shrink its "
                              f"all-reduce")
        if qg is not None and self.reduce_dtype is not None:
            raise ConfigError(f"quantize_grads={qg!r} and reduce_dtype={self.reduce_dtype!r} "
                              f"both set the gradient reduction: qgZ sends {qg} and sums in "
                              f"float32; drop reduce_dtype (or quantize_grads for a plain "
                              f"{self.reduce_dtype} reduction)")
        object.__setattr__(self, "hpz", _boolean("hpz", self.hpz))
        if self.hpz and self.stage != 3:
            raise ConfigError(f"hpz=True needs stage=3 (got stage={self.stage}): hpZ keeps a "
                              f"secondary copy of the params that stage 3 shards")

    def check_mesh(self, replica: int) -> None:
        """ConfigError for options that the mesh (`replica` groups) cannot run."""
        if self.hpz and replica < 2:
            raise ConfigError("hpz=True needs a replica axis: build the mesh with "
                              "make_mesh(replica=R, data=D), R > 1 (e.g. R nodes of D "
                              "devices), or drop hpz")

    @property
    def zeropp(self) -> bool:
        """Whether any ZeRO++ option is on."""
        return bool(self.quantize_weights or self.quantize_grads or self.hpz)

    @property
    def grad_dtype(self) -> str:
        """Dtype the gradients are reduced in (qgZ sums the dequantized pieces in float32)."""
        if self.quantize_grads is not None:
            return "float32"
        return self.reduce_dtype or self.param_dtype

    @property
    def dynamic_scale(self) -> bool:
        return self.loss_scale == "dynamic" or (self.loss_scale is None
                                                and self.param_dtype == "float16")

    @property
    def initial_scale(self) -> float:
        if self.dynamic_scale:
            return float(self.loss_scale_init)
        return float(self.loss_scale) if self.loss_scale is not None else 1.0


def delay_advice(k: int, warmup: int | None = None, flag: str = "delayed_update=") -> str | None:
    """Why a delayed update that starts at step `k` is unwise, or None: it starts within the
    first `DELAY_AFTER` steps, or (`warmup`: the schedule's warm-up steps, where known) before
    the learning rate's warm-up ends. The early steps move the params fastest, and a step run
    on the params before the last update then overshoots: measured with `zerojax train`'s
    defaults (nano, lr 3e-3 after 10 warm-up steps, 200 steps; docs/training.md), K = 2 and
    K = 10 spike the loss (to 6.77 at step 19, 5.49 at step 13), K = 20 and 40 do not."""
    start = max(DELAY_AFTER, warmup or 0)
    if k >= start:
        return None
    when = (f"before the learning rate's {warmup}-step warm-up ends" if warmup and
            warmup > DELAY_AFTER else f"within the first {DELAY_AFTER} steps")
    return (f"{flag}{k} starts the delayed update {when}, where the params move fastest and "
            f"a step run on the params before the last update can spike the loss (nano at "
            f"the command line's defaults: K = 2 spikes it to 6.77 at step 19, K = 40 does "
            f"not); ZeRO-Offload starts the delay after a few dozen steps: use {flag}{start} "
            f"or more (docs/training.md)")


def _integer(name: str, v, want: str = "an integer") -> int:
    """`v` as an int; a float (3.0), bool or string is refused, not rounded."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ConfigError(f"{name}={v!r} ({type(v).__name__}) must be {want}")
    return int(v)


def _boolean(name: str, v) -> bool:
    """`v` as a bool; a string ("no" is truthy) or a number is refused."""
    if not isinstance(v, (bool, np.bool_)):
        raise ConfigError(f"{name}={v!r} ({type(v).__name__}) must be True or False")
    return bool(v)


def _positive(name: str, v, want: str) -> float:
    """`v` as a float that is positive and finite, also once stored as float32 (a loss scale
    of 1e39 would be inf on the device)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer,
                                                              np.floating)):
        raise ConfigError(f"{name}={v!r} ({type(v).__name__}) must be {want}")
    with np.errstate(over="ignore"):
        ok = v > 0 and math.isfinite(v) and np.isfinite(np.float32(v))
    if not ok:
        raise ConfigError(f"{name}={v!r} must be {want}")
    return float(v)
