"""The offloaded optimizer update alone: its state traffic per second next to a plain memory
copy measured in the same process (ZeRO-Offload's update should run at the host's memory
bandwidth).

The update is the engine's own (its host program, `offload/host.py`: the step's
`ShardedUpdate` run by the CPU backend over the host mesh), over the state of a one-leaf model
of `params` elements, the master and optimizer state donated, as the step donates them. Bytes
per step: the gradient shard, master and optimizer state read, master and optimizer state and
the compute-dtype shard written.

`--host-devices K ...` also times the same update with its state split over K CPU devices (one
program, a partition on each): XLA:CPU gives one memory-bound fusion at most ceil(sqrt(cores))
threads, so one device's update of a large leaf runs on a few cores however many the host has,
while K partitions run at once. What a host mesh of several CPU devices per accelerator would
gain, measured before it is built (docs/performance.md).

The same AdamW as `zerojax.adamw` runs as the engine's fused host update (one pass per leaf,
each byte read and written once, in place, on every core: zerojax/offload/fused.py), on a
state of its own, its numbers checked against the XLA program's update of the same state.

Each form's time is also given until its call returned: XLA:CPU runs a program its cost
analysis deems cheap (under 1,000 flops; a custom call counts none, so the fused pass's
program is one) inline, on the calling thread, so that call returns only when the update is
done, where the other forms' calls return once dispatched. The delayed step therefore calls
its update from a thread of its own (`offload/host.py`).

    .venv/bin/python experiments/update_bench.py --params 50e6
    .venv/bin/python experiments/update_bench.py --params 302e6 --host-devices 1 2 4 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's zerojax

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.precision import DTYPES  # noqa: E402


class FlatModel:
    """One parameter leaf `w` of `size` elements (the update's cost does not depend on the
    model's shapes, only on the elements it touches)."""

    def __init__(self, size: int):
        self.size = size

    def init(self, rng):
        del rng
        return {"w": jnp.zeros((self.size,), jnp.float32)}

    def loss(self, params, batch, units):
        w = units.gather(params)["w"]
        return jnp.mean(jnp.square(w[None, :8].astype(jnp.float32) * batch["x"]))


BATCH = {"x": np.ones((2, 8), np.float32)}


def offload_engine(size: int, optimizer, param_dtype: str = "bfloat16", devices=None) -> tuple:
    """An initialised stage-3 offload engine and its state (`eng.init(key, BATCH)` gives
    another): over the default backend's first device, or over `devices` (CPU devices: the
    host mesh is that mesh itself, the update one program over them)."""
    devices = jax.devices()[:1] if devices is None else devices
    eng = zj.Engine(FlatModel(size), optimizer, zj.make_mesh(data=len(devices), devices=devices),
                    zj.ZeroConfig(stage=3, offload="optimizer", param_dtype=param_dtype))
    batch = {"x": np.ones((2 * len(devices), 8), np.float32)}  # rows for each device
    return eng, eng.init(jax.random.key(0), batch)


def _scalars(eng) -> tuple:
    """The update's scalars on the host mesh: divisor 1, norm 1, no finite flag, loss 0."""
    one = lambda x: jax.device_put(x, NamedSharding(eng.host_mesh, P()))
    return one(jnp.float32(1)), one(jnp.float32(1)), None, one(jnp.float32(0))


def update_fn(eng, donate: bool = True):
    """`(master, opt_state, grads) -> (master, opt_state, compute shards)`: the step's
    offloaded update alone (no clipping; a finite step), the engine's own host program (the
    fused pass of a zerojax.adamw), the host state donated if `donate`, and then the gradient
    too where it has the compute dtype (its buffer takes the shards), as the step donates it.
    `grads` on the engine's host mesh."""
    fused = eng._offload.fused()[0] is not None
    fn = eng._offload._update_fn(donate, False, donate, fused=fused)
    scalars = _scalars(eng)

    def run(master, opt_state, grads):
        master, opt_state, shards, _ = fn(scalars, master, opt_state, grads)
        return master, opt_state, shards

    return run


def cpu_backend_fn(optimizer, dtype):
    """The same AdamW step as one program of the CPU backend (outside any device program:
    on a GPU machine, the host's own XLA:CPU with its thread pool), its state donated."""
    def step(master, opt, grads):
        updates, opt = optimizer.update(grads.astype(jnp.float32), opt, master)
        master = optax.apply_updates(master, updates)
        return master, opt, master.astype(dtype)

    return jax.jit(step, donate_argnums=(0, 1))



def fused_check(fused_eng, eng, grads) -> dict:
    """The fused update's first step against the XLA program's, each from its engine's fresh
    state (the same init) and the same gradient: of master, moments and compute shard, the
    share of elements that differ and the largest difference in units in the last place."""
    def first(e):
        state = e.init(jax.random.key(0), BATCH)
        g = jax.tree.map(jnp.copy, grads)  # donated
        master, opt, shards = update_fn(e)(state.master, state.opt_state, g)
        return [np.asarray(x).view(np.uint32 if x.dtype == jnp.float32 else np.uint16)
                .astype(np.int64) for x in jax.tree.leaves((master, opt[0].mu, opt[0].nu,
                                                            shards))]

    d = [np.abs(a - b) for a, b in zip(first(fused_eng), first(eng), strict=True)]
    return {"differ": sum(int(np.count_nonzero(x)) for x in d) / sum(x.size for x in d),
            "max_ulps": max(int(x.max()) for x in d)}


class Threaded:
    """A callable that runs `fn` on its state and returns the seconds it took (state threaded
    through each call, as the step threads it); with `fresh`, `fn` also takes `fresh()`, made
    before the clock starts (a gradient the update donates, as each step's arrives)."""

    def __init__(self, fn, *state, fresh=None):
        self.fn, self.state, self.fresh = fn, state, fresh
        self.returned = 0.0  # the last call's seconds until `fn` returned (dispatched)

    def __call__(self) -> float:
        extra = () if self.fresh is None else (jax.block_until_ready(self.fresh()),)
        t0 = time.perf_counter()
        *self.state, out = self.fn(*self.state, *extra)
        self.returned = time.perf_counter() - t0
        jax.block_until_ready((self.state, out))
        return time.perf_counter() - t0


def cpu_backend_timer(params: int, optimizer, dtype) -> Threaded:
    """`cpu_backend_fn` on `params` elements in CPU memory."""
    cpu = jax.devices("cpu")[0]
    master = jax.device_put(jnp.zeros((params,), jnp.float32), cpu)
    opt = jax.device_put(optimizer.init(master), cpu)
    grads = jax.device_put(jnp.full((params,), 1e-3, dtype), cpu)
    fn = cpu_backend_fn(optimizer, dtype)
    return Threaded(lambda m, o: fn(m, o, grads), master, opt)


def state_bytes(eng, state, grads) -> int:
    """Bytes one update reads and writes: grads + master + state in, master + state + the
    compute shard out."""
    size = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))
    compute = sum(x.size for x in jax.tree.leaves(state.master)) * np.dtype(
        DTYPES[eng.config.param_dtype]).itemsize
    return size(grads) + 2 * (size(state.master) + size(state.opt_state)) + compute


def traffic(eng, state, grads) -> int:
    """Bytes the engine's compiled host update reads and writes, all partitions (XLA's cost
    analysis, per partition, times the host mesh's devices): more than `state_bytes` where
    XLA:CPU writes an intermediate to memory and reads it back. An AdamW update is four
    fusions, one per output (XLA:CPU fuses no two outputs into one loop): the two moments
    (each reads the gradient), the master (reads both new moments) and the compute shard
    (reads the new master): 42 bytes a param against 28."""
    fn = eng._offload._update_fn(True, False, True)
    cost = fn.lower(_scalars(eng), state.master, state.opt_state, grads).compile()
    return int(cost.cost_analysis()["bytes accessed"]) * eng.host_mesh.size


def copy_timer(nbytes: int, threads: int, pool: ThreadPoolExecutor):
    """() -> seconds of one `np.copyto` of `nbytes`, split over `threads` of `pool`."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    bounds = [(p[0], p[-1] + 1) for p in np.array_split(np.arange(src.size), threads) if p.size]

    def copy(b):
        np.copyto(dst[b[0]:b[1]], src[b[0]:b[1]])

    def run() -> float:
        t0 = time.perf_counter()
        list(pool.map(copy, bounds))
        return time.perf_counter() - t0

    return run


def gradient_of(eng, state):
    """A gradient shard for `state`'s master: the compute dtype, on the host mesh."""
    dtype = DTYPES[eng.config.param_dtype]
    return jax.device_put(jax.tree.map(lambda m: jnp.full(m.shape, 1e-3, dtype), state.master),
                          jax.tree.map(lambda m: m.sharding, state.master))


def _engine_timer(eng, state, grads, donate: bool = True) -> Threaded:
    """The engine's update of `state` as the step runs it, each call on a fresh copy of
    `grads` when it donates them."""
    fn = update_fn(eng, donate=donate)
    if not donate:
        return Threaded(lambda m, o: fn(m, o, grads), state.master, state.opt_state)
    return Threaded(fn, state.master, state.opt_state,
                    fresh=lambda: jax.tree.map(jnp.copy, grads))


FUSED = "fused (zerojax.adamw)"


def measure(params: int, repeats: int = 5, donate=(True, False), param_dtype="bfloat16",
            host_devices=()) -> dict:
    """The offloaded AdamW update of `params` elements: the engine's program of optax.adamw
    (donated, and not), the engine's fused pass of zerojax.adamw (donated), the same AdamW as
    a donated program of the CPU backend, and the program donated with its state over K CPU
    devices for each K of `host_devices`; against a one-thread and an all-core `np.copyto` of
    the same bytes (read + written), in this process. Round-robin: each repeat times every
    one once, so load drift on a shared machine hits all alike; medians over the repeats."""
    optimizer = optax.adamw(1e-3, weight_decay=0.1)
    eng, state = offload_engine(params, optimizer, param_dtype)
    dtype = DTYPES[param_dtype]
    grads = gradient_of(eng, state)
    moved = state_bytes(eng, state, grads)
    traffic_of = {"donated": traffic(eng, state, grads)}
    cores = os.cpu_count() or 1
    pool = ThreadPoolExecutor(cores)
    copies = {"1 thread": copy_timer(moved // 2, 1, pool),
              f"{cores} threads": copy_timer(moved // 2, cores, pool)}
    updates = {}
    for i, d in enumerate(donate):
        if i:  # a state of its own: the first timer donates its state away
            state = eng.init(jax.random.key(0), BATCH)
        updates["donated" if d else "not donated"] = _engine_timer(eng, state, grads, d)
    fused_eng, fused_state = offload_engine(params, zj.adamw(1e-3, weight_decay=0.1),
                                            param_dtype)
    why = fused_eng._offload.fused()[1]
    checks = {FUSED: {"n/a": why} if why else fused_check(fused_eng, eng, grads)}
    if not why:
        updates[FUSED] = _engine_timer(fused_eng, fused_state, grads)
    updates["CPU-backend program"] = cpu_backend_timer(params, optimizer, dtype)
    bytes_of = dict.fromkeys(updates, moved)
    cpus = jax.devices("cpu")
    for k in host_devices:
        if k > len(cpus):
            raise SystemExit(f"--host-devices {k}: jax has {len(cpus)} CPU devices here")
        e, s = offload_engine(params, optimizer, param_dtype, cpus[:k])
        g = gradient_of(e, s)
        name = f"over {k} CPU device{'s' if k > 1 else ''}"
        updates[name] = _engine_timer(e, s, g)
        bytes_of[name] = state_bytes(e, s, g)  # the flat leaf padded to a multiple of k
        traffic_of[name] = traffic(e, s, g)
    timers = {**{("copy", k): v for k, v in copies.items()},
              **{("update", k): v for k, v in updates.items()}}
    times = {k: [] for k in timers}
    returned = {k: [] for k in updates}
    for i in range(repeats + 1):  # the first: compile, page the outputs in
        for k, run in timers.items():
            t = run()
            if i:
                times[k].append(t)
                if k[0] == "update":
                    returned[k[1]].append(run.returned)
    pool.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    copy = {k: moved / med["copy", k] for k in copies}
    best = max(copy.values())
    return {"params": params, "bytes_per_update": moved, "cores": cores, "repeats": repeats,
            "copy_bytes_per_s": copy,
            "update": {k: {"median_s": med["update", k],
                           "returned_s": statistics.median(returned[k]),
                           "bytes_per_s": bytes_of[k] / med["update", k],
                           "ratio_to_copy": bytes_of[k] / med["update", k] / best}
                       | ({"traffic_bytes": traffic_of[k],
                           "traffic_per_s": traffic_of[k] / med["update", k],
                           "traffic_ratio_to_copy": traffic_of[k] / med["update", k] / best}
                          if k in traffic_of else {})
                       for k in updates},
            "fused_check": checks}


def table(res: dict) -> str:
    gb = lambda b: f"{b / 1e9:.2f} GB/s"
    best = max(res["copy_bytes_per_s"].values())
    lines = [f"offloaded AdamW update of {res['params']:,} params on {res['cores']} cores: "
             f"{res['bytes_per_update'] / 1e9:.2f} GB read + written per update"]
    for name, bw in res["copy_bytes_per_s"].items():
        lines.append(f"  np.copyto, {name:<28} {gb(bw):>12}  ({bw / best:.2f}x the best copy)")
    for name, r in res["update"].items():
        lines.append(f"  update, {name:<31} {gb(r['bytes_per_s']):>12}  "
                     f"({r['ratio_to_copy']:.2f}x the best copy; {r['median_s'] * 1e3:.1f} ms, "
                     f"the call returning after {r['returned_s'] * 1e3:.1f})")
    for name, check in res.get("fused_check", {}).items():
        if "n/a" in check:
            lines.append(f"  ({name}: n/a, {check['n/a']})")
            continue
        same = "bitwise" if not check["differ"] else (
            f"bitwise but {check['differ']:.2%} of the elements, within {check['max_ulps']} "
            f"unit(s) in the last place")
        lines.append(f"  ({name} gives the XLA program's numbers: {same})")
    traffic = {k: r for k, r in res["update"].items() if "traffic_bytes" in r}
    if traffic:
        per = traffic["donated"]["traffic_bytes"] / res["params"]
        lines.append(f"the engine's compiled XLA program reads and writes {per:.1f} bytes a "
                     f"param (XLA's cost analysis), at")
        for name, r in traffic.items():
            lines.append(f"  update, {name:<31} {gb(r['traffic_per_s']):>12}  "
                         f"({r['traffic_ratio_to_copy']:.2f}x the best copy)")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=50e6, help="elements of the update's shard")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--param-dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--host-devices", type=int, nargs="+", default=[], metavar="K",
                   help="also time the update with its state over K CPU devices (jax is "
                        "started with as many CPU devices as the largest K)")
    p.add_argument("--out", type=Path, help="write the results here as JSON")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.host_devices:  # before jax starts its backends
        jax.config.update("jax_num_cpu_devices", max(a.host_devices))
    res = measure(int(a.params), a.repeats, param_dtype=a.param_dtype,
                  host_devices=a.host_devices)
    print(table(res))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
