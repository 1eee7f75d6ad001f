"""Export: the consolidated fp32 params of a checkpoint step as one `.safetensors` file,
streamed leaf by leaf and chunk by chunk, and `load_exported` to read it back as plain params.
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

from zerojax.checkpoint.record import np_checksum, why
from zerojax.checkpoint.store import _dir, _open, _open_array, _stored
from zerojax.errors import CheckpointError


def _header(meta: dict, step: int) -> tuple[bytes, list[int]]:
    entries, offsets, pos = {}, [], 0
    for d in meta["params"]:
        n = 4 * int(np.prod(d["shape"], dtype=np.int64))
        entries["/".join(d["keys"])] = {"dtype": "F32", "shape": d["shape"],
                                        "data_offsets": [pos, pos + n]}
        offsets.append(pos)
        pos += n
    entries["__metadata__"] = {"format": "np", "zerojax_step": str(step),
                               "zerojax_version": meta["zerojax_version"]}
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the spec allows space padding; aligns the data
    return len(header).to_bytes(8, "little") + header, offsets


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
    leaf and chunk by chunk, so host memory stays near one stored chunk.

    `directory`: a checkpoint directory, or a training run directory holding `checkpoints/`."""
    out = Path(os.fspath(out))
    if out.suffix != ".safetensors":
        raise ValueError(f"--out {out} must end in .safetensors")
    _, step, meta = _open(directory, step)
    path = _dir(directory)
    where = f"step {step} of {path}"
    arrays_dir, arrays, use_zarr3 = _stored(path, step, where)
    header, offsets = _header(meta, step)
    # Few threads: each keeps its own malloc arena of decoded chunks (measured: half the peak).
    ctx = ocp.type_handlers.get_ts_context(use_ocdbt=True, file_io_concurrency_limit=4,
                                           data_copy_concurrency_limit=1)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            base = len(header)
            for d, off in zip(meta["params"], offsets, strict=True):
                name = arrays.get(("params", *d["keys"]))
                if name is None:
                    raise CheckpointError(f"cannot read params{d['path']} of {where}: it is "
                                          f"not among the stored arrays")
                try:
                    t = _open_array(arrays_dir, name, use_zarr3, ctx).result()
                    if tuple(t.shape) != tuple(d["shape"]):
                        raise ValueError(f"stored with shape {tuple(t.shape)}, recorded as "
                                         f"{tuple(d['shape'])}")
                    total = _write_leaf(f, t, base + off, tuple(d["shape"]))
                except Exception as e:  # tensorstore reports damaged files as ValueError etc.
                    raise CheckpointError(f"cannot read params{d['path']} of {where}: "
                                          f"{why(e)}") from None
                if d["checksum"] != total:
                    raise CheckpointError(f"{where} is corrupted: checksum mismatch in "
                                          f"params{d['path']}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _write_leaf(f, t, pos: int, shape: tuple[int, ...]) -> int:
    """Streams one stored array into the file at byte `pos`; returns its checksum."""
    total = 0
    chunk = tuple(t.chunk_layout.read_chunk.shape) if shape else ()
    row = [int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape))]
    for split, box in _slabs(shape, chunk):
        x = np.ascontiguousarray(t[box].read().result(), dtype=np.float32)
        total = (total + np_checksum(x, shape, [s.start or 0 for s in box])) % 2**32
        if not split:
            os.pwrite(f.fileno(), memoryview(x.reshape(-1)).cast("B"), pos)
            continue
        j, a = split
        for idx in np.ndindex(*shape[:j]):  # leading axes are whole: one write per index
            flat = sum(i * r for i, r in zip(idx, row, strict=False)) + a * row[j]
            os.pwrite(f.fileno(), memoryview(x[idx].reshape(-1)).cast("B"), pos + 4 * flat)
    return total


def load_exported(path) -> Any:
    """Params (nested dicts of numpy fp32 arrays) from an exported `.safetensors` file."""
    from flax import traverse_util
    from safetensors.numpy import load_file

    path = Path(os.fspath(path))
    if not path.is_file():
        raise FileNotFoundError(f"exported params file {path} does not exist")
    return traverse_util.unflatten_dict(load_file(path), sep="/")


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
