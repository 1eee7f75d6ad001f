"""`ZeroConfig`: the frozen, hashable description of how a step is sharded and computed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from zerojax.errors import ConfigError
from zerojax.precision import dtype_name

STAGES = (0, 1, 2, 3)
OFFLOADS = ("optimizer",)


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

    @property
    def grad_dtype(self) -> str:
        """Dtype the gradients are reduced in."""
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
