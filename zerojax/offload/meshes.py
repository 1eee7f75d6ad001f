"""Where ZeRO-Offload's state lives: the host mesh, and programs over arrays on two meshes.

The fp32 master and the optimizer state of `offload="optimizer"` live on the *host mesh*: a
CPU device of the host for each device of the mesh, in the mesh's shape and axis names, so
that a leaf keeps its PartitionSpec and each device's shard has a host twin. The CPU backend
runs the update there (host.py): donated, so in place, and one partition per CPU device. On
a machine whose mesh is already of CPU devices the host mesh is the mesh itself. (The memory
spaces a step's program moves a value between are step.py's: `HOST`, `DEVICE`.)
"""

from __future__ import annotations

from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: no public form in jax 0.10
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.errors import ConfigError
from zerojax.update.parts import runs


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


def mesh_of(x) -> Mesh | None:
    """The mesh an array's NamedSharding names (None for another sharding)."""
    return getattr(x.sharding, "mesh", None)


def by_mesh(fn, xs: list) -> list:
    """`fn(xs)` (a jitted map of a list of arrays to one output each) for arrays on several
    meshes: one call per mesh, each on that mesh's arrays, the outputs in the order of `xs`."""
    groups: dict = defaultdict(list)
    for i, x in enumerate(xs):
        groups[mesh_of(x)].append(i)
    out = [None] * len(xs)
    for idx in groups.values():
        for i, y in zip(idx, fn([xs[i] for i in idx]), strict=True):
            out[i] = y
    return out


def _filler(x):
    """A function giving a value of `x`'s type (a zero; a PRNG key array of its impl)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        impl, data = jax.random.key_impl(x), jax.eval_shape(jax.random.key_data, x)
        return lambda: jax.random.wrap_key_data(jnp.zeros(data.shape, data.dtype), impl=impl)
    return lambda: jnp.zeros(x.shape, x.dtype)


class OnMeshes:
    """`jax.jit(fn, out_shardings=homes)(*args)` where the arguments and the outputs live on
    several meshes (offload's host mesh, the devices' mesh), which one program cannot span:
    one program per mesh, giving the outputs that live there from the arguments that live
    there (the others are dead in it, stood in for by zeros).

    `homes`: per output a NamedSharding, or a PartitionSpec: on the mesh of the arguments the
    output reads (`default` where it reads none). Which arguments each output reads is read
    from the traced program. An argument that only another mesh's outputs read moves there
    first (`across`); an output that would read arguments of two meshes is a ValueError.
    Made from the first arguments it is called with (their shapes and meshes).

    `views`: an output that is its one argument reshaped, on the one CPU device the argument
    lives on, is that argument's buffer seen in the output's shape (nothing is copied; while
    the view lives, a program donating the argument copies it instead). For what is written
    and dropped (a save), not for state that programs go on to donate (a restore).
    `parts`: a mesh's outputs of at least `least` bytes in about that many programs by bytes,
    each reading only its own arguments; `free`: each argument deleted once the last program
    that reads it has run (the caller's own: a restore's freshly read tree), so that the
    peak is the outputs and a part's arguments, not the outputs beside all the arguments."""

    def __init__(self, fn, homes, default: Mesh | None = None, *, views: bool = False,
                 parts: int = 1, least: int = 0, free: bool = False):
        self.fn, self.homes, self.default, self._made = fn, homes, default, None
        self.views, self.parts, self.least, self.free = views, parts, least, free

    def _make(self, args):
        flat, tree = jax.tree.flatten(args)
        is_home = lambda x: isinstance(x, (NamedSharding, P))
        homes, out_tree = jax.tree.flatten(self.homes, is_leaf=is_home)
        closed = jax.make_jaxpr(lambda *a: jax.tree.leaves(self.fn(*jax.tree.unflatten(
            tree, a))))(*flat)
        if len(closed.jaxpr.outvars) != len(homes):
            raise ValueError(f"fn gives {len(closed.jaxpr.outvars)} outputs for {len(homes)} "
                             f"homes")
        dced = [pe.dce_jaxpr(closed.jaxpr, [o == k for k in range(len(homes))])
                for o in range(len(homes))]
        reads = [{i for i, r in enumerate(used) if r} for _, used in dced]
        for o, h in enumerate(homes):
            if isinstance(h, P):
                meshes = {mesh_of(flat[i]) for i in reads[o]} or {self.default}
                if len(meshes) > 1:
                    raise ValueError(f"output {o} reads arguments {sorted(reads[o])} of "
                                     f"{len(meshes)} meshes")
                homes[o] = NamedSharding(meshes.pop(), h)
        # where each argument is read: an argument read by one other mesh alone moves there
        moves = {}
        for i, x in enumerate(flat):
            readers = {homes[o].mesh for o in range(len(homes)) if i in reads[o]}
            if len(readers) > 1:
                raise ValueError(f"argument {i} is read on {len(readers)} meshes")
            if readers and mesh_of(x) not in readers:
                moves[i] = readers.pop()
        views = {o: i for o, (j, _) in enumerate(dced) if self.views and len(reads[o]) == 1
                 and (i := next(iter(reads[o]))) not in moves
                 and _one_cpu(flat[i]) and homes[o].device_set == flat[i].sharding.device_set
                 and _reshapes(j)}
        avals = [v.aval for v in closed.jaxpr.outvars]
        fill = [_filler(x) for x in flat]
        programs = []
        for mesh in dict.fromkeys(h.mesh for h in homes):
            outs = [o for o, h in enumerate(homes) if h.mesh == mesh and o not in views]
            sizes = [avals[o].size * avals[o].dtype.itemsize for o in outs]
            split = runs(sizes, self.parts) if sum(sizes) >= self.least else [range(len(outs))]
            for run in split if outs else []:
                mine = [outs[k] for k in run]
                ins = sorted(set().union(*(reads[o] for o in mine)))

                def part(*got, ins=ins, mine=mine):
                    a = [f() for f in fill]
                    for i, x in zip(ins, got, strict=True):
                        a[i] = x
                    out = jax.tree.leaves(self.fn(*jax.tree.unflatten(tree, a)))
                    return [out[o] for o in mine]

                programs.append((ins, mine, jax.jit(part, out_shardings=[
                    homes[o] for o in mine])))
        last = {i: k for k, (ins, _, _) in enumerate(programs) for i in ins}
        views = {o: (i, avals[o].shape, homes[o]) for o, i in views.items()}
        return programs, moves, views, last, out_tree, len(homes)

    def __call__(self, *args):
        if self._made is None:
            self._made = self._make(args)
        programs, moves, views, last, out_tree, n = self._made
        flat = jax.tree.leaves(args)
        for i, mesh in moves.items():
            x, src = flat[i], mesh_of(flat[i])
            twin = twins(src, mesh)
            (flat[i],) = across([x], [NamedSharding(mesh, x.sharding.spec)], twin, crosses(twin))
            if self.free:
                x.delete()
        out = [None] * n
        for o, (i, shape, home) in views.items():
            out[o] = jax.device_put(np.asarray(flat[i]).reshape(shape), home)
        for k, (ins, outs, prog) in enumerate(programs):
            for o, y in zip(outs, prog(*(flat[i] for i in ins)), strict=True):
                out[o] = y
            if self.free:  # what no later program reads
                for i in ins:
                    if last[i] == k:
                        jax.block_until_ready(out[outs[0]])
                        flat[i].delete()
        return jax.tree.unflatten(out_tree, out)


# What a program may do to an argument and still give the argument's buffer in another shape.
_VIEW = frozenset({"reshape", "squeeze", "expand_dims", "device_put", "copy", "copy_p"})


def _reshapes(jaxpr) -> bool:
    """Whether `jaxpr` (one output, from one input) only reshapes or moves its input, in
    place: the same elements in the same order, the same dtype."""
    (x,), (y,) = [v for v in jaxpr.invars if v in _read(jaxpr)], jaxpr.outvars
    return isinstance(y, jcore.Var) and x.aval.dtype == y.aval.dtype \
        and x.aval.size == y.aval.size and _only_views(jaxpr)


def _only_views(jaxpr) -> bool:
    return all(e.primitive.name in _VIEW or (e.primitive.name in ("pjit", "jit")
                                             and _only_views(e.params["jaxpr"].jaxpr))
               for e in jaxpr.eqns)


def _read(jaxpr) -> set:
    """The variables `jaxpr`'s equations and outputs read."""
    return {v for e in jaxpr.eqns for v in e.invars if isinstance(v, jcore.Var)} | {
        v for v in jaxpr.outvars if isinstance(v, jcore.Var)}


def _one_cpu(x) -> bool:
    """Whether `x` is one buffer on one CPU device (a view of it can be taken)."""
    devices = x.sharding.device_set
    return len(devices) == 1 and next(iter(devices)).platform == "cpu" and \
        not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
