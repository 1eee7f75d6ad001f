"""The programs of ZeRO-Offload's step (host.py runs them): the devices' gradients program,
the host's update (whole, or as parts side by side), and the refresh of the compute params;
each made once per plan and cached by the engine."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.offload.fused import for_update
from zerojax.step import _refresh, learning_rate, local_grads, settle


class HostPrograms:
    """`HostOffload`'s programs: it gives `engine`, `mesh` (the host mesh), `k`, `fraction`,
    `device_part`, `by_home`, `on_devices`, `split` and `shardings`."""

    def _cached(self, key, build):
        return self.engine._jitted(("offload", key), build)  # made once per plan

    def _specs(self):
        """(the device part's manual specs, the reduced gradient's, the shards', each
        leaf's specs as NamedShardings take them)."""
        eng = self.engine
        specs, full = eng._manual_specs(), eng.state_specs()
        finite = P() if eng.config.dynamic_scale else None
        return (self.device_part(specs), (specs.master, P(), P(), finite, P()),
                jax.tree.leaves(specs.master, is_leaf=lambda x: isinstance(x, P)), full)

    def _grads_fn(self):
        eng = self.engine

        def build():
            device, reduced, _, full = self._specs()
            kept = self.on_devices("master")  # Twin-Flow's gradient stays in device memory

            def body(plan, state, batch):
                reduced, model_state, means = local_grads(plan, state, batch, kept)
                new, metrics = settle(plan, state, reduced, model_state, means)
                return new, reduced, metrics

            fn = jax.shard_map(partial(body, eng.plan), mesh=eng.mesh,
                               in_specs=(device, P(eng.axes)), out_specs=(device, reduced, P()),
                               axis_names=frozenset(eng.axes), check_vma=True)
            # The gradient shard leaves the device in the program that makes it (Twin-Flow's
            # stays, for the devices' update).
            on = lambda kind: lambda s: NamedSharding(eng.mesh, s, memory_kind=kind)
            grads = self.by_home("master", full.master, on("pinned_host"), on("device"))
            return jax.jit(fn, out_shardings=(self.device_part(eng.state_shardings()),
                                              (grads, None, None, None, None), None))

        return self._cached("grads", build)

    def _update_fn(self, donate: bool, finite: bool, grads_too: bool = False,
                   fused: bool = False):
        """`(scalars, master, optimizer state, gradient) -> (master, optimizer state, shards,
        {"lr"?})`. `finite`: whether the scalars hold a flag that skips the update (dynamic
        loss scaling's, or a pending update's `ok`); `donate`: the master and optimizer state
        donated, and with `grads_too` the gradient, whose buffer then takes the shards;
        `fused`: the update as `fused()` gives it (a zerojax.adamw's one pass per leaf), not
        as the planned program of the step's `ShardedUpdate`."""
        eng = self.engine

        def build():
            _, reduced, shards, full = self._specs()
            specs = eng._manual_specs()
            run = self.fused()[0] if fused else None

            def body(plan, scalars, master, opt_state, grads):
                master, opt_state, shards = (run or plan.update)((grads, *scalars), opt_state,
                                                                 master)
                lr = learning_rate(opt_state)
                return master, opt_state, shards, ({} if lr is None else {"lr": lr})

            scalars = (*reduced[1:3], P() if finite else None, P())
            fn = jax.shard_map(partial(body, eng.plan), mesh=self.mesh,
                               in_specs=(scalars, specs.master, specs.opt_state, reduced[0]),
                               out_specs=(specs.master, specs.opt_state, shards, P()),
                               axis_names=frozenset(eng.axes), check_vma=True)
            # Donated in the order of the outputs: jax pairs a donated buffer with the first
            # output of its shape and dtype, so master -> master, each moment to its own and
            # the gradient to the shards.
            donated = ((1, 2, 3) if grads_too else (1, 2)) if donate else ()
            return jax.jit(fn, donate_argnums=donated, keep_unused=True,
                           out_shardings=(self.shardings(full.master),
                                          self.shardings(full.opt_state), None, None))

        return self._cached(("update", donate, finite, grads_too, fused), build)

    def fused(self):
        """(the host update as a zerojax.adamw's fused pass (fused.py), or None, and why
        not), made once per plan."""
        def build():
            return for_update(self.engine.plan.update.optimizer, self.engine.plan.update)

        return self._cached("fused", build)

    def _parts_fn(self, donate: bool, finite: bool, gdtypes, grads_too: bool,
                  host_parts: int | None = None, fused: bool = False):
        """The update as parts (update/parts.py), each `(scalars, replicated state leaves, its
        master, its sharded state leaves, its gradient) -> (its master, its state leaves, its
        shards)`, a program of its own: [(part, its program)]. A part runs on the host mesh,
        Twin-Flow's on the devices' (its gradient, state and shards in device memory). `donate`
        as `_update_fn`'s; a replicated state leaf (read by every part) is not donated.
        `host_parts`: the host's leaves in at most this many parts (default: update/parts.py's);
        `fused`: a host part as `fused()`'s pass over its params, not its planned program."""
        eng = self.engine

        def build():
            run = self.fused()[0] if fused else None
            _, reduced, shards, full = self._specs()
            specs = eng._manual_specs()
            leaves = lambda tree: jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, P))
            master, opt = leaves(specs.master), leaves(specs.opt_state)
            sharded = eng.plan.update.sharded
            scalars = (*reduced[1:3], *([P()] if finite else []), P())
            shared = [j for j, s in enumerate(sharded) if not s]
            out = []
            for part, prog in eng.plan.update.parts(finite, gdtypes, self.split()[0],
                                                    host_parts):
                mine = sorted((*part.owned, *part.writes))
                mesh = eng.mesh if part.on_device else self.mesh

                def body(scalars, shared_, master_, own, grads, part=part, prog=prog,
                         shared=shared, mine=mine):
                    state = dict(zip(shared, shared_, strict=True))
                    state.update(zip(part.owned, own, strict=True))
                    if run is not None and not part.on_device:
                        flag = (scalars[2],) if finite else (None,)
                        ps, new, shards = run.part(part.params, (*scalars[:2], *flag,
                                                                 scalars[-1]),
                                                   state, master_, grads)
                        return ps, [new[j] for j in mine], shards
                    outs = prog(*grads, *scalars, *(state[j] for j in sorted(state)), *master_)
                    k, j = len(part.params), len(part.params) + len(mine)
                    return outs[:k], outs[k:j], outs[j:]

                fn = jax.shard_map(
                    body, mesh=mesh, axis_names=frozenset(eng.axes), check_vma=True,
                    in_specs=(scalars, [opt[j] for j in shared],
                              [master[i] for i in part.params], [opt[j] for j in part.owned],
                              [master[i] for i in part.params]),
                    out_specs=([master[i] for i in part.params], [opt[j] for j in mine],
                               [shards[i] for i in part.params]))
                on = lambda specs, mesh=mesh: [NamedSharding(mesh, s) for s in specs]
                donated = ((2, 3, 4) if grads_too else (2, 3)) if donate else ()
                out.append((part, jax.jit(fn, donate_argnums=donated, keep_unused=True,
                                          out_shardings=(
                                              on(leaves(full.master)[i] for i in part.params),
                                              on(leaves(full.opt_state)[j] for j in mine),
                                              None))))
            return out

        return self._cached(("parts", donate, finite, tuple(gdtypes), grads_too, host_parts,
                             fused), build)

    def _refresh_fn(self, donate: bool):
        eng = self.engine

        def build():
            _, _, shards, _ = self._specs()
            compute = eng._manual_specs().compute
            fn = jax.shard_map(partial(_refresh, eng.plan), mesh=eng.mesh,
                               in_specs=(shards, compute), out_specs=compute,
                               axis_names=frozenset(eng.axes), check_vma=True)
            return jax.jit(fn, donate_argnums=1 if donate else (),
                           out_shardings=eng.state_shardings().compute)

        return self._cached(("refresh", donate), build)

    def lower(self, state, batch):
        """The gradients program (the device's), lowered."""
        return self._grads_fn().lower(self.device_part(state), batch)

    def lower_update(self, state):
        """The host's update of a step, lowered (the state donated): of a delayed step with
        delayed_update, whose update a flag may skip, as dynamic loss scaling's may; with
        Twin-Flow, of the host's share of the leaves. The gradient in the dtype the step hands
        it over in (`StepPlan.reduced_dtype`)."""
        specs, mesh, plan = self.engine.state_specs(), self.mesh, self.engine.plan
        grads = jax.tree.map(lambda m, s: jax.ShapeDtypeStruct(
            m.shape, plan.reduced_dtype, sharding=NamedSharding(mesh, s)),
            state.master, specs.master, is_leaf=lambda x: isinstance(x, P))
        one = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=NamedSharding(mesh, P()))
        reduced = (grads, one(jnp.float32), one(jnp.float32), one(jnp.bool_), one(jnp.float32))
        if not (self.engine.config.dynamic_scale or self.k is not None):
            reduced = (*reduced[:3], None, reduced[4])  # no flag: nothing skips the update
        same = plan.reduced_dtype == plan.dtype
        fused = self.fused()[0] is not None
        if self.split()[0]:  # Twin-Flow: the host's leaves, as one program
            parts = self._parts_fn(True, reduced[3] is not None, tuple(
                x.dtype for x in jax.tree.leaves(grads)), same, host_parts=1, fused=fused)
            ((part, fn),) = [(p, f) for p, f in parts if not p.on_device]
            master, opt, g = (jax.tree.leaves(t) for t in (state.master, state.opt_state,
                                                           grads))
            sharded = self.engine.plan.update.sharded
            return fn.lower(tuple(x for x in reduced[1:] if x is not None),
                            [x for x, s in zip(opt, sharded) if not s],
                            [master[i] for i in part.params], [opt[j] for j in part.owned],
                            [g[i] for i in part.params])
        return self._update_fn(True, reduced[3] is not None, same, fused).lower(
            reduced[1:], state.master, state.opt_state, reduced[0])
