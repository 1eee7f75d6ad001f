"""The NVMe tier's principle under a memory cap: a state of `--factor` x the cap (fp32 master
and two AdamW moments on disk) steps through the streamed update in a process capped at
`--cap` bytes, while the same update with the state loaded whole into memory (the host tier's
way: the fused pass over in-memory arrays) is killed by the cap.

The store is made and filled outside the cap (a block at a time); then each child runs under
the cap (scripts/memcap.py: a cgroup v1 memory controller, root only; skipped with the reason
elsewhere):

    streamed  opens the store and runs `--steps` steps: one jitted program per step streaming
              every leaf through `zerojax_adamw_nvme` (bf16 gradient in, bf16 shard out, in
              the gradient's buffer); prints the bytes it read and wrote
    whole     reads every leaf's master, mu and nu into memory and runs the in-memory fused
              pass (`zerojax_adamw`) over them

and the cgroup's peak is reported beside the state's bytes and the cap.

    .venv/bin/python experiments/nvme_memcap.py --cap 1e9 --factor 1.5
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

LEAVES = 4


def sizes_for(state: float) -> list[int]:
    per = int(state / 12 / LEAVES) // 1024 * 1024
    return [per] * (LEAVES - 1) + [per + 333]


def child(mode: str, where: Path, sizes: list[int], steps: int):
    """The capped side: the streamed update, or the state whole in memory."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from zerojax.offload import fused, nvme
    from zerojax.offload.store import Store

    row = np.array([0.1, 0.9, 0.001, 0.999, 1e-8, 0.0, 10.0, 1000.0, 0.01, 1.0, -1e-4, 1.0,
                    1.0], np.float32)
    store = Store(where, {"memcap": sizes}, {0: sizes})
    if mode == "whole":
        fused.kernel()
        state = [[jnp.asarray(store.read_leaf(0, i, p)) for p in ("master", "mu", "nu")]
                 for i in range(len(sizes))]
        print(f"held {sum(x.nbytes for s in state for x in s):,} bytes of state", flush=True)
        for p, m, v in state:
            f32 = jax.ShapeDtypeStruct(p.shape, jnp.float32)
            call = jax.ffi.ffi_call(fused.TARGET, (f32, f32, f32, jax.ShapeDtypeStruct(
                p.shape, jnp.bfloat16)), input_output_aliases={1: 0, 2: 1, 3: 2})
            jax.block_until_ready(call(row, p, m, v, jnp.zeros(p.shape, jnp.bfloat16)))
        print("updated in memory", flush=True)
        return

    def update(row, gs):
        return [nvme.update_leaf(store.handle, i, row, jnp.int32(0), g, jnp.bfloat16)
                for i, g in enumerate(gs)]

    update = jax.jit(update, donate_argnums=1)
    for s in range(steps):
        gs = [jnp.full((n,), 1e-3 * (s + 1), jnp.bfloat16) for n in sizes]
        store.begin()
        store.counters(reset=True)
        t = time.perf_counter()
        jax.block_until_ready(update(row, gs))
        store.commit(step=s + 1)
        c = store.counters()
        print(json.dumps({"step": s + 1, "seconds": round(time.perf_counter() - t, 2),
                          "read": c["read"], "written": c["written"]}), flush=True)
        del gs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--cap", type=float, default=1e9, help="the memory cap (bytes)")
    ap.add_argument("--factor", type=float, default=1.5, help="the state's size / the cap")
    ap.add_argument("--steps", type=int, default=2, help="streamed steps under the cap")
    ap.add_argument("--dir", default=None, help="the store's directory (default: a new one "
                    "under $TMPDIR, removed after)")
    ap.add_argument("--child", choices=("streamed", "whole"), help=argparse.SUPPRESS)
    ap.add_argument("--sizes", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, Path(args.dir), json.loads(args.sizes), args.steps)

    why = memcap.available()
    if why:
        print(json.dumps({"skipped": why}))
        return {"skipped": why}
    own = args.dir is None
    where = Path(tempfile.mkdtemp(prefix="nvme-memcap-") if own else args.dir) / "store"
    sizes = sizes_for(args.factor * args.cap)
    res = {"cap": int(args.cap), "state_bytes": 12 * sum(sizes)}
    try:
        import numpy as np

        from zerojax.offload.store import Store

        t = time.perf_counter()
        with Store(where, {"memcap": sizes}, {0: sizes}) as store:
            rng = np.random.default_rng(0)
            for i, n in enumerate(sizes):  # a block at a time: no whole leaf here either
                for part in ("master", "mu", "nu"):
                    for lo in range(0, n, store.chunk()):
                        k = min(store.chunk(), n - lo)
                        block = rng.standard_normal(k, np.float32)
                        if part != "master":
                            block = np.abs(block) * 1e-3
                        store.write(0, i, part, lo, block)
            store.commit(step=0)
            res["io"] = store.io[0]
        res["fill_seconds"] = round(time.perf_counter() - t, 1)
        print(f"state {res['state_bytes'] / 1e9:.2f} GB ({res['state_bytes'] / args.cap:.2f}x "
              f"the cap of {args.cap / 1e9:.2f} GB) in {where} ({res['io']})", flush=True)
        for mode in ("streamed", "whole"):
            t = time.perf_counter()
            got = memcap.run([sys.executable, __file__, "--child", mode, "--dir", str(where),
                              "--sizes", json.dumps(sizes), "--steps", str(args.steps)],
                             int(args.cap))
            res[mode] = {"rc": got.rc, "oom_killed": got.oom_killed, "peak": got.peak,
                         "seconds": round(time.perf_counter() - t, 1),
                         "out": got.stdout.strip().splitlines()[-3:],
                         "err": got.stderr.strip().splitlines()[-2:] if got.rc else []}
            print(f"{mode:>8}: rc {got.rc}, killed by the cap: {got.oom_killed}, peak "
                  f"{got.peak / 1e9:.3f} GB ({got.peak / res['state_bytes']:.2f}x the state, "
                  f"{got.peak / args.cap:.2f}x the cap), {res[mode]['seconds']} s", flush=True)
            for line in res[mode]["out"] + res[mode]["err"]:
                print(f"          {line}")
    finally:
        if own:
            shutil.rmtree(where.parent, ignore_errors=True)
    res["holds"] = res["streamed"]["rc"] == 0 and res["whole"]["oom_killed"]
    print("the principle holds" if res["holds"] else "the principle does NOT hold")
    return res


if __name__ == "__main__":
    main()
