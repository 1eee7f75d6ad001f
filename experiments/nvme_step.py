"""The NVMe tier's training step beside the host tier's, in one process on one machine: a GPT
of `--d-model` × `--layers` (short context, small vocabulary: the optimizer state dominates),
stage 3, bf16 compute, `zerojax.adamw`, each tier's engine built and stepped in turn
(`--rounds` times, alternating, so drift on a shared machine hits both), the median step time
of each and their ratio; for the NVMe tier also the store's size, the bytes each step read and
wrote against it, and where the update's time went (reading, writing, computing, waiting).

    .venv/bin/python experiments/nvme_step.py --d-model 1024 --layers 4 --devices 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser(prog="nvme_step.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--devices", type=int, default=2, help="simulated CPU devices (data axis)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per round (after one)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--path", default=None, help="where the store goes (default: a temp dir)")
    args = p.parse_args()
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import numpy as np

    import zerojax as zj
    from zerojax.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=256, seq_len=16, d_model=args.d_model,
                          n_heads=args.d_model // 128, n_layers=args.layers,
                          d_ff=4 * args.d_model))
    tokens = np.random.default_rng(0).integers(0, 256, (2 * args.devices, 17)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    mesh = zj.make_mesh(data=args.devices, devices=jax.devices()[:args.devices])
    root = tempfile.mkdtemp(prefix="nvme-step-", dir=args.path)
    times: dict[str, list[float]] = {"cpu": [], "nvme": []}
    for r in range(args.rounds):
        for tier in ("cpu", "nvme"):
            where = dict(offload_device="nvme", nvme_path=f"{root}/store{r}") \
                if tier == "nvme" else {}
            eng = zj.Engine(model, zj.adamw(1e-4), mesh, zj.ZeroConfig(
                stage=3, offload="optimizer", param_dtype="bfloat16", **where))
            state = eng.init(jax.random.key(0), batch)
            state, m = eng.step(state, batch)  # compiles
            float(m["loss"])
            tier_ = eng._offload
            if tier == "nvme":
                tier_._wait()
                tier_.store.counters(reset=True)
            for _ in range(args.steps):
                t = time.perf_counter()
                state, m = eng.step(state, batch)
                float(m["loss"])
                if tier == "nvme":
                    tier_._wait()  # the update's passes are done
                times[tier].append(time.perf_counter() - t)
            if tier == "nvme":
                io, size = tier_.store.counters(), tier_.store.bytes
                n = args.steps
                print(f"round {r}: nvme store {size / 1e9:.3f} GB ({tier_.store.io[0]}), per "
                      f"step read {io['read'] / n / size:.4f}x and wrote "
                      f"{io['written'] / n / size:.4f}x of it; seconds per step reading "
                      f"{io['read_s'] / n:.2f}, writing {io['write_s'] / n:.2f}, computing "
                      f"{io['compute_s'] / n:.2f}, waiting for a block {io['stall_s'] / n:.2f} "
                      f"(summed over the {len(tier_.store.shards)} shards' passes)", flush=True)
                tier_.close()
            print(f"round {r}: {tier} {eng.layout.num_params / 1e6:.1f}M params, steps "
                  f"{', '.join(f'{t:.3f}' for t in times[tier][-args.steps:])} s", flush=True)
    cpu, nvme = (statistics.median(times[k]) for k in ("cpu", "nvme"))
    print(f"median step: host tier {cpu:.3f} s, NVMe tier {nvme:.3f} s, ratio {nvme / cpu:.2f}x")


if __name__ == "__main__":
    main()
