"""Gradients to the host as the backward produces them: the mechanism, on CPU, for a stacked
loop of units (stage 2's view: replicated weights forward, reduce-scatter backward).

A `custom_vjp` backward cannot send its cotangent to the host itself: jax 0.10 types the
cotangent's memory space, and a bwd rule that returns `device_put(g, Host)` for a device input
fails ("Custom VJP bwd rule must produce an output with the same type as the args tuple of the
primal function, but at output[0] the bwd rule produced an output of type float32<host>[4]
... corresponding to an input of type float32[4]"). What works: differentiate zero stand-ins
that live in host memory and are moved to the device per unit in the forward; the transpose of
that move is a `device_put` to the host of the unit's reduced gradient shard, inside the
backward loop, right after its reduce-scatter. This script checks that on a scan of layers:
the gradient's placement, its numbers against plain jax, and where the transfer sits.

    .venv/bin/python experiments/grads_to_host.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device
N, L, K = 2, 3, 4  # devices, layers, shard elements per layer


@jax.custom_vjp
def view(w_full, standin):
    """Stage 2's unit: the replicated weights forward; backward, the cotangent summed over the
    devices and scattered onto the `[K]` stand-in."""
    del standin
    return w_full


def _fwd(w_full, standin):
    return w_full, None


def _bwd(_, ct):
    return None, lax.psum_scatter(ct, "data", tiled=True)  # [N·K] {U} -> [K]


view.defvjp(_fwd, _bwd)


def per_device(w_LxNK):
    standins = jax.device_put(jnp.zeros((L, K), jnp.float32), HOST)  # [L, K] in host memory

    def loss(s_LxK):
        def layer(c, xs):
            w, s = xs
            w = view(w, jax.device_put(s, DEVICE))  # per unit: its transpose goes to the host
            return jnp.sin(c * w), None

        c, _ = lax.scan(jax.checkpoint(layer), jnp.ones((N * K,)), (w_LxNK, s_LxK))
        return jnp.sum(c)

    return jax.grad(loss)(standins)


def scans(jaxpr, out=None) -> list:
    """The bodies of the `scan`s in `jaxpr` and the jaxprs inside it, in program order."""
    out = [] if out is None else out
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            out.append(eqn.params["jaxpr"].jaxpr)
            continue
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                scans(inner, out)
    return out


def flat(jaxpr) -> list[str]:
    """The primitives of `jaxpr` and the jaxprs inside it, in program order (a `device_put`
    with its target memory)."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn.primitive.name + str(eqn.params.get("devices", "")))
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                out += flat(inner)
    return out


def main() -> None:
    mesh = jax.make_mesh((N,), ("data",))
    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P(),
                                 out_specs=P(None, "data"), check_vma=False))
    w = jnp.arange(L * N * K, dtype=jnp.float32).reshape(L, N * K) / 10
    g = step(w)
    assert g.sharding.memory_kind == "pinned_host", g.sharding
    ref = jax.grad(lambda w: jnp.sum(lax.scan(lambda c, w: (jnp.sin(c * w), None),
                                              jnp.ones((N * K,)), w)[0]))(w)
    # Every device computed the same loss, so the reduced gradient is N times plain jax's.
    np.testing.assert_allclose(np.asarray(g), N * np.asarray(ref), rtol=1e-6)
    loops = scans(jax.make_jaxpr(step)(w).jaxpr)
    assert len(loops) == 2  # forward, then the backward
    body = flat(loops[1])
    rs = body.index("reduce_scatter")
    assert "device_put(MemorySpace.Host,)" in body[rs + 1:], body  # in the loop, after it
    print(f"gradient in {g.sharding.memory_kind}, equal to plain jax's x {N}; in the backward "
          f"loop each unit's reduce_scatter is followed by its device_put to the host")


if __name__ == "__main__":
    main()
