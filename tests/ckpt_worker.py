"""Subprocess side of tests/test_checkpoint.py: one run per process, so each can have its own
simulated device count (XLA_FLAGS is set by the parent before Python starts).

  train   --stage S --data N --steps T [--restore DIR] [--save DIR --save-at K ...]
          [--out FILE.npz]                     (--out: the final params)
  resave  SRC DST --hang {write,finalize}      (prints HANG inside a save, for SIGKILL)
  big     DIR --leaves L --rows R --cols C     (a > 1 GB checkpoint of a plain model)
  rss     CHECKPOINT OUT                       (export; prints peak RSS over baseline)
"""

import argparse
import faulthandler
import json
import resource
import signal
import sys
import time

import psutil

import zerojax  # noqa: F401 -- the RSS baseline is taken right after this import

BASELINE_RSS = psutil.Process().memory_info().rss


def _hang_in(where: str, dst: str) -> None:
    """Makes the next save stop forever at `where`, announcing it, so the parent can kill it.

    orbax creates the step's temporary directory in the background, so the announcement waits
    until that directory exists: the kill must find a half-written step on disk.
    """
    import asyncio
    import pathlib

    from orbax.checkpoint._src.handlers import json_checkpoint_handler
    from orbax.checkpoint._src.path import atomicity

    async def hang_async(*args, **kwargs):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(
                p.name.startswith("8.") for p in pathlib.Path(dst).iterdir()):
            await asyncio.sleep(0.05)  # lets the directory creation run, wherever it runs
        print("HANG", flush=True)
        await asyncio.sleep(3600)

    if where == "write":  # the "meta" item: the arrays are being or have been written
        json_checkpoint_handler.JsonCheckpointHandler.async_save = hang_async
    else:  # everything written, just before the atomic rename
        atomicity.AtomicRenameTemporaryPath.finalize = hang_async


def train(args) -> None:
    import jax
    import numpy as np
    from helpers import CLIP, adamw, gpt_batch, tiny_gpt

    import zerojax as zj

    jax.config.update("jax_default_matmul_precision", "highest")
    model = tiny_gpt()
    engine = zj.Engine(model, adamw(), zj.make_mesh(data=args.data),
                       zj.ZeroConfig(stage=args.stage, clip_norm=CLIP))
    batch = lambda s: gpt_batch(model.cfg, 24, s)
    if args.restore:
        state = engine.restore(args.restore)
    else:
        state = engine.init(jax.random.key(0), batch(0))
    while True:
        step = int(state.step)
        if step in args.save_at:
            engine.save(state, args.save, extra={"seed": 0, "batch": 24})
        if step >= args.steps:
            break
        state, _ = engine.step(state, batch(step))
    if args.out:
        flat = jax.tree.flatten_with_path(engine.params(state))[0]
        np.savez(args.out, **{jax.tree_util.keystr(p): np.asarray(x) for p, x in flat})


def resave(args) -> None:
    """Restores SRC, saves it to DST, then saves it again as step 8 and stops inside that save."""
    import jax
    from helpers import CLIP, adamw, tiny_gpt

    import zerojax as zj

    engine = zj.Engine(tiny_gpt(), adamw(), zj.make_mesh(data=jax.device_count()),
                       zj.ZeroConfig(stage=3, clip_norm=CLIP))
    state = engine.restore(args.src)
    engine.save(state, args.dst)
    _hang_in(args.hang, args.dst)
    engine.save(state, args.dst, step=8)


class BigModel:
    """`leaves` fp32 matrices of [rows, cols]; the loss touches each one (never run here)."""

    def __init__(self, leaves: int, rows: int, cols: int):
        self.leaves, self.rows, self.cols = leaves, rows, cols

    def init(self, rng):
        import jax.numpy as jnp
        from jax import lax

        def leaf(i):  # cheap pseudo-random values (threefry over 1 GB is slow on CPU)
            n = lax.broadcasted_iota(jnp.uint32, (self.rows, self.cols), 0) * self.cols \
                + lax.broadcasted_iota(jnp.uint32, (self.rows, self.cols), 1)
            h = (n + jnp.uint32(i)) * jnp.uint32(2654435761)
            return (h ^ (h >> 15)).astype(jnp.float32) * jnp.float32(2.0**-32) - 0.5

        return {f"w{i}": leaf(i) for i in range(self.leaves)}

    def loss(self, params, batch, units):
        total = sum(units.gather(w)[0, 0] for w in params.values())
        return total * batch["x"].mean()


def big(args) -> None:
    import jax
    import numpy as np
    import optax

    import zerojax as zj

    engine = zj.Engine(BigModel(args.leaves, args.rows, args.cols), optax.sgd(0.1),
                       zj.make_mesh(data=jax.device_count()), zj.ZeroConfig(stage=3))
    state = engine.init(jax.random.key(0), {"x": np.ones((jax.device_count(),), np.float32)})
    engine.save(state, args.dir)


def _peak_rss() -> int:
    """Peak RSS of this process's own address space (VmHWM).

    Not ru_maxrss: Linux carries that over exec from the spawning process, so a child of a
    large pytest process would report the parent's peak.
    """
    try:
        status = open("/proc/self/status").read()
        return int(next(x for x in status.splitlines() if x.startswith("VmHWM:")).split()[1]) \
            * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss(args) -> None:
    from zerojax.checkpoint.export import export_main

    t = time.perf_counter()
    rc = export_main([args.checkpoint, "--out", args.out])
    peak = _peak_rss()
    print(json.dumps({"rc": rc, "baseline": BASELINE_RSS, "peak": peak,
                      "seconds": time.perf_counter() - t}))


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # the parent asks for stacks when a run seems stuck
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--stage", type=int, required=True)
    t.add_argument("--data", type=int, required=True)
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--restore")
    t.add_argument("--save")
    t.add_argument("--save-at", type=int, nargs="*", default=[])
    t.add_argument("--out")
    v = sub.add_parser("resave")
    v.add_argument("src")
    v.add_argument("dst")
    v.add_argument("--hang", choices=["write", "finalize"], required=True)
    b = sub.add_parser("big")
    b.add_argument("dir")
    b.add_argument("--leaves", type=int, required=True)
    b.add_argument("--rows", type=int, required=True)
    b.add_argument("--cols", type=int, required=True)
    r = sub.add_parser("rss")
    r.add_argument("checkpoint")
    r.add_argument("out")
    args = p.parse_args()
    {"train": train, "resave": resave, "big": big, "rss": rss}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
