"""The files a run rewrites whole (metrics.jsonl on resume, summary.json, loss.png): written
beside the old one and moved over it, so a failed write (a full disk) leaves the old file as
it was."""

from __future__ import annotations

import contextlib
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
        raise RunFileError(cannot_write(path, e)) from None
    finally:
        tmp.unlink(missing_ok=True)


def not_a_directory(path: Path) -> str | None:
    """Why `path` cannot be (made) a directory: "is a file" or "is under 'P', which is a
    file"; None when it is one or can be made."""
    for p in (path, *path.parents):  # the first one that exists must be a directory
        if p.exists() or p.is_symlink():
            if p.is_dir():
                return None
            return "is a file" if p == path else f"is under {str(p)!r}, which is a file"
    return None


def append_line(path: Path, line: bytes) -> None:
    """Appends `line` to `path`, or raises a RunFileError naming it and its free space with the
    file as it was: a write cut short (a full disk, a file-size limit) is taken back."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        rest = memoryview(line)
        while rest:  # unbuffered: nothing is left to be flushed, and fail, at exit
            rest = rest[os.write(fd, rest):]
    except OSError as e:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)  # else the next resume drops the cut-off last record
        raise RunFileError(cannot_write(path, e, appended=True)) from None
    finally:
        os.close(fd)


def cannot_write(path: Path, e: OSError, appended: bool = False, kept: str | None = None
                 ) -> str:
    """One line: `path` could not be written (or `appended` to), why, the free space, what is
    `kept`, and what to do."""
    from zerojax.checkpoint.guard import fix_for, why_not_written  # orbax: only on a failure

    if kept is None and appended:
        kept = f"the records before it are intact in {path.name}"
    elif kept is None:
        kept = f"{path.name} is as it was" if path.exists() else f"{path.name} was not written"
    what = f"cannot {'append to' if appended else 'write'} {path}"
    if not e.errno:
        return f"{what}: {e}; {kept}"
    return f"{what}: {why_not_written(e.errno, path)}; {kept}. {fix_for(e.errno)} and run again"
