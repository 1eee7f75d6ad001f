"""The NVMe tier's streamed update beside the disk's own sequential O_DIRECT bandwidth,
measured in the same run on the same directory.

The disk: a file of the state's size written, then read, sequentially with O_DIRECT in
`--disk-block` transfers from one thread (as `dd oflag=direct` / `iflag=direct`; the page
cache neither helps nor counts), just before each point of the sweep (the load of a shared
machine drifts): R and W, the read and write bandwidths. The update: a store
(zerojax/offload/store.py) of S bytes of state (fp32 master and two moments, one shard of
`--leaves` leaves), each step one jitted program streaming every leaf through
`zerojax_adamw_nvme` (bf16 gradient in, bf16 compute shard out, in the gradient's buffer), as
the host update of the NVMe tier runs it. Per step: its time t, the bytes it read and wrote
(the store's counters: S each for S of state), and

    t / (S/R + S/W)     the update's time over the disk's serial read-then-write time
                        (the tier's target: <= 1/0.7 = 1.43, i.e. >= 0.7x the disk)

`--blocks` x `--counts` sweep the ring's buffer size (elements of each of master, mu, nu) and
buffer count; each point runs `--steps` steps, and the sweep `--repeats` times in turn (on
a shared machine the range over repeats is the noise).

    .venv/bin/python experiments/nvme_bench.py --dir /tmp/x --state-gb 2
    .venv/bin/python experiments/nvme_bench.py --blocks 262144 1048576 4194304 --counts 2 3 4 8
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's zerojax

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from zerojax.offload import nvme  # noqa: E402
from zerojax.offload.store import BLOCK, COUNT, Store  # noqa: E402


def disk(path: Path, size: int, block: int) -> dict:
    """{"write", "read"}: bytes per second of one sequential O_DIRECT pass over a file of
    `size` bytes (preallocated, as a store's file is) in `block`-byte transfers; the file is
    removed after."""
    size = max(size // block, 1) * block
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
    buf.write(np.random.default_rng(0).bytes(block))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
        out = {}
        for name in ("write", "read"):
            t = time.perf_counter()
            for at in range(0, size, block):
                n = (os.pwritev if name == "write" else os.preadv)(fd, [buf], at)
                assert n == block, n
            if name == "write":
                os.fdatasync(fd)
            out[name] = size / (time.perf_counter() - t)
        return out
    finally:
        os.close(fd)
        path.unlink()


def steps(store: Store, sizes: list[int], grads: list[np.ndarray], n: int) -> list[dict]:
    """`n` streamed update steps of every leaf: per step its seconds and the store's
    counters."""
    row = np.array([0.1, 0.9, 0.001, 0.999, 1e-8, 0.0, 1 / (1 - 0.9), 1 / (1 - 0.999), 0.01,
                    1.0, -1e-4, 1.0, 1.0], np.float32)

    @jax.jit
    def update(row, gs):
        return [nvme.update_leaf(store.handle, i, row, jnp.int32(0), g, jnp.bfloat16)
                for i, g in enumerate(gs)]

    update = jax.jit(update.__wrapped__, donate_argnums=1)  # the gradient takes the shard
    out = []
    for _ in range(n):
        gs = [jnp.asarray(g) for g in grads]  # fresh buffers: the last step's were donated
        jax.block_until_ready(gs)
        store.counters(reset=True)
        t = time.perf_counter()
        jax.block_until_ready(update(row, gs))
        out.append({"seconds": time.perf_counter() - t, **store.counters()})
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--dir", default=None, help="where the store and the disk's test file go "
                    "(default: a new directory under $TMPDIR, removed after)")
    ap.add_argument("--state-gb", type=float, default=2.0, help="the state's size S (GB)")
    ap.add_argument("--leaves", type=int, default=4, help="leaves of the state")
    ap.add_argument("--blocks", type=int, nargs="+", default=[BLOCK],
                    help="ring buffer sizes to sweep (elements per array; multiples of 1024)")
    ap.add_argument("--counts", type=int, nargs="+", default=[COUNT],
                    help="ring buffer counts to sweep")
    ap.add_argument("--steps", type=int, default=2, help="steps per point")
    ap.add_argument("--repeats", type=int, default=1, help="passes over the sweep")
    ap.add_argument("--disk-block", type=int, default=4 << 20,
                    help="bytes per transfer of the disk's own test (dd's bs)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    own = args.dir is None
    where = Path(tempfile.mkdtemp(prefix="nvme-bench-") if own else args.dir)
    where.mkdir(parents=True, exist_ok=True)
    per = int(args.state_gb * 1e9 / 12 / args.leaves) // 1024 * 1024
    sizes = [per] * (args.leaves - 1) + [per + 777]  # the last one not a whole block
    rng = np.random.default_rng(0)
    grads = [(rng.standard_normal(n, np.float32) * 1e-2).astype(jnp.bfloat16) for n in sizes]
    store = Store(where / "store", {"bench": sizes}, {0: sizes}, block=args.blocks[0],
                  count=args.counts[0])
    S = 12 * sum(sizes)
    res = {"state_bytes": S, "store_bytes": store.bytes, "io": store.io[0], "disk": [],
           "points": []}
    try:
        t = time.perf_counter()
        store.begin()
        for i, n in enumerate(sizes):
            store.write_leaf(0, i, rng.standard_normal(n, np.float32), None, None)
        store.commit(step=0)
        res["init_seconds"] = time.perf_counter() - t
        print(f"state {S / 1e9:.2f} GB in {where} ({store.io[0]}), written in "
              f"{res['init_seconds']:.1f} s", flush=True)
        steps(store, sizes, grads, 1)  # compiled, and the store once through
        for rep in range(args.repeats):
            for block in args.blocks:
                for count in args.counts:
                    # the disk just before each point: the machine's load drifts
                    d = disk(where / "disk.bin", S, args.disk_block)
                    res["disk"].append(d)
                    serial = S / d["read"] + S / d["write"]
                    print(f"disk: write {d['write'] / 1e9:.2f} GB/s, read {d['read'] / 1e9:.2f} "
                          f"GB/s: S/R + S/W = {serial:.2f} s", flush=True)
                    store.configure(block, count)
                    for s in steps(store, sizes, grads, args.steps):
                        res["points"].append({"repeat": rep, "block": block, "count": count,
                                              "serial": serial, **s})
                        print(f"block {block:>8} count {count}: {s['seconds']:.2f} s "
                              f"({s['seconds'] / serial:.2f} S/R+S/W), read "
                              f"{s['read'] / S:.3f} S, wrote {s['written'] / S:.3f} S, "
                              f"{(s['read'] + s['written']) / s['seconds'] / 1e9:.2f} GB/s; "
                              f"stalled {s['stall_s']:.2f} s, computed {s['compute_s']:.2f} s",
                              flush=True)
    finally:
        store.close()
        if own:
            import shutil
            shutil.rmtree(where, ignore_errors=True)
    rs, ws = [d["read"] / 1e9 for d in res["disk"]], [d["write"] / 1e9 for d in res["disk"]]
    print(f"\nthe disk over the run: R {min(rs):.2f}-{max(rs):.2f} GB/s, W {min(ws):.2f}-"
          f"{max(ws):.2f} GB/s (O_DIRECT, {args.disk_block >> 20} MiB transfers)")
    print(f"{'block':>8} {'count':>5}  t/(S/R+S/W) min-max (each step against the disk "
          f"measured just before)  read/S  written/S")
    for block in args.blocks:
        for count in args.counts:
            pts = [p for p in res["points"] if p["block"] == block and p["count"] == count]
            r = [p["seconds"] / p["serial"] for p in pts]
            print(f"{block:>8} {count:>5}  {min(r):.2f}-{max(r):.2f} (>= 0.7x the disk: "
                  f"{'yes' if max(r) <= 1 / 0.7 else 'no'})  "
                  f"{max(p['read'] for p in pts) / S:.4f}  "
                  f"{max(p['written'] for p in pts) / S:.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
