"""What a `PlanResult` says in words: the `zerojax plan` table, its notes and the chosen line
(the command prints them; `str(result)` gives the same text to a script)."""

from __future__ import annotations

from typing import Any

from zerojax.analysis.accounting import format_bytes
from zerojax.analysis.flops import format_flops
from zerojax.analysis.ranking import GAIN, budget_text, format_seconds


def notes(r) -> list[str]:
    """What the figures of the `PlanResult` `r` assume and why some look odd, one line each."""
    n, psi = r.devices, r.num_params
    out = [f"fits: the peak is at most {budget_text(r.device_memory, r.margin)}"]
    if r.platform == "cpu":
        out.append("peaks and bytes are read from XLA:CPU compiles on simulated devices; a "
                   "GPU's peaks differ (on CPU stages 0-2 hold float32 copies of the weights: "
                   "docs/memory.md), so keep the margin")
    if r.model_searched:
        sizes = sorted({c.model for c in r.candidates if c.model > 1})
        out.append(f"nothing fits on model = 1, so the model axes {sizes} were tried (data x "
                   f"model meshes: Megatron's tensor parallelism beside ZeRO)")
    if r.offload_searched:
        out.append("nothing fits without offload, so stages 1-3 were also tried with "
                   "offload='optimizer' (master and moments in host memory; peak is device "
                   "memory, host bytes per device in host_bytes)")
    if r.bandwidth:
        compute = (f"{format_flops(r.flops / r.devices)} per device at "
                   f"{100 * r.efficiency:.0f}% of {r.peak_tflops:g} TFLOP/s ({r.peak_from}) = "
                   f"{format_seconds(r.compute_seconds)}") if r.compute_seconds else \
            "not counted (no FLOPs or peak)"
        out.append(f"step: compute ({compute}) + the link time it does not hide + "
                   f"{r.latency * 1e6:g} us per collective launched; links: each "
                   f"mesh axis's bytes at its bandwidth (a collective across replicas at the "
                   f"slower one); data and replica collectives inside the loops that compute "
                   f"(the layer scans' gathers and reduce-scatters) hide behind compute, the "
                   f"model axis's all-reduces and everything else do not; the quantization's "
                   f"own work is not "
                   f"counted, so a quantized option must shorten the step by "
                   f"{100 * GAIN:g}%")
    if r.best is not None and r.best.quantized:
        out.append(f"the chosen {r.best.zeropp()} sends quantized values, so its numbers "
                   f"differ from the exact step's (see docs/performance.md); --quantize off "
                   f"chooses among exact options only")
    if not any(c.stage <= 1 and c.grad_accum > 1 and c.peak_bytes for c in r.candidates):
        return out
    # Stages 0-1 differentiate the full params, so the sum over micro-batches is full-size;
    # it is float32 so that adding micro-batch gradients loses no precision.
    return [*out, f"grad_accum > 1 in stages 0-1 adds a full-size float32 gradient "
            f"accumulator (4 B x Ψ = {format_bytes(4 * psi)}) to the peak; stages 2-3 "
            f"accumulate a 1/N shard ({format_bytes(4 * psi / n)}), so there smaller "
            f"micro-batches lower it"]


def rows(r) -> list[dict[str, Any]]:
    """The table's rows, one per candidate of the `PlanResult` `r`."""
    fmt = lambda v: "-" if v is None else format_bytes(v)
    secs = lambda v: "-" if v is None else format_seconds(v)
    links = r.bandwidth is not None
    meshes = r.replica > 1 or any(c.model > 1 for c in r.candidates)
    return [{"stage": c.stage, "remat": "on" if c.remat else "off", "accum": c.grad_accum,
             **({"offload": c.offload or "-", "host": fmt(c.host_bytes)}
                if r.offload_searched else {}),
             **({"mesh": c.mesh_text(r.devices)} if meshes else {}),
             **({"zero++": c.zeropp() or "-"} if links else {}),
             "state": fmt(c.state_bytes), "peak": fmt(c.peak_bytes),
             "sent/step": fmt(c.comm_bytes),
             **({"links": secs(c.comm_seconds), "step": secs(c.step_seconds)} if links else {}),
             "launches": c.launches or "-",
             "fits": "yes" if c.fits else "no", "chosen": "<==" if c.chosen else "",
             "reason": c.reason} for c in r.candidates]


def title(r) -> str:
    return (f"{r.name or 'plan'} on {r.devices} devices with {format_bytes(r.device_memory)} "
            f"each")


def chosen_line(r) -> str:
    """"chosen: ..." (the best, its mesh, peak, traffic and step), or why nothing was."""
    b = r.best
    if b is None:
        return "nothing fits: more devices, a smaller batch, or a smaller model"
    host = f" + offload ({format_bytes(b.host_bytes)} in host memory)" if b.offload else ""
    axes = {"replica": b.replica, "data": r.devices // (b.replica * b.model), "model": b.model}
    mesh = (" on make_mesh(" + ", ".join(f"{k}={v}" for k, v in axes.items()
                                         if v > 1 or k == "data") + ")"
            if b.replica > 1 or b.model > 1 else "")
    zeropp = f" + {b.zeropp()}" if b.zeropp() else ""
    time = ""
    if r.bandwidth is not None:
        time = (f" (step {format_seconds(b.step_seconds)}: compute "
                f"{format_seconds(r.compute_seconds)}, {format_seconds(b.comm_seconds)} on the "
                f"links)")
    return (f"chosen: stage {b.stage}{host}{zeropp}, remat {'on' if b.remat else 'off'}, "
            f"grad_accum {b.grad_accum}{mesh}: peak {format_bytes(b.peak_bytes)}, "
            f"sends {format_bytes(b.comm_bytes)} per step per device{time}")


def report(r) -> str:
    """The table, the notes and the chosen line, as `zerojax plan` prints them."""
    from zerojax.analysis.tables import render_table

    return "\n".join([render_table(title(r), rows(r)).rstrip("\n"),
                      *(f"note: {n}" for n in notes(r)), chosen_line(r)])
