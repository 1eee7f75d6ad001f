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
import os

import jax.numpy as jnp

from zerojax.analysis.estimate_args import (
    EstimateError,
    check_args,
    check_delayed,
    check_device,
    check_formats,
    check_fraction,
    check_hpz,
)
from zerojax.analysis.tensor import Activations
from zerojax.collectives.quantize import SCALE_BYTES, bytes_per_element
from zerojax.config import NVME_BUFFER_COUNT, NVME_BUFFER_SIZE, QUANT_BLOCK
from zerojax.precision import DTYPES
from zerojax.step import stores_compute

# --- Analytic model --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device model-state bytes: `total` is what device memory holds; with optimizer
    offload the master and optimizer state are in `host` memory instead and `transfer` bytes cross
    between host and device each step; with the NVMe tier they are `on_disk` and the host holds
    the I/O buffers (`ring`) instead."""

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
    # offload_device="nvme": the master and optimizer state in the store's files, Ψ·K/N (not in
    # host); the host keeps the ring of I/O buffers its update streams them through (in host)
    on_disk: float = 0.0
    ring: float = 0.0

    @property
    def host_peak(self) -> float:
        """Offload: the host's peak while the update runs in place: the state, the gradient
        shard that came down and the compute shard that goes up, Ψ·(K + gb + pb)/N (with the
        delayed update: + the pending gradient shard, Ψ·gb/N; the NVMe tier: the ring in place
        of the state)."""
        return self.host + self.transfer if self.host or self.transfer else 0.0

    @property
    def state(self) -> float:
        """What the engine keeps between steps: the total less gradients, hpZ's secondary
        copy and the delayed update's next compute shard, which live only while a step runs."""
        return self.total - self.grads - self.secondary - self.ahead

    def as_dict(self) -> dict[str, float]:
        """The fields, and offload's `host_peak`; hpZ's `secondary`, `host_peak`, the
        delayed update's `pending` and `ahead` and the NVMe tier's `on_disk` and `ring` only
        where they are not 0."""
        return _without_zero(dataclasses.asdict(self) | {"host_peak": self.host_peak},
                             ("secondary", "host_peak", "pending", "ahead", "on_disk", "ring"))

    def row(self) -> dict[str, str]:
        """The columns `zerojax estimate` prints for a stage's memory (offload's host bytes
        and hpZ's secondary copy where they are not 0)."""
        row = {k: format_bytes(getattr(self, k)) for k in ("params", "grads", "optimizer",
                                                            "total")}
        if self.host or self.transfer:
            row |= {"host": format_bytes(self.host), "host peak": format_bytes(self.host_peak),
                    "host<->device": format_bytes(self.transfer)}
        if self.on_disk:
            row["disk"] = format_bytes(self.on_disk)
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
    offload_device: str = "cpu",
    ring_bytes: float | None = None,
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

    `offload_device="nvme"` (ZeRO-Infinity's tier, docs/nvme.md) keeps those master and
    optimizer bytes `on_disk` (each device's shard in its process's store) instead of in
    `host`, which holds the ring of I/O buffers the update streams them through,
    `ring_bytes` per device (default `nvme_ring_bytes()`), and the pending gradient shard; the
    host peak is the ring, the pending shard and the update's gradient and compute shards.
    """
    n = check_args(
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
    check_hpz(hpz, stage, replica)
    check_delayed(delayed_update, offload)
    check_fraction(offload_fraction, offload)
    ring = check_device(offload_device, offload, ring_bytes, nvme_ring_bytes())
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
    # The NVMe tier: the host's share of master and optimizer state in the store, streamed
    # through the ring; the pending gradient stays in host memory as it arrived.
    host, disk = (f * pending + ring, f * optimizer) if ring else (f * (optimizer + pending), 0.0)
    return MemoryEstimate(params, grads, kept, params + grads + kept + secondary + ahead, host,
                          f * transfer, secondary, f * pending, ahead, disk, ring)


def nvme_ring_bytes(buffer_size: int = NVME_BUFFER_SIZE,
                    buffer_count: int = NVME_BUFFER_COUNT) -> int:
    """Host bytes of the NVMe tier's ring per device shard: `buffer_count` buffers of
    `buffer_size` elements of master, mu and nu in float32 (ZeroConfig's `nvme_buffer_size`
    and `nvme_buffer_count`; the defaults: 48 MiB)."""
    return buffer_count * 3 * MASTER_BYTES * buffer_size


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
                   offload_fraction: float = 1.0, offload_device: str = "cpu",
                   ring_bytes: float | None = None) -> MemoryEstimate:
    """Per-device model-state bytes of a zerojax engine training in `param_dtype` with an
    optimizer whose state takes `optimizer_state_bytes` per param (default: Adam's two fp32
    moments, 8; any optimizer's: `zerojax.analysis.measurement.state_size(...).per_param`).

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
    Twin-Flow's host share, `offload_device` and `ring_bytes`: the NVMe tier, as `estimate`
    takes them.
    """
    if param_dtype not in DTYPES:
        raise EstimateError(f"param_dtype={param_dtype!r} is not supported; use one of "
                            f"{sorted(DTYPES)}")
    size = jnp.dtype(DTYPES[param_dtype]).itemsize
    master = 0 if shares_master(param_dtype, stage, offload) else MASTER_BYTES
    check_args(num_params, devices, stage, replica, offload, model, split_params,
               optimizer_state_bytes=optimizer_state_bytes)
    check_formats(quantize_weights, quantize_grads, quant_block)
    secondary = bytes_per_element(quantize_weights, quant_block) if quantize_weights else size
    grads = MASTER_BYTES if quantize_grads else size
    return estimate(num_params, devices, stage, param_bytes=size, grad_bytes=grads,
                    optimizer_bytes=optimizer_state_bytes + master, replica=replica,
                    offload=offload, hpz=hpz, secondary_bytes=secondary, model=model,
                    split_params=split_params, delayed_update=delayed_update,
                    offload_fraction=offload_fraction, offload_device=offload_device,
                    ring_bytes=ring_bytes)


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
    n = check_args(
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
    check_formats(quantize_weights, quantize_grads, quant_block)
    check_hpz(hpz, stage, replica)
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
