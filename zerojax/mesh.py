"""Device meshes, `jax.distributed` start-up, placing the global batch on the mesh, and the
checks of what a call brings to the engine (meshes, keys, batches; states: state.py): each
refused with one zerojax error naming the value and the fix before anything is traced.

The step runs every iteration, so its batch check compares the batch with an expectation
cached once per layout (tree structure, shapes and dtypes, in Python); it touches no device.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.errors import ArgumentError, BatchError, MeshError, short

DATA = "data"
REPLICA = "replica"
MODEL = "model"


def make_mesh(data: int | None = None, replica: int = 1,
              devices: Sequence[jax.Device] | None = None, *, model: int = 1) -> Mesh:
    """A mesh of `replica × data × model` devices: axes `("replica", "data", "model")`, the
    replica axis left out when replica=1 and the model axis when model=1.

    ZeRO state is sharded over `data` and replicated over `replica` (hybrid sharding); each
    layer's weights are split over `model` as the model's annotations say (tensor
    parallelism; DESIGN.md section 8), `model` innermost, so its devices are neighbours
    (the fastest links). `data=None` takes all devices. With fewer devices requested than
    exist, the first ones are used, and a warning on the `zerojax` logger names the idle ones
    unless `devices=` chose them.
    """
    devs = list(jax.devices() if devices is None else devices)
    for name, v in (("replica", replica), ("model", model)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise MeshError(f"{name}={v!r} must be a positive integer")
    if data is None:
        if len(devs) % (replica * model):
            raise MeshError(f"{len(devs)} devices do not split into replica={replica} × "
                            f"model={model} groups; pass data=... so that replica × data × "
                            f"model divides the device count")
        data = len(devs) // (replica * model)
    if isinstance(data, bool) or not isinstance(data, int) or data < 1:
        raise MeshError(f"data={data!r} must be a positive integer")
    need = replica * data * model
    if need > len(devs):
        raise MeshError(
            f"mesh replica={replica} × data={data} × model={model} needs {need} devices but "
            f"only {len(devs)} exist; on CPU simulate more with "
            f"jax.config.update('jax_num_cpu_devices', {need}) before jax starts (or "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need})")
    if devices is None and need < len(devs):
        # jax frameworks' meshes take every device; a product that falls short (data=2 ×
        # model=3 on 8) is more often a slip than a choice, so it is said, not silent.
        logging.getLogger("zerojax").warning(
            "mesh replica=%d × data=%d × model=%d uses %d of the %d devices (%d idle); pass "
            "devices=jax.devices()[:%d] to choose them", replica, data, model, need, len(devs),
            len(devs) - need, need)
    sizes = [(REPLICA, replica), (DATA, data), (MODEL, model)]
    names = tuple(a for a, n in sizes if n > 1 or a == DATA)
    shape = tuple(n for a, n in sizes if n > 1 or a == DATA)
    return Mesh(np.array(devs[:need], dtype=object).reshape(shape), names)


def mesh_sizes(mesh: Mesh) -> tuple[int, int]:
    """`(replica, data)` sizes of a zerojax mesh; a clear error for any other mesh."""
    names = tuple(mesh.axis_names)
    if DATA not in names:
        raise MeshError(f"mesh axes {names} have no {DATA!r} axis; build the mesh with "
                        f"zerojax.make_mesh(data=..., replica=..., model=...)")
    extra = [a for a in names if a not in (DATA, REPLICA, MODEL)]
    if extra:
        raise MeshError(f"mesh axes {extra} are not zerojax axes; only {REPLICA!r}, {DATA!r} "
                        f"and {MODEL!r} are supported (use zerojax.make_mesh)")
    shape = dict(mesh.shape)
    return shape.get(REPLICA, 1), shape[DATA]


def model_size(mesh: Mesh) -> int:
    """`M`: the devices of the mesh's `model` axis (1 without one)."""
    return dict(mesh.shape).get(MODEL, 1)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the batch is split over: all but `model` (the devices of one model group
    see the same examples). The step runs manual over these axes."""
    return tuple(a for a in (REPLICA, DATA) if a in mesh.axis_names)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a batch leaf: axis 0 split over the batch axes, replicated over `model`."""
    return NamedSharding(mesh, P(batch_axes(mesh)))


def check_batch(batch, mesh: Mesh, grad_accum: int = 1, process_count: int = 1, *,
                divisible: bool = True) -> int:
    """Validates a (process-local) batch and returns the global batch size; `divisible=False`
    (evaluate, which pads) takes any size."""
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
    if size == 0:
        raise BatchError("the batch holds no examples (its batch axis has size 0)")
    if not divisible:
        return size
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


def eval_parts(batch, local: int, shards: int, process_count: int = 1) -> list[tuple]:
    """The batches `evaluate` runs for this process's `local` examples over its `shards` batch
    slices, each as (rows, real-example weights, offset of its first example in the global
    batch): the largest part the slices divide, then the rest one example per slice, padded
    with copies that weigh nothing."""
    full = local // shards * shards
    parts = []
    if full:
        part = batch if full == local else _rows(batch, 0, full, full)
        parts.append((part, np.ones(full, np.float32), 0))
    if local > full:  # one example per slice: a slice holds 1 real example or 1 pad
        parts.append((_rows(batch, full, local, shards),
                      (np.arange(shards) < local - full).astype(np.float32),
                      full * process_count))
    return parts


def _rows(batch, lo: int, hi: int, size: int):
    """Rows `lo:hi` of every leaf of `batch`, padded to `size` rows with copies of row `lo`."""
    def take(x):
        x = x if hasattr(x, "shape") else np.asarray(x)
        xp = jnp if isinstance(x, jax.Array) else np
        part = x[lo:hi]
        if size > hi - lo:
            part = xp.concatenate([part, xp.repeat(x[lo:lo + 1], size - (hi - lo), axis=0)])
        return part

    return jax.tree.map(take, batch)


def put_batch(batch, mesh: Mesh):
    """Places a process-local batch on the mesh as global arrays sharded on axis 0 (inside an
    outer `jax.jit`, traced leaves are the global batch and only get the sharding)."""
    sharding = batch_sharding(mesh)
    if jax.process_count() == 1 or any(isinstance(x, jax.core.Tracer)
                                       for x in jax.tree.leaves(batch)):
        return jax.tree.map(lambda x: jax.device_put(x, sharding), batch)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)


def put_global(tree, shardings, mesh: Mesh):
    """`tree` placed on `shardings` (a tree of Shardings that is a prefix of `tree`'s; None:
    replicated on `mesh`). Where a
    sharding spans other processes' devices, which `jax.device_put` cannot place a host value
    on, each process gives its own shards of the value it holds (every process holds the same
    one, as for the params a run starts from); a PRNG key array stays as it is, for the jitted
    program to take as the replicated value it is."""
    def put(x, s):
        if s.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
            return jax.device_put(x, s)
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            return x
        value = np.asarray(x)
        return jax.make_array_from_callback(value.shape, s, lambda index: value[index])

    replicated = NamedSharding(mesh, P())
    return jax.tree.map(
        lambda s, sub: jax.tree.map(lambda x: put(x, replicated if s is None else s), sub),
        shardings, tree, is_leaf=lambda s: s is None or isinstance(s, jax.sharding.Sharding))


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


# ------------------------------------------------------------------------------- at the door

# engine -> (batch treedef, {batch path: (shape without the batch axis, dtype)}, its type name)
_BATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_key(rng, name: str = "rng") -> None:
    """`rng` must be one PRNG key: a typed key (`jax.random.key`) or raw key data
    (`jax.random.PRNGKey`)."""
    dtype = getattr(rng, "dtype", None)
    shape = getattr(rng, "shape", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        if shape == ():
            return
        raise ArgumentError(f"{name} is an array of {shape} PRNG keys; pass one key, e.g. "
                            f"jax.random.key(0)")
    if dtype is not None and np.dtype(dtype) == np.uint32 and shape == (2,):
        return  # the raw data of a default (threefry) key, as jax.random.PRNGKey makes
    raise ArgumentError(f"{name}={short(rng)} is not a PRNG key; pass jax.random.key(seed), "
                        f"e.g. jax.random.key(0)")


def check_mesh(mesh) -> None:
    if not isinstance(mesh, Mesh):
        raise MeshError(f"mesh={short(mesh)} is not a jax.sharding.Mesh; build one with "
                        f"zerojax.make_mesh(data=N) (or make_mesh(replica=R, data=N))")


# ------------------------------------------------------------------------------- the batch


def _describe(batch):
    flat, treedef = jax.tree.flatten_with_path(batch)
    leaves = {}
    for path, x in flat:
        shape = getattr(x, "shape", None)
        shape = np.shape(x) if shape is None else shape
        dtype = jax.dtypes.canonicalize_dtype(jnp.result_type(x)) if hasattr(x, "dtype") \
            else None
        leaves[jax.tree_util.keystr(path)] = (tuple(shape[1:]), dtype)
    return treedef, leaves, type(batch).__name__


def remember_batch(engine, batch) -> None:
    """Takes `batch` (the example batch of init) as what later batches must look like."""
    _BATCHES[engine] = _describe(batch)


def check_batch_like(engine, batch, *, sizes: bool = True) -> None:
    """`batch` must have the keys, dtypes and shapes (but for the batch axis) of the batch the
    engine was initialized with; the first step's batch after a `restore` sets them.
    `sizes=False` (evaluate): any sizes, the same number of axes."""
    want = _BATCHES.get(engine)
    if want is None:
        if sizes:  # an evaluation batch (another length) says nothing of the training batches
            _BATCHES[engine] = _describe(batch)
        return
    same = (lambda got, w: got == w) if sizes else (lambda got, w: len(got) == len(w))
    leaves, got_def = jax.tree.flatten(batch)  # the fast path, taken every step
    if got_def == want[0] and all(
            same(tuple(getattr(x, "shape", ())[1:]), shape)
            and getattr(x, "dtype", None) is not None
            and jax.dtypes.canonicalize_dtype(x.dtype) == dtype
            for x, (shape, dtype) in zip(leaves, want[1].values())):
        return
    treedef, leaves, kind = want
    got_def, got, got_kind = _describe(batch)
    if got_def != treedef:
        missing = [k for k in leaves if k not in got]
        extra = [k for k in got if k not in leaves]
        if got_kind != kind:
            what = f"the batch is a {got_kind}; the engine was initialized with a {kind}"
        else:
            what = "the batch has other leaves than the one the engine was initialized with"
        parts = [f"missing batch{', batch'.join(missing[:5])}" if missing else "",
                 f"extra batch{', batch'.join(extra[:5])}" if extra else ""]
        detail = "; ".join(p for p in parts if p) or f"keys {list(got)}, expected {list(leaves)}"
        raise BatchError(f"{what} ({detail}); pass batches with the keys of the init batch "
                         f"({', '.join(leaves) or 'none'})")
    for (name, (shape, dtype)), (_, (want_shape, want_dtype)) in zip(got.items(),
                                                                     leaves.items()):
        if not same(shape, want_shape) or dtype != want_dtype:
            show = lambda s, d: (np.dtype(d).name if d is not None else "no dtype") + \
                "[" + ", ".join(["B", *map(str, s)]) + "]"
            rule = ("any batch size B, the other axes and the dtype as at init" if sizes else
                    "evaluate takes any sizes; the number of axes and the dtype as at init")
            raise BatchError(f"batch{name} is {show(shape, dtype)}; the engine was initialized "
                             f"with {show(want_shape, want_dtype)} ({rule})")


@contextlib.contextmanager
def naming_the_batch(batch):
    """Turns the KeyError or TypeError a model raises on an example batch that lacks a key it
    reads, or that is not a mapping, into a BatchError that says so."""
    try:
        yield
    except KeyError as e:
        key = e.args[0] if e.args else None
        if not isinstance(batch, Mapping) or key in batch or not isinstance(key, str):
            raise
        raise BatchError(f"the model reads batch[{key!r}], which the batch lacks (its keys: "
                         f"{sorted(map(str, batch))}); pass a batch with every key the model "
                         f"reads") from None
    except TypeError as e:
        if isinstance(batch, Mapping):
            raise
        raise BatchError(f"the model's loss failed on a batch that is a "
                         f"{type(batch).__name__}, not a dict ({e}); pass the batch as the "
                         f"model reads it, e.g. {{'inputs': ..., 'targets': ...}}") from None
