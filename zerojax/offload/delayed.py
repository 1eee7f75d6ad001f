"""ZeRO-Offload's delayed parameter update (DPU): `ZeroConfig(offload="optimizer",
delayed_update=K)`.

With m_j the master after j updates (m_0 the initial params, m_{j+1} = U(m_j, g_j), U the
optax update on the host) and b_t the batch of step t:

    g_t = grad L(m_t;     b_t)   for t < K       (ordinary steps, as plain offload)
    g_t = grad L(m_{t-1}; b_t)   for t >= K      (m_{-1} = m_0: K = 0 runs as K = 1)

Each step from max(K-1, 0) on leaves its reduced gradient pending in the state
(`TrainState.pending`) instead of applying it, and the next step applies it on the host (m_t
= U(m_{t-1}, g_{t-1})) while the device runs its forward and backward on the compute params
of m_{t-1}: the update reads nothing the backward computes, so the two overlap. host.py runs
the programs: the pending update is dispatched before the step's gradients program. A step's
loss is the loss at the params it ran on; `engine.params`, `evaluate`, `optimizer_state`
and checkpoints apply the pending update first.

A pending update is stored as the step hands it to the optimizer: the summed, loss-scaled
gradient shard (as it arrived in host memory, in the reduction dtype: no program stores it, and
its buffer takes the next update's compute-dtype shards), its divisor, the global norm (for
clipping), the global loss (for `value=` optimizers) and `ok` (False: nothing pending, or
the step was skipped by dynamic loss scaling, whose update is skipped as it would have
been). A checkpoint holds the params with the pending update applied, and the compute
params the next step runs on ("delayed"/"params"), so a resume on any N and stage continues
as the uninterrupted run.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.offload.side_by_side import holds_collective


class Pending(NamedTuple):
    """The update a step left for the next one (N = size of "data")."""

    grads: Any  # per leaf like `master` {data}, reduction dtype, on the host mesh: summed, scaled
    denom: jax.Array  # f32 [] {replicated}: divides `grads` into the mean gradient
    norm: jax.Array  # f32 [] {replicated}: the global norm of the mean gradient
    ok: jax.Array  # bool [] {replicated}: an update is pending (False: none, or skipped)
    value: jax.Array  # f32 [] {replicated}: the step's global loss (`value=` optimizers)


def pending_specs(master_specs) -> Pending:
    return Pending(master_specs, P(), P(), P(), P())


def empty_pending(master, dtype) -> Pending:
    """Nothing pending, for a state whose master is `master` and whose gradient is reduced in
    `dtype` (global view, inside jit)."""
    zero = jnp.zeros((), jnp.float32)
    return Pending(jax.tree.map(lambda m: jnp.zeros(m.shape, dtype), master),
                   jnp.ones((), jnp.float32), zero, jnp.zeros((), jnp.bool_), zero)


def lagging(plan, compute):
    """The compute params (global view, inside jit) as logical float32 params: what a
    checkpoint records as "delayed"/"params"."""
    f32 = jax.tree.map(lambda c: c.astype(jnp.float32), compute)
    return plan.layout.from_flat(f32) if plan.config.stage == 3 else f32


def with_lagging(plan, state, params):
    """`state` (global view, inside jit) whose next step runs on the logical `params`."""
    dtype = plan.dtype
    src = plan.layout.to_flat(params) if plan.config.stage == 3 else params
    return state._replace(compute=jax.tree.map(lambda x: x.astype(dtype), src))


class DelayedUpdate:
    """`HostOffload`'s delayed update, and what the engine asks of it (`Engine._delay`): it
    gives `engine`, `mesh` (the host mesh), `k` (K, or None without a delayed update),
    `_last`, `_thread`, `_crosses`, `_update`, `_compute_of`, `_host_scalars`, `up`, `split`,
    `lower_update` and `_cached`."""

    def pending_specs(self, master_specs) -> Pending:
        """`Engine.state_specs`'s `pending`."""
        return pending_specs(master_specs)

    def empty_pending(self, master) -> Pending:
        """Nothing pending (global view, inside jit), the gradient in the step's reduction
        dtype."""
        return empty_pending(master, self.engine.plan.reduced_dtype)

    def lagging(self, compute):
        """A checkpoint's "delayed"/"params" (`lagging`)."""
        return lagging(self.engine.plan, compute)

    def with_lagging(self, state, params):
        """`state` whose next step runs on the logical `params` (`with_lagging`)."""
        return with_lagging(self.engine.plan, state, params)

    def _store(self, grads, scalars) -> Pending:
        """The step's reduced gradient (on the host mesh; Twin-Flow's leaves on the devices')
        as the pending update, as it arrived: a skipped step's (`ok` False) is never read, the
        update's skip being a branch."""
        denom, norm, finite, value = self._host_scalars(scalars)
        ok = jax.device_put(jnp.ones((), jnp.bool_), NamedSharding(self.mesh, P())) \
            if finite is None else finite
        homes = jax.tree.leaves(self.engine.state_shardings().pending.grads)
        leaves = jax.device_put(jax.tree.leaves(grads), homes)  # each where it is, as a rule
        return Pending(jax.tree.unflatten(jax.tree.structure(grads), leaves), denom, norm, ok,
                       value)

    # ------------------------------------------------------------ the pending update, applied

    def applied(self, state):
        """(master, optimizer state, compute-dtype shards) with the pending update applied
        (nothing is donated)."""
        return self._update(tuple(state.pending), state, False)[:3]

    def applied_compute(self, state):
        """The compute params with the pending update applied (for evaluate)."""
        shards = self.up(self.applied(state)[2])
        return self._compute_of(shards, state.compute, donate=False)

    def settled(self, state):
        """`state` with the pending update applied to its master and optimizer state, its
        compute params (those the next step runs on) as they are, and `pending` None: what a
        checkpoint holds."""
        master, opt_state, _ = self.applied(state)
        return state._replace(master=master, opt_state=opt_state, pending=None)

    def _delays(self, state) -> bool:
        """Whether the state's next step is a delayed one (its step >= K - 1)."""
        if self.k is None:
            return False
        ref, n = self._last
        if ref() is not state.step:
            n = int(state.step)  # once after init or restore: nothing queued
        self._last = (ref, n)
        return n >= self.k - 1

    def _beside(self, pending, state) -> Future:
        """The update of `pending` (`_update`, donating), called from a thread of its own, so
        the caller goes on to dispatch the devices' programs whether or not XLA:CPU runs the
        update inline (a fused pass's program it does: the call returns when the host is
        done). The first call is the caller's own, as SideBySide's: it traces and compiles
        under the caller's jax context, and its errors are the caller's; so is every call
        where `_apart` says the update cannot run beside the devices' programs (and then no
        thread is made)."""
        apart = self._apart(state)  # (read before the update donates the state)
        if self._thread is None or not apart:
            done = Future()
            done.set_result(self._update(pending, state, True, send=True))
            if self._thread is None and apart:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="zerojax-delayed-update")
            return done
        return self._thread.submit(self._update, pending, state, True, True)

    def _apart(self, state) -> bool:
        """Whether the delayed update may run beside the gradients program: always where the
        host mesh is another client's (an accelerator's host); where both meshes are CPU
        devices of one client only if no program of the update waits for every device (a
        collective over several, as SideBySide keeps such programs in turn: two of them side
        by side, with the gradients program's, could each hold the threads the other's
        devices wait for). With Twin-Flow there, the devices' share runs on the client's
        threads too: in turn."""
        def build():
            if self._crosses or self.mesh.size == 1:
                return True
            if self.split()[0]:
                return False
            return not holds_collective(self.lower_update(state))

        return self._cached("apart", build)
