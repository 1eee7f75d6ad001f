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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


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
