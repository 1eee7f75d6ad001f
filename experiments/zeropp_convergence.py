"""ZeRO++ convergence: the quick-start run (200 steps, `nano`, 4 devices) with and without
`--quantize-weights int8 --quantize-grads int4`; prints both eval-loss curves and plots them.

    .venv/bin/python experiments/zeropp_convergence.py --out runs/zeropp   # runs both
    .venv/bin/python experiments/zeropp_convergence.py --out runs/zeropp --plot-only

Writes OUT/plain/ and OUT/quantized/ (the `zerojax train` run directories) and the plot
(default docs/zeropp_loss.png). See docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"plain": [], "quantized": ["--quantize-weights", "int8", "--quantize-grads", "int4"]}


def curves(run: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(train loss, eval loss) as (step, value) pairs from a run's metrics.jsonl."""
    train, evals = [], []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            train.append((r["step"], r["loss"]))
        if "eval_loss" in r:
            evals.append((r["step"], r["eval_loss"]))
    return train, evals


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/zeropp")
    p.add_argument("--plot", default=str(ROOT / "docs" / "zeropp_loss.png"))
    p.add_argument("--plot-only", action="store_true", help="plot existing runs in OUT")
    args = p.parse_args(argv)
    out = Path(args.out)
    if not args.plot_only:
        for name, flags in RUNS.items():
            subprocess.run([sys.executable, "-m", "zerojax", "train", "--devices", "4",
                            "--quiet", "--out", str(out / name), *flags], check=True, cwd=ROOT)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    final = {}
    for name, color in zip(RUNS, ("tab:blue", "tab:orange")):
        train, evals = curves(out / name)
        ax.plot(*zip(*train), color=color, alpha=0.35, lw=0.8, label=f"{name}: train")
        ax.plot(*zip(*evals), color=color, marker="o", label=f"{name}: eval")
        final[name] = evals[-1][1]
        print(name, " ".join(f"{s}:{v:.4f}" for s, v in evals))
    ax.set(xlabel="step", ylabel="loss (nats/byte)", ylim=(2.2, 4.0),
           title="nano, 4 devices, stage 3: plain vs qwZ int8 + qgZ int4")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    rel = final["quantized"] / final["plain"] - 1
    print(f"final eval: plain {final['plain']:.4f}, quantized {final['quantized']:.4f} "
          f"({rel:+.2%}) -> {args.plot}")


if __name__ == "__main__":
    main()
