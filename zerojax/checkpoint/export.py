"""Export: the consolidated fp32 params of a checkpoint step (and the model state, under
`model_state/`) as one `.safetensors` file, streamed leaf by leaf and chunk by chunk, and
`load_exported` to read it back as plain params.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

from zerojax.checkpoint.arrays import open_array, stored_arrays
from zerojax.checkpoint.load import _open
from zerojax.checkpoint.record import np_checksum, why
from zerojax.checkpoint.store import _dir
from zerojax.errors import ArgumentError, CheckpointError

STATE_PREFIX = "model_state"  # the model state's keys in an export: model_state/<its keys>
_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
          "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64", "uint8": "U8",
          "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL"}


def _leaves(meta: dict) -> list[tuple[str, tuple[str, ...], dict, str]]:
    """(part, stored keys, record, dtype name) of every exported leaf: params (fp32), then the
    model state (its own dtypes)."""
    out = [("params", ("params", *d["keys"]), d, "float32") for d in meta["params"]]
    return out + [(STATE_PREFIX, (STATE_PREFIX, *d["keys"]), d, d["dtype"])
                  for d in meta["model_state"]]


def _header(meta: dict, step: int) -> tuple[bytes, list[int]]:
    entries, offsets, pos = {}, [], 0
    for part, _, d, dtype in _leaves(meta):
        if dtype not in _CODES:
            raise CheckpointError(f"{part}{d['path']} has dtype {dtype}, which safetensors "
                                  f"cannot hold")
        n = np.dtype(_np_dtype(dtype)).itemsize * int(np.prod(d["shape"], dtype=np.int64))
        name = "/".join(d["keys"] if part == "params" else (STATE_PREFIX, *d["keys"]))
        entries[name] = {"dtype": _CODES[dtype], "shape": d["shape"],
                         "data_offsets": [pos, pos + n]}
        offsets.append(pos)
        pos += n
    entries["__metadata__"] = {"format": "np", "zerojax_step": str(step),
                               "zerojax_version": meta["zerojax_version"]}
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the spec allows space padding; aligns the data
    return len(header).to_bytes(8, "little") + header, offsets


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return np.dtype(name)


def _slabs(shape, chunk):
    """Chunk-aligned boxes in row-major order: each stored chunk is decoded once."""
    j = next((i for i, (s, c) in enumerate(zip(shape, chunk, strict=True)) if c < s), None)
    if j is None:
        yield (), tuple(slice(None) for _ in shape)
        return
    for a in range(0, shape[j], chunk[j]):
        yield (j, a), (*(slice(None),) * j, slice(a, min(a + chunk[j], shape[j])))


def export(directory, out, step: int | None = None) -> Path:
    """Writes the fp32 params of `step` (default: latest) to a `.safetensors` file, leaf by
    leaf and chunk by chunk, so host memory stays near one stored chunk. A model state is
    written too, under `model_state/` (`load_exported(path, with_state=True)` reads it).

    `directory`: a checkpoint directory, or a training run directory holding `checkpoints/`."""
    out = Path(os.fspath(out))
    if out.suffix != ".safetensors":
        raise ArgumentError(f"out={str(out)!r} is not a .safetensors file name; export writes "
                            f"safetensors: pass e.g. out={str(out.with_suffix('.safetensors'))!r}")
    _, step, meta = _open(directory, step)
    path = _dir(directory)
    where = f"step {step} of {path}"
    arrays_dir, arrays, use_zarr3 = stored_arrays(path, step, where)
    header, offsets = _header(meta, step)
    # Few threads: each keeps its own malloc arena of decoded chunks (measured: half the peak).
    ctx = ocp.type_handlers.get_ts_context(use_ocdbt=True, file_io_concurrency_limit=4,
                                           data_copy_concurrency_limit=1)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            base = len(header)
            for (part, keys, d, dtype), off in zip(_leaves(meta), offsets, strict=True):
                name = arrays.get(keys)
                if name is None:
                    raise CheckpointError(f"cannot read {part}{d['path']} of {where}: it is "
                                          f"not among the stored arrays")
                try:
                    t = open_array(arrays_dir, name, use_zarr3, ctx).result()
                    if tuple(t.shape) != tuple(d["shape"]):
                        raise ValueError(f"stored with shape {tuple(t.shape)}, recorded as "
                                         f"{tuple(d['shape'])}")
                    total = _write_leaf(f, t, base + off, tuple(d["shape"]), _np_dtype(dtype))
                except Exception as e:  # tensorstore reports damaged files as ValueError etc.
                    raise CheckpointError(f"cannot read {part}{d['path']} of {where}: "
                                          f"{why(e)}") from None
                if d["checksum"] != total:
                    raise CheckpointError(f"{where} is corrupted: checksum mismatch in "
                                          f"{part}{d['path']}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _write_leaf(f, t, pos: int, shape: tuple[int, ...], dtype=np.float32) -> int:
    """Streams one stored array into the file at byte `pos`; returns its checksum."""
    total, size = 0, np.dtype(dtype).itemsize
    chunk = tuple(t.chunk_layout.read_chunk.shape) if shape else ()
    row = [int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape))]
    for split, box in _slabs(shape, chunk):
        x = np.ascontiguousarray(t[box].read().result(), dtype=dtype)
        total = (total + np_checksum(x, shape, [s.start or 0 for s in box])) % 2**32
        if not split:
            os.pwrite(f.fileno(), memoryview(x.reshape(-1).view(np.uint8)), pos)
            continue
        j, a = split
        for idx in np.ndindex(*shape[:j]):  # leading axes are whole: one write per index
            flat = sum(i * r for i, r in zip(idx, row, strict=False)) + a * row[j]
            os.pwrite(f.fileno(), memoryview(x[idx].reshape(-1).view(np.uint8)),
                      pos + size * flat)
    return total


def load_exported(path, *, with_state: bool = False) -> Any:
    """Params (nested dicts of numpy fp32 arrays) from an exported `.safetensors` file;
    `with_state=True`: `(params, model_state)`, the model state None if the file has none."""
    from flax import traverse_util
    from safetensors.numpy import load_file

    path = Path(os.fspath(path))
    if not path.is_file():
        raise FileNotFoundError(f"exported params file {path} does not exist")
    tree = traverse_util.unflatten_dict(load_file(path), sep="/")
    model_state = tree.pop(STATE_PREFIX, None)
    return (tree, model_state) if with_state else tree


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _UsageError(message)


def export_main(argv: list[str]) -> int:
    """`python -m zerojax export CHECKPOINT [--step S] --out FILE.safetensors`."""
    p = _Parser(prog="python -m zerojax export",
                description="Write the consolidated fp32 params of a zerojax checkpoint.")
    p.add_argument("checkpoint", help="checkpoint directory (as passed to engine.save), or a "
                                      "train --out directory")
    p.add_argument("--step", type=int, default=None, help="step to export (default: latest)")
    p.add_argument("--out", required=True, help="output file, .safetensors")
    try:
        args = p.parse_args(argv)
        if not args.out.endswith(".safetensors"):
            p.error(f"--out {args.out} must end in .safetensors")
        out = export(args.checkpoint, args.out, args.step)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except _UsageError as e:
        print(f"zerojax export: error: {e} (see --help)", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:  # a missing or damaged checkpoint: bad input, as in train
        print(f"zerojax export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
