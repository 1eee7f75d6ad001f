"""The time a step takes in `plan`'s model: compute (model FLOPs at a fraction of the target
device's peak) plus the time on the links that compute does not hide.

- compute = model FLOPs per device / (peak TFLOP/s × `EFFICIENCY`). The default efficiency,
  0.45, is the MFU measured on one H100 80GB HBM3 for the 1b preset (batch 8 × 2048, bf16,
  remat per layer): 45–47 % for plain optax and every stage (docs/performance.md, GPU
  section). Model FLOPs leave out remat's recompute, so the efficiency absorbs it.
- links: each mesh axis's bytes at that axis's bandwidth (`link_seconds`).
- hidden: the collectives over `data` and `replica` that run inside a loop which also
  computes matrix products (the layer scans: stage 2's and 3's per-layer gathers and
  reduce-scatters; `hlo.collective_sites`'s `beside_compute`) can run beside the loop's
  other iterations' compute (prefetch, XLA's latency-hiding scheduler), so up to the compute
  time they cost nothing. Everything else is exposed: the `model` axis's all-reduces sit
  between dependent matmuls, and a collective outside such loops (stages 0-1's
  whole-gradient reduction, the gathers of updated params after the optimizer, the
  embedding and head units) has no compute beside it to hide behind.

- latency: every collective the step launches costs `LATENCY`, 10 µs, exposed: about NCCL's
  small-message latency within an NVLink node. It is what a step of a small model on fast
  links is made of, and what ZeRO++ adds (a quantized collective is two: values and scales).

step = compute + exposed + launches × latency + max(0, hidden − compute). Not modelled: the
quantize/dequantize work of ZeRO++ (`plan` takes a quantized option only when it is ≥ 5 %
faster), kernel launch overheads.
"""

from __future__ import annotations

from zerojax.analysis.flops import peak_tflops

EFFICIENCY = 0.45  # the MFU the compute time assumes (measured: docs/performance.md)
DEVICE = "NVIDIA H100 80GB HBM3"  # the target when planning on a machine not in the table
HIDDEN_AXES = ("data", "replica", "all", "other")  # what a loop's compute can hide
LATENCY = 10e-6  # seconds a collective launch costs besides its bytes


def link_seconds(axis_bytes: dict[str, float], bandwidth: dict[str, float]) -> float:
    """Seconds one device spends sending per step: each mesh axis's bytes at its link's
    bandwidth (bytes/s). A collective whose groups span several axes ("all", or another
    grouping) runs at the slowest link, as a ring through devices of every replica does."""
    slow = min(bandwidth.values())
    return sum(sent / bandwidth.get(axis, slow) for axis, sent in axis_bytes.items())


def target_peak(peak: float | None = None, device: str | None = None,
                local=None) -> tuple[float, str]:
    """The per-device peak TFLOP/s compute is timed at, and where it comes from: `peak`
    (given), else the table's for the `device` kind named, else the `local` device's (a
    GPU/TPU the planner runs on), else an H100's (`DEVICE`: planning on CPU)."""
    from zerojax.errors import ConfigError

    if peak is not None:
        if isinstance(peak, bool) or not isinstance(peak, (int, float)) or not peak > 0:
            raise ConfigError(f"peak_tflops={peak!r}: give the device's peak TFLOP/s, > 0 "
                              f"(e.g. 989 for an H100 SXM in bf16)")
        return float(peak), "given"
    if device is not None:
        found = peak_tflops(str(device))
        if found is None:
            raise ConfigError(f"device={device!r} is not in the peak table "
                              f"(zerojax.analysis.flops.PEAK_TFLOPS); name one of its kinds, "
                              f"e.g. 'h100' or 'a100', or give peak_tflops")
        return found, f"{device}, dense bf16"
    if local is not None and local.platform != "cpu" and peak_tflops(local) is not None:
        return peak_tflops(local), f"{local.device_kind} (this machine), dense bf16"
    return peak_tflops(DEVICE), f"{DEVICE}, dense bf16 (the default when planning on CPU)"


def compute_seconds(flops: float, devices: int, peak: float,
                    efficiency: float = EFFICIENCY) -> float:
    """Seconds of compute per step: `flops` (model FLOPs over all devices) per device at
    `efficiency` × `peak` TFLOP/s."""
    return flops / devices / (peak * 1e12 * efficiency)


def step_seconds(axis_bytes: dict[str, float], overlap_bytes: dict[str, float],
                 bandwidth: dict[str, float], compute: float, launches: int = 0,
                 latency: float = LATENCY) -> float:
    """compute + the link time compute does not hide: `overlap_bytes` (the part of `axis_bytes`
    sent beside a loop's compute) over `HIDDEN_AXES` hides behind compute, the rest does not;
    each of the `launches` collectives adds `latency`."""
    hidden = link_seconds({a: b for a, b in overlap_bytes.items() if a in HIDDEN_AXES}, bandwidth)
    exposed = link_seconds(axis_bytes, bandwidth) - hidden
    return compute + exposed + launches * latency + max(0.0, hidden - compute)
