"""The embedded corpus, token files and the deterministic, per-process batch source."""

import os

import numpy as np
import pytest

from zerojax.app import data
from zerojax.app.data import DataError, TokenBatches, embedded_corpus, eval_batches, load_tokens

MAX_BYTES = 2**20


def test_embedded_corpus_is_deterministic_bytes():
    train = embedded_corpus(MAX_BYTES, "train")
    data._embedded_splits.cache_clear()  # rebuild from disk, not from the cache
    again = embedded_corpus(MAX_BYTES, "train")
    assert train is not again
    np.testing.assert_array_equal(train, again)
    eval_ = embedded_corpus(MAX_BYTES, "eval")
    assert train.dtype == eval_.dtype == np.uint8
    assert train.size > 0 and eval_.size > 0
    assert train.size + eval_.size == MAX_BYTES
    assert eval_.size < train.size / 5
    assert b"def " in train.tobytes() and b"def " in eval_.tobytes()


def test_embedded_eval_files_are_not_in_train(monkeypatch, tmp_path):
    for i in range(40):
        (tmp_path / f"m{i:02d}.py").write_bytes(f"file {i:02d}\n".encode())
    for skipped in ("site-packages", "test", "idlelib"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "x.py").write_bytes(b"skipped\n")
    (tmp_path / "notes.txt").write_bytes(b"not python\n")
    monkeypatch.setattr(data.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    data._embedded_splits.cache_clear()
    try:
        train = embedded_corpus(10**6, "train").tobytes()
        eval_ = embedded_corpus(10**6, "eval").tobytes()
    finally:
        data._embedded_splits.cache_clear()
    assert eval_ == b"file 00\n\n\nfile 20\n\n\n"
    assert train == b"".join(f"file {i:02d}\n\n\n".encode() for i in range(40) if i % 20)
    assert b"skipped" not in train + eval_ and b"not python" not in train + eval_


def test_embedded_corpus_rejects_bad_split():
    with pytest.raises(DataError, match="'valid'"):
        embedded_corpus(MAX_BYTES, "valid")


@pytest.fixture(scope="module")
def tokens():
    return embedded_corpus(MAX_BYTES, "train")


def test_batch_is_deterministic_and_shifted(tokens):
    src = TokenBatches(tokens, seq_len=32, global_batch=8, seed=3)
    b0, again, b1 = src.batch(0), TokenBatches(tokens, 32, 8, seed=3).batch(0), src.batch(1)
    assert b0["inputs"].dtype == b0["targets"].dtype == np.int32
    assert b0["inputs"].shape == (8, 32)
    np.testing.assert_array_equal(b0["inputs"], again["inputs"])
    assert not np.array_equal(b0["inputs"], b1["inputs"])
    assert not np.array_equal(b0["inputs"], TokenBatches(tokens, 32, 8, seed=4).batch(0)["inputs"])
    np.testing.assert_array_equal(b0["inputs"][:, 1:], b0["targets"][:, :-1])
    assert b0["inputs"].max() < 256 and b0["inputs"].min() >= 0
    assert next(src.iterate(start_step=1))["inputs"].tolist() == b1["inputs"].tolist()


@pytest.mark.parametrize("count", [2, 4])
def test_process_slices_make_the_global_batch(tokens, count):
    one = TokenBatches(tokens, seq_len=16, global_batch=8, seed=7)
    parts = [
        TokenBatches(tokens, 16, 8, seed=7, process_index=i, process_count=count).batch(5)
        for i in range(count)
    ]
    assert parts[0]["inputs"].shape == (8 // count, 16)
    for key in ("inputs", "targets"):
        whole = np.concatenate([p[key] for p in parts])
        np.testing.assert_array_equal(whole, one.batch(5)[key])
        np.testing.assert_array_equal(whole, one.global_batch_at(5)[key])


def test_batch_errors_name_the_values():
    with pytest.raises(DataError, match=r"global_batch=6.*process_count=4"):
        TokenBatches(np.arange(100), seq_len=8, global_batch=6, process_count=4)
    with pytest.raises(DataError, match="seq_len"):
        TokenBatches(np.arange(8), seq_len=8, global_batch=2)
    with pytest.raises(DataError, match="process_index=2"):
        TokenBatches(np.arange(100), seq_len=8, global_batch=4, process_index=2, process_count=2)


def test_eval_batches_are_fixed_and_span_the_tokens():
    toks = np.arange(1000, dtype=np.uint16)
    batches = eval_batches(toks, seq_len=10, batch=3, num_batches=4)
    assert len(batches) == 4 and batches[0]["inputs"].shape == (3, 10)
    assert batches[0]["inputs"][0, 0] == 0 and batches[-1]["targets"][-1, -1] == 999
    np.testing.assert_array_equal(batches[1]["targets"], batches[1]["inputs"] + 1)
    again = eval_batches(toks, seq_len=10, batch=3, num_batches=4)
    assert all(
        np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(batches, again, strict=True)
    )


def test_load_token_files(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"hi\xff")
    np.arange(5, dtype=np.uint16).tofile(tmp_path / "a.bin")
    np.save(tmp_path / "a.npy", np.array([7, 300, 9], dtype=np.int32))
    txt, bin_, npy = (load_tokens(tmp_path / f"a.{e}") for e in ("txt", "bin", "npy"))
    assert txt.dtype == np.uint8 and txt.tolist() == [104, 105, 255]
    assert bin_.dtype == np.uint16 and bin_.tolist() == [0, 1, 2, 3, 4]
    assert isinstance(bin_, np.memmap) and isinstance(npy, np.memmap)
    assert npy.dtype == np.int32 and npy.tolist() == [7, 300, 9]


def test_load_token_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        load_tokens(tmp_path / "nope.bin")
    (tmp_path / "a.csv").write_text("1,2")
    with pytest.raises(DataError, match=r"'\.csv'.*\.npy"):
        load_tokens(tmp_path / "a.csv")
    np.save(tmp_path / "f.npy", np.zeros(4, np.float32))
    with pytest.raises(DataError, match="float32"):
        load_tokens(tmp_path / "f.npy")
    np.save(tmp_path / "2d.npy", np.zeros((2, 2), np.int32))
    with pytest.raises(DataError, match=r"\(2, 2\)"):
        load_tokens(tmp_path / "2d.npy")


class _Payload:
    def __reduce__(self):  # unpickling this would create the file
        return (open, (MARKER, "w"))


MARKER = ""


def test_token_files_never_unpickle(tmp_path):
    global MARKER
    MARKER = str(tmp_path / "ran")
    np.save(tmp_path / "obj.npy", np.array([_Payload(), 1], dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match="Python objects"):
        load_tokens(tmp_path / "obj.npy")
    (tmp_path / "junk.npy").write_bytes(b"\x80\x04junk")  # a bare pickle, no NumPy header
    with pytest.raises(DataError, match="not a .npy file"):
        load_tokens(tmp_path / "junk.npy")
    np.save(tmp_path / "short.npy", np.arange(1000, dtype=np.int32))
    (tmp_path / "short.npy").write_bytes((tmp_path / "short.npy").read_bytes()[:500])
    with pytest.raises(DataError, match="cannot load"):
        load_tokens(tmp_path / "short.npy")
    assert not (tmp_path / "ran").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files despite chmod 000")
def test_unreadable_token_file(tmp_path):
    for ext in ("txt", "bin", "npy"):
        path = tmp_path / f"a.{ext}"
        np.save(path, np.arange(10, dtype=np.uint16)) if ext == "npy" else path.write_bytes(b"ab")
        path.chmod(0)
        with pytest.raises(DataError, match="cannot read token file .*Permission denied"):
            load_tokens(path)


def test_check_ids_names_the_first_bad_id():
    ids = np.array([5, 3, -2, 7, 64, -1], dtype=np.int64)
    with pytest.raises(DataError, match=r"^t.npy has 3 token id\(s\) outside \[0, 64\), the first "
                                        r"-2 at position 12; token ids are never negative"):
        data.check_ids(ids, 64, "t.npy", offset=10)
    with pytest.raises(DataError, match="the first 64 at position 2; use a larger preset"):
        data.check_ids(ids[3:], 64, "t.npy", offset=1)
    data.check_ids(ids[:2], 64, "t.npy")
    data.check_ids(np.arange(256, dtype=np.uint8), 256, "t.bin")  # uint8 always fits


def test_split_tokens_holds_out_the_tail():
    train, eval_ = data.split_tokens(np.arange(100), 0.05)
    assert train.tolist() == list(range(95)) and eval_.tolist() == list(range(95, 100))
    with pytest.raises(DataError, match="eval_fraction=1.5"):
        data.split_tokens(np.arange(100), 1.5)
