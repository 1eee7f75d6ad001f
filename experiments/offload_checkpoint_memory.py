"""The memory an offloaded engine's save and restore take beside its step, over the host
state's bytes: this process's resident memory (the host's; on a CPU machine the devices' too)
and, on a GPU, the device's bytes in use, each sampled every millisecond while the phase
runs, less what was in use before it.

The phases, on one device of a GPT preset with `ZeroConfig(offload="optimizer")`: a step, a
save (the first compiles its programs; the second is what every later save costs), a restore
after the state is dropped (a resume) and the first step after it. A save makes each logical
leaf where its state leaf lives, on one device a view of the state's own buffer; a restore
reads the params and moments onto the host mesh and builds the master and moments there in
parts, each freeing what it read (checkpoint/store.py and load.py, offload/meshes.py `OnMeshes`).

`--restore-only DIR` is a resume: a fresh process that builds the engine and restores DIR (a
step written by a run of this script with `--dir`, its `b`), nothing before it. It reports the
peak and the end over the host state, and the host arrays alive after it (the state and, on a
CPU machine, the compute params): what the process holds beyond them is the allocator's and
the reads'. `--mmap-threshold BYTES` fixes glibc's mmap threshold first (as
MALLOC_MMAP_THRESHOLD_ would), so that freed large blocks go back to the system.

    .venv/bin/python experiments/offload_checkpoint_memory.py --preset 1b --out runs/ckpt.json
    .venv/bin/python experiments/offload_checkpoint_memory.py --preset 1b --dir /tmp/c
    .venv/bin/python experiments/offload_checkpoint_memory.py --preset 1b --restore-only /tmp/c/b
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's zerojax

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.analysis.measurement import state_bytes  # noqa: E402
from zerojax.mesh import put_batch  # noqa: E402
from zerojax.models.gpt import GPT, PRESETS  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small8", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="the preset's, with this many layers")
    p.add_argument("--d-model", type=int, default=None,
                   help="the preset's, this wide (and d_ff 4x that)")
    p.add_argument("--batch", type=int, default=1, help="global batch (sequences)")
    p.add_argument("--dir", type=Path, default=None,
                   help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument("--restore-only", type=Path, default=None, metavar="DIR",
                   help="only restore DIR, in this fresh process (a resume)")
    p.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES",
                   help="glibc's mmap threshold, fixed at BYTES before anything is allocated")
    return p.parse_args(argv)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def fix_mmap_threshold(nbytes: int) -> None:
    """glibc's mmap threshold fixed at `nbytes` (its default grows with the blocks freed, up to
    32 MiB, and what is freed below it stays in the process)."""
    if ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, nbytes) != 1:
        raise SystemExit(f"--mmap-threshold {nbytes}: mallopt refused it (not glibc?)")


def host_array_bytes() -> int:
    """Bytes of the live arrays in host memory: the CPU backend's (on a CPU-only machine, all
    of them), and an accelerator's in its pinned host memory."""
    cpu = sum(x.nbytes for x in jax.live_arrays("cpu"))
    if jax.default_backend() == "cpu":
        return cpu
    return cpu + sum(x.nbytes for x in jax.live_arrays()
                     if x.sharding.memory_kind == "pinned_host")


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def device_in_use() -> int:
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("bytes_in_use", 0))


class Peak:
    """The most each of host and device memory held above where it was, while in the block, and
    what the host held above it as the block ended (`end`)."""

    def __enter__(self):
        self.base, self.dbase = resident(), device_in_use()
        self.host, self.device, self._stop = 0, 0, False
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop:
            self.host = max(self.host, resident() - self.base)
            self.device = max(self.device, device_in_use() - self.dbase)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.end = resident() - self.base
        self.host = max(self.host, self.end)


def write_json(path: Path | None, res: dict) -> None:
    """`res` as JSON at `path` (its folder made), when a path is given."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1))


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.mmap_threshold is not None:
        fix_mmap_threshold(a.mmap_threshold)
    cfg = PRESETS[a.preset]
    if a.layers:
        cfg = dataclasses.replace(cfg, n_layers=a.layers)
    if a.d_model:
        cfg = dataclasses.replace(cfg, d_model=a.d_model, d_ff=4 * a.d_model)
    model = GPT(cfg)
    mesh = zj.make_mesh(data=1, devices=jax.devices()[:1])
    eng = zj.Engine(model, optax.adamw(1e-4), mesh,
                    zj.ZeroConfig(stage=3, param_dtype="bfloat16", offload="optimizer"))
    if a.restore_only is not None:
        return restore_only(a, eng)
    tokens = np.random.default_rng(0).integers(
        0, model.cfg.vocab_size, (a.batch, model.cfg.seq_len + 1), dtype=np.int32)
    batch = put_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh)
    state = eng.init(jax.random.key(0), batch)
    state, _ = eng.step(state, batch)  # compiled
    host = state_bytes(eng)["host"]
    where = Path(tempfile.mkdtemp(prefix="zerojax-ckpt-memory-")) if a.dir is None else a.dir
    rows = {}

    def phase(name, fn):
        with Peak() as p:
            out = jax.block_until_ready(fn())
        rows[name] = {"host": p.host / host, "device": p.device / host}
        print(f"{name:<28} host +{p.host / host:5.2f}x   device +{p.device / host:5.2f}x "
              f"(of the host state, {host / 1e9:.2f} GB)", flush=True)
        return out

    state, _ = phase("step", lambda: eng.step(state, batch))
    phase("save (first: compiles)", lambda: eng.save(state, where / "a"))
    phase("save", lambda: eng.save(state, where / "b"))
    state = None  # dropped: the restore holds nothing else
    back = phase("restore (nothing else held)", lambda: eng.restore(where / "b"))
    phase("first step after it", lambda: eng.step(back, batch))
    if a.dir is None:
        shutil.rmtree(where, ignore_errors=True)
    res = {"device": jax.devices()[0].device_kind, "preset": a.preset,
           "params": eng.layout.num_params, "host_state_bytes": host, "over_host_state": rows}
    write_json(a.out, res)
    return res


def restore_only(a, eng) -> dict:
    with Peak() as p:
        state = jax.block_until_ready(eng.restore(a.restore_only))
    host = state_bytes(eng)["host"]
    row = {"host": p.host / host, "device": p.device / host,
           "host_at_end": p.end / host, "host_arrays": host_array_bytes() / host}
    print(f"restore, fresh process: host peak +{row['host']:.2f}x, at its end "
          f"+{row['host_at_end']:.2f}x, host arrays {row['host_arrays']:.2f}x; device "
          f"+{row['device']:.2f}x (of the host state, {host / 1e9:.2f} GB; mmap threshold "
          f"{a.mmap_threshold or 'glibc default'})", flush=True)
    del state
    res = {"device": jax.devices()[0].device_kind, "preset": a.preset,
           "params": eng.layout.num_params, "host_state_bytes": host,
           "mmap_threshold": a.mmap_threshold, "restore_fresh_process": row}
    write_json(a.out, res)
    return res


if __name__ == "__main__":
    main()
