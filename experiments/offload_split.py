"""ZeRO-Offload with its update on the CPU backend: a prototype of the split step on one
device, timed against plain optax in the same run.

What `experiments/offload_overlap.py` measured on an H100 host decides the shape: the update
runs in place and fastest as donated programs of the host's own XLA:CPU over `--slices` flat
slices, each called from a thread of its own. So one step here is:

1. the device program: the loss and gradient at the compute-dtype params (held on the device
   as `--slices` flat slices), the gradient's global norm, the gradient as flat slices;
2. the slices go down to the CPU backend (`device_put` between the clients);
3. per slice, on a thread of its own: the clip (optax's `clip_by_global_norm` arithmetic, from
   the device's norm) and AdamW on the float32 master and moments, donated, in the CPU
   backend's memory; the new compute-dtype slice out;
4. the new slices go up to the device.

The run times both forms: the step above, and the delayed one (DeepSpeed's delayed parameter
update), where step t's gradient is taken at the params before step t-1's update while the
host computes that update: the host update is started first, from its threads, then the
device program. Then plain optax on the same batch, for the ratio.

AdamW is elementwise, so its update over flat slices is its update over the tree; an
optimizer that reads a whole leaf or the whole tree (LAMB's norms, Muon's matrices) needs the
engine's program split (`zerojax.update`), which this prototype does not have.

    .venv/bin/python experiments/offload_split.py --preset 1b --slices 15 --out runs/split.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # offload_overlap beside this file
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's zerojax

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402
from offload_overlap import peak, reset_peak, rss, write_json  # noqa: E402

from zerojax.models import GPT  # noqa: E402
from zerojax.units import PlainUnits  # noqa: E402

COMPUTE = jnp.bfloat16


def adamw(lr: float) -> optax.GradientTransformation:
    return optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=0.1)


def bounds(size: int, slices: int) -> list[tuple[int, int]]:
    edges = np.linspace(0, size, slices + 1).astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


class SplitOffload:
    """The split step's state and programs: the compute slices on the device, the float32
    master and AdamW state of each slice in the CPU backend's memory."""

    def __init__(self, model, params, slices: int, tx: optax.GradientTransformation,
                 clip: float, remat: bool, compute=COMPUTE):
        """`tx`: an elementwise optax transformation (AdamW here), run per slice."""
        self.dev, self.cpu = jax.devices()[0], jax.devices("cpu")[0]
        flat, self.unravel_master = ravel_pytree(params)
        _, self.unravel = ravel_pytree(jax.tree.map(lambda x: x.astype(compute), params))
        self.bounds = bounds(flat.size, slices)
        self.tx, self.clip = tx, clip
        flat = np.asarray(flat)
        put = lambda x: jax.device_put(x, self.cpu)
        self.master = [put(flat[a:b]) for a, b in self.bounds]
        self.opt = [jax.jit(self.tx.init)(m) for m in self.master]
        self.compute = [jax.device_put(flat[a:b].astype(compute), self.dev)
                        for a, b in self.bounds]
        self.pending = None  # the delayed update's gradient slices and norm, on the host
        units = PlainUnits(compute, remat)

        def grads(compute, batch):
            p = self.unravel(jnp.concatenate(compute))
            loss, g = jax.value_and_grad(lambda p: model.loss(p, batch, units))(p)
            flat_g, _ = ravel_pytree(g)
            norm = optax.global_norm(jax.tree.map(lambda x: x.astype(jnp.float32), g))
            return loss, norm, [flat_g[a:b] for a, b in self.bounds]

        def update(master, opt, g, norm):
            g = g.astype(jnp.float32)  # optax's clip_by_global_norm, from the device's norm
            g = jnp.where(norm < self.clip, g, g / norm * self.clip)
            updates, opt = self.tx.update(g, opt, master)
            master = optax.apply_updates(master, updates)
            return master, opt, master.astype(compute)

        self.grads = jax.jit(grads)
        self.update_fn = jax.jit(update, donate_argnums=(0, 1))
        self.pool = ThreadPoolExecutor(slices)
        self.driver = ThreadPoolExecutor(1)  # runs a delayed update's slices beside the step

    def _update_one(self, i, g, norm):
        self.master[i], self.opt[i], out = self.update_fn(self.master[i], self.opt[i], g, norm)
        return jax.block_until_ready(out)

    def host_update(self, gs, norm) -> list:
        """Every slice's update, one thread each; the new compute slices on the host."""
        return list(self.pool.map(lambda i: self._update_one(i, gs[i], norm), range(len(gs))))

    def _down(self, gs, norm):
        return [jax.device_put(g, self.cpu) for g in gs], jax.device_put(norm, self.cpu)

    def step(self, batch):
        """One step without the delay: the gradient, then its update; returns the loss."""
        loss, norm, gs = self.grads(self.compute, batch)
        out = self.host_update(*self._down(gs, norm))
        self.compute = [jax.device_put(o, self.dev) for o in out]
        return loss

    def delayed_step(self, batch):
        """One delayed step: the pending update on the host's threads, started first, beside
        the gradient at the params before it; returns the loss."""
        job = self.driver.submit(self.host_update, *self.pending) if self.pending else None
        loss, norm, gs = self.grads(self.compute, batch)
        jax.block_until_ready(gs)
        if job is not None:
            self.compute = [jax.device_put(o, self.dev) for o in job.result()]
        self.pending = self._down(gs, norm)
        return loss

    def params(self):
        """The master params with every update applied except a pending one, as a tree."""
        return self.unravel_master(jnp.asarray(np.concatenate([np.asarray(m)
                                                                for m in self.master])))

    def state_bytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves((self.master, self.opt)))


def plain_step(model, tx: optax.GradientTransformation, clip: float, remat: bool):
    """Plain optax on one device (bench.py's `optax_single`): the same clip and AdamW."""
    tx = optax.chain(optax.clip_by_global_norm(clip), tx)
    units = PlainUnits(COMPUTE, remat)

    def step(state, batch):
        params, opt = state
        loss, g = jax.value_and_grad(lambda p: model.loss(p, batch, units))(params)
        updates, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, updates), opt), loss

    return tx, jax.jit(step, donate_argnums=0)


def make_batch(model, batch: int, seed: int = 0) -> dict:
    c = model.cfg
    tokens = np.random.default_rng(seed).integers(0, c.vocab_size, (batch, c.seq_len + 1))
    tokens = tokens.astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def timed(fn, steps: int) -> tuple[float, list]:
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(jax.block_until_ready(fn()))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:] or times), [float(x) for x in losses]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="1b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--slices", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="timed steps after the first")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--no-remat", dest="remat", action="store_false")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    model = GPT.from_preset(a.preset)
    batch = jax.device_put(make_batch(model, a.batch), jax.devices()[0])
    params = jax.jit(model.init)(jax.random.key(0))
    res = {"preset": a.preset, "batch": a.batch, "slices": a.slices,
           "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "params": int(sum(x.size for x in jax.tree.leaves(params)))}
    split = SplitOffload(model, params, a.slices, adamw(a.lr), a.clip, a.remat)
    del params
    state = split.state_bytes()
    for mode in ("split", "split, delayed"):
        fn = split.delayed_step if "delayed" in mode else split.step
        fn(batch)  # compile
        reset_peak()
        start = rss()
        t, losses = timed(lambda fn=fn: fn(batch), a.steps + 1)
        res[mode] = {"median_ms": t * 1e3, "losses": losses,
                     "host_peak_beyond_state": (peak() - start) / state}
        print(mode, res[mode], flush=True)
    res["host_state_bytes"] = state
    split = None
    tx, step = plain_step(model, adamw(a.lr), a.clip, a.remat)
    params = jax.jit(model.init)(jax.random.key(0))
    st = (params, jax.jit(tx.init)(params))
    st, _ = step(st, batch)  # compile

    def plain():
        nonlocal st
        st, loss = step(st, batch)
        return loss

    t, losses = timed(plain, a.steps + 1)
    res["plain optax"] = {"median_ms": t * 1e3, "losses": losses}
    for mode in ("split", "split, delayed"):
        res[mode]["x_plain"] = res[mode]["median_ms"] / res["plain optax"]["median_ms"]
    print(json.dumps(res, indent=1), flush=True)
    write_json(a.out, res)
    return res


if __name__ == "__main__":
    main()
