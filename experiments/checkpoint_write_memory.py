"""The host memory an orbax save takes beside the tree it writes, by the OCDBT writer's data-file
size: orbax's default (2 GiB) against zerojax's (`zerojax.checkpoint.store.DATA_FILE_BYTES`),
for trees of a GPT's leaf shapes of several sizes, each save in its own process (so one's pages
do not lower another's figure). The figure is the process's resident memory above where it was
before the save, sampled every millisecond until the save is written, over the tree's bytes.

    .venv/bin/python experiments/checkpoint_write_memory.py --copies 3 6 12 24
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORBAX_DEFAULT = 2**31  # orbax's _DEFAULT_OCDBT_TARGET_DATA_FILE_SIZE
# one copy: a layer stack's kernels and two small leaves, 0.40 GB in float32 at width 1024
SHAPES = [(8, 1, 4), (8, 1, 4), (8, 1, 3), (8, 1, 1), (256, 1), (256, 1)]


def one(copies: int, width: int, data_file_bytes: int) -> dict:
    """Saves `copies` copies of SHAPES (scaled by `width`) with that data-file size."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    rng = np.random.default_rng(0)
    shapes = [tuple(d * width if i else d for i, d in enumerate(s)) for s in SHAPES]
    tree = {f"l{i}_{k}": jax.device_put(rng.standard_normal(s, dtype=np.float32))
            for k in range(copies) for i, s in enumerate(shapes)}
    nbytes = sum(x.nbytes for x in tree.values())
    jax.block_until_ready(tree)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from offload_checkpoint_memory import Peak  # the same watcher of resident memory

    with tempfile.TemporaryDirectory() as d, Peak() as peak:
        start = time.perf_counter()
        ck = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler())
        ck.save(Path(d) / "x", args=ocp.args.PyTreeSave(
            tree, ocdbt_target_data_file_size=data_file_bytes))
        ck.wait_until_finished()
        seconds = time.perf_counter() - start
        files = sum(1 for _ in (Path(d) / "x").glob("ocdbt.process_*/d/*"))
    return {"tree_bytes": nbytes, "data_file_bytes": data_file_bytes, "extra_bytes": peak.host,
            "over_tree": peak.host / nbytes, "seconds": seconds, "data_files": files}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copies", type=int, nargs="+", default=[3, 6],
                   help="tree sizes, in copies of a 0.4 GB layer stack (at --width 1024)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    p.add_argument("--one", nargs=3, type=int, help=argparse.SUPPRESS)  # a child's save
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(one(*a.one)))
        return []
    sys.path.insert(0, str(ROOT))
    from zerojax.checkpoint.store import DATA_FILE_BYTES

    rows = []
    print(f"{'tree':>9} {'data file':>10} {'beside the tree':>16} {'files':>6} {'seconds':>8}")
    for copies in a.copies:
        for size in (ORBAX_DEFAULT, DATA_FILE_BYTES):
            out = subprocess.run([sys.executable, __file__, "--one", str(copies), str(a.width),
                                  str(size)], capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{row['tree_bytes'] / 1e9:7.2f}GB {size / 2**20:8.0f}MiB "
                  f"{row['extra_bytes'] / 1e9:7.2f} GB {row['over_tree']:5.2f}x "
                  f"{row['data_files']:6d} {row['seconds']:8.1f}", flush=True)
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
