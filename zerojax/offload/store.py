"""The NVMe tier's store: a process's fp32 master and AdamW moments in files under one
directory, a working copy (the checkpoints stay the record; docs/nvme.md, "Design notes").

    DIR/zerojax-store.json   what the store holds and for whom: the run's identity (a JSON
                             token the engine gives: leaf paths, shapes, dtypes, run id...),
                             each shard's leaf sizes, "state" ("clean" or "dirty"), a record
    DIR/zerojax-store.lock   held (flock) while a process has the store open
    DIR/shard-NNNNN.bin      one device shard's state: per leaf, its master, mu and nu, each
                             n float32 padded to 4 KiB (`layout`); preallocated whole

A store whose identity or shards are not this run's, that another process holds, or a
directory holding other files is refused by name (`StoreError`), as are a read-only path and
a disk without room for the whole store (at creation: the files are preallocated, so a step
never meets a full disk half way). `begin` marks the store dirty before anything writes to
it, `commit` makes the data durable and marks it clean: a store found dirty was left half
written (a crash, an I/O error) and holds no valid state.
"""

from __future__ import annotations

import ctypes
import errno as errnos
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from zerojax.errors import StoreError
from zerojax.offload.nvme import COUNTERS, library

META, LOCK, FORMAT = "zerojax-store.json", "zerojax-store.lock", 1
ALIGN = 4096  # O_DIRECT's unit; a region, a block and a bulk transfer are whole ones
UNIT = ALIGN // 4  # float32 per ALIGN
BLOCK, COUNT = 1 << 20, 4  # elements per buffer (of each of master, mu, nu), buffers: measured
PARTS = ("master", "mu", "nu")


def layout(sizes: list[int]) -> tuple[list[tuple[int, int, int]], int]:
    """(the byte offsets of each leaf's master, mu and nu, the file's bytes) for leaves of
    `sizes` elements."""
    at, offsets = 0, []
    for n in sizes:
        stride = -(-4 * n // ALIGN) * ALIGN
        offsets.append((at, at + stride, at + 2 * stride))
        at += 3 * stride
    return offsets, at


def shard_file(index: int) -> str:
    return f"shard-{index:05d}.bin"


class Store:
    """A process's store at `path` for the run `identity` (a JSON-able token; the engine's),
    holding the shards `shards` ({shard index: [elements per leaf]}): opened, or created and
    preallocated where the directory holds none. `block` (elements, a multiple of 1024) and
    `count` size the update's ring of buffers (3 * 4 * block bytes each); `direct`: O_DIRECT
    where the file system takes it (`io` says what each shard got)."""

    def __init__(self, path, identity, shards: dict[int, list[int]], *, block: int = BLOCK,
                 count: int = COUNT, direct: bool = True):
        self.path = Path(path)
        self.identity = json.loads(json.dumps(identity))  # as it reads back
        self.shards = {int(k): [int(n) for n in v] for k, v in shards.items()}
        self._lock, self.handle = None, None
        self.dll = self._library()
        _check_block(block, count)
        self.block, self.count = block, count
        self._take()
        try:
            meta = self._read_meta()
            if meta is None:
                self._create()
                meta = self._read_meta()
            self.state, self.record = meta["state"], meta.get("record", {})
            self._open(direct)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ opening

    @staticmethod
    def _library():
        dll, why = library()
        if dll is None:
            raise StoreError(f"the NVMe tier's update is a C++ pass built at first use, and "
                             f"{why}; install a C++ compiler (g++, or set CXX)")
        return dll

    def _fail(self, what: str, e: OSError):
        if e.errno in (errnos.EROFS, errnos.EACCES, errnos.EPERM):
            raise StoreError(f"nvme_path {self.path} is not writable ({e.strerror}, {what}); "
                             f"give nvme_path a writable directory", self.path,
                             e.errno) from None
        if e.errno in (errnos.ENOSPC, errnos.EDQUOT):
            raise StoreError(f"nvme_path {self.path}: no space left on its disk ({what}); the "
                             f"store needs {self.bytes:,} bytes: free space there or give "
                             f"nvme_path on a larger disk", self.path, e.errno) from None
        raise StoreError(f"nvme_path {self.path}: {what} failed ({e})", self.path,
                         e.errno) from None

    def _take(self):
        """The directory made, and its lock held by this process."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            self._fail("making the store's directory and lock", e)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreError(f"the NVMe store at {self.path} is in use by another process (it "
                             f"holds {LOCK}); give this run another nvme_path", self.path
                             ) from None

    def _read_meta(self) -> dict | None:
        """The store's metadata, or None where the directory holds no store (and nothing
        else: another file there is refused); a foreign store is refused."""
        file = self.path / META
        if not file.exists():
            mine = {LOCK, META + ".tmp", *(shard_file(i) for i in self.shards)}
            other = sorted(p.name for p in self.path.iterdir() if p.name not in mine)
            if other:
                raise StoreError(f"nvme_path {self.path} holds files that are not a zerojax "
                                 f"store ({', '.join(other[:3])}{'...' if len(other) > 3 else ''}"
                                 f"); give nvme_path an empty or new directory", self.path)
            return None
        try:
            meta = json.loads(file.read_text())
            meta["identity"], meta["shards"], meta["state"]  # noqa: B018 (present)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StoreError(f"the NVMe store at {self.path} has an unreadable {META} ({e}); "
                             f"delete {self.path} to start a store there afresh", self.path
                             ) from None
        mine = {str(k): v for k, v in self.shards.items()}
        if meta.get("format") != FORMAT or meta["identity"] != self.identity \
                or meta["shards"] != mine:
            raise StoreError(f"the NVMe store at {self.path} belongs to another run or shape "
                             f"({_difference(meta, self.identity, mine)}); give this run "
                             f"another nvme_path, or delete {self.path} to start it afresh "
                             f"there", self.path)
        return meta

    def _create(self):
        """The shards' files made and preallocated, then the metadata (dirty: nothing valid
        in them yet); on failure nothing of the store is left but the lock."""
        need = self.bytes
        try:
            usage = shutil.disk_usage(self.path)
            free = usage.free if usage.total else None  # ramfs tells no size: fallocate will
        except OSError:
            free = None
        if free is not None and free < need:
            raise StoreError(f"nvme_path {self.path} has {free:,} bytes free; the store needs "
                             f"{need:,}: free space there or give nvme_path on a larger disk",
                             self.path, errnos.ENOSPC)
        made = []
        try:
            for index, sizes in self.shards.items():
                file = self.path / shard_file(index)
                made.append(file)
                fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
                try:
                    size = layout(sizes)[1]
                    if size:
                        os.posix_fallocate(fd, 0, size)
                finally:
                    os.close(fd)
            self._write_meta("dirty", {})
        except OSError as e:
            for file in made:
                file.unlink(missing_ok=True)
            self._fail("creating the store's files", e)

    def _open(self, direct: bool):
        self.handle = self.dll.zjn_open(self.block, self.count)
        self.io = {}
        for index, sizes in self.shards.items():
            offsets, size = layout(sizes)
            file = self.path / shard_file(index)
            try:
                if file.stat().st_size < size:  # shortened since: room for it again
                    with open(file, "r+b") as f:
                        os.posix_fallocate(f.fileno(), 0, size)
            except OSError as e:
                self._fail(f"preallocating {file.name}", e)
            n = np.asarray(sizes or [0], np.int64)
            at = np.asarray(offsets or [(0, 0, 0)], np.int64)
            got, err = ctypes.c_int(0), _text()
            rc = self.dll.zjn_add_shard(self.handle, index, str(file).encode(), len(sizes),
                                        n.ctypes.data, at.ctypes.data, int(direct), got, err,
                                        len(err))
            if rc:
                raise StoreError(err.value.decode(), self.path, rc)
            self.io[index] = "O_DIRECT" if got.value else (
                "buffered (O_DIRECT not asked)" if not direct else
                "buffered: the file system refused O_DIRECT")

    # ------------------------------------------------------------ the store's state

    @property
    def bytes(self) -> int:
        """The state's bytes on disk (master and moments, with their padding)."""
        return sum(layout(s)[1] for s in self.shards.values())

    @property
    def direct(self) -> bool:
        """Whether every shard's file is read and written with O_DIRECT."""
        return all(v == "O_DIRECT" for v in self.io.values())

    @property
    def clean(self) -> bool:
        """Whether the last write to the store was committed (False: created and never
        written whole, or left half written by a crash or an error)."""
        return self.state == "clean"

    def _write_meta(self, state: str, record: dict):
        meta = {"format": FORMAT, "identity": self.identity,
                "shards": {str(k): v for k, v in self.shards.items()}, "state": state,
                "record": record}
        tmp = self.path / (META + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / META)
        dir_fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self.state, self.record = state, record

    def begin(self):
        """Marks the store dirty (durably) before an update or a bulk write changes it."""
        if self.state != "dirty":
            try:
                self._write_meta("dirty", self.record)
            except OSError as e:
                self._fail("marking the store dirty", e)

    def commit(self, **record):
        """Makes what was written durable (fdatasync) and marks the store clean, with
        `record` (JSON-able: the step it holds, say) in its metadata."""
        err = _text()
        rc = self.dll.zjn_sync(self.handle, err, len(err))
        if rc:
            raise StoreError(err.value.decode(), self.path, rc)
        try:
            self._write_meta("clean", record)
        except OSError as e:
            self._fail("marking the store clean", e)

    def configure(self, block: int | None = None, count: int | None = None):
        """The ring's `block` (elements) and `count` (buffers) for the passes from now on."""
        block, count = block or self.block, count or self.count
        _check_block(block, count)
        self.dll.zjn_configure(self.handle, block, count)
        self.block, self.count = block, count

    def counters(self, reset: bool = False) -> dict:
        """Bytes read and written, passes, and the seconds spent reading, writing, computing
        and waiting for a block, since the store was opened or the last `reset`."""
        out = np.zeros(len(COUNTERS), np.int64)
        self.dll.zjn_counters(self.handle, out.ctypes.data, int(reset))
        return {k: int(v) if i < 3 else v / 1e9 for i, (k, v) in enumerate(zip(COUNTERS, out))}

    # ------------------------------------------------------------ bulk transfers

    def _transfer(self, shard: int, leaf: int, part: str, lo: int, data: np.ndarray,
                  write: bool):
        err = _text()
        rc = self.dll.zjn_transfer(self.handle, shard, leaf, PARTS.index(part), lo, data.size,
                                   data.ctypes.data, int(write), err, len(err))
        if rc:
            raise StoreError(err.value.decode(), self.path, rc)

    def write(self, shard: int, leaf: int, part: str, lo: int, data):
        """Writes float32 `data` into `part` ("master", "mu" or "nu") of a leaf from element
        `lo` (a multiple of 1024; `data`'s size too unless it ends the leaf)."""
        data = np.ascontiguousarray(np.asarray(data, np.float32).reshape(-1))
        self._transfer(shard, leaf, part, lo, data, True)

    def read(self, shard: int, leaf: int, part: str, lo: int = 0, k: int | None = None
             ) -> np.ndarray:
        """`k` float32 of `part` of a leaf from element `lo` (default: to its end)."""
        k = self.shards[shard][leaf] - lo if k is None else k
        out = np.empty(k, np.float32)
        self._transfer(shard, leaf, part, lo, out, False)
        return out

    def chunk(self) -> int:
        """Elements per bulk transfer: a buffer's (3 * block)."""
        return 3 * self.block

    def write_leaf(self, shard: int, leaf: int, master, mu=None, nu=None):
        """Writes a leaf's master and moments (None: zeros, an optimizer's first state) a
        block at a time from anything sliceable of the leaf's size (a numpy array, a memmap,
        a CPU jax array), so no more than a block of each is copied at once."""
        for part, src in zip(PARTS, (master, mu, nu), strict=True):
            self.write_part(shard, leaf, part, src)

    def write_part(self, shard: int, leaf: int, part: str, src=None):
        """Writes `part` of a leaf as `write_leaf` does (None: zeros)."""
        n, step = self.shards[shard][leaf], self.chunk()
        flat = None if src is None else _flat(src, n)
        for lo in range(0, n, step):
            k = min(step, n - lo)
            block = np.zeros(k, np.float32) if flat is None else flat[lo:lo + k]
            self.write(shard, leaf, part, lo, block)

    def blocks(self, shard: int, leaf: int, part: str) -> Iterator[tuple[int, np.ndarray]]:
        """`part` of a leaf a block at a time: (its first element, the block)."""
        n, step = self.shards[shard][leaf], self.chunk()
        for lo in range(0, n, step):
            yield lo, self.read(shard, leaf, part, lo, min(step, n - lo))

    def read_leaf(self, shard: int, leaf: int, part: str, out=None) -> np.ndarray:
        """`part` of a leaf, read a block at a time into `out` (a float32 array or memmap of
        its size; default a new array)."""
        n = self.shards[shard][leaf]
        out = np.empty(n, np.float32) if out is None else out
        flat = out.reshape(-1)
        for lo, block in self.blocks(shard, leaf, part):
            flat[lo:lo + block.size] = block
        return out

    # ------------------------------------------------------------ closing

    def close(self):
        """Closes the files and lets the directory go (the files stay)."""
        if self.handle is not None:
            self.dll.zjn_close(self.handle)
            self.handle = None
        if self._lock is not None:
            os.close(self._lock)  # the flock with it
            self._lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # at interpreter exit the library may be gone
            pass


def _check_block(block: int, count: int):
    if not (isinstance(block, int) and block > 0 and block % UNIT == 0):
        raise ValueError(f"block={block!r}: the NVMe ring's buffers hold a positive multiple "
                         f"of {UNIT} elements (O_DIRECT's 4 KiB); e.g. {BLOCK}")
    if not (isinstance(count, int) and count >= 2):
        raise ValueError(f"count={count!r}: the NVMe ring needs at least 2 buffers (one "
                         f"updated, one read or written); e.g. {COUNT}")


def _flat(src, n: int):
    flat = np.asarray(src).reshape(-1)  # a view: of a memmap's file, a CPU jax array's buffer
    if flat.shape[0] != n:
        raise ValueError(f"an array of {flat.shape[0]} elements for a leaf of {n}")
    return flat


def _difference(meta: dict, identity, shards: dict) -> str:
    """What differs between a store's metadata and this run, in a few words."""
    theirs = meta.get("identity")
    if isinstance(theirs, dict) and isinstance(identity, dict):
        for k in sorted(set(theirs) | set(identity)):
            if theirs.get(k) != identity.get(k):
                return (f"its {k} {_short(theirs.get(k))}, this run's "
                        f"{_short(identity.get(k))}")
    elif theirs != identity:
        return f"its run {_short(theirs)}, this run's {_short(identity)}"
    if meta.get("format") != FORMAT:
        return f"format {meta.get('format')!r}, this zerojax's {FORMAT}"
    return (f"its shards {_short(sorted(meta['shards']))} of other sizes, this run's "
            f"{_short(sorted(shards))}")


def _short(x) -> str:
    text = json.dumps(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _text():
    return ctypes.create_string_buffer(512)  # a C call's message
