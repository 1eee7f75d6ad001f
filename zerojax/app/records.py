"""What a run writes as it goes and at its end: metrics.jsonl, loss.png, summary.json and the
final line."""

from __future__ import annotations

import dataclasses
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from zerojax.analysis.accounting import format_bytes
from zerojax.analysis.flops import throughput
from zerojax.app.files import append_line, replace_file


def tflops_text(r: dict[str, Any]) -> str:
    """A record's (or summary's) TFLOP/s per device, and MFU where the peak is known:
    "412 TFLOP/s/device (MFU 41.7%)"."""
    if r.get("tflops_per_device") is None:
        return ""
    mfu = f" (MFU {100 * r['mfu']:.1f}%)" if r.get("mfu") is not None else ""
    return f"{r['tflops_per_device']:.3g} TFLOP/s/device{mfu}"


class MetricsLog:
    """`metrics.jsonl`: one JSON object per step; on resume, records past `start` are dropped
    (the file is then replaced, never rewritten in place: see `files.replace_file`)."""

    def __init__(self, path: Path, start: int, enabled: bool = True):
        self.path, self.enabled = path, enabled
        self.records: list[dict[str, Any]] = []
        if not enabled:
            return
        old = path.read_bytes() if path.is_file() else None
        lines = (old or b"").splitlines(keepends=True) if start > 0 else []
        kept = [x for x in lines if x.strip() and json.loads(x)["step"] <= start]
        if kept and not kept[-1].endswith(b"\n"):
            kept[-1] += b"\n"  # the next record starts a line of its own
        self.records = [json.loads(line) for line in kept]
        if b"".join(kept) != old:
            replace_file(path, b"".join(kept))

    def write(self, record: dict[str, Any]) -> None:
        """Appends `record`; a write that fails (a full disk) raises a RunFileError, the file
        as it was."""
        if self.enabled:
            append_line(self.path, (json.dumps(record) + "\n").encode())
        self.records.append(record)


def plot_losses(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """Train loss per step and eval loss where it was measured, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train:
        ax.plot([s for s, _ in train], [v for _, v in train], lw=1, label="train")
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", lw=1.5, ms=4, label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    replace_file(path, png.getvalue())


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """Writes `obj` as indented JSON (replacing the file); non-finite floats become null."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    replace_file(path, (json.dumps(clean(obj), indent=2) + "\n").encode())


def summary(cfg, records, times, num_params, devices, mesh, estimate, measured, wall_s,
            eval_s, step, interrupted, flops: dict[str, Any] | None = None,
            host_update: str | None = None,
            host_memory: dict[str, int] | None = None,
            resumed: dict[str, Any] | None = None,
            nvme: dict[str, Any] | None = None) -> dict[str, Any]:
    """The contents of `summary.json`; `flops`: the model FLOPs per step (`per_step`), their
    `formula`, and the per-device `peak_tflops` (or None) and where it comes from;
    `host_update`: `Engine.host_update` (offload: "fused" or "xla: <why>"); `host_memory`:
    `runlog.host_memory()` at the end (this process's resident set and its peak); `resumed`:
    a resume's step and the options it changed ({"from_step", "changed": {option: [saved,
    now]}}), None for a fresh run; `nvme`: an NVMe run's store and the I/O of its updates
    (bytes read and written, seconds, GB/s: `offload.disk.DiskOffload.io`), else None."""
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    steady = times[1:] or times
    mean_step = float(np.mean(steady)) if steady else None
    perf = {"tflops_per_device": None, "mfu": None}
    if flops and mean_step:
        perf |= throughput(flops["per_step"], mean_step, len(devices), flops["peak_tflops"])
    return {
        "config": dataclasses.asdict(cfg),
        "resumed": resumed,
        "steps_done": step,
        "interrupted": interrupted,
        "final_loss": train[-1]["loss"] if train else None,
        "initial_eval_loss": evals[0]["eval_loss"] if evals else None,
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "eval_count": len(evals),
        "num_params": num_params,
        "devices": {"count": len(devices), "platform": devices[0].platform,
                    "processes": len({d.process_index for d in devices}),
                    "mesh": dict(mesh.shape)},
        "memory_per_device": {"estimate": estimate.as_dict(), "measured_state_bytes": measured},
        "host_update": host_update,
        "host_memory": host_memory or {},
        "nvme": nvme,
        "timings": {
            "wall_s": wall_s,
            "first_step_s": times[0] if times else None,  # includes compilation
            "mean_step_s": mean_step,
            "tokens_per_s": cfg.batch * cfg.seq_len / mean_step if mean_step else None,
            **perf,
            "eval_s": eval_s,
        },
        "flops": flops,
    }


def final_line(s: dict[str, Any], out: Path) -> str:
    """One line: where the run ended and how fast it went (with offload, the process's host
    memory peak)."""
    parts = [f"step {s['steps_done']}"]
    if s["final_loss"] is not None:
        parts.append(f"loss {s['final_loss']:.4f}")
    first, last = s["initial_eval_loss"], s["final_eval_loss"]
    if last is not None:
        parts.append(f"eval {first:.3f} → {last:.3f}" if s["eval_count"] > 1
                     else f"eval {last:.3f}")
    t = s["timings"]
    if t["tokens_per_s"]:
        parts.append(f"{t['tokens_per_s']:,.0f} tok/s")
    if t.get("tflops_per_device") is not None:
        parts.append(tflops_text(t))
    peak = s["host_memory"].get("host_rss_peak_bytes")
    if s["config"].get("offload") and peak:  # what binds with offload: the host's memory
        parts.append(f"host peak {format_bytes(peak)}")
    parts.append(f"{t['wall_s']:.0f} s")
    head = "interrupted" if s["interrupted"] else "done"
    return f"{head}: " + ", ".join(parts) + f"  → {out}/"


def finish(out: Path, s: dict[str, Any]) -> None:
    """Process 0's end of a run (its `RunLog` has drawn loss.png): summary.json and the final
    line (even if quiet)."""
    write_json(out / "summary.json", s)
    print(final_line(s, out), flush=True)
