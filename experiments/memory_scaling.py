"""Per-device memory vs device count N for ZeRO stages 0-3: the paper's formulas as lines,
compiled measurements as points. Writes OUT/memory_scaling.png and OUT/memory_scaling.md
(the table docs/memory.md quotes).

    .venv/bin/python experiments/memory_scaling.py [--preset gpt2-small] \
        [--devices 1,2,4,8,16,32,64]

Runs in one process with max(N) simulated CPU devices; each N uses a mesh over the first N.
The global batch is N sequences (one per device), so activations per device do not change
with N and every difference between points is where the model state lives.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(preset: str, ns: list[int], param_dtype: str) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import optax

    import zerojax as zj
    from zerojax.analysis.measurement import measure
    from zerojax.models.gpt import GPT

    model = GPT.from_preset(preset)
    rows = []
    for n in ns:
        batch = {k: jax.ShapeDtypeStruct((n, model.cfg.seq_len), jnp.int32)
                 for k in ("inputs", "targets")}
        for stage in range(4):
            t = time.perf_counter()
            cfg = zj.ZeroConfig(stage=stage, param_dtype=param_dtype)
            m = measure(zj.Engine(model, optax.adamw(3e-4), zj.make_mesh(data=n), cfg), batch)
            mem, comm = m.estimates()
            rows.append({"n": n, "stage": stage, "formula": mem.total,
                         "formula_state": mem.total - mem.grads, "state": m.state["total"],
                         "temp": m.temp_bytes, "peak": m.peak_bytes,
                         "sent": m.collective_bytes["total"], "sent_formula": comm.total})
            print(f"N={n:>2} stage {stage}: peak {m.peak_bytes / 1e6:9.1f} MB, state "
                  f"{m.state['total'] / 1e6:9.1f} MB ({time.perf_counter() - t:.1f} s)",
                  flush=True)
    return rows


def plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    colors = ["tab:red", "tab:orange", "tab:green", "tab:blue"]
    for stage, color in enumerate(colors):
        rs = [r for r in rows if r["stage"] == stage]
        ns = [r["n"] for r in rs]
        ax.plot(ns, [r["formula"] / 1e6 for r in rs], "-", color=color,
                label=f"stage {stage}: formula (params + grads + optimizer)")
        ax.plot(ns, [r["formula_state"] / 1e6 for r in rs], ":", color=color, lw=1)
        ax.plot([r["n"] for r in rs], [r["state"] / 1e6 for r in rs], "o", mfc="none", color=color)
        ax.plot([r["n"] for r in rs], [r["peak"] / 1e6 for r in rs], "s", color=color)
    ax.plot([], [], ":", color="gray", label="formula without grads")
    ax.plot([], [], "o", mfc="none", color="gray", label="measured model state (no grads)")
    ax.plot([], [], "s", color="gray", label="measured peak of the compiled step")
    ax.set(xscale="log", yscale="log", xlabel="devices N", ylabel="MB per device", title=title)
    ax.set_xticks(sorted({r["n"] for r in rows}), labels=sorted({r["n"] for r in rows}))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(rows: list[dict], header: str, image: str) -> str:
    mb = lambda v: f"{v / 1e6:,.1f}"
    lines = [header, "", f"![per-device memory vs N]({image})", "",
             "| N | stage | formula: params+grads+opt (MB) | formula without grads (MB) | "
             "measured state (MB) | temp (MB) | peak (MB) | sent/step (MB) | formula (MB) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['stage']} | {mb(r['formula'])} | {mb(r['formula_state'])}"
                     f" | {mb(r['state'])} | {mb(r['temp'])} | {mb(r['peak'])} | "
                     f"{mb(r['sent'])} | {mb(r['sent_formula'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--devices", default="1,2,4,8,16,32,64")
    p.add_argument("--param-dtype", default="bfloat16")
    p.add_argument("--out", type=Path, default=Path("runs/memory"),
                   help="directory for memory_scaling.md and memory_scaling.png (default: "
                        "runs/memory; --out docs refreshes the plot docs/memory.md shows)")
    a = p.parse_args(argv)
    ns = sorted(int(n) for n in a.devices.split(","))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={max(ns)}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    from zerojax.models.gpt import GPT

    t = time.perf_counter()
    rows = run(a.preset, ns, a.param_dtype)
    psi = GPT.from_preset(a.preset).num_params()
    a.out.mkdir(parents=True, exist_ok=True)
    title = f"GPT {a.preset} (Ψ = {psi / 1e6:.1f}M), {a.param_dtype}, AdamW, batch 1/device"
    plot(rows, title, a.out / "memory_scaling.png")
    header = MD_HEADER.format(preset=a.preset, psi=psi, dtype=a.param_dtype,
                              cmd=" ".join([".venv/bin/python experiments/memory_scaling.py",
                                            *sys.argv[1:]]),
                              secs=time.perf_counter() - t)
    (a.out / "memory_scaling.md").write_text(markdown(rows, header, "memory_scaling.png"))
    print(f"wrote {a.out / 'memory_scaling.png'} and {a.out / 'memory_scaling.md'}")
    return 0


MD_HEADER = """# Per-device memory by ZeRO stage and device count

GPT preset `{preset}` (Ψ = {psi:,} parameters), {dtype} compute params and gradients, fp32
master params and AdamW moments (K = 12), one sequence per device. Lines: the ZeRO paper's
model-state formulas (stage 0 `16Ψ`, 1 `4Ψ + 12Ψ/N`, 2 `2Ψ + 14Ψ/N`, 3 `16Ψ/N`). Points:
`zerojax.measure` of the compiled step on simulated CPU devices (nothing allocated).

- *measured state* is what the engine keeps between steps. It has no gradients, so it
  matches the formula **without** the grads term (to the byte, up to padding and a few
  scalars); the gradients exist only inside the step and are part of *temp*.
- *peak* = arguments + outputs − aliased (donated state) + temp: what the device must hold.
  Temp (activations, gradients, collective buffers) does not shrink with N, so the measured
  peak flattens where the formula keeps falling.
- Findings on XLA:CPU (read from `*buffer-assignment.txt` with `--xla_dump_to`):
  stages 0–2 hold an fp32 copy of every scanned layer's bf16 weights in temp (CPU upcasts
  bf16 matmuls and the cast ends up outside the layer loop; 4 bytes per block parameter).
  For gpt2-small the peak is set at the head, where the fp32 logits and the untied
  50257-row tables (one unit each, so not split by stage 2) dominate, which is why stage 2
  saves far less than a full gradient against stage 1 here. GPU peaks for stages 0–2 should
  be lower (not measured here).
- At N = 1 every stage holds the whole state (nothing to shard), as the formulas say; their
  temps differ by how each stage arranges the step.
- *sent/step*: bytes each device sends per step in the requested dtype, from the lowered
  program with loop trip counts (stage 3 gathers the embedding and head once, not twice).

Reproduce: `{cmd}` ({secs:.0f} s on a shared 2-core CPU machine).
"""


if __name__ == "__main__":
    sys.exit(main())
