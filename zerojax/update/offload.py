"""Where ZeRO-Offload's state lives: memory spaces, and the host mesh.

The fp32 master and the optimizer state of `offload="optimizer"` live on the *host mesh*: a
CPU device of the host for each device of the mesh, in the mesh's shape and axis names, so
that a leaf keeps its PartitionSpec and each device's shard has a host twin. The CPU backend
runs the update there (host.py): donated, so in place, and one partition per CPU device. On
a machine whose mesh is already of CPU devices the host mesh is the mesh itself.
"""

from __future__ import annotations

from collections import defaultdict

import jax
import numpy as np
from jax.sharding import Mesh

from zerojax.errors import ConfigError

HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


def to_memory(tree, space):
    return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def host_mesh(mesh: Mesh) -> Mesh:
    """`mesh`'s host twin: each device replaced by a CPU device of its own process (the i-th
    of the process's devices in the mesh by the process's i-th CPU device)."""
    devices = mesh.devices
    if all(d.platform == "cpu" for d in devices.flat):
        return mesh
    try:
        cpus = jax.devices("cpu")
    except RuntimeError as e:
        raise ConfigError(f"offload='optimizer' runs the update on the host's CPU devices, and "
                          f"jax has no CPU backend here ({e}); if JAX_PLATFORMS names the "
                          f"accelerator alone, add cpu (e.g. JAX_PLATFORMS=cuda,cpu)") from None
    by_process = defaultdict(list)
    for c in cpus:
        by_process[c.process_index].append(c)
    used: dict = defaultdict(int)
    twins = np.empty(devices.shape, dtype=object)
    for idx, d in np.ndenumerate(devices):
        p = d.process_index
        have = sorted(by_process[p], key=lambda c: c.id)
        if used[p] >= len(have):
            want = sum(1 for x in devices.flat if x.process_index == p)
            raise ConfigError(
                f"offload='optimizer' keeps each device's optimizer shard on a CPU device of its "
                f"host: process {p} has {want} devices in the mesh but {len(have)} CPU "
                f"device(s). Start jax with as many CPU devices: "
                f"jax.config.update('jax_num_cpu_devices', {want}) before the first jax call "
                f"(or XLA_FLAGS=--xla_force_host_platform_device_count={want})")
        twins[idx] = have[used[p]]
        used[p] += 1
    return Mesh(twins, mesh.axis_names, axis_types=mesh.axis_types)


def twins(src: Mesh, dst: Mesh) -> dict:
    """Each device of `src` to the device at its place in `dst` (a mesh of the same shape)."""
    return dict(zip(src.devices.flat, dst.devices.flat, strict=True))


def crosses(twin: dict) -> bool:
    """Whether `twin` pairs devices of two backends (an accelerator's and the CPU's)."""
    return any(a.client is not b.client for a, b in twin.items())


def across(xs: list, shardings: list, twin: dict, by_shard: bool) -> list:
    """Arrays on one mesh put on `shardings` of its twin mesh (`twin`: device to device).

    `by_shard` (between two backends, `crosses(twin)`): each shard moves by itself, as a
    single-device array onto its twin device, and the array is assembled from the moved
    shards. Measured on an H100's host (docs/performance.md): a single-device array in the
    GPU's pinned host memory reached a CPU device at once (1 GB in 0.6 ms: read where it
    is), and a CPU one reached the GPU at 9 GB/s, where a sharded `device_put` between the
    two backends moved 1.1-1.3 GB/s either way. Otherwise, and for a PRNG key array (its
    shards are not assembled so), a plain `device_put`.
    """
    def put(x, s):
        if not by_shard or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.device_put(x, s)
        return jax.make_array_from_single_device_arrays(
            x.shape, s, [jax.device_put(p.data, twin[p.device]) for p in x.addressable_shards])

    return [put(x, s) for x, s in zip(xs, shardings, strict=True)]
