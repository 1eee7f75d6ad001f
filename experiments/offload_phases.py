"""Where an offloaded step's time goes: the engine's own programs and moves (offload/host.py),
each timed alone and blocked, on a GPT preset, beside the whole step without and with the
delayed update and plain moves of `--move-gb` between the two backends.

A step of `ZeroConfig(offload="optimizer")` is: the devices' gradients program, the
gradient's move to the host mesh, the host's update, the compute-dtype shards' move back, and
the compute params made of them (at stage 3 the shards themselves, no program; it also says
which of the devices' memories the shards came up into). Run one by one here, their times say
which one binds; the step's own time says how much of them overlaps (the update runs as parts,
update/parts.py, side by side, each part's shards sent as it is done). The moves are timed
both ways jax can make them between two backends: a sharded `device_put`, and shard by shard
(`offload.across`, what the engine uses).
The gradients program is also timed beside a load on every core of the host that computes in
cache, and beside one that copies through memory: which of the host's cores (some thread
launches the devices' work) or its memory bandwidth (the backward's copies to host memory)
the update takes from the devices, when the delayed step overlaps the two.
And the engine's own delayed step as a timeline: when the call to each of its programs and
moves returned and when its result was ready, from the step's call, beside when the step
returned.
Last, the offloaded run's params against the run without offload on a small preset, so a
wrong move or a wrongly aliased buffer between the backends shows as a number.

    .venv/bin/python experiments/offload_phases.py --preset 1b --batch 8 --out runs/phases.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's zerojax

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.mesh import put_batch  # noqa: E402
from zerojax.models.gpt import GPT, PRESETS  # noqa: E402
from zerojax.offload.meshes import across, host_mesh, twins  # noqa: E402

SEND_RUNS = 4  # the "in parts" form of `sent`: the fused update's parts whose shards it sends


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=3, help="timed repeats of each phase and step")
    p.add_argument("--move-gb", type=float, default=1.0, help="bytes of the plain moves, GB")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    return p.parse_args(argv)


def timed(fn, repeats: int) -> tuple[float, object]:
    """(median seconds of `fn()` blocked, its last result)."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def engine(preset: str, batch: int, delayed: int | None):
    model = GPT.from_preset(preset)
    mesh = zj.make_mesh(data=1, devices=jax.devices()[:1])
    cfg = zj.ZeroConfig(stage=3, param_dtype="bfloat16", remat=True, clip_norm=1.0,
                        offload="optimizer", delayed_update=delayed)
    eng = zj.Engine(model, zj.adamw(1e-4), mesh, cfg)
    tokens = np.random.default_rng(0).integers(
        0, model.cfg.vocab_size, (batch, model.cfg.seq_len + 1), dtype=np.int32)
    data = put_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh)
    return eng, eng.init(jax.random.key(0), data), data


def clock(fn, *args) -> tuple[float, object]:
    """(seconds, result) of `fn(*args)`, blocked."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0, out


def phases(eng, state, batch, repeats: int) -> tuple[dict, object]:
    """Each program and move of an ordinary offloaded step, alone; the state stepped."""
    h = eng._offload
    out = {}
    for _ in range(repeats):
        t = {}
        t["gradients program"], (new, reduced, _) = clock(h._grads_fn(), h.device_part(state),
                                                          batch)
        grads, *scalars = reduced
        t["gradient to the host mesh"], leaves = clock(h.down, jax.tree.leaves(grads))
        grads = jax.tree.unflatten(jax.tree.structure(grads), leaves)
        t["host update"], (master, opt_state, shards, _) = clock(
            h._update, (grads, *scalars), state, True)
        t["shards to the devices"], shards = clock(h.up, shards)
        out["shard memory"] = sorted({str(p.data.sharding.memory_kind) for x in shards
                                      for p in x.addressable_shards})
        # stage 3: the shards themselves (no program); stages 1-2: the refresh's gathers
        t["compute params"], compute = clock(h._compute_of, shards, state.compute)
        state = new._replace(master=master, opt_state=opt_state, compute=compute,
                             pending=state.pending)
        for k, v in t.items():
            out.setdefault(k, []).append(v)
    kinds = out.pop("shard memory")
    return {k: statistics.median(v) for k, v in out.items()}, kinds, state


def sent(eng, state, batch, repeats: int) -> tuple[dict, object]:
    """The step's host update as a step runs it (`_update(..., send=True)`), in two forms,
    interleaved: "in parts", on a GPU's host a fused update in about SEND_RUNS parts, each
    part's shards put on the devices as it ends (`side_by_side.Sending`), timed to the last one
    there; "in one part", `runs` 1 (the engine's default, `side_by_side.RUNS`: the upload after the
    whole update). Against `phases`' update and move up, one after the other. Each repeat
    updates a fresh gradient (its program not timed)."""
    h = eng._offload
    times: dict = {}
    forms, was = {"in parts": SEND_RUNS, "in one part": 1}, h.runs

    def update(reduced, state):
        master, opt_state, shards, _ = h._update(reduced, state, True, send=True)
        return master, opt_state, h.up(shards)  # (what it did not send)

    try:
        for _ in range(repeats):
            for name, runs in forms.items():
                h.runs = runs
                new, (grads, *scalars), _ = h._grads_fn()(h.device_part(state), batch)
                grads = jax.tree.unflatten(jax.tree.structure(grads),
                                           h.down(jax.tree.leaves(grads)))
                jax.block_until_ready(grads)
                t, (master, opt_state, shards) = clock(update, (grads, *scalars), state)
                times.setdefault(name, []).append(t)
                state = new._replace(master=master, opt_state=opt_state, pending=state.pending,
                                     compute=h._compute_of(shards, state.compute))
    finally:
        h.runs = was
    return {k: statistics.median(v) for k, v in times.items()}, state


def together(eng, state, batch, repeats: int) -> tuple[dict, object]:
    """The delayed step's overlap as it dispatches it: the host's update of the last gradient
    (from a thread of its own, `_beside`; its parts side by side, the state donated), then the
    devices' gradients program, each timed from the dispatch to when its own result is ready.
    Against `phases`' times of each alone: a gradients program slower beside the update says
    the two compete (for the host's cores, which also launch the devices' work, or its memory
    bandwidth, which the backward's copies to host memory share). The first of `repeats` + 1
    is not counted: `_beside`'s first call is the caller's own."""
    h = eng._offload
    _, reduced, _ = h._grads_fn()(h.device_part(state), batch)
    out = {}
    for i in range(repeats + 1):
        grads, *scalars = reduced
        grads = jax.tree.unflatten(jax.tree.structure(grads), h.down(jax.tree.leaves(grads)))
        jax.block_until_ready(grads)
        t0 = time.perf_counter()
        applied = h._beside((grads, *scalars), state)
        _, reduced, _ = h._grads_fn()(h.device_part(state), batch)
        jax.block_until_ready(reduced)
        beside = time.perf_counter() - t0
        master, opt_state, shards, _ = jax.block_until_ready(applied.result())
        if i:
            out.setdefault("gradients, beside the update", []).append(beside)
            out.setdefault("update, beside the gradients", []).append(time.perf_counter() - t0)
        state = state._replace(master=master, opt_state=opt_state)
    return {k: statistics.median(v) for k, v in out.items()}, state


class Load:
    """Every core of the host kept busy by programs of the CPU backend until the block ends,
    one thread each (the CPU backend runs one thread's programs one after another): `kind`
    "compute" loops over 64 KB, in cache; "memory" updates 64 MB in place (donated), through
    memory. The block starts once each thread has run its program."""

    def __init__(self, kind: str, threads: int | None = None):
        self.threads = threads or os.cpu_count() or 1
        if kind == "compute":
            self.size = 1 << 14
            self.fn = jax.jit(lambda x: jax.lax.fori_loop(
                0, 2000, lambda i, y: y * 1.0001 + 1e-7, x))
        else:
            self.size = 16 << 20
            self.fn = jax.jit(lambda x: x * 1.0001 + 1e-7, donate_argnums=0)
        self.cpu = jax.devices("cpu")[0]
        jax.block_until_ready(self.fn(self._array()))  # compiled here, not in the threads

    def _array(self):
        return jax.device_put(jnp.zeros((self.size,), jnp.float32), self.cpu)

    def _run(self):
        x = self._array()
        x = jax.block_until_ready(self.fn(x))
        self._started.release()
        while not self._stop.is_set():
            x = jax.block_until_ready(self.fn(x))

    def __enter__(self):
        self._stop, self._started = threading.Event(), threading.Semaphore(0)
        self._pool = [threading.Thread(target=self._run, daemon=True)
                      for _ in range(self.threads)]
        for t in self._pool:
            t.start()
        for _ in self._pool:
            self._started.acquire()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._pool:
            t.join()


def under_load(eng, state, batch, repeats: int) -> dict:
    """The gradients program timed (median, blocked) beside each `Load`: against its time
    alone (`phases`), a program slower beside the computing load says the devices wait for a
    core of the host; slower beside the copying one, for its memory bandwidth."""
    h = eng._offload
    part = h.device_part(state)
    out = {}
    for kind in ("compute", "memory"):
        with Load(kind) as load:
            s, _ = timed(lambda: h._grads_fn()(part, batch)[1], repeats)
        doing = "computing" if kind == "compute" else "copying"
        out[f"gradients, beside {load.threads} threads {doing}"] = s
    return out


def timeline(eng, state, batch, steps: int) -> tuple[list, object]:
    """The engine's own steps (`eng.step`), each program and move of them recorded as
    (name, ms from the step's call to the return of its own call (a program's dispatch; a
    move's, which may wait for what it moves; the host update's hand-off to its thread,
    `_beside`), ms to its result being ready); the last rows
    "step returned" and "step ready". Medians over `steps`. A watcher thread per result waits
    for it, so nothing in the step waits more than it would (and sees it ready as it wakes: a
    little late, where the host's cores are busy)."""
    h = eng._offload
    clock = {"t0": 0.0}
    rows: list = []
    watchers: list = []

    def watch(name, out):
        row = [name, 1e3 * (time.perf_counter() - clock["t0"]), None]
        rows.append(row)

        def wait():
            jax.block_until_ready(out.result()[:3] if isinstance(out, Future) else out)
            row[2] = 1e3 * (time.perf_counter() - clock["t0"])

        watchers.append(threading.Thread(target=wait, daemon=True))
        watchers[-1].start()
        return out

    grads_fn = h._grads_fn
    orig = {n: getattr(h, n) for n in ("_beside", "down", "up", "_compute_of")}
    names = {"_beside": "host update", "down": "gradient to the host mesh",
             "up": "shards to the devices", "_compute_of": "compute params"}

    def recorded(n):
        def run(*a, **k):
            return watch(names[n], orig[n](*a, **k))
        return run

    def grads():
        fn = grads_fn()
        return lambda *a: watch("gradients program", fn(*a))

    table: dict = {}
    try:
        for n in orig:
            setattr(h, n, recorded(n))
        h._grads_fn = grads
        for _ in range(steps):
            rows.clear()
            watchers.clear()
            clock["t0"] = time.perf_counter()
            state, m = eng.step(state, batch)
            returned = 1e3 * (time.perf_counter() - clock["t0"])
            jax.block_until_ready((state, m))
            ready = 1e3 * (time.perf_counter() - clock["t0"])
            for w in watchers:
                w.join()
            for name, at, done in [*rows, ["step returned", returned, returned],
                                   ["step ready", ready, ready]]:
                table.setdefault(name, []).append((at, done))
    finally:
        for n in (*orig, "_grads_fn"):
            h.__dict__.pop(n, None)  # the class's own methods again
    med = statistics.median
    return [(name, med([a for a, _ in v]), med([d for _, d in v]))
            for name, v in table.items()], state


def parity(preset: str = "test", steps: int = 4) -> float:
    """The offloaded run's params against the run without offload on the same batches, as
    their distance relative to how far the run moved them (stage 3, float32 compute: on a GPU
    the two updates are compiled by different backends, so they agree to rounding, not
    bitwise). The offloaded run is saved and restored halfway, so the restore's move to the
    host mesh is in the figure too."""
    model = GPT.from_preset(preset)
    mesh = zj.make_mesh(data=1, devices=jax.devices()[:1])
    tokens = np.random.default_rng(1).integers(
        0, model.cfg.vocab_size, (steps, 2, model.cfg.seq_len + 1), dtype=np.int32)
    batches = [put_batch({"inputs": t[:, :-1], "targets": t[:, 1:]}, mesh) for t in tokens]
    out = []
    for offload in (None, "optimizer"):
        eng = zj.Engine(model, zj.adamw(1e-3), mesh,
                        zj.ZeroConfig(stage=3, clip_norm=1.0, offload=offload))
        state = eng.init(jax.random.key(0), batches[0])
        start = eng.params(state)
        for i, b in enumerate(batches):
            if offload and i == steps // 2:
                with tempfile.TemporaryDirectory() as d:
                    eng.save(state, d)
                    state = eng.restore(d)
            state, _ = eng.step(state, b)
        out.append((start, eng.params(state)))
    flat = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float64))
                                     for x in jax.tree.leaves(t)])
    (start, ref), (_, got) = out
    return float(np.linalg.norm(flat(got) - flat(ref)) / np.linalg.norm(flat(ref) - flat(start)))


def moves(gb: float, repeats: int) -> dict:
    """Plain moves of `gb` GB of float32 between the first device and its CPU twin, both ways,
    as a sharded `device_put` and shard by shard; the first device's own pinned host memory
    where it has one."""
    mesh = zj.make_mesh(data=1, devices=jax.devices()[:1])
    host = host_mesh(mesh)
    n = int(gb * 1e9) // 4
    kind = "pinned_host" if mesh.devices.flat[0].platform != "cpu" else None
    x = jax.device_put(np.ones(n, np.float32), NamedSharding(mesh, P(), memory_kind=kind))
    down, up = NamedSharding(host, P()), NamedSharding(mesh, P())
    res = {}
    for name, by_shard in (("sharded device_put", False), ("shard by shard", True)):
        s, y = timed(lambda b=by_shard: across([x], [down], twins(mesh, host), b), repeats)
        res[f"to the host mesh, {name}"] = s
        s, _ = timed(lambda b=by_shard, y=y: across(y, [up], twins(host, mesh), b), repeats)
        res[f"to the devices, {name}"] = s
    return {"bytes": 4 * n, "seconds": res}


def write_json(path: Path | None, res: dict) -> None:
    """`res` as JSON at `path` (its folder made), when a path is given."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1))


def main(argv=None) -> dict:
    args = parse_args(argv)
    res = {"device": jax.devices()[0].device_kind, "preset": args.preset, "batch": args.batch}
    eng, state, batch = engine(args.preset, args.batch, None)
    state, _ = eng.step(state, batch)  # compiled and warm
    res["phases_s"], res["shard_memory"], state = phases(eng, state, batch, args.steps)
    res["together_s"], state = together(eng, state, batch, args.steps)
    res["under_load_s"] = under_load(eng, state, batch, args.steps)
    res["sent_s"], state = sent(eng, state, batch, args.steps)
    fused, sends = eng.host_update == "fused", eng._offload._sends
    res["update_parts"] = len(eng.plan.update.parts(False, [eng.plan.rdtype] * len(
        eng.layout.leaves), host_parts=SEND_RUNS if fused else None)) if sends or not fused else 1
    for _ in range(args.steps):  # each step donates the state: stepped on, not repeated
        t0 = time.perf_counter()
        state, m = jax.block_until_ready(eng.step(state, batch))
        res.setdefault("steps_s", []).append(time.perf_counter() - t0)
    res["step_s"] = statistics.median(res.pop("steps_s"))
    del state
    eng, state, batch = engine(args.preset, args.batch, 0)
    times = []
    for _ in range(args.steps + 2):  # the first two: compile, then the first delayed step
        t0 = time.perf_counter()
        state, m = jax.block_until_ready(eng.step(state, batch))
        times.append(time.perf_counter() - t0)
    res["delayed_step_s"] = statistics.median(times[2:])
    res["delayed_timeline_ms"], state = timeline(eng, state, batch, args.steps)
    del state
    res["moves"] = moves(args.move_gb, args.steps)
    res["parity"] = parity()
    print(f"{res['device']}: {args.preset}, batch {args.batch}, offload stage 3 (medians, ms)")
    for k, v in res["phases_s"].items():
        print(f"  {k:<28}{1e3 * v:>9.1f}")
    print(f"  {'sum of the phases':<28}{1e3 * sum(res['phases_s'].values()):>9.1f}")
    how = ("each one's shards sent up as it ends" if fused and sends else
           "side by side, the shards up after" if not fused else "one program")
    alone = res["phases_s"]["host update"] + res["phases_s"]["shards to the devices"]
    print(f"  {'update and shards up':<28}{1e3 * res['sent_s']['in parts']:>9.1f}  (in "
          f"{res['update_parts']} part(s), {how}; in one part, the engine's default: "
          f"{1e3 * res['sent_s']['in one part']:.1f}; the two phases one after the other: "
          f"{1e3 * alone:.1f})")
    print(f"  (the shards came up into the devices' {', '.join(res['shard_memory'])} memory)")
    for k, v in res["together_s"].items():  # the delayed step's overlap, dispatched as it does
        print(f"  {k:<28}{1e3 * v:>9.1f}  (from the dispatch of both)")
    alone = 1e3 * res["phases_s"]["gradients program"]
    for k, v in res["under_load_s"].items():  # what the update could take from the devices
        print(f"  {k:<28}{1e3 * v:>9.1f}  (alone: {alone:.1f})")
    print(f"  {'the step':<28}{1e3 * res['step_s']:>9.1f}")
    print(f"  {'the delayed step':<28}{1e3 * res['delayed_step_s']:>9.1f}")
    print("  the delayed step's timeline (ms from its call: each call returned, its result "
          "ready)")
    for name, at, done in res["delayed_timeline_ms"]:
        print(f"    {name:<30}{at:>9.1f}{done:>9.1f}")
    gb = res["moves"]["bytes"] / 1e9
    for k, v in res["moves"]["seconds"].items():
        print(f"  {gb:.2f} GB {k:<36}{1e3 * v:>9.1f} ms  {gb / v:>7.2f} GB/s")
    print(f"  offload (saved and restored at step 2) against no offload, test preset, 4 steps: "
          f"distance {res['parity']:.2e} of the run's movement")
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
