"""A GPT trains on the NVMe tier under a memory cap that kills the same run on the host tier:
the 1b preset's width (d_model 2048, d_ff 8192, 16 heads) and depth (`--layers`, 18: 0.91B
params; context `--seq-len`, vocabulary `--vocab`), stage 3, bf16 params, `zerojax.adamw`, one
CPU device, each tier's run in a process under a cgroup memory cap of `--cap` bytes
(scripts/memcap.py: cgroup v1, root only; skipped with the reason elsewhere).

    nvme  offload_device="nvme": init (each part of the state written to the store as it is
          built), `--steps` steps, then with `--save` a checkpoint
    cpu   offload_device="cpu" (the host tier): the same run, its state whole in memory

On CPU the devices' memory is host memory too: the cap holds the bf16 params, the gradients
program's buffers and the runtime beside what the tier keeps in memory. The NVMe run's peak
is that program's: 11.2 bytes a param at 18 layers on XLA:CPU (docs/nvme.md), near the
state's 12, so on CPU the cap the NVMe run fits under is about the state's bytes, not 1/1.5
of them; the host tier's run needs both. The script prints the state's bytes (fp32 master
and two moments), the cap, each run's cgroup peak, its phases and step times; `holds`: the
NVMe run did all it was asked under the cap and the host tier's was killed by it.

    .venv/bin/python experiments/nvme_gpt_memcap.py --cap 14e9 --steps 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's zerojax
sys.path.insert(0, str(HERE.parent / "scripts"))

import memcap  # noqa: E402

SHAPE = dict(d_model=2048, n_heads=16, d_ff=8192)  # the 1b preset's (and its 18 layers)


def child(tier: str, where: Path, args):
    """The capped side: one tier's run, a JSON line per phase."""
    import os

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    import zerojax as zj
    from zerojax.models import GPT, GPTConfig

    say = lambda **kw: print(json.dumps(kw), flush=True)
    model = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layers=args.layers,
                          **SHAPE))
    tokens = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq_len + 1))
    batch = {"inputs": tokens[:, :-1].astype(np.int32),
             "targets": tokens[:, 1:].astype(np.int32)}
    disk = dict(offload_device="nvme", nvme_path=str(where / "store")) if tier == "nvme" else {}
    eng = zj.Engine(model, zj.adamw(1e-4), zj.make_mesh(data=1, devices=jax.devices()[:1]),
                    zj.ZeroConfig(stage=3, offload="optimizer", param_dtype="bfloat16", **disk))
    t = time.perf_counter()
    state = eng.init(jax.random.key(0), batch)
    jax.block_until_ready(state)
    say(phase="init", seconds=round(time.perf_counter() - t, 1),
        params=eng.layout.num_params)
    for s in range(args.steps):
        t = time.perf_counter()
        state, m = eng.step(state, batch)
        loss = float(m["loss"])
        if tier == "nvme":
            eng._offload._wait()  # the update's passes are done
        say(phase="step", step=s + 1, seconds=round(time.perf_counter() - t, 1), loss=loss)
    if args.save:
        t = time.perf_counter()
        eng.save(state, where / "ckpt")
        say(phase="save", seconds=round(time.perf_counter() - t, 1))
    say(phase="done")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--cap", type=float, default=14e9, help="the memory cap (bytes)")
    ap.add_argument("--steps", type=int, default=3, help="training steps")
    ap.add_argument("--save", action="store_true", help="then write a checkpoint")
    ap.add_argument("--layers", type=int, default=18, help="the depth (the 1b preset's: 18)")
    ap.add_argument("--seq-len", type=int, default=32, help="the context")
    ap.add_argument("--vocab", type=int, default=256, help="the vocabulary")
    ap.add_argument("--batch", type=int, default=2, help="sequences per step")
    ap.add_argument("--tiers", nargs="+", default=["nvme", "cpu"], choices=["nvme", "cpu"])
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per run at most")
    ap.add_argument("--dir", default=None, help="where the store and checkpoint go (default: "
                    "a new directory under $TMPDIR, removed after)")
    ap.add_argument("--child", choices=("nvme", "cpu"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, Path(args.dir), args)

    why = memcap.available()
    if why:
        print(json.dumps({"skipped": why}))
        return {"skipped": why}
    import jax

    from zerojax.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layers=args.layers,
                          **SHAPE))
    n = sum(x.size for x in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0))))
    res = {"cap": int(args.cap), "params": n, "state_bytes": 12 * n}
    print(f"{n / 1e9:.3f}B params: fp32 master and moments {12 * n / 1e9:.2f} GB = "
          f"{12 * n / args.cap:.2f}x the cap of {args.cap / 1e9:.2f} GB", flush=True)
    own = args.dir is None
    root = Path(tempfile.mkdtemp(prefix="nvme-gpt-memcap-") if own else args.dir)
    try:
        for tier in args.tiers:
            where = root / tier
            where.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, __file__, "--child", tier, "--dir", str(where),
                   "--steps", str(args.steps), "--layers", str(args.layers),
                   "--seq-len", str(args.seq_len), "--vocab", str(args.vocab),
                   "--batch", str(args.batch)]
            t = time.perf_counter()
            got = memcap.run(cmd + (["--save"] if args.save else []), int(args.cap),
                             timeout=args.timeout)
            lines = [json.loads(x) for x in got.stdout.splitlines() if x.startswith("{")]
            res[tier] = {"rc": got.rc, "oom_killed": got.oom_killed, "peak": got.peak,
                         "seconds": round(time.perf_counter() - t, 1), "phases": lines,
                         "err": got.stderr.strip().splitlines()[-2:] if got.rc else []}
            reached = [x["phase"] for x in lines]
            print(f"{tier:>5}: rc {got.rc}, killed by the cap: {got.oom_killed}, peak "
                  f"{got.peak / 1e9:.2f} GB ({got.peak / res['state_bytes']:.2f}x the state, "
                  f"{got.peak / args.cap:.2f}x the cap), {res[tier]['seconds']} s; reached "
                  f"{', '.join(reached) or 'nothing'}", flush=True)
            for x in lines + [{"stderr": e} for e in res[tier]["err"]]:
                print(f"       {json.dumps(x)}")
            if tier == "nvme" and not own:
                shutil.rmtree(where / "store", ignore_errors=True)
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    nv, cpu = res.get("nvme"), res.get("cpu")
    res["state_over_cap"] = round(res["state_bytes"] / args.cap, 3)
    res["holds"] = bool(nv and cpu and nv["rc"] == 0 and nv["phases"][-1]["phase"] == "done"
                        and nv["peak"] < args.cap and cpu["oom_killed"])
    print("the NVMe tier trains under the cap, the host tier is killed by it" if res["holds"] else
          "NOT shown: see the runs above")
    return res


if __name__ == "__main__":
    main()
