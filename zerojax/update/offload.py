"""ZeRO-Offload's update: the local work of each round on the host, only the collectives on the
device."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on

from zerojax.update.program import Program, run_comms, run_local

HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


def on_host(f):
    """`f` compiled as one host computation whose outputs stay in host memory."""
    if "out_memory_spaces" in inspect.signature(compute_on).parameters:  # jax >= 0.11
        return compute_on(jax.jit(f), compute_type="device_host", out_memory_spaces=HOST)
    return compute_on("device_host")(jax.jit(f))  # jax 0.10: a context manager


def to_memory(tree, space):
    return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def run_offloaded(prog: Program, args, spaces):
    """`prog` with its local work in host memory and compute (`compute_on("device_host")`):
    one host computation per round (split at control flow with collectives inside, which runs
    on the device), the fused collectives of each round on the device; the outputs end in the
    memory `spaces` say."""
    env = dict(zip(prog.inputs, args, strict=True))
    # What depends on no input (a dummy leaf, a flag) is computed in the step itself, on the
    # device: XLA folds such a value into a constant, whatever memory it was asked to be in.
    fixed = set(prog.consts)
    for locals_, _ in prog.rounds:
        for op in locals_:
            if op.kind == "local" and all(k in fixed for k in op.ins):
                run_local(op, env, prog.consts)
                fixed.update(op.outs)
    steps = []  # ("host", [ops]) | ("device", [ops]) | ("comm", [ops])
    for locals_, comms in prog.rounds:
        for op in locals_:
            if all(k in env for k in op.outs):
                continue
            kind = "device" if op.kind == "sync" else "host"
            if steps and steps[-1][0] == kind == "host":
                steps[-1][1].append(op)
            else:
                steps.append((kind, [op]))
        if comms:
            steps.append(("comm", comms))
    last_use: dict[int, int] = {}
    for i, (_, ops) in enumerate(steps):
        for op in ops:
            for k in op.ins:
                last_use[k] = i
    for k in prog.outputs:
        last_use[k] = len(steps)
    for i, (kind, ops) in enumerate(steps):
        made = {k for op in ops for k in op.outs}
        ins = sorted({k for op in ops for k in op.ins if k not in made and k in env})
        outs = sorted(k for k in made if last_use.get(k, -1) > i)
        if kind == "comm":
            sub = {k: to_memory(env[k], DEVICE) for k in ins}
            run_comms(ops, sub, prog.axis, prog.shards)
            env.update({k: to_memory(sub[k], HOST) for k in outs})
            continue

        def seg(*vals, ops=ops, ins=ins, outs=outs, host=kind == "host"):
            # Inside the host computation the values are typed as device memory, so that they
            # mix with the constants the update creates (a select needs one memory space).
            local = dict(zip(ins, to_memory(vals, DEVICE) if host else vals))
            for op in ops:
                run_local(op, local, prog.consts)
            res = [local[k] for k in outs]
            return to_memory(res, HOST) if host else res

        space = HOST if kind == "host" else DEVICE
        vals = [to_memory(env[k], space) for k in ins]
        res = on_host(seg)(*vals) if kind == "host" else seg(*vals)
        env.update(zip(outs, [to_memory(r, HOST) for r in res] if kind == "device" else res))
    return [to_memory(env[k] if k in env else jnp.asarray(prog.consts[k]), space)
            for k, space in zip(prog.outputs, spaces, strict=True)]
