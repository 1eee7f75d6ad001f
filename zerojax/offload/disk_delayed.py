"""The NVMe tier's delayed update (disk.py; delayed.py is the host tier's): the pending
update applied, for what reads the state (`Engine.params`, `optimizer_state`, `evaluate`, a
save), by dry passes over the store (`update_leaf(..., dry=...)`), which read the master and
moments and write nothing: the update stays pending for the next step's streamed pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.offload.nvme import update_leaf


class DryPasses:
    """`DiskOffload`'s reads of a state with a pending update: it gives `engine`, `mesh`,
    `streamed`, `moments`, `_check`, `_bulk`, `_specs`, `_host_scalars`, `shardings`, `up`,
    `_compute_of` and `_cached`."""

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
