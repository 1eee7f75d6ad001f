"""Training data for the byte-level GPT: an embedded corpus, token files, deterministic batches.

Every batch is a pure function of `(seed, step)`, so resuming needs only the step, and the
processes of a multi-host run each take their own rows of the same global batch.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

Batch = dict[str, np.ndarray]  # {"inputs": int32 [B, T], "targets": int32 [B, T]}

DEFAULT_CORPUS_BYTES = 8 * 2**20
EVAL_EVERY = 20  # every 20th stdlib file (sorted index % 20 == 0) is held out for eval
EVAL_FRACTION = 0.05
_SEPARATOR = b"\n\n"
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"})


class DataError(ValueError):
    """A bad data argument, file or token array."""


def _stdlib_files(root: Path) -> list[Path]:
    """The stdlib's `*.py` files, sorted by relative path, skipping tests and installed packages."""
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        rels += [(rel_dir / f).as_posix() for f in filenames if f.endswith(".py")]
    return [root / r for r in sorted(rels)]


@functools.lru_cache(maxsize=4)
def _embedded_splits(max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    root = Path(sysconfig.get_paths()["stdlib"])
    train: list[bytes] = []
    eval_: list[bytes] = []
    total = 0
    for i, path in enumerate(_stdlib_files(root)):
        if total >= max_bytes:
            break
        try:
            if not path.is_file():
                continue
            data = path.read_bytes() + _SEPARATOR
        except OSError:  # unreadable or vanished since the walk
            continue
        data = data[: max_bytes - total]
        (eval_ if i % EVAL_EVERY == 0 else train).append(data)
        total += len(data)
    out = tuple(np.frombuffer(b"".join(p), dtype=np.uint8) for p in (train, eval_))
    return out[0], out[1]  # read-only (frombuffer of bytes): every caller shares them


def embedded_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES, split: str = "train") -> np.ndarray:
    """Byte tokens (uint8) of this interpreter's stdlib sources; no download, cached per process.

    Files are read in sorted relative-path order until `max_bytes` in total (both splits);
    the file with sorted index `i` goes to `"eval"` if `i % 20 == 0`, else to `"train"`.
    """
    if split not in ("train", "eval"):
        raise DataError(f"split={split!r}; use 'train' or 'eval'")
    if max_bytes <= 0:
        raise DataError(f"max_bytes={max_bytes}; use a positive byte count")
    train, eval_ = _embedded_splits(int(max_bytes))
    tokens = train if split == "train" else eval_
    if tokens.size == 0:
        raise DataError(
            f"no stdlib sources under {sysconfig.get_paths()['stdlib']!r} for split={split!r}"
            f" with max_bytes={max_bytes}; raise max_bytes or pass a token file"
        )
    return tokens


def load_tokens(path: str | os.PathLike) -> np.ndarray:
    """1-D integer tokens from `.txt` (bytes as uint8), `.bin` (raw uint16) or `.npy`."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"token file {str(path)!r} is a directory; pass a .txt, .bin or .npy file")
    if path.exists() and not path.is_file():  # /dev/null, a FIFO, a socket: no tokens to map
        raise DataError(f"token file {str(path)!r} is not a regular file; pass a .txt, .bin or "
                        f".npy file")
    if not path.is_file():
        raise FileNotFoundError(f"token file not found: {str(path)!r}")
    ext = path.suffix.lower()
    if ext not in (".txt", ".bin", ".npy"):
        raise DataError(
            f"unknown token file extension {ext!r} in {str(path)!r}; use .txt, .bin or .npy"
        )
    try:
        return _read_tokens(path, ext)
    except OSError as e:
        raise DataError(f"cannot read token file {str(path)!r}: {e.strerror or e}") from None


def _read_tokens(path: Path, ext: str) -> np.ndarray:
    if ext == ".txt":
        return np.frombuffer(path.read_bytes(), dtype=np.uint8)
    if ext == ".bin":
        size = path.stat().st_size
        if size % 2:
            raise DataError(f"{str(path)!r} has {size} bytes, not a whole number of uint16 tokens")
        if size == 0:  # np.memmap refuses empty files
            return np.zeros(0, np.uint16)
        return np.memmap(path, dtype=np.uint16, mode="r")
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic != b"\x93NUMPY":  # np.load would try to unpickle it (and refuse)
        raise DataError(f"{str(path)!r} is not a .npy file (no NumPy header); write it with "
                        f"np.save(path, tokens)")
    try:  # allow_pickle stays off: a token file never needs to run code to load
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:  # a truncated file, or an object array (pickled Python objects)
        raise DataError(f"cannot load {str(path)!r}: {e}; save a 1-D integer array, e.g. "
                        f"np.save(path, tokens.astype(np.uint16).ravel())") from None
    if not np.issubdtype(tokens.dtype, np.integer) or tokens.ndim != 1:
        raise DataError(
            f"{str(path)!r} holds {tokens.dtype} with shape {tokens.shape}; save a 1-D integer"
            " array, e.g. np.save(path, tokens.astype(np.uint16).ravel())"
        )
    return tokens


def check_ids(tokens: np.ndarray, vocab: int, what: str, offset: int = 0,
              whose: str = "") -> None:
    """Raises `DataError` naming the first id of `tokens` outside `[0, vocab)`.

    `offset`: the position of `tokens[0]` in the file; `whose`: a note on the vocabulary;
    both for the message."""
    info = np.iinfo(tokens.dtype)
    if info.min >= 0 and info.max < vocab:  # the dtype cannot hold a bad id
        return
    if len(tokens) == 0 or (tokens.min() >= 0 and tokens.max() < vocab):
        return
    bad = (tokens < 0) | (tokens >= vocab)
    first = int(np.argmax(bad))
    value = int(tokens[first])
    fix = "token ids are never negative; re-tokenize" if value < 0 else (
        "use a larger preset or re-tokenize")
    raise DataError(f"{what} has {int(bad.sum()):,} token id(s) outside [0, {vocab}){whose}, "
                    f"the first {value} at position {offset + first:,}; {fix}")


def split_tokens(
    tokens: np.ndarray, eval_fraction: float = EVAL_FRACTION
) -> tuple[np.ndarray, np.ndarray]:
    """`(train, eval)` views of `tokens`: eval is the last `eval_fraction` of it, train the rest."""
    if not 0.0 < eval_fraction < 1.0:
        raise DataError(f"eval_fraction={eval_fraction}; use a value strictly between 0 and 1")
    n_eval = max(1, int(len(tokens) * eval_fraction))
    if n_eval >= len(tokens):
        raise DataError(f"{len(tokens)} tokens are too few to hold out {eval_fraction:.0%}")
    return tokens[:-n_eval], tokens[-n_eval:]


def _check_length(tokens: np.ndarray, seq_len: int) -> None:
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len}; use a positive sequence length")
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"{len(tokens)} tokens are fewer than seq_len + 1 = {seq_len + 1}; "
            "use a longer corpus or a shorter seq_len"
        )


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    x = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int32)
    return {"inputs": x[:, :-1], "targets": x[:, 1:]}


class TokenBatches:
    """Random windows of `tokens`; the global batch of step `s` depends only on `(seed, s)`.

    Process `process_index` of `process_count` gets rows
    `[process_index * B_local, (process_index + 1) * B_local)` with
    `B_local = global_batch // process_count`.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        global_batch: int,
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
    ):
        _check_length(tokens, seq_len)
        if global_batch < 1 or process_count < 1 or global_batch % process_count:
            raise DataError(
                f"global_batch={global_batch} is not a positive multiple of "
                f"process_count={process_count}; pick a global batch divisible by it"
            )
        if not 0 <= process_index < process_count:
            raise DataError(f"process_index={process_index} is outside [0, {process_count})")
        if seed < 0:
            raise DataError(f"seed={seed}; use a non-negative seed")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.global_batch = global_batch
        self.local_batch = global_batch // process_count
        self.process_index, self.process_count = process_index, process_count

    def _starts(self, step: int) -> np.ndarray:
        if step < 0:
            raise DataError(f"step={step}; steps count from 0")
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.global_batch)

    def global_batch_at(self, step: int) -> Batch:
        """The whole batch of `step` across all processes, int32 `[global_batch, seq_len]`."""
        return _windows(self.tokens, self._starts(step), self.seq_len)

    def batch(self, step: int) -> Batch:
        """This process's rows of step `step`'s global batch, int32 `[local_batch, seq_len]`."""
        lo = self.process_index * self.local_batch
        return _windows(self.tokens, self._starts(step)[lo : lo + self.local_batch], self.seq_len)

    def iterate(self, start_step: int = 0) -> Iterator[Batch]:
        """`batch(s)` for `s = start_step, start_step + 1, ...`."""
        step = start_step
        while True:
            yield self.batch(step)
            step += 1


def eval_batches(tokens: np.ndarray, seq_len: int, batch: int, num_batches: int) -> list[Batch]:
    """`num_batches` fixed batches of `batch` windows, evenly spaced across `tokens`."""
    _check_length(tokens, seq_len)
    if batch < 1 or num_batches < 1:
        raise DataError(f"batch={batch}, num_batches={num_batches}; use positive counts")
    starts = np.linspace(0, len(tokens) - seq_len - 1, batch * num_batches).astype(np.int64)
    return [_windows(tokens, s, seq_len) for s in starts.reshape(num_batches, batch)]
