"""Device meshes, `jax.distributed` start-up, and placing the global batch on the mesh."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.errors import BatchError, MeshError

DATA = "data"
REPLICA = "replica"


def make_mesh(data: int | None = None, replica: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh of `replica × data` devices: axes `("replica", "data")`, or `("data",)` if replica=1.

    ZeRO state is sharded over `data` and replicated over `replica` (hybrid sharding).
    `data=None` takes all devices. With fewer devices requested than exist, the first ones
    are used.
    """
    devs = list(jax.devices() if devices is None else devices)
    if not isinstance(replica, int) or replica < 1:
        raise MeshError(f"replica={replica!r} must be a positive integer")
    if data is None:
        if len(devs) % replica:
            raise MeshError(f"{len(devs)} devices do not split into replica={replica} groups; "
                            f"pass data=... so that replica × data divides the device count")
        data = len(devs) // replica
    if not isinstance(data, int) or data < 1:
        raise MeshError(f"data={data!r} must be a positive integer")
    need = replica * data
    if need > len(devs):
        raise MeshError(
            f"mesh replica={replica} × data={data} needs {need} devices but only {len(devs)} "
            f"exist; on CPU simulate more with XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{need} (set before jax starts)")
    grid = np.array(devs[:need], dtype=object)
    if replica == 1:
        return Mesh(grid, (DATA,))
    return Mesh(grid.reshape(replica, data), (REPLICA, DATA))


def mesh_sizes(mesh: Mesh) -> tuple[int, int]:
    """`(replica, data)` sizes of a zerojax mesh; a clear error for any other mesh."""
    names = tuple(mesh.axis_names)
    if DATA not in names:
        raise MeshError(f"mesh axes {names} have no {DATA!r} axis; build the mesh with "
                        f"zerojax.make_mesh(data=..., replica=...)")
    extra = [a for a in names if a not in (DATA, REPLICA)]
    if extra:
        raise MeshError(f"mesh axes {extra} are not zerojax axes; only {REPLICA!r} and "
                        f"{DATA!r} are supported (use zerojax.make_mesh)")
    shape = dict(mesh.shape)
    return shape.get(REPLICA, 1), shape[DATA]


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the batch is split over (all of them: every device sees its own slice)."""
    return tuple(a for a in (REPLICA, DATA) if a in mesh.axis_names)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a batch leaf: axis 0 split over every mesh axis."""
    return NamedSharding(mesh, P(batch_axes(mesh)))


def check_batch(batch, mesh: Mesh, grad_accum: int = 1, process_count: int = 1) -> int:
    """Validates a (process-local) batch and returns the global batch size."""
    leaves, _ = jax.tree.flatten_with_path(batch)
    if not leaves:
        raise BatchError("the batch has no array leaves")
    sizes = {}
    for path, x in leaves:
        if np.ndim(x) == 0:
            raise BatchError(f"batch leaf {jax.tree_util.keystr(path)} is a scalar; every leaf "
                             f"needs the batch on axis 0")
        sizes[jax.tree_util.keystr(path)] = np.shape(x)[0]
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise BatchError(f"batch leaves have different leading (batch) sizes ({listing}); "
                         f"give every leaf the same batch size on axis 0")
    size = next(iter(sizes.values())) * process_count
    replica, data = mesh_sizes(mesh)
    n = replica * data
    if size % n:
        raise BatchError(f"global batch size {size} is not divisible by the data-parallel size "
                         f"{n} (replica {replica} × data {data}); use a batch that is a multiple "
                         f"of {n}")
    if (size // n) % grad_accum:
        raise BatchError(f"per-device batch {size // n} (global {size} / {n} devices) is not "
                         f"divisible by grad_accum={grad_accum}; choose a batch that is a "
                         f"multiple of {n * grad_accum}")
    return size


def put_batch(batch, mesh: Mesh):
    """Places a process-local batch on the mesh as global arrays sharded on axis 0."""
    sharding = batch_sharding(mesh)
    if jax.process_count() == 1:
        return jax.tree.map(lambda x: jax.device_put(x, sharding), batch)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *,
                           heartbeat_timeout_s: int | None = None) -> None:
    """Starts `jax.distributed` (explicitly, or auto-detected on SLURM / Open MPI).

    Must run before anything touches a jax backend. CPU processes exchange collectives over
    gloo (only the CPU client reads that setting, so it is harmless on GPU).
    `heartbeat_timeout_s`: seconds without a heartbeat after which a process counts as lost
    (default: jax's, 100).
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {} if heartbeat_timeout_s is None else {
        "heartbeat_timeout_seconds": heartbeat_timeout_s}
    if coordinator is None and num_processes is None:
        jax.distributed.initialize(**kwargs)
    else:
        jax.distributed.initialize(coordinator, num_processes=num_processes,
                                   process_id=process_id, **kwargs)
