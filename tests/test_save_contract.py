"""The save contract: no call deletes what it was not asked to delete. `keep` is a positive
count that always keeps the new step, a diverged (non-finite) state is refused, a step
directory's record must name its step, and a full disk is one error with the saved steps
intact."""

import logging
import os
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import full_disk_after

import zerojax as zj
from zerojax import checkpoint as ck
from zerojax.checkpoint import store
from zerojax.checkpoint.load import MisnamedStep
from zerojax.models import SeedMLP

BATCH = {"x": np.array([[1.0, 3.0], [2.0, 1.0]], np.float32), "y": np.array([5.0, 7.0],
                                                                             np.float32)}
NAN_BATCH = {**BATCH, "x": np.full((2, 2), np.nan, np.float32)}


def make_engine(param_dtype="float32", stage=1):
    # 2**8: the first loss scale under which these gradients fit float16
    return zj.Engine(SeedMLP(), optax.adam(0.1), zj.make_mesh(data=2),
                     zj.ZeroConfig(stage=stage, param_dtype=param_dtype, loss_scale_init=2.0**8))


@pytest.fixture(scope="module")
def seed():
    """A stage-1 engine of the walkthrough's MLP and its state after one step."""
    e = make_engine()
    state, _ = e.step(e.init(jax.random.key(0), BATCH), BATCH)
    return e, state


def test_keep_is_a_positive_count_that_keeps_the_new_step(seed, tmp_path, monkeypatch):
    e, state = seed
    for step in (5, 8):
        e.save(state, tmp_path, step=step)
    for keep in (0, -1, 1.5, True, "2"):
        with pytest.raises(zj.ConfigError, match=rf"keep={keep!r} must be a positive integer "
                                                 r"\(how many of the most recent steps to keep, "
                                                 r"the new one included\) or None"):
            e.save(state, tmp_path, step=9, keep=keep)
    assert ck.steps(tmp_path) == [5, 8]  # keep=0 used to delete both, and the new step 9
    monkeypatch.setattr(store, "KEEP", 0)  # the module default is checked as well
    with pytest.raises(zj.ConfigError, match="keep=0"):
        e.save(state, tmp_path, step=9)
    monkeypatch.undo()
    # A step below the others (a rewound run) is the newest save: it stays, 5 goes.
    e.save(state, tmp_path, step=3, keep=2)
    assert ck.steps(tmp_path) == [3, 8]
    e.save(state, tmp_path, step=4, keep=1, wait=False)
    ck.wait_until_finished(tmp_path)
    assert ck.steps(tmp_path) == [4]


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16", "float16"])
def test_a_nan_batch_is_flagged_in_every_precision(param_dtype):
    e = make_engine(param_dtype)
    state = e.init(jax.random.key(0), BATCH)
    state, m = e.step(state, BATCH)
    assert int(m["nonfinite"]) == 0 and np.isfinite(float(m["loss"]))
    state, m = e.step(state, NAN_BATCH)
    assert int(m["nonfinite"]) == 1 and np.isnan(float(m["loss"]))
    finite = all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(e.params(state)))
    # float16's dynamic loss scaling skips the step; the others take it and diverge.
    assert finite == (param_dtype == "float16")
    if param_dtype == "float16":
        assert int(m["skipped"]) == 1


def test_a_diverged_state_is_refused_and_the_good_steps_stay(seed, tmp_path):
    e, good = seed
    e.save(good, tmp_path, step=1, keep=1)
    state = e.init(jax.random.key(0), BATCH)
    state, _ = e.step(state, NAN_BATCH)
    with pytest.raises(zj.CheckpointError, match=(
            rf"^refusing to save step 2 to {tmp_path}: params\['layer1'\]\['w'\] holds NaN or "
            r"inf \(the run has diverged\); .*allow_nonfinite=True")) as err:
        e.save(state, tmp_path, step=2, keep=1)  # would have rotated step 1 out
    assert (err.value.nonfinite, err.value.step) == ("params['layer1']['w']", 2)
    assert ck.steps(tmp_path) == [1]
    restored = e.restore(tmp_path)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(e.params(restored)))
    # Finite params with a non-finite optimizer moment: named too.
    moments = jax.tree.map(lambda x: x * jnp.nan if x.ndim else x, restored.opt_state)
    with pytest.raises(zj.CheckpointError, match=r"opt_state\S*mu\S*\['layer1'\]\['w'\] holds "
                                                 r"NaN or inf"):
        e.save(restored._replace(opt_state=moments), tmp_path, step=3)
    # Asked for explicitly, it is saved.
    e.save(state, tmp_path, step=2, keep=1, allow_nonfinite=True)
    assert ck.steps(tmp_path) == [2]
    with pytest.raises(zj.ArgumentError, match=r"allow_nonfinite='yes' must be True or False"):
        e.save(state, tmp_path, step=4, allow_nonfinite="yes")


def test_a_step_directory_renamed_to_a_name_is_named(seed, tmp_path):
    """`mv 2 best`: no step any more, and every listing, restore and read says so."""
    e, state = seed
    for step in (1, 2):
        e.save(state, tmp_path, step=step)
    os.rename(tmp_path / "2", tmp_path / "best")
    note = (rf"{tmp_path} holds step directories whose names are not step numbers, which no "
            rf"restore sees: best \(step 2 by its record\); rename one to its step number to "
            rf"use it")
    with pytest.warns(MisnamedStep, match=note):
        assert ck.steps(tmp_path) == [1]
    with pytest.warns(MisnamedStep, match=note):
        assert int(e.restore(tmp_path).step) == 1
    os.rename(tmp_path / "1", tmp_path / "1.old")
    with pytest.raises(zj.CheckpointError, match=rf"^{tmp_path} holds no complete checkpoint "
                                                 rf"step; step directories whose names are not "
                                                 rf"step numbers: 1.old \(step 1 by its "
                                                 rf"record\), best \(step 2 by its record\); "
                                                 rf"rename one to its step number to use it$"):
        with pytest.warns(MisnamedStep):
            e.restore(tmp_path)


def test_a_record_knows_its_step(seed, tmp_path):
    e, state = seed
    for step in (1, 2, 3):
        e.save(state, tmp_path, step=step)
    os.rename(tmp_path / "3", tmp_path / "4")  # mv ckpt/3 ckpt/4
    want = rf"step directory {tmp_path / '4'} holds the record of step 3: it was renamed"
    with pytest.raises(zj.CheckpointError, match=rf"{want}.*; intact older steps, newest "
                                                 r"first: \[2, 1\]; restore one with step=2$"):
        e.restore(tmp_path)
    with pytest.raises(zj.CheckpointError, match=want):
        e.restore(tmp_path, step=4)
    with pytest.raises(zj.CheckpointError, match=want):
        ck.read_metadata(tmp_path, 4)
    assert ck.steps(tmp_path) == [1, 2]
    # Two swapped: neither restores as the other.
    os.rename(tmp_path / "1", tmp_path / "x")
    os.rename(tmp_path / "2", tmp_path / "1")
    os.rename(tmp_path / "x", tmp_path / "2")
    assert ck.steps(tmp_path) == []
    with pytest.raises(zj.CheckpointError, match=r"directory \S+/1 holds the record of step 2"):
        e.restore(tmp_path, step=1)


def test_a_step_is_an_integer(seed, tmp_path):
    e, state = seed
    e.save(state, tmp_path, step=0)
    for call in (lambda: e.restore(tmp_path, step="0"),
                 lambda: ck.read_metadata(tmp_path, "0")):
        with pytest.raises(zj.ArgumentError, match=r"step='0' \(str\) is not a step number; "
                                                   r"pass an integer; e.g. step=0"):
            call()
    with pytest.raises(zj.ArgumentError, match=r"step=1\.0 \(float\)"):
        e.save(state, tmp_path, step=1.0)
    # A bool is an int to Python, but no step number: True would have saved as step 1.
    for step in (True, False, np.bool_(True)):
        for call in (lambda step=step: e.save(state, tmp_path, step=step),
                     lambda step=step: e.restore(tmp_path, step=step)):
            with pytest.raises(zj.ArgumentError, match=rf"step={step!r} \({type(step).__name__}"
                                                       rf"\) is not a step number; pass an "
                                                       rf"integer$"):
                call()
    with pytest.raises(zj.ArgumentError, match=r"step=-1 is negative; steps count from 0"):
        e.save(state, tmp_path, step=-1)
    assert ck.steps(tmp_path) == [0]  # nothing was written
    assert int(e.restore(tmp_path, step=np.int64(0)).step) == 1


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("wait", [True, False])
def test_a_full_disk_is_one_error_and_the_saved_steps_stay(seed, tmp_path, wait, monkeypatch,
                                                           caplog):
    e, state = seed
    monkeypatch.setattr(*full_disk_after(1))
    e.save(state, tmp_path, step=1)
    with pytest.raises(zj.CheckpointError, match=(
            rf"^cannot write step 2 to {tmp_path}: no space left on its device \([\d,.]+ "
            r"(MB|bytes) free\); the steps saved there before are intact")):
        e.save(state, tmp_path, step=2, wait=wait)
        ck.wait_until_finished(tmp_path)  # a background save fails here
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]  # no half-written step 2
    assert not [r for r in caplog.records if "No space" in r.getMessage()]  # no tracebacks
    monkeypatch.undo()  # space freed: the same directory takes the next save
    e.save(state, tmp_path, step=2)
    assert ck.steps(tmp_path) == [1, 2]
    shutil.rmtree(tmp_path)


def test_logging_filter_keeps_other_records():
    from zerojax.checkpoint.guard import _QuietNoSpace

    keep = logging.LogRecord("absl", logging.ERROR, "/x/orbax/y.py", 1, "other failure", (), None)
    drop = logging.LogRecord("absl", logging.ERROR, "/x/orbax/y.py", 1, "No space left on device",
                             (), None)
    mine = logging.LogRecord("absl", logging.ERROR, "/x/app.py", 1, "No space left on device", (),
                             None)
    assert [_QuietNoSpace().filter(r) for r in (keep, drop, mine)] == [True, False, True]
    # asyncio's report of a future the failed write left unread, from its own module
    unread = logging.LogRecord("asyncio", logging.ERROR, "/x/asyncio/base_events.py", 1,
                               f"_GatheringFuture exception was never retrieved: {TENSORSTORE}",
                               (), None)
    other = logging.LogRecord("asyncio", logging.ERROR, "/x/asyncio/base_events.py", 1,
                              "Task exception was never retrieved: KeyError", (), None)
    assert [_QuietNoSpace().filter(r) for r in (unread, other)] == [False, True]


# What tensorstore raises from inside an orbax save under `ulimit -f`
TENSORSTORE = ("OUT_OF_RANGE: Error writing \"params.w/0\" in OCDBT database at local file "
               "\"/c/2.orbax-checkpoint-tmp/state/ocdbt.process_0/\": Failed writing: \"/c/d/4b\": "
               "Failed to write 76916 bytes to file 14: File too large [os_error_code='27']")


def test_the_os_error_of_a_failed_write_is_read_from_any_layer(tmp_path, monkeypatch):
    """An OSError's errno, or the one a tensorstore message names; each told in one line with
    the free space and what to do."""
    import errno
    import resource

    from zerojax.checkpoint.guard import fix_for, why_not_written, write_errno

    assert write_errno(ValueError(TENSORSTORE)) == errno.EFBIG
    assert write_errno(ValueError("RESOURCE_EXHAUSTED: ... No space left on device")) == \
        errno.ENOSPC
    assert write_errno(OSError(errno.EDQUOT, "Disk quota exceeded")) == errno.EDQUOT
    assert write_errno(ValueError("INVALID_ARGUMENT: bad shape")) is None
    monkeypatch.setattr(resource, "getrlimit", lambda which: (8000, 8000))
    assert re.fullmatch(r"a file would exceed the file-size limit of 8,000 bytes \(ulimit -f; "
                        r"[\d,.]+ (MB|bytes) free\)", why_not_written(errno.EFBIG, tmp_path))
    assert re.fullmatch(r"no space left on its device \([\d,.]+ (MB|bytes) free\)",
                        why_not_written(errno.ENOSPC, tmp_path))
    assert fix_for(errno.EFBIG) == "Raise the file-size limit (ulimit -f unlimited)"
    assert fix_for(errno.EROFS) == "Make the directory writable"


def test_a_full_disk_is_recognised_by_tensorstore_s_code_alone_and_its_leftovers_removed(
        tmp_path):
    """tensorstore may report a full disk as RESOURCE_EXHAUSTED with no OS error code or
    text; and a failed save's temporary directory, with orbax's numbered suffix or without,
    is removed (only that step's)."""
    import errno

    from zerojax.checkpoint import guard

    assert guard.write_errno(ValueError("RESOURCE_EXHAUSTED: Error writing \"state/d/0\"")) \
        == errno.ENOSPC
    assert guard.write_errno(ValueError("RESOURCE_EXHAUSTED: [os_error_code=27]")) == errno.EFBIG
    assert guard.write_errno(ValueError("INVALID_ARGUMENT: bad shape")) is None
    names = ["4.orbax-checkpoint-tmp", "4.orbax-checkpoint-tmp-17", "40.orbax-checkpoint-tmp-3",
             "3", "4"]
    for name in names:
        (tmp_path / name).mkdir()
    guard._remove_partial(tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "4", "40.orbax-checkpoint-tmp-3"]
