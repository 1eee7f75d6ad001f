"""ZeRO-Offload's step: `ZeroConfig(offload="optimizer")`; meshes.py says where its state
lives (the host mesh), twin_flow.py which leaves stay on the devices.

A step is three programs, dispatched in order and run asynchronously:

  gradients  device mesh: forward, backward and reduction (`step.local_grads`); the reduced
             gradient shard ends in host memory, per unit inside the backward at stages 2-3
             (`step.per_unit`), in its reduction dtype (Twin-Flow's share stays in device
             memory, for the devices' update)
  update     host mesh: unscaling, clipping, optax and the loss-scale skip (the step's own
             `ShardedUpdate`; a zerojax.adamw's as one fused pass per leaf, fused.py) on
             the donated master and optimizer state, so in place, one partition per CPU
             device; out come the compute-dtype shards
  refresh    device mesh: the compute params from those shards (a cast at stage 3, one
             all_gather per layer at stages 1-2, into the donated compute params)

The update is the CPU backend's own program, not a host computation inside the device's
program: measured on an H100's host (docs/performance.md), the latter got fresh output buffers
(a host peak of 2.17x the state) and ran at a third of the former's bandwidth.

With `delayed_update` (delayed.py) the update of the previous step's gradient is dispatched
before this step's gradients program, which runs on the params without it, so the CPU backend
updates while the devices compute; this step's gradient waits in host memory as the pending
update. It is dispatched from a thread of its own (`_beside`): XLA:CPU runs a program its cost
analysis deems cheap (under 1,000 flops: a fused pass's, whose custom call counts none) inline,
to its end, on the thread that calls it, which would hold the gradients program back until the
host is done.
"""

from __future__ import annotations

import math
import weakref
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.mesh import put_global
from zerojax.offload.delayed import DelayedUpdate
from zerojax.offload.meshes import OnMeshes, crosses, host_mesh, twins
from zerojax.offload.moves import HostMoves
from zerojax.offload.programs import HostPrograms
from zerojax.offload.side_by_side import RUNS, Sending, SideBySide
from zerojax.offload.twin_flow import HOSTED, Homes
from zerojax.step import learning_rate
from zerojax.update.parts import runs


class HostOffload(Homes, DelayedUpdate, HostPrograms, HostMoves):
    """An engine's offload (`Engine._offload`): its state's homes, its programs and its step;
    with `delayed_update` (`Engine._delay`), which one a state's next step runs."""

    def __init__(self, engine):
        self.engine = engine
        self.mesh = host_mesh(engine.mesh)
        self._twins = (twins(engine.mesh, self.mesh), twins(self.mesh, engine.mesh))  # down, up
        self._crosses = crosses(self._twins[0])  # a GPU's mesh and the CPU's: by shard
        self.k = engine.config.delayed_update
        self.fraction = engine.config.offload_fraction
        self._order: list[int] = []  # the params' order in the update's parts (`_parted`)
        self._side_by_side = SideBySide()  # the host's parts, each from a thread of its own
        self._sending = Sending()  # a fused update's runs, each one's shards up as it ends
        self._sends = self.mesh != engine.mesh  # the host mesh apart: a move is a copy
        self.runs = RUNS  # a sent fused update's parts, about (1: none sent, the upload after)
        self._last = (lambda: None, 0)  # (weak ref to the last stepped state's `step`, its value)
        self._thread: ThreadPoolExecutor | None = None  # the delayed update's (`_beside`)

    # ------------------------------------------------------------ what the engine asks

    def abstract(self, state):
        """`Engine.abstract_state`'s shapes as this tier's state holds them."""
        return state

    def check_logical(self, state):
        """`Engine.logical`'s check of a state (the NVMe tier refuses its placeholders)."""

    def saveable(self, state):
        """`Engine.saveable`: with delayed_update, the pending update applied."""
        return self.settled(state) if self.k is not None else state

    def host_update(self) -> str:
        """`Engine.host_update`: "fused" or "xla: <why not fused>"."""
        self.engine.layout  # noqa: B018 -- raises a clear error before init
        fused, why = self.fused()
        return "fused" if fused is not None else f"xla: {why}"

    def read(self, field: str, state):
        """A hosted field of `state` ("master" or "opt_state"), with a pending update applied,
        on the devices' mesh in device memory: what `Engine.params` and `optimizer_state`
        read, as without offload."""
        value = self.applied(state)[HOSTED.index(field)] if self.k is not None else \
            getattr(state, field)
        homes = getattr(self.engine.view_shardings(), field)
        return self.to_devices(value, jax.tree.map(lambda s: s.with_memory_kind("device"),
                                                   homes))

    def evaluated(self, state):
        """What `Engine.evaluate` reads of `state`: the devices' part, with a pending update
        applied to its compute params."""
        if self.k is not None:
            state = state._replace(compute=self.applied_compute(state))
        return self.device_part(state)

    # ------------------------------------------------------------ the state, built

    def built(self, build, args, homes, sink=None):
        """The state `build(*args)` makes, each part by a program of the mesh it lives on: the
        master, optimizer state (and pending update) by the host mesh's, the rest by the
        devices', and the compute params from the new master's compute-dtype shards by the
        step's refresh. So the host state is never in the devices' memory, nor in the pinned
        host memory that XLA:GPU's pool keeps once it has held it; the host's program runs in
        parts (`_by_parts`), so its temporaries are a part's, not the state's. (XLA compiles
        the params' random draw per program, so a draw may round otherwise in its last bits
        than the one-program build's; from given params, as `init_from`, the two builds are
        bitwise the same.) `homes`: per argument, its shardings on the devices' mesh (given
        params: 1/N per device), which the host's program reads it by on its own mesh; None:
        replicated. `sink` (the NVMe tier's): takes each hosted leaf not Twin-Flow's as its
        part is done, by its index among them, and gives what the state holds in its place;
        the state is then `sink.done(state)`, not refreshed here (the parts' programs run on
        CPU devices too)."""
        eng, arg_homes = self.engine, homes
        homes = eng.state_shardings()
        if self.mesh is eng.mesh and sink is None:  # CPU devices: one program, as without offload
            return jax.jit(build, out_shardings=homes)(*put_global(args, arg_homes, self.mesh))

        # The hosted fields' leaves, and which of them Twin-Flow keeps on the devices.
        fields = lambda st: tuple(getattr(st, f) for f in HOSTED)
        flat_homes, tree = jax.tree.flatten(fields(homes))
        kept = [h.mesh is not self.mesh for h in flat_homes]

        def host(*a):
            return [x for x, k in zip(tree.flatten_up_to(fields(build(*a))), kept) if not k]

        def device(*a):  # the params' computation is dead code here but for Twin-Flow's
            state = build(*a)
            mine = [x for x, k in zip(tree.flatten_up_to(fields(state)), kept) if k]
            state = self.device_part(state)
            return state._replace(compute=jax.tree.map(jnp.zeros_like, state.compute)), mine

        # Each argument on the host mesh as `homes` places it on the devices' (given params
        # 1/N per host device), else replicated.
        twin = lambda s: NamedSharding(self.mesh, s.spec)
        on_host = tuple(None if h is None else jax.tree.map(twin, h) for h in arg_homes)
        hosted = iter(_by_parts(host, put_global(args, on_host, self.mesh),
                                [h for h, k in zip(flat_homes, kept) if not k], sink))
        if any(kept):  # Twin-Flow's share is built from the params on the devices, 1/N each
            args = put_global(args, arg_homes, eng.mesh)
        state, mine = jax.jit(device, out_shardings=(
            self.device_part(homes), [h for h, k in zip(flat_homes, kept) if k]))(*args)
        mine = iter(mine)
        built = tree.unflatten([next(mine) if k else next(hosted) for k in kept])
        state = state._replace(**dict(zip(HOSTED, built, strict=True)))
        return self._refreshed(state) if sink is None else sink.done(state)

    def _refreshed(self, state):
        """`state` with its compute params made from its master's compute-dtype shards by the
        step's refresh (into `state.compute`, donated)."""
        master, on = jax.tree.leaves(state.master), self.on_devices("master")
        shards = [None] * len(master)
        cast = jax.jit(lambda m: [x.astype(self.engine.plan.dtype) for x in m])
        for side in ([i for i in range(len(master)) if i not in on], sorted(on)):
            for i, x in zip(side, cast([master[i] for i in side]) if side else []):
                shards[i] = x  # on the mesh its master leaf lives on
        return state._replace(compute=self._compute_of(self.up(shards), state.compute))

    def from_logical(self, build, tree, loss_scale: bool, owned: bool):
        """The state `build(tree)` makes from a logical tree, each part by a program of the
        mesh it lives on (`OnMeshes`): the master and optimizer state from the params and
        optimizer state on the host mesh (restore reads them there; Twin-Flow's share moves
        on to the devices), the rest on the devices'; the compute params, unless the tree
        holds those the next step runs on ("delayed"), from the new master as `built` makes
        them. So a restore of a model larger than the devices' memory never holds its master
        and moments there. `loss_scale`: `build`'s (part of what its programs are cached by);
        `owned`: the tree's arrays are freed as their programs are done (a restore's, which
        then holds the logical tree beside the new state a part at a time: about 1/PARTS)."""
        eng = self.engine
        target = self.read_target(eng.logical_target(delayed="delayed" in tree))
        tree = put_global(tree, jax.tree.map(lambda t: t.sharding, target), eng.mesh)
        lagging = eng._delay is not None and "delayed" in tree
        homes = eng.state_shardings()
        if not lagging:
            homes = homes._replace(compute=None)

        def make():
            return OnMeshes(build if lagging else lambda t: build(t)._replace(compute=None),
                            homes, parts=PARTS, least=RESTORE_LEAST, free=owned)

        key = ("from_logical", lagging, loss_scale, owned, jax.tree.structure(tree))
        state = self._cached(key, make)(tree)
        if lagging:
            return state
        shapes = eng.abstract_state().compute
        compute = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes),
                          out_shardings=eng.state_shardings().compute)()
        return self._refreshed(state._replace(compute=compute))

    def read_target(self, target: dict) -> dict:
        """A logical target (`Engine.logical_target`) with its params and optimizer state on
        the host mesh, where a restore reads them and builds the master and moments."""
        host = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
            self.mesh, x.sharding.spec))
        return dict(target, params=jax.tree.map(host, target["params"]),
                    opt_state=jax.tree.map(host, target["opt_state"]))

    # ------------------------------------------------------------ a step's results

    def _compute_of(self, shards, old, donate: bool = True):
        """The compute params from the compute-dtype shards on the devices' mesh: at stage 3
        the shards themselves (the refresh there is a cast to the dtype they have: one
        program and a copy of the params a step, for nothing), else the refresh (an
        all_gather per layer into `old`, donated)."""
        eng = self.engine
        if eng.config.stage != 3:
            return self._refresh_fn(donate)(shards, old)
        # (a no-op where a shard is on its home already: device_put returns it)
        return eng.layout.unflatten(jax.device_put(list(shards),
                                                   jax.tree.leaves(eng.state_shardings().compute)))

    def _update(self, reduced, state, donate: bool, send: bool = False):
        """(master, optimizer state, compute-dtype shards, {"lr"?}) of the update of `reduced`;
        `send` (a step's): where the host mesh is apart from the devices' (a GPU's host) and
        `runs` (`side_by_side.RUNS`) > 1, a fused update runs in about `runs` parts, and each part's
        shards are put on the devices as it ends (`Sending`), while the next part updates."""
        grads, *scalars = reduced
        # The gradient's buffer takes the shards where their dtypes agree.
        same = {g.dtype for g in jax.tree.leaves(grads)} == {self.engine.plan.dtype}
        finite, gdtypes = scalars[2] is not None, [g.dtype for g in jax.tree.leaves(grads)]
        fused = self.fused()[0] is not None
        send = send and fused and self._sends and self.runs > 1
        if fused and not self.split()[0] and not send:  # one pass per leaf, on every thread
            self._order = []
            fn = self._update_fn(donate, finite, same, fused=True)
            return fn(self._host_scalars(scalars), state.master, state.opt_state, grads)
        if send or self.split()[0] or len(self.engine.plan.update.parts(finite, gdtypes)) > 1:
            return self._parted(scalars, state, grads, donate, same, send)
        fn = self._update_fn(donate, finite, same)
        return fn(self._host_scalars(scalars), state.master, state.opt_state, grads)

    def _parted(self, scalars, state, grads, donate: bool, same: bool, send: bool = False):
        """`_update` as its parts (update/parts.py): Twin-Flow's on the devices first, then the
        host's, side by side, each dispatched from a thread of its own (`SideBySide`); with
        `send` (a fused pass's), the host's in turn, the largest first, each one's shards put on
        the devices as it ends (`Sending`)."""
        master, opt = jax.tree.leaves(state.master), jax.tree.leaves(state.opt_state)
        g = jax.tree.leaves(grads)
        finite = scalars[2] is not None
        # with the fused pass, the host's leaves in one part (the pass runs on every thread),
        # or in `runs` to send
        fused = self.fused()[0] is not None
        host_parts = (self.runs if send else 1) if fused else None
        parts = self._parts_fn(donate, finite, tuple(x.dtype for x in g), same,
                               host_parts=host_parts, fused=fused)
        sharded = self.engine.plan.update.sharded
        shared = [opt[j] for j, s in enumerate(sharded) if not s]
        new_master, new_opt, shards = [None] * len(master), list(opt), [None] * len(master)
        # the scalars and the replicated state leaves (small) where each part runs
        here = {False: (tuple(x for x in self._host_scalars(scalars) if x is not None), shared)}
        if parts[0][0].on_device:
            mesh = self.engine.mesh
            here[True] = (tuple(x for x in self._host_scalars(scalars, mesh) if x is not None),
                          jax.device_put(shared, NamedSharding(mesh, P())))
        args = [(*here[part.on_device], [master[i] for i in part.params],
                 [opt[j] for j in part.owned], [g[i] for i in part.params]) for part, _ in parts]
        device = [fn(*a) for (part, fn), a in zip(parts, args) if part.on_device]
        if send:
            host = self._sent(parts, args)
        else:
            host = self._side_by_side([(fn, a, self.mesh.size) for (part, fn), a
                                       in zip(parts, args) if not part.on_device])
        for (part, _), (m, o, s) in zip(parts, device + host, strict=True):
            for i, a, b in zip(part.params, m, s, strict=True):
                new_master[i], shards[i] = a, b
            for j, x in zip(sorted((*part.owned, *part.writes)), o, strict=True):
                # a replicated leaf the devices' part wrote goes back to the host mesh
                new_opt[j] = jax.device_put(x, NamedSharding(self.mesh, P())) \
                    if part.on_device and j in part.writes else x
        new_opt = jax.tree.unflatten(jax.tree.structure(state.opt_state), new_opt)
        self._order = [i for part, _ in parts for i in part.params if not part.on_device]
        lr = learning_rate(new_opt)
        return (jax.tree.unflatten(jax.tree.structure(state.master), new_master), new_opt,
                shards, {} if lr is None else {"lr": lr})

    def step(self, state, batch):
        """One offloaded step; donates `state`."""
        if isinstance(state.step, jax.core.Tracer):
            raise NotImplementedError(
                "engine.step with offload runs a program on the devices and one on the host's "
                "CPU devices, which an outer jax.jit or scan cannot hold; call engine.step "
                "outside jit (each call dispatches its programs asynchronously)")
        delayed = self._delays(state)
        n = self._last[1]
        if delayed:  # dispatched first: the host updates while the devices compute
            applied = self._beside(tuple(state.pending), state)
        new, reduced, metrics = self._grads_fn()(self.device_part(state), batch)
        grads, *scalars = reduced
        grads = jax.tree.unflatten(jax.tree.structure(grads), self.down(jax.tree.leaves(grads)))
        if delayed:
            master, opt_state, shards, lr = applied.result()
            pending = self._store(grads, scalars)
        else:
            master, opt_state, shards, lr = self._update((grads, *scalars), state, True,
                                                         send=True)
            pending = state.pending
        compute = self._compute_of(self.up(shards), state.compute)
        metrics.update(jax.device_put(lr, NamedSharding(self.engine.mesh, P())))
        new = new._replace(master=master, opt_state=opt_state, compute=compute, pending=pending)
        if self.k is not None:
            self._last = (weakref.ref(new.step), n + 1)
        return new, metrics


PARTS = 16  # the host build's outputs in about this many programs (init, restore)
RESTORE_LEAST = 1 << 28  # a mesh's restored bytes at least for parts: below, one program


def _by_parts(fn, args, shardings, sink=None):
    """`jax.jit(fn, out_shardings=shardings)(*args)` as a few programs, each giving a run of
    consecutive output leaves of about 1/PARTS of the output bytes (or one leaf): XLA drops
    what a part's leaves do not need, so a part's temporaries (the random draw of the params
    it holds) are about its own size. As one program, XLA:CPU held temporaries as large as the
    state itself (0.97x the host state, small8 preset, measured from `memory_analysis`).
    `sink(i, x)`: what the output holds for leaf i, called as its part is done."""
    shapes, tree = jax.tree.flatten(jax.eval_shape(fn, *args))
    homes = tree.flatten_up_to(shardings)
    out = [None] * len(shapes)
    for part in runs([math.prod(x.shape) * getattr(x.dtype, "itemsize", 8) for x in shapes],
                     PARTS):
        def some(*a, part=part):
            flat = jax.tree.leaves(fn(*a))
            return [flat[i] for i in part]

        for i, x in zip(part, jax.jit(some, out_shardings=[homes[i] for i in part])(*args),
                        strict=True):
            out[i] = x if sink is None else sink(i, x)
    return jax.tree.unflatten(tree, out)
