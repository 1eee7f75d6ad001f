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
the files; `init`, `init_from` and `restore` build them as the host tier does and write them
to the store leaf by leaf, each leaf's arrays freed once written. So a save or a restore
holds the whole state in host memory while it runs (the checkpoint wing writes and reads one
tree); the steps between hold a few I/O buffers.
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
from zerojax.offload.fused import spec_of
from zerojax.offload.host import HostOffload
from zerojax.offload.nvme import StreamedAdamW, update_leaf
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


class DiskOffload(HostOffload):
    """`HostOffload` with the master and AdamW moments in a `Store` at `config.nvme_path`."""

    def __init__(self, engine):
        cfg = engine.config
        refuse = lambda what: ConfigError(f"offload_device='nvme' {what}")
        if spec_of(engine.optimizer) is None:
            raise refuse("streams a zerojax.adamw's update (the store holds its master and "
                         "moments); the optimizer is not one: use zerojax.adamw(...), or "
                         "offload_device='cpu'")
        if cfg.offload_fraction < 1:
            raise refuse(f"does not run Twin-Flow (offload_fraction={cfg.offload_fraction}) "
                         f"yet; use offload_fraction=1.0, or offload_device='cpu'")
        super().__init__(engine)
        self.store: Store | None = None
        self._token = None  # the placeholders of the state the store holds (one per leaf)
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

    def _placed(self, state, make):
        """`state` with its master and moments replaced by `make()` each."""
        mu, nu, _ = self.moments()
        opt, tree = jax.tree.flatten(state.opt_state)
        opt = [make() if j in {*mu, *nu} else x for j, x in enumerate(opt)]
        return state._replace(master=jax.tree.map(lambda _: make(), state.master),
                              opt_state=jax.tree.unflatten(tree, opt))

    # ------------------------------------------------------------ the store

    def _shard_index(self) -> dict:
        """Each host device to its shard's index in the store: its place in the mesh, as
        `jax.lax.axis_index` of every axis numbers it in the update's shard_map (manual over
        the model axis too: a device's shard is its own part of a split leaf)."""
        mesh, axes = self.mesh, self.mesh.axis_names
        names, out = mesh.axis_names, {}
        for pos, d in np.ndenumerate(mesh.devices):
            k = 0
            for a in axes:
                k = k * mesh.devices.shape[names.index(a)] + pos[names.index(a)]
            out[d] = k
        return out

    def _identity(self) -> dict:
        eng, cfg = self.engine, self.engine.config
        return {"leaves": [[leaf.path, list(leaf.shape)] for leaf in eng.layout.leaves],
                "stage": cfg.stage, "mesh": [eng.replica, eng.data],
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
        sizes = {}
        for x in jax.tree.leaves(real.master):
            local = x.sharding.shard_shape(x.shape)
            for d in x.sharding.addressable_devices:
                sizes.setdefault(index[d], []).append(math.prod(local))
        self.store = Store(cfg.nvme_path, identity, sizes, block=cfg.nvme_buffer_size,
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
        if self._token is None or jax.tree.leaves(state.master)[0] is not self._token[0]:
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
            for i, x in enumerate(master):
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
        self._token = jax.tree.leaves(placed.master)
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
        if "master" in fields:
            out["master"] = jax.tree.unflatten(jax.tree.structure(real.master), [
                read(i, "master", x) for i, x in enumerate(jax.tree.leaves(real.master))])
        if "opt_state" in fields:
            leaves, tree = jax.tree.flatten(state.opt_state)
            like = jax.tree.leaves(real.opt_state)
            for i, (a, b) in enumerate(zip(mu, nu, strict=True)):
                leaves[a], leaves[b] = read(i, "mu", like[a]), read(i, "nu", like[b])
            out["opt_state"] = jax.tree.unflatten(tree, leaves)
        return out

    # ------------------------------------------------------------ the host tier's hooks

    def built(self, build, args, homes):
        return self._to_store(super().built(build, args, homes))

    def from_logical(self, build, tree, loss_scale: bool, owned: bool):
        return self._to_store(super().from_logical(build, tree, loss_scale, owned))

    def read(self, field: str, state):
        value = self.applied(state)[HOSTED.index(field)] if self.k is not None else \
            self._from_store(state, (field,))[field]
        homes = getattr(self.engine.view_shardings(), field)
        return self.to_devices(value, jax.tree.map(lambda s: s.with_memory_kind("device"),
                                                   homes))

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

    # ------------------------------------------------------------ the delayed update

    def applied(self, state):
        """(master, optimizer state, compute-dtype shards) with the pending update applied,
        by dry passes: the store is read, not written (the update stays pending)."""
        master, opt, shards = self._dry(state, ("master", "mu", "nu", "shard"))
        return master, opt, shards

    def applied_compute(self, state):
        shards = self._dry(state, ("shard",))[2]
        return self._compute_of(self.up(shards), state.compute, donate=False)

    def _dry(self, state, parts):
        """(master, optimizer state, shards) of the pending update of `state`, each of `parts`
        read by a dry pass (None where not asked for)."""
        self._check(state)
        pend = state.pending
        mu, nu, small = self.moments()
        opt, tree = jax.tree.flatten(state.opt_state)
        with self._bulk():
            counts, outs = self._dry_fn(parts)(
                self._host_scalars((pend.denom, pend.norm, pend.ok, pend.value)),
                [opt[j] for j in small], pend.grads)
            jax.block_until_ready((counts, outs))
        for j, x in zip(small, counts, strict=True):
            opt[j] = x
        if "mu" in parts:
            for i, (a, b) in enumerate(zip(mu, nu, strict=True)):
                opt[a], opt[b] = outs["mu"][i], outs["nu"][i]
        master = outs.get("master")
        return (None if master is None else jax.tree.unflatten(
            jax.tree.structure(state.master), master), jax.tree.unflatten(tree, opt),
            outs.get("shard"))

    def _dry_fn(self, parts):
        """`(scalars, counts, gradient) -> (new counts, {part: leaves})`: the pending update's
        result read from the store by dry passes ("master" and the moments "mu", "nu" in
        float32 with the host tier's shardings, "shard" the compute-dtype shards)."""
        def build():
            run = self.streamed()
            _, reduced, _, full = self._specs()
            mu, nu, small = self.moments()
            leaves = lambda t: jax.tree.leaves(t, is_leaf=lambda x: isinstance(x, P))
            shards = leaves(full.master)
            specs = {"master": shards, "shard": shards}
            opt = leaves(full.opt_state)
            specs |= {"mu": [opt[j] for j in mu], "nu": [opt[j] for j in nu]}
            homes = {"master": leaves(full.master), "mu": [leaves(full.opt_state)[j] for j in mu],
                     "nu": [leaves(full.opt_state)[j] for j in nu]}

            def body(scalars, counts, grads):
                shard = jax.lax.axis_index(self.mesh.axis_names)
                decayed, plain, new = run._rows(scalars, dict(zip(small, counts, strict=True)))
                out = {}
                for part in parts:
                    dtype = run.how.out_dtype if part == "shard" else jnp.float32
                    out[part] = [update_leaf(run.handle, i, decayed if run.decay[i] else plain,
                                             shard, g, dtype, "master" if part == "shard"
                                             else part)
                                 for i, g in enumerate(jax.tree.leaves(grads))]
                return [new.get(j, x) for j, x in zip(small, counts, strict=True)], out

            scalars = (*reduced[1:3], P(), P())
            fn = jax.shard_map(body, mesh=self.mesh,
                               in_specs=(scalars, [P()] * len(small), full.master),
                               out_specs=([P()] * len(small), {p: specs[p] for p in parts}),
                               check_vma=False)
            host = lambda p: self.shardings(homes[p]) if p in homes else [None] * len(shards)
            return jax.jit(fn, out_shardings=([NamedSharding(self.mesh, P())] * len(small),
                                              {p: host(p) for p in parts}))

        return self._cached(("streamed-dry", parts), build)

    def _update(self, reduced, state, donate: bool, send: bool = False):
        """(master placeholders, optimizer state with its counts stepped, compute-dtype
        shards, {}) of the streamed update of `reduced` (the store's master and moments
        updated in place)."""
        self._check(state)
        grads, *scalars = reduced
        same = {g.dtype for g in jax.tree.leaves(grads)} == {self.engine.plan.dtype}
        finite = scalars[2] is not None
        _, _, small = self.moments()
        opt, tree = jax.tree.flatten(state.opt_state)
        self.store.begin()
        self._order = []
        counts, shards = self._streamed_fn(finite, same and donate)(
            self._host_scalars(scalars), [opt[j] for j in small], grads)
        self._running = counts
        for j, x in zip(small, counts, strict=True):
            opt[j] = x
        return state.master, jax.tree.unflatten(tree, opt), shards, {}

    def _streamed_fn(self, finite: bool, donate: bool):
        """`(scalars, the optimizer state's counts, gradient) -> (new counts, shards)`: the
        store's update as one program of the host mesh; `donate`: the gradient's buffers
        take the shards."""
        def build():
            run = self.streamed()
            _, reduced, _, full = self._specs()
            shards = jax.tree.leaves(full.master, is_leaf=lambda x: isinstance(x, P))
            _, _, small = self.moments()
            n = len(run.decay)

            def body(scalars, counts, grads):
                shard = jax.lax.axis_index(self.mesh.axis_names)
                new, out = run.part(range(n), scalars, dict(zip(small, counts, strict=True)),
                                    jax.tree.leaves(grads), shard)
                return [new.get(j, x) for j, x in zip(small, counts, strict=True)], out

            scalars = (*reduced[1:3], P() if finite else None, P())
            fn = jax.shard_map(body, mesh=self.mesh,
                               in_specs=(scalars, [P()] * len(small), full.master),
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
        one = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=NamedSharding(mesh, P()))
        finite = self.engine.config.dynamic_scale or self.k is not None
        scalars = (one(jnp.float32), one(jnp.float32), one(jnp.bool_) if finite else None,
                   one(jnp.float32))
        opt = jax.tree.leaves(state.opt_state)
        return self._streamed_fn(finite, plan.reduced_dtype == plan.dtype).lower(
            scalars, [opt[j] for j in self.moments()[2]],
            jax.tree.unflatten(jax.tree.structure(real.master), grads))
