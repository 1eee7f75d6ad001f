"""Memory and communication accounting for the ZeRO stages.

The analytic model follows Rajbhandari et al. 2020 (ZeRO, Figure 1 and section 7): per-device
model-state bytes and per-device bytes sent by ring collectives, as functions of the parameter
count Ψ, the stage and the device count. Sizes are exact fractions Ψ·b/N (no padding).
measurement.py checks them against compiled programs.

With a `model` axis of M devices (tensor parallelism, DESIGN.md section 8) the ZeRO formulas
apply to each device's model piece, Ψ_split/M + Ψ_replicated params, sharded over the
N = devices / (replica · M) devices of `data`; Megatron's activation all-reduces over `model`
are tensor.py's.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax.numpy as jnp

from zerojax.analysis.tensor import Activations
from zerojax.collectives.quantize import FORMATS, SCALE_BYTES, bytes_per_element
from zerojax.config import OFFLOADS, QUANT_BLOCK
from zerojax.precision import DTYPES
from zerojax.step import stores_compute

# --- Analytic model --------------------------------------------------------------------------

STAGES = (0, 1, 2, 3)


class EstimateError(ValueError):
    """A bad argument to the analytic estimates; the message names the value and the fix."""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device model-state bytes: `total` is what device memory holds; with optimizer
    offload the master and optimizer state are in `host` memory instead and `transfer` bytes cross
    between host and device each step."""

    params: float  # compute params, Ψ·pb (stage 3: /N)
    grads: float  # gradients, Ψ·gb (stages 2, 3: /N)
    optimizer: float  # master params and optimizer state, Ψ·K (stages 1-3: /N; offload: 0)
    total: float  # device bytes: params + grads + optimizer
    host: float = 0.0  # offload: master and optimizer state in host memory, Ψ·K/N (+ pending)
    transfer: float = 0.0  # offload: gradient shard down + compute shard up, Ψ·(gb + pb)/N
    secondary: float = 0.0  # hpZ: the secondary copy while a step runs, Ψ·pb/D (in total)
    # delayed_update: the pending gradient shard, as it arrived, Ψ·gb/N (in host); and the next
    # step's compute shard, which comes up while the step runs on the one before, Ψ·pb/N (in
    # total, while a step runs)
    pending: float = 0.0
    ahead: float = 0.0

    @property
    def host_peak(self) -> float:
        """Offload: the host's peak while the update runs in place: the state, the gradient
        shard that came down and the compute shard that goes up, Ψ·(K + gb + pb)/N (with the
        delayed update: + the pending gradient shard, Ψ·gb/N)."""
        return self.host + self.transfer if self.host else 0.0

    @property
    def state(self) -> float:
        """What the engine keeps between steps: the total less gradients, hpZ's secondary
        copy and the delayed update's next compute shard, which live only while a step runs."""
        return self.total - self.grads - self.secondary - self.ahead

    def as_dict(self) -> dict[str, float]:
        """The fields, and offload's `host_peak`; hpZ's `secondary`, `host_peak` and the
        delayed update's `pending` and `ahead` only where they are not 0."""
        return _without_zero(dataclasses.asdict(self) | {"host_peak": self.host_peak},
                             ("secondary", "host_peak", "pending", "ahead"))

    def row(self) -> dict[str, str]:
        """The columns `zerojax estimate` prints for a stage's memory (offload's host bytes
        and hpZ's secondary copy where they are not 0)."""
        row = {k: format_bytes(getattr(self, k)) for k in ("params", "grads", "optimizer",
                                                            "total")}
        if self.host or self.transfer:
            row |= {"host": format_bytes(self.host), "host peak": format_bytes(self.host_peak),
                    "host<->device": format_bytes(self.transfer)}
        if self.pending:
            row["of which pending"] = format_bytes(self.pending)
        if self.secondary:
            row["hpZ secondary"] = format_bytes(self.secondary)
        return row

    def __str__(self) -> str:
        """The estimate as `zerojax estimate`'s table prints it, one row."""
        from zerojax.analysis.tables import render_table

        return render_table("per-device model state (estimated)", [self.row()]).rstrip("\n")


def _without_zero(d: dict[str, float], optional: tuple[str, ...]) -> dict[str, float]:
    return {k: v for k, v in d.items() if k not in optional or v}


@dataclasses.dataclass(frozen=True)
class CommEstimate:
    """Per-device bytes sent per step by ring collectives."""

    all_reduce: float
    reduce_scatter: float
    all_gather: float
    total: float
    all_to_all: float = 0.0  # qgZ: quantized pieces (values + scales)
    all_gather_scales: float = 0.0  # qwZ: the float32 block scales within `all_gather`
    all_to_all_scales: float = 0.0  # qgZ: the float32 block scales within `all_to_all`
    # The total by the mesh axes the collectives span: "data", "replica", "all" (a ring over
    # replica and data together: stage 0 with replicas), "model" (Megatron's all-reduces, in
    # `all_reduce` too; only where the activations were given); axes that send nothing left out.
    axes: dict[str, float] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        """The fields; the ZeRO++ ones only where they are not 0."""
        return _without_zero(dataclasses.asdict(self), ZEROPP_COMM)


ZEROPP_COMM = ("all_to_all", "all_gather_scales", "all_to_all_scales")


def _check(num_params: Any, devices: Any, stage: Any, replica: Any, offload: Any = None,
           model: Any = 1, split_params: Any = None, **nbytes: Any) -> int:
    """Validates the common arguments; returns N, the devices the state is sharded over (the
    `data` axis: devices / (replica · model))."""
    if offload is not None and offload not in OFFLOADS:
        raise EstimateError(f"offload={offload!r} is not an offload mode; use one of "
                            f"{OFFLOADS} or None")
    if offload is not None and stage == 0:
        raise EstimateError(f"offload={offload!r} needs stage 1, 2 or 3 (got stage=0); stage 0 "
                            f"has no optimizer shard to offload")
    if isinstance(num_params, bool) or not isinstance(num_params, (int, float)):
        raise EstimateError(f"num_params={num_params!r} must be a number of parameters")
    if not (num_params >= 0 and math.isfinite(num_params)) or num_params != int(num_params):
        raise EstimateError(f"num_params={num_params!r} must be a non-negative whole number")
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise EstimateError(f"stage={stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
    for name, value in (("devices", devices), ("replica", replica), ("model", model)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EstimateError(f"{name}={value!r} must be an integer >= 1")
    if devices % replica:
        raise EstimateError(
            f"devices={devices} is not divisible by replica={replica}; "
            f"use a replica count that divides the device count"
        )
    if devices % (replica * model):
        raise EstimateError(f"devices={devices} do not split into replica={replica} x data x "
                            f"model={model}; use a model size that divides devices / replica")
    if split_params is not None and (isinstance(split_params, bool)
                                     or not isinstance(split_params, (int, float))
                                     or not 0 <= split_params <= num_params):
        raise EstimateError(f"split_params={split_params!r} must be a number of params between "
                            f"0 and num_params={num_params}")
    for name, value in nbytes.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise EstimateError(f"{name}={value!r} must be a non-negative number of bytes")
    return devices // (replica * model)


def _piece(num_params: int, model: int, split_params: float | None) -> float:
    """Params of one device's model piece (all of them without a model axis)."""
    from zerojax.analysis.tensor import piece_params

    if model == 1:
        return num_params
    return piece_params(num_params, num_params if split_params is None else split_params,
                        model)


def estimate(
    num_params: int,
    devices: int,
    stage: int,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
    replica: int = 1,
    offload: str | None = None,
    hpz: bool = False,
    secondary_bytes: float | None = None,
    model: int = 1,
    split_params: float | None = None,
    delayed_update: int | None = None,
    offload_fraction: float = 1.0,
) -> MemoryEstimate:
    """Per-device model-state bytes for `stage` on `devices` (sharded over devices / replica).

    `model` = M > 1 (tensor parallelism): `devices` counts every device, replica × data ×
    model; the `split_params` (default: all) are split over `model` and the rest replicated
    over it, so each device's model piece holds Ψ_split/M + Ψ_replicated params, and the
    formulas below shard that over the N = devices / (replica · M) devices of `data` (stage 3:
    the split params over D·M, the replicated over D).

    `optimizer_bytes` is K: the fp32 master and the optimizer state per param (Adam: 4 + 8).

    `hpz` (stage 3, ZeRO++): everything is sharded over all `devices` (full ZeRO-3 memory),
    and while a step runs each device holds a secondary copy of the params sharded over the
    D = devices / replica devices of its replica: `secondary` = Ψ·`secondary_bytes`/D
    (default `param_bytes`; qwZ keeps the quantized message, 1 + 4/block bytes per param).

    `offload="optimizer"` (stages 1-3) moves the optimizer bytes to `host` memory: the device
    keeps the compute params and gradients (stage 1: `2Ψ + 2Ψ`, the full gradient exists
    before its reduce-scatter; stage 2: `2Ψ + 2Ψ/N`; stage 3: `4Ψ/N`), the host `12Ψ/N`.

    `delayed_update=K` (with offload; any K >= 0: the memory is the delayed phase's) adds the
    pending update: its gradient shard stays in host memory between steps as it arrived
    (`pending`, `Ψ·gb/N`, in `host`), and while a step runs on the compute params before the
    update the next step's compute shard comes up beside them (`ahead`, `Ψ·pb/N`, in
    `total`).

    `offload_fraction=f` (Twin-Flow) keeps only the share f of those host bytes (and of the
    transfer) on the host; the devices hold and update the rest (in `optimizer` and `total`).
    The engine splits by whole leaves, so its measured share is near f, not exactly f.
    """
    n = _check(
        num_params,
        devices,
        stage,
        replica,
        offload,
        model,
        split_params,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes,
    )
    _check_hpz(hpz, stage, replica)
    _check_delayed(delayed_update, offload)
    _check_fraction(offload_fraction, offload)
    psi = _piece(int(num_params), model, split_params)
    secondary = psi * (param_bytes if secondary_bytes is None else secondary_bytes) / n \
        if hpz else 0.0
    n = devices // model if hpz else n
    params = psi * param_bytes / (n if stage >= 3 else 1)
    grads = psi * grad_bytes / (n if stage >= 2 else 1)
    optimizer = psi * optimizer_bytes / (n if stage >= 1 else 1)
    if offload is None:
        return MemoryEstimate(params, grads, optimizer, params + grads + optimizer + secondary,
                              secondary=secondary)
    # Each step the reduced gradient shard goes down and the updated compute shard comes up.
    transfer = psi * (grad_bytes + param_bytes) / n
    pending = psi * grad_bytes / n if delayed_update is not None else 0.0
    ahead = psi * param_bytes / n if delayed_update is not None else 0.0
    f = offload_fraction
    kept = (1 - f) * (optimizer + pending)  # Twin-Flow's share, in device memory
    return MemoryEstimate(params, grads, kept, params + grads + kept + secondary + ahead,
                          f * (optimizer + pending), f * transfer, secondary, f * pending,
                          ahead)


def _check_fraction(offload_fraction: Any, offload: Any) -> None:
    f = offload_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
        raise EstimateError(f"offload_fraction={f!r} must be a number in (0, 1]: the host's "
                            f"share of the offloaded state")
    if f < 1 and offload is None:
        raise EstimateError(f"offload_fraction={f} needs offload='optimizer' (got "
                            f"offload=None): it splits the offloaded state")


def _check_delayed(delayed_update: Any, offload: Any) -> None:
    if delayed_update is None:
        return
    if isinstance(delayed_update, bool) or not isinstance(delayed_update, int) \
            or delayed_update < 0:
        raise EstimateError(f"delayed_update={delayed_update!r} must be an integer K >= 0 "
                            f"(or None: no delay)")
    if offload is None:
        raise EstimateError(f"delayed_update={delayed_update} needs offload='optimizer' (got "
                            f"offload=None): the delayed update is the offloaded one")


def _check_hpz(hpz: Any, stage: int, replica: int) -> None:
    if hpz and (stage != 3 or replica < 2):
        raise EstimateError(f"hpz=True needs stage 3 and replica >= 2 (got stage={stage}, "
                            f"replica={replica}): hpZ's secondary copy is sharded within a "
                            f"replica")


def _check_formats(quantize_weights: Any, quantize_grads: Any, quant_block: Any) -> None:
    if quantize_weights not in (None, "int8"):
        raise EstimateError(f"quantize_weights={quantize_weights!r}: use 'int8' or None")
    if quantize_grads not in (None, *FORMATS):
        raise EstimateError(f"quantize_grads={quantize_grads!r}: use one of {FORMATS} or None")
    if isinstance(quant_block, bool) or not isinstance(quant_block, int) or quant_block < 1:
        raise EstimateError(f"quant_block={quant_block!r} must be a positive integer")


# XLA:GPU's pinned-host allocator (where offload's gradient shard goes on its way to the host
# mesh) has a limit of its own, below the machine's memory: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB,
# default 64 GiB (per process).
PINNED_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
PINNED_LIMIT_DEFAULT_GB = 64


def pinned_limit(environ=None) -> int:
    """Bytes XLA:GPU's pinned-host pool may hold: `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` GiB from
    `environ` (default: os.environ), else XLA's default of 64 GiB."""
    text = (os.environ if environ is None else environ).get(PINNED_LIMIT_ENV, "")
    try:
        gib = int(text) if text.strip() else PINNED_LIMIT_DEFAULT_GB
    except ValueError:
        raise EstimateError(f"{PINNED_LIMIT_ENV}={text!r} is not a whole number of GiB") from None
    return gib << 30


MASTER_BYTES = 4  # the fp32 master copy of a parameter
ADAM_BYTES = 8  # Adam's two fp32 moments


def state_estimate(num_params: int, devices: int, stage: int, param_dtype: str = "bfloat16",
                   *, replica: int = 1, offload: str | None = None,
                   optimizer_state_bytes: float = ADAM_BYTES, hpz: bool = False,
                   quantize_weights: str | None = None, quantize_grads: str | None = None,
                   quant_block: int = QUANT_BLOCK, model: int = 1,
                   split_params: float | None = None,
                   delayed_update: int | None = None,
                   offload_fraction: float = 1.0) -> MemoryEstimate:
    """Per-device model-state bytes of a zerojax engine training in `param_dtype` with an
    optimizer whose state takes `optimizer_state_bytes` per param (default: Adam's two fp32
    moments, 8; any optimizer's: `zerojax.update.presets.state_size(...).per_param`).

    `estimate` with the engine's byte sizes: params and grads in `param_dtype`; K = 4 (fp32
    master) + the optimizer state (Adam: K = 12), except where the compute params are the fp32
    master itself (float32 in stages 0 and 3 keep no separate copy), where K is the optimizer
    state alone and `params` is the master. bfloat16 and float16 with Adam give the ZeRO
    paper's numbers. `total - grads` is what the engine keeps between steps; gradients exist
    only inside the step. With `offload="optimizer"` the master and optimizer state are host
    bytes and the device always keeps a compute copy. `hpz`: see `estimate`; its secondary
    copy is in `param_dtype`, or int8 plus scales under `quantize_weights`. Under
    `quantize_grads` (qgZ sums the dequantized pieces in float32) gradients are float32.
    `model`, `split_params`: the model axis, as `estimate` takes it. `delayed_update`: the
    pending update's host and device bytes, as `estimate` counts them; `offload_fraction`:
    Twin-Flow's host share, as `estimate` takes it.
    """
    if param_dtype not in DTYPES:
        raise EstimateError(f"param_dtype={param_dtype!r} is not supported; use one of "
                            f"{sorted(DTYPES)}")
    size = jnp.dtype(DTYPES[param_dtype]).itemsize
    master = 0 if shares_master(param_dtype, stage, offload) else MASTER_BYTES
    _check(num_params, devices, stage, replica, offload, model, split_params,
           optimizer_state_bytes=optimizer_state_bytes)
    _check_formats(quantize_weights, quantize_grads, quant_block)
    secondary = bytes_per_element(quantize_weights, quant_block) if quantize_weights else size
    grads = MASTER_BYTES if quantize_grads else size
    return estimate(num_params, devices, stage, param_bytes=size, grad_bytes=grads,
                    optimizer_bytes=optimizer_state_bytes + master, replica=replica,
                    offload=offload, hpz=hpz, secondary_bytes=secondary, model=model,
                    split_params=split_params, delayed_update=delayed_update,
                    offload_fraction=offload_fraction)


def shares_master(param_dtype: str, stage: int, offload: str | None = None) -> bool:
    """Whether the compute params are the fp32 master itself (no separate copy is kept)."""
    # An offloaded master lives on the host, so the device computes on a copy of it.
    return offload is None and not stores_compute(param_dtype, stage)


def _ring(n: int, size: float, factor: int = 1) -> float:
    # Ring all-gather / reduce-scatter send (n-1)/n of the buffer; an all-reduce is both.
    return factor * (n - 1) * size / n


def comm_estimate(
    num_params: int,
    devices: int,
    stage: int,
    *,
    grad_bytes: float = 2,
    param_bytes: float = 2,
    reduce_bytes: float | None = None,
    replica: int = 1,
    quantize_weights: str | None = None,
    quantize_grads: str | None = None,
    quant_block: int = QUANT_BLOCK,
    hpz: bool = False,
    model: int = 1,
    split_params: float | None = None,
    activations: Activations | None = None,
) -> CommEstimate:
    """Per-device bytes sent per training step by ring collectives, by collective and (`axes`)
    by the mesh axes they cross.

    ZeRO++ (Wang et al. 2023): `quantize_weights="int8"` (qwZ) sends each gathered param as
    1 + 4/`quant_block` bytes (int8 value + its share of a float32 scale);
    `quantize_grads` (qgZ) turns each gradient reduce-scatter into an all_to_all of
    int8 (1 + 4/block) or int4 (0.5 + 4/block) bytes per element, and the replica all-reduce
    (and stage 0's) into those plus an all_gather of the sum in `param_bytes`; `hpz` (stage 3)
    adds a gather over the replicas of the Ψ/D secondary shard and reduces the gradient over
    the replicas too (a reduce-scatter instead of an all-reduce).

    `model` = M > 1 (`devices` counts replica × data × model): ZeRO's collectives move each
    device's model piece (Ψ_split/M + Ψ_replicated, `estimate`) over `data` and `replica`;
    given the `activations` of a step, Megatron's all-reduces over `model`
    (`tensor.megatron_bytes`) add to `all_reduce` and `axes["model"]`.
    """
    rb = grad_bytes if reduce_bytes is None else reduce_bytes
    n = _check(
        num_params,
        devices,
        stage,
        replica,
        None,
        model,
        split_params,
        grad_bytes=grad_bytes,
        param_bytes=param_bytes,
        reduce_bytes=rb,
    )
    _check_formats(quantize_weights, quantize_grads, quant_block)
    _check_hpz(hpz, stage, replica)
    if quantize_weights and stage == 0:
        raise EstimateError("quantize_weights needs stage 1, 2 or 3: stage 0 gathers no params")
    psi = _piece(int(num_params), model, split_params)
    data = replica * n  # the devices stage 0 all-reduces over: every one of a model index
    wb = bytes_per_element(quantize_weights, quant_block) if quantize_weights else param_bytes
    qb = bytes_per_element(quantize_grads, quant_block) if quantize_grads else rb
    g, p = psi * rb, psi * wb
    weights = sums = rs = ar = a2a = 0.0  # all_gathers: of params; of reduced gradients
    over = {"data": 0.0, "replica": 0.0, "all": 0.0}  # bytes by the axes they cross
    if stage == 0 and not quantize_grads:
        # DDP all-reduces over every device; the replica axis is just more data parallelism.
        ar = over["all" if replica > 1 else "data"] = _ring(data, g, 2)
    elif stage == 0:  # quantized reduce-scatters (data, then replica), then gathers of the sum
        a2a = _ring(n, psi * qb) + _ring(replica, psi * qb / n)
        sums = _ring(replica, psi * param_bytes / n) + _ring(n, psi * param_bytes)
        over["data"] = _ring(n, psi * qb) + _ring(n, psi * param_bytes)
        over["replica"] = _ring(replica, psi * qb / n) + _ring(replica, psi * param_bytes / n)
    else:
        # Stage 3 gathers each unit in forward and again in backward (remat).
        weights = _ring(n, p, 2 if stage == 3 else 1)
        hop = _ring(n, psi * qb)
        a2a, rs = (hop, 0.0) if quantize_grads else (0.0, hop)
        over["data"] = weights + hop
        if hpz:  # the secondary shard over the replicas; the gradient reduced over them too
            weights += _ring(replica, p / n)
            if quantize_grads:
                a2a += _ring(replica, psi * qb / n)
            else:
                rs += _ring(replica, g / n)
            over["replica"] = _ring(replica, p / n) + _ring(replica, psi * qb / n)
        elif quantize_grads:
            a2a += _ring(replica, psi * qb / n)
            sums = _ring(replica, psi * param_bytes / n)
            over["replica"] = _ring(replica, psi * qb / n) + sums
        else:  # hybrid sharding: the 1/N gradient shard is all-reduced across the R replicas
            ar = over["replica"] = _ring(replica, g / n, 2)
    if activations is not None and model > 1:
        over["model"] = activations.bytes(model, param_bytes)
        ar += over["model"]
    ag = weights + sums
    ag_scales = weights * SCALE_BYTES / quant_block / wb if quantize_weights else 0.0
    a2a_scales = a2a * SCALE_BYTES / quant_block / qb if quantize_grads else 0.0
    return CommEstimate(ar, rs, ag, ar + rs + ag + a2a, a2a, ag_scales, a2a_scales,
                        {k: v for k, v in over.items() if v})


_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")


def _sig3(v: float) -> str:
    return f"{v:.{2 if v < 10 else 1 if v < 100 else 0}f}"


def format_bytes(n: float) -> str:
    """Three significant figures in decimal units (1 GB = 1e9 B, as the ZeRO paper uses)."""
    sign, v, k = ("-" if n < 0 else ""), abs(float(n)), 0
    while float(_sig3(v)) >= 1000 and k < len(_UNITS) - 1:  # 999.7 GB prints as 1.00 TB
        v, k = v / 1000, k + 1
    text = f"{v:.0f}" if k == 0 and v.is_integer() else _sig3(v)
    return f"{sign}{text} {_UNITS[k]}"


def estimate_table(num_params: int, devices: int, **kwargs: Any) -> list[dict[str, str]]:
    """Rows for stages 0..3: memory by kind, total, saving vs stage 0 and bytes sent per step.

    `kwargs` are the byte sizes, `replica`, `offload`, `model` and `split_params` of
    `estimate` / `comm_estimate` (and its `activations`: then an "over model" column), and
    ZeRO++'s `quantize_weights` (stages 1-3), `quantize_grads` and `hpz` (stage 3 row).
    With `offload`, stages 1-3 offload (stage 0, which cannot, stays the baseline) and the rows
    add the `host` bytes, the `host peak` of the in-place host update (`host_peak`) and the
    host<->device `transfer` per step; `total` is device bytes. `delayed_update` (with
    `offload`) counts the pending update (`estimate`) and adds its column; `offload_fraction`
    (Twin-Flow) keeps that share on the host.
    """
    mem_keys = ("param_bytes", "grad_bytes", "optimizer_bytes", "replica", "offload", "model",
                "split_params", "delayed_update", "offload_fraction")
    comm_keys = ("param_bytes", "grad_bytes", "reduce_bytes", "replica", "model",
                 "split_params", "activations")
    zeropp_keys = ("quantize_weights", "quantize_grads", "hpz")
    unknown = set(kwargs) - set(mem_keys) - set(comm_keys) - set(zeropp_keys)
    if unknown:
        known = sorted({*mem_keys, *comm_keys, *zeropp_keys})
        raise EstimateError(f"unknown options {sorted(unknown)}; use {known}")
    mem_kw = {k: v for k, v in kwargs.items() if k in mem_keys}
    comm_kw = {k: v for k, v in kwargs.items() if k in comm_keys}
    qw, qg = kwargs.get("quantize_weights"), kwargs.get("quantize_grads")
    hpz = kwargs.get("hpz", False)
    _check_formats(qw, qg, QUANT_BLOCK)
    offload = mem_kw.pop("offload", None)
    delayed = mem_kw.pop("delayed_update", None)
    fraction = mem_kw.pop("offload_fraction", 1.0)
    _check_delayed(delayed, offload)
    _check_fraction(fraction, offload)
    base = estimate(num_params, devices, 0, **mem_kw).total
    secondary = bytes_per_element(qw, QUANT_BLOCK) if qw else mem_kw.get("param_bytes", 2)
    rows = []
    for stage in STAGES:
        # ZeRO++ where the stage has it: qwZ from stage 1 (stage 0 gathers no params), hpZ at 3.
        zpp = {"quantize_weights": qw if stage else None, "quantize_grads": qg,
               "hpz": bool(hpz) and stage == 3}
        m = estimate(num_params, devices, stage, **mem_kw, offload=offload if stage else None,
                     hpz=zpp["hpz"], secondary_bytes=secondary,
                     delayed_update=delayed if stage else None,
                     offload_fraction=fraction if stage else 1.0)
        c = comm_estimate(num_params, devices, stage, **comm_kw, **zpp)
        saving = 1 - m.total / base if base else 0.0
        row = {
            "stage": str(stage) + (" + offload" if offload and stage else ""),
            "params": format_bytes(m.params),
            "grads": format_bytes(m.grads),
            "optimizer": format_bytes(m.optimizer),
            "total": format_bytes(m.total),
            "saving": f"{100 * saving:.1f}%",
            "comm": format_bytes(c.total),
        }
        if offload:
            row["host"] = format_bytes(m.host)
            row["host peak"] = format_bytes(m.host_peak) if stage else format_bytes(0)
            row["host<->device"] = format_bytes(m.transfer)
        if offload and delayed is not None:
            row["of which pending"] = format_bytes(m.pending)
        if hpz:
            row["hpZ secondary"] = format_bytes(m.secondary)
        if qw or qg:
            row["of which scales"] = format_bytes(c.all_gather_scales + c.all_to_all_scales)
        if "model" in c.axes:
            row["over model"] = format_bytes(c.axes["model"])
        rows.append(row)
    return rows
