"""Can the offloaded update run beside the device's step? The measurements that decide where
ZeRO-Offload's host update runs on a GPU machine, in one process:

1. the AdamW update of a `--params` shard as a donated program of the host's own XLA:CPU
   backend (outside any device program): whole, and split into `--slices` independent programs
   dispatched at once or from one thread each; its host memory growth against its state;
2. the engine's own offloaded update (`update_bench.update_fn`: its host program over the
   host mesh), for the same bytes;
3. a device program of about the step's length alone, the host update alone, and both
   together, in either order: the device program called first, then the host update; or the
   host update started from a thread of its own, then the device program. Does the host
   update hide behind the device's work? Also how long the device program's call holds its
   caller (its dispatch);
4. the transfers the split path needs: the compute-dtype shard device -> CPU backend and
   back, and device -> pinned host memory of the device's own client;
5. `np.copyto` of the update's bytes on every core, the bandwidth the update is measured against.

    .venv/bin/python experiments/offload_overlap.py --params 1e9 --out runs/overlap.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # update_bench beside this file
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's zerojax

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

BYTES_PER_PARAM = 2 + 2 * 12 + 2  # bf16 grad in; f32 master, mu, nu in and out; bf16 out


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1]) * 1024
    raise KeyError(field)


def rss() -> float:
    """This process's resident memory now, bytes."""
    return _status("VmRSS")


def reset_peak() -> bool:
    """Start a new peak of resident memory (Linux: `clear_refs` 5); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak() -> float:
    """Peak resident memory since the last `reset_peak` (or the start), bytes."""
    try:
        return _status("VmHWM")
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0


def median_time(fn, repeats: int) -> float:
    fn()  # compile, page the outputs in
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class HostUpdate:
    """AdamW over `slices` flat shards in the CPU backend's memory, one donated program per
    shard (the same compiled program for equal shards); `run(mode)` updates every shard once."""

    def __init__(self, params: int, slices: int, optimizer):
        cpu = jax.devices("cpu")[0]
        size = -(-params // slices)
        self.opt = optimizer

        def step(master, opt, grads):
            updates, opt = optimizer.update(grads.astype(jnp.float32), opt, master)
            master = optax.apply_updates(master, updates)
            return master, opt, master.astype(jnp.bfloat16)

        self.fn = jax.jit(step, donate_argnums=(0, 1))
        put = lambda x: jax.device_put(x, cpu)  # committed: the programs run on the CPU backend
        with jax.default_device(cpu):
            self.master = [put(jnp.zeros((size,), jnp.float32)) for _ in range(slices)]
            self.state = [jax.jit(optimizer.init)(m) for m in self.master]
            self.grads = [put(jnp.full((size,), 1e-3, jnp.bfloat16)) for _ in range(slices)]
        self.pool = ThreadPoolExecutor(slices)
        self.out = None

    def one(self, i):
        self.master[i], self.state[i], out = self.fn(self.master[i], self.state[i], self.grads[i])
        return out

    def dispatch(self):
        """Every shard's update dispatched; returns without waiting."""
        self.out = [self.one(i) for i in range(len(self.master))]
        return self.out

    def run(self, mode: str = "dispatch"):
        if mode == "threads":
            self.out = list(self.pool.map(lambda i: jax.block_until_ready(self.one(i)),
                                          range(len(self.master))))
        else:
            self.dispatch()
        jax.block_until_ready((self.master, self.state, self.out))


def device_work(seconds: float, size: int = 4096):
    """A device program of about `seconds` (bf16 `size`² matmuls in a loop) and its runner."""
    dev = jax.devices()[0]
    a = jax.device_put(jnp.ones((size, size), jnp.bfloat16) * 1e-3, dev)

    def body(n):
        return jax.lax.fori_loop(0, n, lambda i, x: (x @ a).astype(jnp.bfloat16), a)

    f = jax.jit(body)
    f(1).block_until_ready()
    t0 = time.perf_counter()
    f(20).block_until_ready()
    per = (time.perf_counter() - t0) / 20
    n = max(1, int(seconds / max(per, 1e-6)))
    return lambda: f(n)


def copy_bandwidth(nbytes: int, threads: int) -> float:
    src = np.ones(nbytes // 8, np.float32)  # read + written = nbytes
    dst = np.empty_like(src)
    parts = np.array_split(np.arange(src.size), threads)
    bounds = [(p[0], p[-1] + 1) for p in parts if p.size]
    with ThreadPoolExecutor(threads) as pool:
        t = median_time(lambda: list(pool.map(
            lambda b: np.copyto(dst[b[0]:b[1]], src[b[0]:b[1]]), bounds)), 3)
    return src.nbytes * 2 / t


def transfers(params: int) -> dict:
    dev, cpu = jax.devices()[0], jax.devices("cpu")[0]
    x = jax.device_put(jnp.ones((params,), jnp.bfloat16), dev)
    out = {}
    to_cpu = lambda: jax.block_until_ready(jax.device_put(x, cpu))
    out["device -> CPU backend"] = x.nbytes / median_time(to_cpu, 3)
    y = to_cpu()
    to_dev = lambda: jax.block_until_ready(jax.device_put(y, dev))
    out["CPU backend -> device"] = x.nbytes / median_time(to_dev, 3)
    if dev.platform != "cpu":
        pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        out["device -> pinned host (device client)"] = x.nbytes / median_time(
            lambda: jax.block_until_ready(jax.device_put(x, pinned)), 3)
        z = jax.device_put(x, pinned)
        on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
        out["pinned host -> device (device client)"] = x.nbytes / median_time(
            lambda: jax.block_until_ready(jax.device_put(z, on_dev)), 3)
    return {k: v / 1e9 for k, v in out.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=1e9)
    p.add_argument("--slices", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device-seconds", type=float, default=0.25,
                   help="length of the device program run beside the host update")
    p.add_argument("--device-size", type=int, default=4096,
                   help="the device program's matrices are this square")
    p.add_argument("--engine-update", type=float, default=50e6,
                   help="params of the engine's own offloaded update, 0: not")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    params, res = int(a.params), {"params": int(a.params), "cores": os.cpu_count(),
                                  "device": str(jax.devices()[0].device_kind),
                                  "jax": jax.__version__}
    moved = params * BYTES_PER_PARAM
    res["copy_GBps"] = {t: copy_bandwidth(moved, t) / 1e9 for t in sorted({1, os.cpu_count()})}
    print("copy GB/s", res["copy_GBps"], flush=True)
    opt = optax.adamw(1e-3, weight_decay=0.1)
    res["host_update"] = {}
    best = None
    for s in a.slices:
        before = rss()
        upd = HostUpdate(params, s, opt)
        jax.block_until_ready((upd.master, upd.state, upd.grads))
        state = rss() - before
        for mode in ("dispatch", "threads") if s > 1 else ("dispatch",):
            exact = reset_peak()
            start = rss()
            t = median_time(lambda upd=upd, mode=mode: upd.run(mode), a.repeats)
            key = f"{s} slice(s), {mode}"
            # the update's working memory beyond its state (in place: only the bf16 output)
            res["host_update"][key] = {"ms": t * 1e3, "GBps": moved / t / 1e9,
                                       "state_GB": state / 1e9,
                                       "peak_extra_over_state": (peak() - start) / max(state, 1),
                                       "peak_exact": exact}
            print(key, res["host_update"][key], flush=True)
            if best is None or t < best[0]:
                best = (t, s, mode)
        if s != a.slices[-1]:
            upd = None  # its host state freed before the next one is made
    if best[1] != a.slices[-1]:
        upd = HostUpdate(params, best[1], opt)
    work = device_work(a.device_seconds, a.device_size)
    t_dev = median_time(lambda: work().block_until_ready(), a.repeats)
    t_host = best[0]
    mode = best[2]
    # How long the device program's call holds the calling thread (its dispatch): where the
    # device runs a loop driven from the host, the call returns only near its end.
    calls = []
    dispatch = median_time(lambda: calls.append(work()), a.repeats)
    jax.block_until_ready(calls)

    def device_first():
        r = work()
        upd.run(mode)
        r.block_until_ready()

    host = ThreadPoolExecutor(1)

    def host_first():
        f = host.submit(upd.run, mode)  # the host update from a thread of its own, then the step
        work().block_until_ready()
        f.result()

    t_df = median_time(device_first, a.repeats)
    t_hf = median_time(host_first, a.repeats)
    host.shutdown()
    res["overlap"] = {"device_ms": t_dev * 1e3, "device_dispatch_ms": dispatch * 1e3,
                      "host_ms": t_host * 1e3, "host_update": f"{best[1]} slice(s), {mode}",
                      "device_first_ms": t_df * 1e3, "host_first_ms": t_hf * 1e3,
                      "device_first_over_max": t_df / max(t_dev, t_host),
                      "host_first_over_max": t_hf / max(t_dev, t_host),
                      "sum_ms": (t_dev + t_host) * 1e3}
    print("overlap", res["overlap"], flush=True)
    upd = None
    res["transfer_GBps"] = transfers(params)
    print("transfers GB/s", res["transfer_GBps"], flush=True)
    if a.engine_update:
        import update_bench  # noqa: E402 -- the engine's offloaded update
        r = update_bench.measure(int(a.engine_update), a.repeats, donate=(True,))
        res["engine_update"] = {k: {"GBps": v["bytes_per_s"] / 1e9, "ms": v["median_s"] * 1e3}
                                 for k, v in r["update"].items()}
        print("engine", res["engine_update"], flush=True)
    write_json(a.out, res)
    return res


def write_json(path: Path | None, res: dict) -> None:
    """`res` as JSON at `path` (its folder made), when a path is given."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
