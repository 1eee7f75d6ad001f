"""The files a run rewrites whole (metrics.jsonl on resume, summary.json, loss.png): written
beside the old one and moved over it, so a failed write (a full disk) leaves the old file as
it was."""

from __future__ import annotations

import os
from pathlib import Path

from zerojax.errors import ZeroError


class RunFileError(ZeroError):
    """A run's file that could not be written; the file is as it was before."""


def replace_file(path: Path, data: bytes) -> None:
    """`path` now holds `data`, or a RunFileError naming it and its free space, `path`
    unchanged. Never written in place: a truncated metrics.jsonl would lose the run's history."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # a delayed allocation fails here, before the old file goes
        os.replace(tmp, path)
    except OSError as e:
        raise RunFileError(_cannot_write(path, e)) from None
    finally:
        tmp.unlink(missing_ok=True)


def _cannot_write(path: Path, e: OSError) -> str:
    from zerojax.checkpoint.guard import free_space, no_space  # orbax: only on this failure

    kept = f"{path.name} is as it was" if path.exists() else f"{path.name} was not written"
    if no_space(e):
        return (f"cannot write {path}: no space left on its device ({free_space(path)}); "
                f"{kept}. Free some space and run again")
    return f"cannot write {path}: {e.strerror or e}; {kept}"
