"""Reading a step's stored arrays straight into their shardings with tensorstore, from orbax's
own read specs. Not orbax's restore: its event loop, once a damaged file fails a read, is left
with callbacks that fire later into the closed loop, and its errors name no leaf; these reads
name the leaf and leave nothing behind."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from zerojax.checkpoint.record import why
from zerojax.errors import CheckpointError

STATE = "state"  # the orbax item that holds the arrays


READ_AHEAD = 2**30  # bytes of reads in flight during a restore: bounds its host memory


def stored_arrays(path: Path, step: int, where: str) -> tuple[Path, dict, bool]:
    """(arrays directory, {key path: orbax array name}, use_zarr3) from the step's array index.

    Read as JSON: orbax's reader of it also opens every array, through an event loop that a
    damaged file leaves callbacks behind in (they fire later, into the closed loop)."""
    directory = path / str(step) / STATE
    index = directory / "_METADATA"
    if not index.is_file():
        raise CheckpointError(f"cannot read the arrays of {where}: their index "
                              f"{STATE}/_METADATA is missing")
    try:
        raw = json.loads(index.read_text())
        keys = [tuple(str(k["key"]) for k in v["key_metadata"])
                for v in raw["tree_metadata"].values()]
        use_zarr3 = bool(raw.get("use_zarr3", False))
    except (OSError, ValueError, LookupError, TypeError, AttributeError) as e:
        raise CheckpointError(f"cannot read the array index {index} of {where}: "
                              f"{why(e)}") from None
    return directory, {k: ".".join(k) for k in keys}, use_zarr3  # orbax's names


def open_array(directory: Path, name: str, use_zarr3: bool, ctx):
    """A future of the tensorstore of one stored array."""
    import tensorstore as ts
    from etils import epath

    ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(directory)
    info = ocp.type_handlers.ParamInfo(name=name, parent_dir=epath.Path(directory),
                                       use_zarr3=use_zarr3, is_ocdbt_checkpoint=ocdbt,
                                       ts_context=ctx)
    return ts.open(ts.Spec(ocp.type_handlers.get_json_tspec_read(info, ocdbt)), open=True,
                   context=ctx)


def read_arrays(stored: tuple[Path, dict, bool], named, where: str) -> list[jax.Array]:
    """Each (keys, name, ShapeDtypeStruct) of `named` read into its sharding, this process's
    shards only. Tensorstore futures rather than orbax's event loop: a failed read leaves no
    callback behind to fire into a closed loop, and the error names its leaf."""
    directory, arrays, use_zarr3 = stored
    ctx = ocp.type_handlers.get_ts_context(use_ocdbt=True)
    failed = lambda name, why: CheckpointError(f"cannot read {name} of {where}: {why}")
    opened = []
    for keys, name, _ in named:
        if keys not in arrays:
            raise failed(name, f"it is not among the arrays of {STATE}/_METADATA")
        try:
            opened.append(open_array(directory, arrays[keys], use_zarr3, ctx))
        except Exception as e:
            raise failed(name, why(e)) from None
    out, pending, in_flight = [], collections.deque(), 0

    def finish():
        nonlocal in_flight
        name, x, reads, nbytes = pending.popleft()
        try:
            shards = [jax.device_put(r.result(), d) for r, devices in reads for d in devices]
        except Exception as e:  # tensorstore reports damaged files as ValueError etc.
            raise failed(name, why(e)) from None
        out.append(jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards))
        in_flight -= nbytes

    for (_, name, x), future in zip(named, opened, strict=True):
        try:
            t = future.result()
        except Exception as e:
            raise failed(name, why(e)) from None
        got = (np.dtype(t.dtype.numpy_dtype), tuple(t.shape))
        if got != (np.dtype(x.dtype), tuple(x.shape)):
            raise failed(name, f"stored as {got[0].name}{got[1]}, recorded as "
                               f"{np.dtype(x.dtype).name}{tuple(x.shape)}")
        boxes = collections.defaultdict(list)  # a replicated shard is read once
        for d, index in x.sharding.addressable_devices_indices_map(x.shape).items():
            boxes[tuple(s.indices(n)[:2] for s, n in zip(index, x.shape, strict=True))].append(d)
        reads = [(t[tuple(slice(a, b) for a, b in box)].read(), devices)
                 for box, devices in boxes.items()]
        nbytes = sum(int(np.prod([b - a for a, b in box])) for box in boxes) * got[0].itemsize
        pending.append((name, x, reads, nbytes))
        in_flight += nbytes
        while in_flight > READ_AHEAD and len(pending) > 1:
            finish()
    while pending:
        finish()
    return out
