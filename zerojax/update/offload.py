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
