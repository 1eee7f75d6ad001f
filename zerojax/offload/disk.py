"""ZeRO-Infinity's NVMe tier in the engine: `ZeroConfig(offload="optimizer",
offload_device="nvme", nvme_path=DIR)` (docs/nvme.md, "The engine tier").

The host tier's step (host.py) with its state's largest parts on disk: the host's share of the
fp32 master and of a `zerojax.adamw`'s moments live in this process's store (store.py), one
file per device shard, and the host's update is `StreamedAdamW` (nvme.py), one streamed pass
per leaf, in a shard_map over the host mesh whose shard index is the device's. In the
`TrainState` those leaves are placeholders (float32[0] on the host mesh, made for the store's
current contents); the optimizer state's counts (and a schedule's) stay ordinary leaves in
memory, stepped by the update's program as the host tier's.

Whatever reads the state whole reads it from the store, a leaf at a time: `Engine.params`,
`optimizer_state` and a save (`saveable`) build the master and moments on the host mesh from
the files, so a save holds the whole state in host memory while it runs (the checkpoint wing
writes one tree); `init` and `init_from` write each part of the state to the store as its
program is done (`_ToStore`; a small state on CPU devices whole), `restore` each leaf once
the state is built; the steps hold a few I/O buffers.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.errors import ConfigError, StateError
from zerojax.offload.disk_delayed import DryPasses
from zerojax.offload.fused import spec_of
from zerojax.offload.host import RESTORE_LEAST, HostOffload
from zerojax.offload.nvme import StreamedAdamW
from zerojax.offload.store import Store
from zerojax.offload.twin_flow import HOSTED


def offload_of(engine) -> HostOffload:
    """An offloading engine's offload (`Engine._offload`): the host tier, or with
    offload_device="nvme" its tier on disk."""
    return DiskOffload(engine) if engine.config.offload_device == "nvme" else \
        HostOffload(engine)


def disk_io(engine) -> dict | None:
    """An NVMe engine's store and its I/O (`DiskOffload.io`); None for another engine or
    before its store is made."""
    tier = getattr(engine, "_offload", None)
    return tier.io() if isinstance(tier, DiskOffload) and tier.store is not None else None


class DiskOffload(DryPasses, HostOffload):
    """`HostOffload` with the master and AdamW moments in a `Store` at `config.nvme_path`."""

    def __init__(self, engine):
        cfg = engine.config
        refuse = lambda what: ConfigError(f"offload_device='nvme' {what}")
        if spec_of(engine.optimizer) is None:
            raise refuse("streams a zerojax.adamw's update (the store holds its master and "
                         "moments); the optimizer is not one: use zerojax.adamw(...), or "
                         "offload_device='cpu'")
        if cfg.offload_fraction < 1 and cfg.delayed_update is not None:
            raise refuse(f"does not run Twin-Flow (offload_fraction={cfg.offload_fraction}) "
                         f"with delayed_update={cfg.delayed_update} yet; drop one of them, or "
                         f"use offload_device='cpu'")
        super().__init__(engine)
        self.store: Store | None = None
        self._token = None  # a placeholder of the state the store holds (its first)
        self._running = None  # the last update's outputs: done once they are ready
        self._real = (None, None)  # (plan, the state's abstract shapes as the host tier's)
        self._bulk_io: dict = {}  # the store's counters that bulk transfers ran up

    # ------------------------------------------------------------ what the engine asks

    def host_update(self) -> str:
        self.engine.layout  # noqa: B018 -- raises a clear error before init
        return "nvme"

    def _adamw(self):
        """The host tier's fused update (its scalars, mask and where its state keeps what)."""
        fused, why = self.fused()
        if fused is None:
            raise ConfigError(f"offload_device='nvme' streams zerojax.adamw's fused pass, "
                              f"which cannot run here: {why}")
        return fused

    def streamed(self) -> StreamedAdamW:
        """The update over the store, made once per plan."""
        return self._cached("streamed", lambda: StreamedAdamW(
            self._adamw().spec, self.engine.plan.update, self._open().handle))

    def moments(self) -> tuple[list[int], list[int], list[int]]:
        """(the optimizer state's leaf indices of each param's mu, of its nu, the others:
        the counts, which stay in memory)."""
        run = self._adamw()
        n = self.engine.plan.update.state_def.num_leaves
        return run.mu, run.nu, [j for j in range(n) if j not in {*run.mu, *run.nu}]

    def abstract(self, state):
        """`Engine.abstract_state`: the store's leaves as placeholders (float32[0])."""
        self._real = (self.engine.plan, state)
        return self._placed(state, lambda: jax.ShapeDtypeStruct(
            (0,), jnp.float32, sharding=NamedSharding(self.mesh, P())))

    def real(self):
        """The state's abstract shapes and shardings as the host tier has them."""
        if self._real[0] is not self.engine.plan:
            self.engine.abstract_state()
        return self._real[1]

    def mine(self) -> list[int]:
        """The params whose master and moments are the store's: all but those Twin-Flow keeps
        on the devices (`offload_fraction` < 1), which stay arrays in device memory."""
        device = self.split()[0]
        return [i for i in range(len(self.engine.layout.leaves)) if i not in device]

    def _placed(self, state, make):
        """`state` with the store's master and moments leaves replaced by `make()` each."""
        mu, nu, _ = self.moments()
        mine = self.mine()
        disk = {*(mu[i] for i in mine), *(nu[i] for i in mine)}
        opt, tree = jax.tree.flatten(state.opt_state)
        master, mtree = jax.tree.flatten(state.master)
        return state._replace(
            master=jax.tree.unflatten(mtree, [make() if i in mine else x
                                              for i, x in enumerate(master)]),
            opt_state=jax.tree.unflatten(tree, [make() if j in disk else x
                                                for j, x in enumerate(opt)]))

    # ------------------------------------------------------------ the store

    def _shard_index(self) -> dict:
        """Each host device to its shard's index in the store: its place in the mesh, as
        `jax.lax.axis_index` of every axis (in the mesh's order, row-major) numbers it in the
        update's shard_map (manual over the model axis too: a device's shard is its own part
        of a split leaf)."""
        return {d: k for k, d in enumerate(self.mesh.devices.flat)}

    def _identity(self) -> dict:
        eng, cfg = self.engine, self.engine.config
        return {"leaves": [[leaf.path, list(leaf.shape)] for leaf in eng.layout.leaves],
                "stage": cfg.stage, "mesh": [eng.replica, eng.data, eng.model_parallel],
                "offload_fraction": cfg.offload_fraction,
                "param_dtype": cfg.param_dtype, "optimizer": "zerojax.adamw"}

    def _open(self) -> Store:
        """This process's store for the engine's current layout: opened (or made) at first
        use, and again after the layout changed (a restore adopting a checkpoint's units)."""
        cfg, identity = self.engine.config, self._identity()
        if self.store is not None and self.store.identity == identity:
            return self.store
        self.close()
        index = self._shard_index()
        real = self.real()
        sizes, mine = {}, self.mine()
        for i, x in enumerate(jax.tree.leaves(real.master)):
            on = NamedSharding(self.mesh, x.sharding.spec)  # Twin-Flow's: none on disk
            for d in on.addressable_devices:
                sizes.setdefault(index[d], []).append(
                    math.prod(on.shard_shape(x.shape)) if i in mine else 0)
        path = cfg.nvme_path  # one store per process: several on one host each their own
        if jax.process_count() > 1:
            path = f"{path}/process-{jax.process_index():05d}"
        self.store = Store(path, identity, sizes, block=cfg.nvme_buffer_size,
                           count=cfg.nvme_buffer_count)
        self._bulk_io = {}
        return self.store

    @contextlib.contextmanager
    def _bulk(self):
        """A bulk transfer (a build, a restore, a read of the state): its I/O counted apart
        from the updates'."""
        self._wait()
        before = self.store.counters()
        try:
            yield
        finally:
            after = self.store.counters()
            for k, v in after.items():
                self._bulk_io[k] = self._bulk_io.get(k, 0) + v - before[k]

    def io(self) -> dict:
        """The store and its I/O since it was opened: the updates' bytes and seconds, and the
        bulk transfers' bytes (what `summary.json` records)."""
        self._wait()
        store, total = self.store, self.store.counters()
        up = {k: v - self._bulk_io.get(k, 0) for k, v in total.items()}
        rate = lambda n, s: n / s / 1e9 if s > 0 else None
        return {"path": str(store.path), "store_bytes": store.bytes, "direct": store.direct,
                "shards": len(store.shards),
                "buffer_size": store.block, "buffer_count": store.count,
                "update": {"read_bytes": up["read"], "written_bytes": up["written"],
                           "passes": up["passes"], "read_s": up["read_s"],
                           "write_s": up["write_s"], "compute_s": up["compute_s"],
                           "stall_s": up["stall_s"],
                           "read_gb_per_s": rate(up["read"], up["read_s"]),
                           "write_gb_per_s": rate(up["written"], up["write_s"])},
                "bulk": {"read_bytes": self._bulk_io.get("read", 0),
                         "written_bytes": self._bulk_io.get("written", 0)}}

    def close(self):
        """Lets the store go (its files stay): another engine may open it."""
        self._wait()
        if self.store is not None:
            self.store.close()
            self.store, self._token = None, None
        # the update's programs hold the closed store's handle
        cache = self.engine.__dict__.get("_jit_cache", {})
        for key in [k for k in cache if k[:1] == ("offload",) and "streamed" in str(k[1])]:
            del cache[key]

    def _wait(self):
        """Blocks until the last update's passes are done (the store is then theirs)."""
        if self._running is not None:
            jax.block_until_ready(self._running)
            self._running = None

    def _check(self, state):
        if self._token is None or \
                jax.tree.leaves(state.master)[self.mine()[0]] is not self._token:
            raise StateError("this state's master and moments are no longer on the NVMe store: "
                             "the engine was initialized or restored again since, and the store "
                             "holds that state; use the state that call returned")

    def _to_store(self, state):
        """`state` (its master and moments on the host mesh) written to the store, a leaf at
        a time, each leaf's arrays deleted once written; with placeholders for them."""
        store, index = self._open(), self._shard_index()
        mu, nu, _ = self.moments()
        master, opt = jax.tree.leaves(state.master), jax.tree.leaves(state.opt_state)
        with self._bulk():
            store.begin()
            for i in self.mine():
                x = master[i]
                parts = [{s.device: s.data for s in a.addressable_shards}
                         for a in (x, opt[mu[i]], opt[nu[i]])]
                for d in parts[0]:
                    store.write_leaf(index[d], i, *(np.asarray(p[d]).reshape(-1)
                                                    for p in parts))
                for a in (x, opt[mu[i]], opt[nu[i]]):
                    a.delete()
            store.commit(step=int(jax.device_get(state.step)))
        token = []

        def make():
            token.append(jax.device_put(np.zeros(0, np.float32), NamedSharding(self.mesh, P())))
            return token[-1]

        placed = self._placed(state, make)
        self._token = token[0]
        return placed

    def _from_store(self, state, fields=("master", "opt_state")) -> dict:
        """The store's master and moments (those of `fields`) as arrays on the host mesh with
        the host tier's shardings, read a leaf at a time; the counts from `state`."""
        self._check(state)
        with self._bulk():
            return self._read_store(state, fields)

    def _read_store(self, state, fields) -> dict:
        real, index, store = self.real(), self._shard_index(), self.store
        mu, nu, _ = self.moments()

        def read(i, part, like):
            local = like.sharding.shard_shape(like.shape)
            shards = [jax.device_put(store.read_leaf(index[d], i, part).reshape(local), d)
                      for d in like.sharding.addressable_devices]
            return jax.make_array_from_single_device_arrays(like.shape, like.sharding, shards)

        out = {}
        if "master" in fields:  # (Twin-Flow's leaves as they are, on the devices)
            leaves, tree = jax.tree.flatten(state.master)
            like = jax.tree.leaves(real.master)
            for i in self.mine():
                leaves[i] = read(i, "master", like[i])
            out["master"] = jax.tree.unflatten(tree, leaves)
        if "opt_state" in fields:
            leaves, tree = jax.tree.flatten(state.opt_state)
            like = jax.tree.leaves(real.opt_state)
            for i in self.mine():
                a, b = mu[i], nu[i]
                leaves[a], leaves[b] = read(i, "mu", like[a]), read(i, "nu", like[b])
            out["opt_state"] = jax.tree.unflatten(tree, leaves)
        return out

    # ------------------------------------------------------------ the host tier's hooks

    def built(self, build, args, homes):
        small = self._open().bytes < RESTORE_LEAST  # (a store refused before the build)
        if self.split()[0] or small and self.mesh is self.engine.mesh:  # as the host tier's
            return self._to_store(super().built(build, args, homes))
        with self._bulk():  # each part of the state to the store as it is made
            return super().built(build, args, homes, sink=_ToStore(self))

    def from_logical(self, build, tree, loss_scale: bool, owned: bool):
        self._open()
        return self._to_store(super().from_logical(build, tree, loss_scale, owned))

    def read(self, field: str, state):
        value = self.applied(state)[HOSTED.index(field)] if self.k is not None else \
            self._from_store(state, (field,))[field]
        homes = getattr(self.engine.view_shardings(), field)
        return self.to_devices(value, jax.tree.map(lambda s: s.with_memory_kind("device"),
                                                   homes))

    def check_logical(self, state):
        if jax.tree.leaves(state.master)[self.mine()[0]].shape == (0,):
            raise StateError("engine.logical takes an NVMe-tier state as engine.saveable(state) "
                             "gives it (its master and moments read from the store)")

    def saveable(self, state):
        """`state` with its master and moments read from the store onto the host mesh (what a
        save writes; with delayed_update, the pending update applied by dry passes, the store
        unchanged); the store committed, holding this step."""
        if self.k is not None:
            master, opt_state, _ = self.applied(state)
            state = state._replace(master=master, opt_state=opt_state, pending=None)
        else:
            state = state._replace(**self._from_store(state))
        self.store.commit(step=int(jax.device_get(state.step)))
        return state

    def _update(self, reduced, state, donate: bool, send: bool = False):
        """(master placeholders, optimizer state with its counts stepped, compute-dtype
        shards, {}) of the streamed update of `reduced` (the store's master and moments
        updated in place)."""
        self._check(state)
        grads, *scalars = reduced
        g = jax.tree.leaves(grads)
        same = {x.dtype for x in g} == {self.engine.plan.dtype}
        finite = scalars[2] is not None
        _, _, small = self.moments()
        opt, tree = jax.tree.flatten(state.opt_state)
        master, mtree = jax.tree.flatten(state.master)
        shards = [None] * len(master)
        if self.split()[0]:  # Twin-Flow: the devices' share first, as the host tier's
            self._devices_share(scalars, master, opt, g, shards, donate, finite, same)
        self.store.begin()
        self._order = []
        mine = self.mine()
        counts, out = self._streamed_fn(finite, same and donate)(
            self._host_scalars(scalars), [opt[j] for j in small], [g[i] for i in mine])
        self._running = counts
        for j, x in zip(small, counts, strict=True):
            opt[j] = x
        for i, x in zip(mine, out, strict=True):
            shards[i] = x
        return (jax.tree.unflatten(mtree, master), jax.tree.unflatten(tree, opt), shards, {})

    def _devices_share(self, scalars, master, opt, g, shards, donate, finite, same):
        """Twin-Flow's update of the devices' share, its parts' programs as the host tier
        runs them (`_parted`): into `master`, `opt` and `shards` (lists, by leaf)."""
        parts = self._parts_fn(donate, finite, tuple(x.dtype for x in g), same, host_parts=1,
                               fused=True)
        shared = [opt[j] for j, s in enumerate(self.engine.plan.update.sharded) if not s]
        mesh = self.engine.mesh
        here = (tuple(x for x in self._host_scalars(scalars, mesh) if x is not None),
                jax.device_put(shared, NamedSharding(mesh, P())))
        for part, fn in parts:
            if not part.on_device:
                continue
            m, o, s = fn(*here, [master[i] for i in part.params], [opt[j] for j in part.owned],
                         [g[i] for i in part.params])
            for i, a, b in zip(part.params, m, s, strict=True):
                master[i], shards[i] = a, b
            for j, x in zip(sorted((*part.owned, *part.writes)), o, strict=True):
                opt[j] = jax.device_put(x, NamedSharding(self.mesh, P())) \
                    if j in part.writes else x

    def _streamed_fn(self, finite: bool, donate: bool):
        """`(scalars, the optimizer state's counts, gradient) -> (new counts, shards)`: the
        store's update as one program of the host mesh; `donate`: the gradient's buffers
        take the shards."""
        def build():
            run = self.streamed()
            _, reduced, _, full = self._specs()
            mine = self.mine()
            every = jax.tree.leaves(full.master, is_leaf=lambda x: isinstance(x, P))
            shards = [every[i] for i in mine]
            _, _, small = self.moments()

            def body(scalars, counts, grads):
                shard = jax.lax.axis_index(self.mesh.axis_names)
                new, out = run.part(mine, scalars, dict(zip(small, counts, strict=True)),
                                    grads, shard)
                return [new.get(j, x) for j, x in zip(small, counts, strict=True)], out

            scalars = (*reduced[1:3], P() if finite else None, P())
            fn = jax.shard_map(body, mesh=self.mesh,
                               in_specs=(scalars, [P()] * len(small), shards),
                               out_specs=([P()] * len(small), shards), check_vma=False)
            return jax.jit(fn, donate_argnums=(2,) if donate else (), keep_unused=True,
                           out_shardings=([NamedSharding(self.mesh, P())] * len(small), None))

        return self._cached(("streamed", finite, donate), build)

    def lower_update(self, state):
        """The streamed update of a step, lowered."""
        plan, specs, mesh = self.engine.plan, self.engine.state_specs(), self.mesh
        real = self.real()
        grads = [jax.ShapeDtypeStruct(m.shape, plan.reduced_dtype,
                                      sharding=NamedSharding(mesh, s))
                 for m, s in zip(jax.tree.leaves(real.master), jax.tree.leaves(
                     specs.master, is_leaf=lambda x: isinstance(x, P)), strict=True)]
        grads = [grads[i] for i in self.mine()]  # (Twin-Flow's share: the devices')
        one = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=NamedSharding(mesh, P()))
        finite = self.engine.config.dynamic_scale or self.k is not None
        scalars = (one(jnp.float32), one(jnp.float32), one(jnp.bool_) if finite else None,
                   one(jnp.float32))
        opt = jax.tree.leaves(state.opt_state)
        return self._streamed_fn(finite, plan.reduced_dtype == plan.dtype).lower(
            scalars, [opt[j] for j in self.moments()[2]], grads)


class _ToStore:
    """`HostOffload.built`'s sink (init, init_from): each master and moment leaf written to
    the store as its part of the build is done, then freed (its compute-dtype shard kept)."""

    def __init__(self, tier: DiskOffload):
        self.tier, self.store, self.index = tier, tier._open(), tier._shard_index()
        mu, nu, _ = tier.moments()
        n = len(tier.engine.layout.leaves)  # the hosted leaves: master's, opt_state's, ...
        self.where = {k: (i, part) for i in tier.mine()
                      for k, part in ((i, "master"), (n + mu[i], "mu"), (n + nu[i], "nu"))}
        self.shards = [None] * n
        self.cast = jax.jit(lambda x: x.astype(tier.engine.plan.dtype))
        self.store.begin()

    def __call__(self, k: int, x):
        if k not in self.where:
            return x
        i, part = self.where[k]
        self.shards[i] = self.cast(x) if part == "master" else self.shards[i]
        for s in x.addressable_shards:
            self.store.write_part(self.index[s.device], i, part, np.asarray(s.data))
        x.delete()
        return jax.device_put(np.zeros(0, np.float32), NamedSharding(self.tier.mesh, P()))

    def done(self, state):
        tier = self.tier
        self.store.commit(step=int(jax.device_get(state.step)))
        tier._token = jax.tree.leaves(state.master)[tier.mine()[0]]
        return state._replace(compute=tier._compute_of(tier.up(self.shards), state.compute))
