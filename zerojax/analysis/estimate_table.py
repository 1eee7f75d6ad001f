"""The analytic model's rows for stages 0..3, as `zerojax estimate` prints them: memory by
kind, the saving against stage 0 and the bytes sent per step (accounting.py's figures).
"""

from __future__ import annotations

from typing import Any

from zerojax.analysis.accounting import comm_estimate, estimate, format_bytes
from zerojax.analysis.estimate_args import (
    STAGES,
    EstimateError,
    check_delayed,
    check_device,
    check_formats,
    check_fraction,
)
from zerojax.collectives.quantize import bytes_per_element
from zerojax.config import QUANT_BLOCK


def estimate_table(num_params: int, devices: int, **kwargs: Any) -> list[dict[str, str]]:
    """Rows for stages 0..3: memory by kind, total, saving vs stage 0 and bytes sent per step.

    `kwargs` are the byte sizes, `replica`, `offload`, `model` and `split_params` of
    `estimate` / `comm_estimate` (and its `activations`: then an "over model" column), and
    ZeRO++'s `quantize_weights` (stages 1-3), `quantize_grads` and `hpz` (stage 3 row).
    With `offload`, stages 1-3 offload (stage 0, which cannot, stays the baseline) and the rows
    add the `host` bytes, the `host peak` of the in-place host update (`host_peak`) and the
    host<->device `transfer` per step; `total` is device bytes. `delayed_update` (with
    `offload`) counts the pending update (`estimate`) and adds its column; `offload_fraction`
    (Twin-Flow) keeps that share on the host. `offload_device="nvme"` (and its `ring_bytes`):
    the master and optimizer state on disk, a `disk` column (`MemoryEstimate.on_disk`).
    """
    mem_keys = ("param_bytes", "grad_bytes", "optimizer_bytes", "replica", "offload", "model",
                "split_params", "delayed_update", "offload_fraction", "offload_device",
                "ring_bytes")
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
    check_formats(qw, qg, QUANT_BLOCK)
    offload = mem_kw.pop("offload", None)
    delayed = mem_kw.pop("delayed_update", None)
    fraction = mem_kw.pop("offload_fraction", 1.0)
    device, ring = mem_kw.pop("offload_device", "cpu"), mem_kw.pop("ring_bytes", None)
    check_delayed(delayed, offload)
    check_fraction(fraction, offload)
    check_device(device, offload, ring, 1)
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
                     offload_fraction=fraction if stage else 1.0,
                     offload_device=device if stage else "cpu",
                     ring_bytes=ring if stage else None)
        c = comm_estimate(num_params, devices, stage, **comm_kw, **zpp)
        saving = 1 - m.total / base if base else 0.0
        row = {
            "stage": str(stage) + (f" + offload{' (nvme)' * (device == 'nvme')}"
                                   if offload and stage else ""),
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
        if device == "nvme":
            row["disk"] = format_bytes(m.on_disk)
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
