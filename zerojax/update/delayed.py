"""ZeRO-Offload's delayed parameter update (DPU): `ZeroConfig(offload="optimizer",
delayed_update=K)`.

With m_j the master after j updates (m_0 the initial params, m_{j+1} = U(m_j, g_j), U the
optax update on the host) and b_t the batch of step t:

    g_t = grad L(m_t;     b_t)   for t < K       (ordinary steps, as plain offload)
    g_t = grad L(m_{t-1}; b_t)   for t >= K      (m_{-1} = m_0: K = 0 runs as K = 1)

Each step from max(K-1, 0) on leaves its reduced gradient pending in the state
(`TrainState.pending`) instead of applying it, and the next step applies it on the host (m_t
= U(m_{t-1}, g_{t-1})) while the device runs its forward and backward on the compute params
of m_{t-1}: the update reads nothing the backward computes, so the two can overlap. A step's
loss is the loss at the params it ran on; `engine.params`, `evaluate`, `optimizer_state`
and checkpoints apply the pending update first.

A pending update is stored as the step hands it to the optimizer: the summed, loss-scaled
gradient shard (float32, in host memory, like the master), its divisor, the global norm (for
clipping), the global loss (for `value=` optimizers) and `ok` (False: nothing pending, or
the step was skipped by dynamic loss scaling, whose update is skipped as it would have
been). A checkpoint holds the params with the pending update applied, and the compute
params the next step runs on ("delayed"/"params"), so a resume on any N and stage continues
as the uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import weakref
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax.step import StepPlan, _refresh, local_step
from zerojax.update import DEVICE, HOST, to_memory
from zerojax.update.offload import on_host


class Pending(NamedTuple):
    """The update a step left for the next one (N = size of "data")."""

    grads: Any  # f32 per leaf like `master` {data}, in pinned host memory: summed, scaled
    denom: jax.Array  # f32 [] {replicated}: divides `grads` into the mean gradient
    norm: jax.Array  # f32 [] {replicated}: the global norm of the mean gradient
    ok: jax.Array  # bool [] {replicated}: an update is pending (False: none, or skipped)
    value: jax.Array  # f32 [] {replicated}: the step's global loss (`value=` optimizers)


def pending_specs(master_specs) -> Pending:
    return Pending(master_specs, P(), P(), P(), P())


def empty_pending(master) -> Pending:
    """Nothing pending, for a state whose master is `master` (global view, inside jit)."""
    zero = jnp.zeros((), jnp.float32)
    return Pending(jax.tree.map(lambda m: jnp.zeros(m.shape, jnp.float32), master),
                   jnp.ones((), jnp.float32), zero, jnp.zeros((), jnp.bool_), zero)


def _apply(plan: StepPlan, state):
    """The pending update on the host: (new master, new optimizer state, new shards)."""
    p = state.pending
    reduced = to_memory((p.grads, p.denom, p.norm, p.ok, p.value), HOST)
    return plan.update(reduced, state.opt_state, state.master, offload=True)


def _stored(reduced) -> Pending:
    """The step's `reduced` (in host memory) as the pending update: float32 on the host, zero
    where the step was skipped."""
    grads, denom, norm, finite, value = reduced
    ok = jnp.ones((), jnp.bool_) if finite is None else to_memory(finite, DEVICE)

    def f32(g, keep):
        # typed as device memory inside the host computation (see update/offload.py)
        g, keep = to_memory((g, keep), DEVICE)
        g = jax.tree.map(lambda x: jnp.where(keep, x.astype(jnp.float32), 0.0), g)
        return to_memory(g, HOST)

    keep = finite if finite is not None else to_memory(jnp.ones((), jnp.bool_), HOST)
    return Pending(on_host(f32)(grads, keep), *to_memory((denom, norm), DEVICE), ok,
                   to_memory(value, DEVICE))


def warm_step(plan: StepPlan, state, batch):
    """An ordinary step (t < K - 1): plain offload's, the (empty) pending update kept."""
    new, metrics = local_step(plan, state, batch)
    return new._replace(pending=state.pending), metrics


def delayed_step(plan: StepPlan, state, batch):
    """A delayed step: forward and backward on the state's compute params, while the host
    applies the pending update; this step's gradient becomes the pending one."""
    applied = _apply(plan, state)  # no input from this step's forward or backward
    taken = []

    def update(reduced, opt_state, master, offload=False):
        taken.append(reduced)  # the step's reduced gradient, sent to host memory
        return applied

    new, metrics = local_step(dataclasses.replace(plan, update=update), state, batch)
    return new._replace(pending=_stored(taken[0])), metrics


def applied_body(plan: StepPlan, state):
    """(master, optimizer state, compute params) with the pending update applied."""
    master, opt_state, shards = _apply(plan, state)
    return master, opt_state, _refresh(plan, shards, state.compute)


class Delay:
    """An engine's delayed-update programs, and which one a state's next step runs."""

    def __init__(self, engine):
        self.engine, self.k = engine, engine.config.delayed_update
        self._last = (lambda: None, 0)  # (weak ref to the last stepped state's `step`, its value)

    def _cached(self, key, build):
        return self.engine._jitted(("delayed", key), build)  # made once per plan

    def _shard_map(self, body, in_specs, out_specs):
        eng = self.engine
        return jax.shard_map(partial(body, eng.plan), mesh=eng.mesh, in_specs=in_specs,
                             out_specs=out_specs, axis_names=frozenset(eng.axes),
                             check_vma=True)

    def step_fn(self, delayed: bool):
        """The jitted ordinary (False) or delayed (True) step; donates the state."""
        eng = self.engine

        def build():
            specs = eng._manual_specs()
            body = self._shard_map(delayed_step if delayed else warm_step,
                                   (specs, P(eng.axes)), (specs, P()))
            return jax.jit(body, donate_argnums=0, keep_unused=True,
                           out_shardings=(eng.state_shardings(), None))

        return self._cached(("step", delayed), build)

    def applied(self, state):
        """(master, optimizer state, compute) of `state` with the pending update applied
        (traceable; inside jit it is one more shard_map)."""
        eng = self.engine
        specs = eng._manual_specs()
        body = self._shard_map(applied_body, (specs,),
                               (specs.master, specs.opt_state, specs.compute))
        return body(state)

    def applied_fn(self):
        """`applied`, jitted (the state is not donated)."""
        return self._cached("applied", lambda: jax.jit(self.applied))

    def settled(self, state):
        """`state` with the pending update applied to its master and optimizer state, its
        compute params (those the next step runs on) as they are, and `pending` None: what a
        checkpoint holds. (Applied inside the save's own program, the update's outputs were
        seen with other bits by the checksums than by the arrays written, on XLA:CPU.)"""
        master, opt_state, _ = self.applied_fn()(state)
        return state._replace(master=master, opt_state=opt_state, pending=None)

    def step(self, state, batch):
        """The state's next step: ordinary while its step < K - 1, delayed from then on."""
        ref, n = self._last
        if isinstance(state.step, jax.core.Tracer):
            raise NotImplementedError(
                "engine.step with delayed_update picks the ordinary or the delayed program by "
                "the state's step counter, which is not known inside an outer jax.jit or "
                "scan; call engine.step outside jit (each call is one compiled program)")
        if ref() is not state.step:
            n = int(state.step)  # once after init or restore: nothing queued
        new, metrics = self.step_fn(n >= self.k - 1)(state, batch)
        self._last = (weakref.ref(new.step), n + 1)
        return new, metrics


def lagging(plan: StepPlan, compute):
    """The compute params (global view, inside jit) as logical float32 params: what a
    checkpoint records as "delayed"/"params"."""
    f32 = jax.tree.map(lambda c: c.astype(jnp.float32), compute)
    return plan.layout.from_flat(f32) if plan.config.stage == 3 else f32


def with_lagging(plan: StepPlan, state, params):
    """`state` (global view, inside jit) whose next step runs on the logical `params`."""
    dtype = plan.dtype
    src = plan.layout.to_flat(params) if plan.config.stage == 3 else params
    return state._replace(compute=jax.tree.map(lambda x: x.astype(dtype), src))
