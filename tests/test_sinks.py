"""A run's records in every sink: metrics.jsonl, TensorBoard event files, a W&B run; the same
values, each step once, across resumes."""

import json
import shutil

import numpy as np
import pytest
from helpers import by_tag, tensorboard_scalars, wandb_history

from zerojax.app.sinks import MetricsWriter


def record(step: int, base: float) -> dict:
    r = {"step": step, "loss": base / step, "grad_norm": 1 + step / 7, "lr": 1e-3 * step,
         "tokens_per_s": 100.0 * step, "tokens_per_s_per_device": 25.0 * step,
         "step_time_s": 0.01 + step / 1000, "tflops_per_device": 3.5 + step, "mfu": 0.25}
    return r | ({"eval_loss": base / (step + 1)} if step % 3 == 0 else {})


def write(out, start: int, steps, base: float, **kw) -> list[dict]:
    log = MetricsWriter(out, start, **kw)
    if start == 0:
        log.write({"step": 0, "eval_loss": base})
    for s in steps:
        log.write(record(s, base))
    log.close()
    return log.records


def test_tensorboard_holds_each_step_once_across_resumes(tmp_path):
    records = write(tmp_path, 0, range(1, 7), 4.0)
    assert tensorboard_scalars(tmp_path) == by_tag(records)
    # Resumed from step 3 with other values (a nondeterministic rerun): steps 4-6 are replaced.
    records = write(tmp_path, 3, range(4, 9), 8.0)
    assert [r["step"] for r in records] == list(range(9))
    assert tensorboard_scalars(tmp_path) == by_tag(records)
    assert tensorboard_scalars(tmp_path)["learning/loss"][4] == np.float32(8.0 / 4)
    # The event files are rewritten: one file, from step 0, whatever the old ones held.
    (newest,) = (tmp_path / "tensorboard").iterdir()
    assert sorted(tensorboard_scalars(tmp_path, newest)["learning/loss"]) == list(range(1, 9))
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[4])["loss"] == 2.0
    # A new run from step 0 starts the curves again.
    records = write(tmp_path, 0, range(1, 3), 2.0)
    assert tensorboard_scalars(tmp_path) == by_tag(records)
    assert len(list((tmp_path / "tensorboard").iterdir())) == 1


def test_tensorboard_after_a_kill_holds_metrics_jsonl_whatever_was_flushed(tmp_path):
    """A killed process's event file may end anywhere: before its last checkpoint's steps (not
    flushed) or past them (superseded). The resume's file replays metrics.jsonl and opens with
    a restart at step 0, so even a reader that still sees the old file (a live TensorBoard)
    holds each record once."""
    import shutil

    write(tmp_path, 0, range(1, 9), 4.0)
    stale = tmp_path / "stale"
    shutil.copytree(tmp_path / "tensorboard", stale)  # steps 0-8 of a killed process
    # The kill lost the flush of steps 5-8: the resume from checkpoint 6 must write 5 and 6.
    write(tmp_path, 0, range(1, 5), 4.0, tensorboard=False)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines + [json.dumps(record(s, 4.0))
                                                                for s in (5, 6)]) + "\n")
    records = write(tmp_path, 6, range(7, 10), 5.0)
    assert [r["step"] for r in records] == list(range(10))
    assert tensorboard_scalars(tmp_path) == by_tag(records)
    (new,) = (tmp_path / "tensorboard").iterdir()
    for old in stale.iterdir():  # the old file back beside the new one: the restart hides it
        shutil.copy(old, tmp_path / "tensorboard" / ("events.out.tfevents.0." + old.name[-20:]))
    assert tensorboard_scalars(tmp_path) == by_tag(records)
    assert tensorboard_scalars(tmp_path)["learning/loss"][7] == np.float32(5.0 / 7)


def test_a_tag_only_the_killed_run_wrote_past_the_resume_is_gone(tmp_path):
    """The killed run wrote a tag past the resume point that the resumed records never write
    (a model's metric of its last steps). TensorBoard's reader drops a tag's points past a
    step it sees again, so the tags the replay writes hide an old file's later steps by
    themselves; this tag's only the restart event (`purge_step`) drops."""
    killed = [record(s, 4.0) | ({"aux": 9.0} if s == 8 else {}) for s in range(1, 9)]
    log = MetricsWriter(tmp_path, 0)
    for r in killed:
        log.write(r)
    log.close()
    stale = tmp_path / "stale"
    shutil.copytree(tmp_path / "tensorboard", stale)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()[:6]  # checkpoint 6
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    records = write(tmp_path, 6, range(7, 9), 5.0)
    (old,) = stale.iterdir()  # the killed process's file back: a live reader may still see it
    shutil.copy(old, tmp_path / "tensorboard" / ("events.out.tfevents.0." + old.name[-20:]))
    seen = tensorboard_scalars(tmp_path)
    assert seen.pop("metrics/aux", {}) == {}  # the tag may stay known, without a point
    assert seen == by_tag(records)


def test_tensorboard_keeps_the_old_files_when_metrics_jsonl_lacks_the_steps(tmp_path):
    """metrics.jsonl deleted before a resume from step 4: the event files are the only record
    of steps 1-4, so they stay, and only their steps after 4 are dropped."""
    first = write(tmp_path, 0, range(1, 7), 4.0)
    (tmp_path / "metrics.jsonl").unlink()
    records = write(tmp_path, 4, range(5, 7), 8.0)
    assert [r["step"] for r in records] == [5, 6]
    assert tensorboard_scalars(tmp_path) == by_tag(first[:5] + records)


def test_tensorboard_of_a_resume_after_a_run_without_it_starts_at_step_1(tmp_path):
    write(tmp_path, 0, range(1, 5), 4.0, tensorboard=False)
    assert not (tmp_path / "tensorboard").exists()
    records = write(tmp_path, 4, range(5, 7), 4.0)
    assert sorted(tensorboard_scalars(tmp_path)["learning/loss"]) == list(range(1, 7))
    assert tensorboard_scalars(tmp_path) == by_tag(records)


def test_only_metrics_jsonl_when_disabled(tmp_path):
    records = write(tmp_path, 0, range(1, 3), 4.0, enabled=False)
    assert len(records) == 3 and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_wandb_offline_run_holds_the_same_history(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    out.mkdir()
    records = write(out, 0, range(1, 5), 4.0, wandb="zerojax-tests", config={"stage": 3})
    runs = wandb_history(out)
    assert len(runs) == 1 and runs[0]["project"] == "zerojax-tests"
    assert runs[0]["config"]["stage"] == 3
    assert runs[0]["history"] == by_tag(records, np.float64)
    # A resume continues the same W&B run (its id kept in the run directory), and its run
    # file holds the whole run: the records it keeps replayed, then its own; the killed
    # process's file (here: with steps 3-4 that the resume supersedes) moves aside.
    records = write(out, 2, range(3, 6), 8.0, wandb="zerojax-tests")
    (resumed,) = wandb_history(out)
    assert resumed["id"] == runs[0]["id"] and resumed["history"] == by_tag(records, np.float64)
    assert resumed["history"]["learning/loss"][3] == 8.0 / 3
    assert len(list((out / "wandb" / "superseded").iterdir())) == 1
    # Two fresh runs in one directory (the first killed before its first checkpoint, which
    # `train` starts again without --resume): two W&B runs, the second's id its own, and the
    # superseded run moved aside, so `wandb sync` uploads only the run metrics.jsonl holds.
    records = write(out, 0, range(1, 3), 2.0, wandb="zerojax-tests")
    (fresh,) = wandb_history(out)
    assert fresh["id"] != resumed["id"] and fresh["history"] == by_tag(records, np.float64)
    assert (out / "wandb_run_id").read_text().strip() == fresh["id"]
    assert len(list((out / "wandb" / "superseded").iterdir())) == 2


def test_a_full_disk_under_the_records_is_one_error_the_files_as_they_were(tmp_path, monkeypatch):
    """metrics.jsonl: an append cut short is taken back; TensorBoard: the failure on its writer
    thread is raised on the next write, once, with no thread traceback."""
    import errno
    import os
    import threading

    from zerojax.app.files import RunFileError

    log = MetricsWriter(tmp_path, 0)
    log.write(record(1, 4.0))
    before = (tmp_path / "metrics.jsonl").read_bytes()
    real = os.write

    def half(fd, data):  # the disk fills halfway through the record
        if len(data) > 8:
            return real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "write", half)
        with pytest.raises(RunFileError, match=r"^cannot append to .*metrics.jsonl: no space "
                                               r"left on its device \([\d,.]+ (MB|bytes) free\)"
                                               r"; the records before it are intact in "
                                               r"metrics.jsonl. Free some space and run again$"):
            log.log.write(record(2, 4.0))
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    assert [r["step"] for r in log.records] == [1]

    hooked = []
    monkeypatch.setattr(threading, "excepthook", hooked.append)
    sink = log.sinks[0]

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sink.file.inner, "flush", full)
    sink.writer.flush()  # what tensorboardX's thread does every 10 s
    with pytest.raises(RunFileError, match=r"^cannot write .*tensorboard/events.out.tfevents.*: "
                                           r"no space left on its device .*; metrics.jsonl holds "
                                           r"every record. Free some space and run again$"):
        log.write(record(3, 4.0))
    log.close(failed=True)  # a failed run closes quietly
    assert not hooked


def test_a_resumed_run_log_counts_skipped_steps_on_from_the_last_record(tmp_path):
    """float16's skipped steps are a running count: a log reopened from step 3 (a resume)
    continues the count its last kept record holds, not from 0 nor from a superseded one."""
    from zerojax.app.runlog import RunLog

    def step(log, s, skipped):
        m = {"loss": 1.0, "grad_norm": 1.0, "loss_scale": 2.0**15, "skipped": skipped}
        return log.step(s, m, seconds=0.1)["skipped_steps"]

    log = RunLog(tmp_path, tensorboard=False, plot_every=1e9)  # no sinks, no plot to close
    assert [step(log, s, k) for s, k in ((1, 1), (2, 0), (3, 1), (4, 1))] == [1, 1, 2, 3]
    log = RunLog(tmp_path, start=3, tensorboard=False, plot_every=1e9)
    assert [step(log, s, k) for s, k in ((4, 0), (5, 1))] == [2, 3]
