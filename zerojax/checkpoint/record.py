"""The checkpoint record: its format version, the per-leaf description and position-sensitive
checksums (computed on device at save, in numpy by export), and the checks that every field
restore and export read is there."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zerojax.errors import CheckpointError
from zerojax.offload.meshes import by_mesh

# Version 2: position-sensitive checksums, which also cover the step counter, loss scale, base
# key and model state.
FORMAT, FORMAT_VERSION = "zerojax-checkpoint", 2


def weighted_sum(bits, flat, xp):
    """sum(w(i) * bits[i]) over the elements, w an odd hash of the flat index i: in wrapping
    uint32 arithmetic, so numpy and the device agree exactly, for any sharding or chunking."""
    h = flat * xp.uint32(0x9E3779B1)
    h = (h ^ (h >> xp.uint32(16))) * xp.uint32(0x85EBCA6B)
    w = (h ^ (h >> xp.uint32(13))) | xp.uint32(1)  # odd: a change of any one element shows
    return xp.sum(w * bits, dtype=xp.uint32)


def strides(shape) -> list[int]:
    return [int(np.prod(shape[a + 1:], dtype=np.uint64)) % 2**32 for a in range(len(shape))]


def checksum(x) -> jax.Array:
    """Position-sensitive uint32 checksum of the bit patterns (see `weighted_sum`)."""
    x = jnp.asarray(x)
    x = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
    bits = lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    flat = jnp.zeros(x.shape, jnp.uint32)
    for a, stride in enumerate(strides(x.shape)):
        flat = flat + lax.broadcasted_iota(jnp.uint32, x.shape, a) * jnp.uint32(stride)
    return weighted_sum(bits.astype(jnp.uint32), flat, jnp)


BLOCK = 1 << 22  # elements a blocked reduction reads at a time


def by_rows(x, f, init, op, block: int = BLOCK):
    """`op`-reduction of `f(rows, first)` over blocks of `x`'s leading axis (`first`: the
    uint32 flat index of the block's first element, mod 2**32), each block of about `block`
    elements or one row: the temporaries of an elementwise `f` are a block's, where XLA:CPU
    materializes them for the whole array (a checksum's index hashes: the leaf's size)."""
    x = jnp.asarray(x)
    if x.ndim == 0:
        return f(x, jnp.uint32(0))
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    rows = max(b for b in range(1, max(1, min(x.shape[0], block // max(row, 1))) + 1)
               if x.shape[0] % b == 0)
    if rows == x.shape[0]:
        return f(x, jnp.uint32(0))

    def body(i, acc):
        part = lax.dynamic_slice_in_dim(x, i * rows, rows)
        return op(acc, f(part, (i * rows).astype(jnp.uint32) * jnp.uint32(row % 2**32)))

    return lax.fori_loop(0, x.shape[0] // rows, body, init)


def checksum_by_rows(x, block: int = BLOCK) -> jax.Array:
    """`checksum(x)` with a block's temporaries (`by_rows`); the same bits: its sum wraps in
    uint32, so blocks add up to the whole."""
    x = jnp.asarray(x)
    x = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
    width = jnp.dtype(f"uint{8 * x.dtype.itemsize}")

    def part(x, first):
        bits = lax.bitcast_convert_type(x, width).astype(jnp.uint32)
        flat = jnp.full(x.shape, first, jnp.uint32)
        for a, stride in enumerate(strides(x.shape)):
            flat = flat + lax.broadcasted_iota(jnp.uint32, x.shape, a) * jnp.uint32(stride)
        return weighted_sum(bits, flat, jnp)

    return by_rows(x, part, jnp.uint32(0), lambda a, b: a + b, block)


def per_mesh(whole, rows, xs: list) -> list:
    """`whole(group)` of each mesh's group of `xs`, by a program of that mesh; on a mesh of one
    device `rows(group)`, its by-rows form (`by_rows`): the host's leaves of a model larger
    than the devices' memory, whose temporaries XLA:CPU would otherwise hold whole."""
    return by_mesh(lambda group: (rows if len(group[0].sharding.device_set) == 1
                                  else whole)(group), xs)


def np_checksum(x: np.ndarray, shape=None, start=None) -> int:
    """`checksum` of `x`, or of the box of a leaf of `shape` that starts at `start` (the
    partial sums of a leaf's boxes add up, mod 2**32, to the leaf's checksum)."""
    x = np.asarray(x)
    shape, start = x.shape if shape is None else shape, list(start or ())
    start += [0] * (x.ndim - len(start))  # a box may leave its trailing (whole) axes out
    bits = np.ascontiguousarray(x).view(f"uint{8 * x.dtype.itemsize}").astype(np.uint32)
    flat = np.zeros(x.shape, np.uint32)
    for a, stride in enumerate(strides(shape)):
        i = np.arange(start[a], start[a] + x.shape[a], dtype=np.uint64).astype(np.uint32)
        flat += (i * np.uint32(stride)).reshape([-1 if b == a else 1 for b in range(x.ndim)])
    # 1-d: numpy warns about wrapping in scalar arithmetic, not in array arithmetic
    return int(weighted_sum(bits.reshape(-1), flat.reshape(-1), np))


PARTS = ("params", "opt_state", "model_state", "")  # "": the step counter, loss scale and key


def parts(tree) -> list:
    """The logical tree in record order: params, optimizer state, model state (None for a
    model without one), and the step counter, loss scale and base key (and, from an engine
    with delayed_update, the "delayed" params)."""
    scalars = {"loss_scale": tree["loss_scale"], "rng": tree["rng"], "step": tree["step"]}
    if "delayed" in tree:  # delayed_update: the params the next step runs on
        scalars["delayed"] = tree["delayed"]
    return [tree["params"], tree["opt_state"], tree.get("model_state"), scalars]


def unparts(parts) -> dict:
    params, opt_state, model_state, scalars = parts
    tree = {"params": params, "opt_state": opt_state, **scalars}
    if model_state is not None:
        tree["model_state"] = model_state
    return tree


def named_leaves(tree) -> list[tuple[tuple[str, ...], str, object]]:
    """(stored key path, name in messages, leaf) of every leaf, in record order."""
    out = []
    for part, sub in zip(PARTS, parts(tree), strict=True):
        for path, x in jax.tree.flatten_with_path(sub)[0]:
            keys = ([part] if part else []) + keys_of(path)
            out.append((tuple(keys), part + jax.tree_util.keystr(path), x))
    return out


def leaf_checksums(tree) -> list[jax.Array]:
    """Checksums of every leaf, in record order."""
    return [checksum(x) for _, _, x in named_leaves(tree)]


def keys_of(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]


def describe(tree, sums=None) -> list[dict]:
    out = []
    for i, (path, x) in enumerate(jax.tree.flatten_with_path(tree)[0]):
        out.append({"path": jax.tree_util.keystr(path), "keys": keys_of(path),
                    "shape": list(jnp.shape(x)), "dtype": jnp.dtype(x.dtype).name})
        if sums is not None:
            out[-1]["checksum"] = sums[i]
    return out


def why(e: Exception) -> str:
    """One line about a read error (tensorstore appends its whole spec in JSON)."""
    return f"{type(e).__name__}: {str(e).split(' [tensorstore_spec=')[0]}".splitlines()[0]


_LEAF = {"path": str, "keys": list, "shape": list, "dtype": str, "checksum": int}
_RECORD = {"zerojax_version": str, "step": int, "stage": int, "mesh": dict, "param_dtype": str,
           "dynamic_loss_scale": bool, "params": list, "opt_state": dict, "model_state": list,
           "scalars": list, "extra": dict}


def check_fields(record, fields: dict, what: str, where: str) -> None:
    if not isinstance(record, dict):
        raise CheckpointError(f"{where}: {what} is {record!r:.60}, not a JSON object")
    for key, kind in fields.items():
        if key not in record:
            raise CheckpointError(f"{where}: {what} has no field {key!r} (renamed or removed)")
        value = record[key]
        if not isinstance(value, kind) or (key == "shape" and not all(
                isinstance(n, int) and n >= 0 for n in value)):
            raise CheckpointError(f"{where}: {what} has {key!r} = {value!r:.60}, not a "
                                  f"{'list of sizes' if key == 'shape' else kind.__name__}")


def check_record(meta, where: str) -> None:
    """Every field that restore and export read is there, with its type."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a zerojax checkpoint record")
    version = meta.get("format_version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise CheckpointError(f"{where} has format version {version}, newer than this zerojax "
                              f"reads ({FORMAT_VERSION}); upgrade zerojax")
    if isinstance(version, int) and version < FORMAT_VERSION:
        raise CheckpointError(
            f"{where} has format version {version}, whose order-free checksums this zerojax no "
            f"longer verifies (it reads version {FORMAT_VERSION}); read the step with the "
            f"zerojax that wrote it ({meta.get('zerojax_version', 'unknown')}) and export it")
    check_fields(meta, {"format_version": int, **_RECORD}, "the record", where)
    leaves = [("params", d, {**_LEAF, "stacked": bool}) for d in meta["params"]]
    check_fields(meta["opt_state"], {"treedef": str, "leaves": list}, "opt_state", where)
    leaves += [("opt_state", d, _LEAF) for d in meta["opt_state"]["leaves"]]
    leaves += [("model_state", d, _LEAF) for d in meta["model_state"]]
    leaves += [("scalars", d, _LEAF) for d in meta["scalars"]]
    counts = collections.Counter()
    for kind, d, fields in leaves:
        name = d.get("path", f"#{counts[kind]}") if isinstance(d, dict) else f"#{counts[kind]}"
        check_fields(d, fields, f"{kind} leaf {name}", where)
        counts[kind] += 1
