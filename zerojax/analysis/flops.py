"""FLOPs of a training step and the figures built on them: TFLOP/s per device and MFU, the
model FLOPs utilization of the PaLM paper (app. B), against a table of device peaks.

Model FLOPs count the arithmetic the model needs, not what the program runs: 6 per
parameter per token (forward and backward) plus the attention term, without remat's
recompute, so MFU does not rise when a step recomputes more.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import jax
import numpy as np

from zerojax.analysis.hlo import matmul_flops
from zerojax.errors import ArgumentError, BatchError, short

# Dense (no sparsity) bf16/fp16 tensor-core peak per device in TFLOP/s, by `device_kind`:
# the first key found in the lower-cased kind as whole words wins, so the more specific names
# come first ("h100 pcie" before "h100"; "gh200", "gb200" are their own words). NVIDIA's data
# sheets headline the 2:4-sparse figure, twice these. TPU: Google Cloud's system-architecture
# pages, per chip (one jax device per chip from v4 on).
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("h100 pcie", 756.0),   # H100 PCIe
    ("h100 nvl", 835.0),    # H100 NVL
    ("h100", 989.0),        # H100 SXM ("NVIDIA H100 80GB HBM3")
    ("h200 nvl", 835.0),    # H200 NVL
    ("h200", 989.0),        # H200 SXM
    ("gh200", 989.0),       # Grace Hopper ("NVIDIA GH200 480GB")
    ("gb200", 2500.0),      # Grace Blackwell, per GPU
    ("b200", 2250.0),       # HGX B200
    ("b100", 1750.0),       # HGX B100
    ("a100", 312.0),        # A100 SXM and PCIe, 40 and 80 GB
    ("a10", 125.0),         # A10 (not the A10G)
    ("l40s", 362.0),
    ("l40", 181.0),
    ("l4", 121.0),
    ("tpu v4", 275.0),
    ("tpu v5 lite", 197.0),  # v5e
    ("tpu v5p", 459.0),
    ("tpu v5", 459.0),       # v5p as jax names it
    ("tpu v6 lite", 918.0),  # v6e (Trillium)
)
# MFU is against the table only for these compute dtypes: a float32 step runs at a peak (TF32,
# or FP32) the table does not give; --peak-tflops / `peak=` says it.
PEAK_DTYPES = ("bfloat16", "float16")

FORMULA = "6·N + 12·L·T·d per token (PaLM app. B)"  # N: params without the embeddings


def formula(model) -> str:
    """How `step_flops` counts `model`'s FLOPs, for a reader to check: the GPT's formula with
    its N shown, else the compiled program's matrix products."""
    n = getattr(model, "flops_params", None)
    if n is None:
        return "the compiled step's matrix products (remat included: hardware FLOPs)"
    return f"{FORMULA}, N = {n():,} params without the embedding tables"


def counts_model_flops(model) -> bool:
    """Whether `step_flops` gives `model`'s model FLOPs (it has `flops_per_token`), not the
    compiled program's (hardware FLOPs, whose utilization is HFU, not MFU)."""
    return getattr(model, "flops_per_token", None) is not None


def peak_tflops(device: jax.Device | str | None = None) -> float | None:
    """Dense bf16/fp16 peak TFLOP/s of one device (`device_kind` or a device; default the
    first device) from `PEAK_TFLOPS`; None where the device is not in the table (CPUs)."""
    if device is None:
        device = jax.devices()[0]
    kind = device if isinstance(device, str) else getattr(device, "device_kind", None)
    if not isinstance(kind, str):
        raise ArgumentError(f"peak_tflops({short(device)}): give a jax device or its "
                            f"device_kind string, e.g. 'NVIDIA H100 80GB HBM3'")
    kind = kind.lower()
    return next((tf for key, tf in PEAK_TFLOPS
                 if re.search(rf"(?<!\w){re.escape(key)}(?!\w)", kind)), None)


def step_flops(engine, batch) -> float:
    """Model FLOPs of one step of `engine` on `batch` (this process's slice in a multi-process
    run), over all devices.

    A model with a `flops_per_token(seq_len)` method (the GPT family) is counted by it on the
    batch's `inputs` [B, T]: 6·N + 12·L·T·d per token. Any other model is counted from its
    compiled step (`program_flops`), which includes remat's recompute and the optimizer's
    matrix products: for such a model the figure is the hardware's, a little above the model's.
    """
    per_token = getattr(engine.model, "flops_per_token", None)
    if per_token is None:
        return program_flops(engine, batch)
    inputs = batch.get("inputs") if isinstance(batch, dict) else None
    if inputs is None or len(np.shape(inputs)) != 2:
        raise BatchError(f"step_flops: a {type(engine.model).__name__} batch needs "
                            f"'inputs' of shape [batch, seq_len]; got "
                            f"{None if inputs is None else np.shape(inputs)}")
    b, t = np.shape(inputs)
    return float(per_token(t)) * b * jax.process_count() * t


def program_flops(engine, batch) -> float:
    """FLOPs of the matrix products of `engine`'s step program on `batch`, over all devices:
    each loop's body once per trip (`hlo.matmul_flops`), remat's recompute included."""
    from zerojax.analysis.measurement import lower

    text = lower(engine, batch).compiler_ir("hlo").as_hlo_text()
    flops, unknown = matmul_flops(text)
    if unknown:
        warnings.warn(f"program_flops: {unknown} loop(s) of the step have no static trip "
                      f"count and were counted once; the FLOPs are a lower bound", stacklevel=2)
    # The step is one program per device on its slice of the batch.
    return flops * math.prod(dict(engine.mesh.shape)[a] for a in engine.axes)


def throughput(flops: float, seconds: float, devices: int,
               peak: float | None = None) -> dict[str, Any]:
    """`{"tflops_per_device": ..., "mfu": ...}` of a step of `flops` (over all devices) that
    took `seconds` on `devices`; `mfu` (a fraction) only with the per-device `peak` TFLOP/s."""
    flops = number("flops", flops, "throughput", low=0.0)
    seconds = number("seconds", seconds, "throughput")
    if isinstance(devices, bool) or not isinstance(devices, (int, np.integer)) or devices < 1:
        raise ArgumentError(f"throughput: devices={short(devices)} must be a positive integer "
                            f"(the devices the step ran on)")
    peak = None if peak is None else number("peak", peak, "throughput")
    tflops = flops / seconds / devices / 1e12
    return {"tflops_per_device": tflops} | ({"mfu": tflops / peak} if peak else {})


def run_peak(device: jax.Device, dtype: str, given: float | None = None
             ) -> tuple[float | None, str]:
    """The per-device peak TFLOP/s a run's MFU is against, and where it comes from: `given`
    (--peak-tflops), else the table's for bfloat16/float16 compute; None (and why) otherwise."""
    if given is not None:
        return number("peak_tflops", given, "the MFU"), "--peak-tflops"
    if dtype not in PEAK_DTYPES:
        return None, f"{dtype} compute (the peak table is bf16/fp16: give --peak-tflops)"
    peak = peak_tflops(device)
    if peak is None:
        return None, f"{device.device_kind} is not in the peak table (give --peak-tflops)"
    return peak, f"{device.device_kind}, dense {dtype}"


def number(name: str, value, where: str, low: float | None = None) -> float:
    """`value` as a float, which must be finite and positive (or at least `low`), else one
    ArgumentError naming `name` and `where` it was given."""
    ok = not isinstance(value, (bool, str)) and np.ndim(value) == 0
    try:
        x = float(value) if ok else math.nan
    except (TypeError, ValueError):
        x, ok = math.nan, False
    if not ok or not math.isfinite(x) or not (x >= low if low is not None else x > 0):
        kind = "a finite, positive number" if low is None else f"a finite number >= {low:g}"
        raise ArgumentError(f"{where}: {name}={short(value)} must be {kind}")
    return x


def format_flops(x: float) -> str:
    """FLOPs with an SI prefix, 3 significant digits: "16.3 MFLOP"."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}FLOP"
    return f"{x:.3g} FLOP"
