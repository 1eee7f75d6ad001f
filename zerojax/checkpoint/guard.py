"""What a save refuses or reports instead of losing a step: a `keep` that would delete every
step, a step that is not an integer, a diverged (non-finite) state, and a write that fails (a
full disk) as one error naming the directory and its free space."""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import re
import resource
import shutil
import sys
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.checkpoint.record import by_rows, per_mesh
from zerojax.errors import ArgumentError, CheckpointError, ConfigError


def check_keep(keep) -> int | None:
    """`keep` as a positive int or None; 0 would delete every step, the new one included."""
    if keep is None:
        return None
    if isinstance(keep, (bool, np.bool_)) or not isinstance(keep, (int, np.integer)) \
            or keep < 1:
        raise ConfigError(f"keep={keep!r} must be a positive integer (how many of the most "
                          f"recent steps to keep, the new one included) or None to keep every "
                          f"step")
    return int(keep)


def check_step(step) -> int:
    """A step number given by the caller: a non-negative integer (not a string or float)."""
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
        hint = f"; e.g. step={int(step)}" if isinstance(step, str) and step.isdigit() else ""
        raise ArgumentError(f"step={step!r} ({type(step).__name__}) is not a step number; "
                            f"pass an integer{hint}")
    if step < 0:
        raise ArgumentError(f"step={step} is negative; steps count from 0")
    return int(step)


def _checked(engine, tree) -> list[tuple[str, jax.Array]]:
    """(name, leaf) of the float params and the optimizer state's param-like leaves (moments)
    of the logical `tree`. Other optimizer leaves may be inf by design (a best-so-far value)."""
    opt = engine.plan.update.param_like(tree["opt_state"])
    out = []
    for part, sub in (("params", tree["params"]), ("opt_state", opt)):
        for path, x in jax.tree.flatten_with_path(sub)[0]:
            if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
                out.append((part + jax.tree_util.keystr(path), x))
    return out


def first_nonfinite(engine, tree) -> str | None:
    """The name of the first leaf of the logical `tree` (params, then optimizer moments) that
    holds a NaN or inf, or None; one small reduction per leaf, where the leaf lives."""
    checked = _checked(engine, tree)
    if not checked:
        return None
    ok = np.asarray(jax.device_get(per_mesh(_finite, _finite_by_rows, [x for _, x in checked])))
    return None if ok.all() else checked[int(np.argmin(ok))][0]


_finite = jax.jit(lambda xs: [jnp.all(jnp.isfinite(x)) for x in xs])
# on one device by blocks of rows, as the checksums (record.by_rows)
_finite_by_rows = jax.jit(lambda xs: [by_rows(x, lambda p, _: jnp.all(jnp.isfinite(p)),
                                              jnp.bool_(True), jnp.logical_and) for x in xs])


# tensorstore names the OS error of a failed write: "... File too large [os_error_code='27']"
_OS_CODE = re.compile(r"os_error_code='?(\d+)")


def write_errno(e: BaseException) -> int | None:
    """The OS error (errno) of a write that failed: an OSError's, or the one a tensorstore or
    orbax message names (a full disk, a file-size limit); None for anything else."""
    if isinstance(e, OSError) and e.errno:
        return e.errno
    return _errno_of(str(e))


def _errno_of(text: str) -> int | None:
    m = _OS_CODE.search(text)
    if m:
        return int(m.group(1))
    if "No space left on device" in text or "RESOURCE_EXHAUSTED" in text:
        return errno.ENOSPC
    if "File too large" in text:
        return errno.EFBIG
    if "Disk quota exceeded" in text:
        return errno.EDQUOT
    return None


def why_not_written(code: int, path: Path) -> str:
    """Why a write into `path` failed with OS error `code`, and the free space there: "no space
    left on its device (1.2 MB free)"."""
    free = free_space(path)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on its device ({free})"
    if code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        cap = f" of {limit:,} bytes" if limit != resource.RLIM_INFINITY else ""
        return f"a file would exceed the file-size limit{cap} (ulimit -f; {free})"
    return f"{os.strerror(code)} ({free})"


def fix_for(code: int) -> str:
    """What to do about a write that failed with OS error `code`, to go on: "Free some space"."""
    if code == errno.EFBIG:
        return "Raise the file-size limit (ulimit -f unlimited)"
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "Free some space"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "Make the directory writable"
    return "Fix the cause"


class _QuietNoSpace(logging.Filter):
    """Drops orbax's log records of a write that failed (no space, a file-size limit): each of
    its threads logs the error with a traceback, and `writing` reports it once, as one error;
    so does asyncio, of the futures the failed write left unread."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "asyncio" and "orbax" not in record.pathname.replace("\\", "/"):
            return True
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += str(record.exc_info[1])
        return _errno_of(text) is None


logging.getLogger("absl").addFilter(_QuietNoSpace())
logging.getLogger("asyncio").addFilter(_QuietNoSpace())


def free_space(path: Path) -> str:
    """The free space of the file system holding `path` (or its nearest existing parent)."""
    for p in (path, *path.parents):
        try:
            free = shutil.disk_usage(p).free
        except OSError:
            continue
        return f"{free / 1e6:,.1f} MB free" if free >= 1e5 else f"{free:,} bytes free"
    return "free space unknown"


def _quiet_closed_loops() -> None:
    """After a failed write, the write's abandoned tensorstore futures may still complete and
    call back into orbax's closed event loop; each would print a RuntimeError as unraisable.
    Installed (once) before the first write: those (and only those) are dropped, everything
    else goes to the hook as before."""
    previous = sys.unraisablehook
    if getattr(previous, "zerojax_quiet", False):
        return

    def hook(u):
        if not (u.exc_type is RuntimeError and str(u.exc_value) == "Event loop is closed"):
            previous(u)

    hook.zerojax_quiet = True
    sys.unraisablehook = hook


def _quiet_abandoned_writes() -> None:
    """After a failed write, orbax's event loop may close with some of the step's fragment
    writes not yet started; each such coroutine warns "was never awaited" when it is collected,
    which may be as Python shuts down, after the one line that reported the failure. Those
    (and only those) are dropped; installed once a write has failed."""
    warnings.filterwarnings("ignore", category=RuntimeWarning,
                            message=r"coroutine '[\w.<>]*write_fragment' was never awaited")


# orbax's threads that write a step's items: once one fails, the others may still be writing.
_WRITERS = ("array_type_handler", "serialize_shardings", "write_metadata_after_commits",
            "json_ch_save", "save_finalize")


def _remove_partial(path: Path, step: int | None) -> None:
    """Removes what a failed save of `step` left (its temporary directory), freeing its space,
    once orbax's other writers of it are done; on process 0, which orbax lets finalize."""
    for t in threading.enumerate():
        if t.name.startswith(_WRITERS) and t is not threading.current_thread():
            with contextlib.suppress(Exception):  # orbax's threads re-raise their error here
                t.join(timeout=60)
    gc.collect()  # the failed write's abandoned coroutines end now, not as Python shuts down
    if step is None or jax.process_index() != 0:
        return
    for p in path.glob(f"{step}.orbax-checkpoint-tmp*"):
        shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def writing(path: Path, step: int | None = None):
    """Reports a write into the checkpoint directory `path` that failed (no space, a file-size
    limit, another OS error) as one CheckpointError naming the directory, why and its free
    space; the complete steps there are left as they were (orbax writes each step into a
    temporary directory first, which is removed here or by the next save)."""
    _quiet_closed_loops()
    try:
        yield
    except Exception as e:  # orbax raises the write's error as it comes, of many types
        code = write_errno(e)
        if code is None:
            raise
        _quiet_abandoned_writes()
        _remove_partial(path, step)
        what = f"step {step}" if step is not None else "a checkpoint step"
        damage = (f"cannot write {what} to {path}: {why_not_written(code, path)}; the steps "
                  f"saved there before are intact")
        more = " (or keep fewer steps: keep=)" if code in (errno.ENOSPC, errno.EDQUOT) else ""
        raise CheckpointError(f"{damage}. {fix_for(code)}{more} and save again",
                              damage=damage) from None
