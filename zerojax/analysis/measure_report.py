"""What a `Measurement` says in words: the `zerojax measure` table's row, measured beside the
formulas (the command prints a row per stage; `str(measurement)` gives its one row)."""

from __future__ import annotations

from typing import Any

from zerojax.analysis.accounting import format_bytes


def row(m, activations=None, memory: float | None = None) -> dict[str, Any]:
    """The table's row of the `Measurement` `m`: its state, traffic and the formulas'
    (`m.estimates(activations)`), with the columns its options call for (offload, ZeRO++,
    the replica and model axes) and, given device `memory`, whether it fits."""
    mem, comm = m.estimates(activations)
    out = {"stage": m.stage, "state": format_bytes(m.state["total"]),
           "state formula": format_bytes(mem.state + mem.host),
           "master+opt": format_bytes(m.state["master"] + m.state["optimizer"]),
           "master+opt formula": format_bytes(mem.optimizer + mem.host),
           "temp": format_bytes(m.temp_bytes), "peak": format_bytes(m.peak_bytes),
           "sent": format_bytes(m.collective_bytes["total"]),
           "sent formula": format_bytes(comm.total),
           "sent compiled": format_bytes(m.collective_bytes_compiled["total"])}
    if m.offload:
        out.update({"device state": format_bytes(m.state["device"]),
                    "host state": format_bytes(m.state["host"]),
                    "host formula": format_bytes(mem.host),
                    "device peak": format_bytes(m.device_peak_bytes), "split": m.split})
    if m.quantize_weights or m.quantize_grads:  # the float32 block scales within "sent"
        out["of which scales"] = format_bytes(sum(
            by.get("f32", 0.0) for kind, by in m.collective_dtype_bytes.items()
            if kind in ("all_gather", "all_to_all")))
    axes = [a for a, on in (("data", m.replica > 1 or m.model > 1),
                            ("replica", m.replica > 1), ("all", m.replica > 1),
                            ("model", m.model > 1)) if on]
    for axis in axes:  # what each link carries (across replica and data: a collective over all)
        out[f"over {axis}"] = format_bytes(m.collective_axis_bytes.get(axis, 0.0))
    if m.model > 1:
        out["model formula"] = format_bytes(comm.axes["model"]) if "model" in comm.axes \
            else "-"
    if memory:
        out["fits"] = "yes" if m.device_peak_bytes <= memory else "no"
    return out


def title(m, name: str = "", optimizer: str = "") -> str:
    """The table's title: what was measured, and what its columns mean."""
    n = m.devices * m.replica * m.model
    quantized = m.quantize_weights or m.quantize_grads
    what = name or f"{m.num_params:,} params"
    if name:
        what += f" ({m.num_params:,} params)"
    return (f"{what}, {n} devices, {optimizer + ', ' if optimizer else ''}per device; "
            f"master+opt: the fp32 master and the optimizer state; state formula excludes "
            f"grads (they live in temp; so does hpZ's secondary copy); sent: bytes per step in "
            f"{m.param_dtype}"
            + (" (quantized collectives: their integer values + float32 scales)"
               if quantized else "")
            + ", compiled: as this backend sends them"
            + ("; over model: Megatron's all-reduces, read from the compiled program"
               if m.model > 1 else "")
            + ("; device peak: the devices' program's, host peak: the host update's, each "
               "measured from its compiled program" if m.offload else ""))


def report(m, activations=None) -> str:
    """`title` and `row` of one measurement as text."""
    from zerojax.analysis.tables import render_table

    return render_table(title(m), [row(m, activations)]).rstrip("\n")
