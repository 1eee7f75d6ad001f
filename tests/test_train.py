"""`python -m zerojax train` / `sample`: options, end-to-end runs, multi-process, resume, failures.

Runs that need their own device count are subprocesses (the count is fixed when jax starts);
option checks run in this process, since they must finish before jax is touched.
"""

import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import FAST_COMPILE
from helpers import by_tag, sweep, tensorboard_scalars, wandb_history

import zerojax as zj
from zerojax.app import cli, options, peers, presets, recipe, report, resume, sample, train
from zerojax.app.data import embedded_corpus
from zerojax.app.files import RunFileError
from zerojax.app.records import MetricsLog
from zerojax.app.sinks import scalars
from zerojax.models import GPT

ROOT = Path(__file__).resolve().parents[1]
# The "test" preset has a 64-token vocabulary: bytes folded into it keep the runs tiny.
SMALL = ["--model", "test", "--batch", "8", "--eval-every", "10", "--eval-batches", "2",
         "--quiet"]


def _env() -> dict[str, str]:
    """Each run sets its own device count, and compiles quickly (runs of a few steps, where
    compiling dominates)."""
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS=FAST_COMPILE)


def zerojax_here(*args) -> int:
    """`python -m zerojax ARGS` in this process (the `zerojax` script's `cli.main`), for runs
    that are not about the process itself: no interpreter start and imports, and the suite's
    compiled programs. The backend starts with the suite's 8 devices first (main would set
    `--devices` for it), and the XLA_FLAGS main sets are restored after. Python warnings go to
    stderr under Python's default filters, as in a fresh process (not to pytest's summary):
    with `capfd`, the test reads all a subprocess's stderr would hold."""
    jax.devices()
    with pytest.MonkeyPatch.context() as m, warnings.catch_warnings(record=True) as caught:
        m.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
        warnings.resetwarnings()
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning,
                         ResourceWarning):
            warnings.simplefilter("ignore", category)
        code = cli.main(list(map(str, args)))
    for w in caught:
        sys.stderr.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno))
    return code


@pytest.fixture(autouse=True)
def _own_directory(tmp_path, monkeypatch):
    """Every test runs in its own directory: never in the one a user's run (runs/train) left."""
    monkeypatch.chdir(tmp_path)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def logged(out: Path, dtype=np.float32) -> dict[str, dict[int, float]]:
    """metrics.jsonl by TensorBoard tag and step (TensorBoard keeps float32)."""
    return by_tag(records(out), dtype)


def losses(out: Path) -> np.ndarray:
    return np.array([r["loss"] for r in records(out) if "loss" in r])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tokens64(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "tokens64.npy"
    np.save(path, (embedded_corpus(2**20) % 64).astype(np.uint16))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tokens64) -> Path:
    """20 steps of the "test" preset on 1 process × 4 devices, saving at 10 and 20."""
    out = tmp_path_factory.mktemp("reference")
    assert zerojax_here("train", *SMALL, "--data", tokens64, "--devices", 4, "--steps", 20,
                        "--save-every", 10, "--out", out) == 0
    return out


# --------------------------------------------------------------------------------- options


def test_help_documents_every_option(capsys):
    assert train.main(["--help"]) == 0
    text = capsys.readouterr().out
    for field in options.TrainConfig.__dataclass_fields__:
        assert f"--{field.replace('_', '-')}" in text, field
    assert "Total optimizer steps" in text  # field docstrings are the help


@pytest.mark.parametrize("flags, text", [
    ("", ""),
    ("--offload optimizer", ", offload optimizer (host memory)"),
    ("--offload optimizer --delayed-update 20",
     ", offload optimizer (host memory), delayed update after 20 ordinary steps"),
    ("--offload optimizer --delayed-update 1 --offload-fraction 0.4",
     ", offload optimizer (Twin-Flow: 0.4 of it in host memory, the rest on the devices), "
     "delayed update after 1 ordinary step"),
    ("--offload optimizer --delayed-update 0",
     ", offload optimizer (host memory), delayed update from the first step")])
def test_the_zero_row_names_the_offload_options(flags, text):
    cfg = options.validate(options.parse_args(flags.split()))
    assert report.offload_text(cfg) == text


def test_config_file_then_flags(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"steps": 7, "seq-len": 32, "stage": 1}))
    (tmp_path / "run.toml").write_text('steps = 9\nmodel = "small8"\n')
    cfg = options.parse_args(["--config", str(tmp_path / "run.json"), "--steps", "5"])
    assert (cfg.steps, cfg.seq_len, cfg.stage, cfg.model) == (5, 32, 1, "nano")
    cfg = options.parse_args([f"--config={tmp_path / 'run.toml'}"])
    assert (cfg.steps, cfg.model) == (9, "small8")


ROOT_USER = hasattr(os, "geteuid") and os.geteuid() == 0
SKIP_AS_ROOT = pytest.mark.skipif(ROOT_USER, reason="root reads and writes despite chmod 000")
BAD = {  # case: (argv, expected message); {tmp} is the test's tmp_path
    "unknown preset": ("--model gpt5", "unknown GPT preset --model='gpt5'"),
    "batch vs devices": ("--devices 4 --batch 6", "--batch=6 is not divisible"),
    "batch vs grad accum": ("--devices 4 --batch 8 --grad-accum 4",
                            "not divisible by --grad-accum=4"),
    "missing data": ("--data {tmp}/nope.txt", "token file not found"),
    "data extension": ("--data {tmp}/bad.json", "extension '.json'"),
    "resume without checkpoint": ("--resume --out {tmp}", "no checkpoint"),
    "existing checkpoints": ("--out {tmp}/old", "pass --resume"),
    "seq-len": ("--seq-len 129", "exceeds the context length of preset 'nano', 128"),
    "vocab": ("--model test", "vocab_size 64"),
    "config key": ("--config {tmp}/bad.json", "unknown option(s) ['stepz']"),
    "config file": ("--config {tmp}/none.json", "config file not found"),
    "half distributed": ("--coordinator localhost:1234", "go together"),
    "prefetch": ("--stage 2 --prefetch", "--prefetch needs --stage 3"),
    "offload": ("--stage 0 --offload optimizer",
                "--offload optimizer needs --stage 1, 2 or 3 (got --stage 0)"),
    "delayed update without offload": ("--stage 3 --delayed-update 2",
                                       "--delayed-update 2 needs --offload optimizer"),
    "offload fraction": ("--stage 2 --offload-fraction 0.5",
                         "--offload-fraction 0.5 needs --offload optimizer and a value in (0, 1]"),
    "delayed update": ("--offload optimizer --delayed-update -1",
                       "--delayed-update=-1 must be a non-negative integer"),
    "steps": ("--steps 0", "--steps=0 must be a positive integer"),
    "model parallel vs devices": ("--devices 8 --model-parallel 3",
                                  "--model-parallel=3 does not divide the 8 devices of the run; "
                                  "use a divisor of 8"),
    "model parallel vs replica groups": ("--devices 8 --replica 4 --model-parallel 4 --batch 8",
                                         "--model-parallel=4 does not divide the 2 devices of a "
                                         "replica group"),
    "model parallel vs heads": ("--devices 8 --model-parallel 8",
                                "--model-parallel=8 does not divide the 4 attention heads of "
                                "preset 'nano' (Megatron gives each model device whole heads)"),
    "batch vs data-parallel devices": ("--devices 8 --model-parallel 2 --batch 6",
                                       "--batch=6 is not divisible by the 4 data-parallel "
                                       "devices; use a multiple of 4"),
    "model parallel 0": ("--model-parallel 0", "--model-parallel=0 must be a positive integer"),
    "negative ids": ("--model test --data {tmp}/neg.npy",
                     "2 token id(s) outside [0, 64) (preset 'test' has vocab_size 64), the "
                     "first -1 at position 3;"),
    "garbage npy": ("--data {tmp}/garbage.npy", "garbage.npy' is not a .npy file"),
    "pickled npy": ("--data {tmp}/objects.npy", "Python objects"),
    "data is a directory": ("--data {tmp}/dir.npy", "dir.npy' is a directory"),
    "unreadable data": ("--data {tmp}/locked.npy", "cannot read token file"),
    "seed": ("--seed 99999999999999999999",
             "--seed=99999999999999999999 must be a non-negative integer below 2**63"),
    "lr inf": ("--lr inf", "--lr=inf must be a finite number"),
    "lr nan": ("--lr nan", "--lr=nan must be a finite number"),
    "weight decay nan": ("--weight-decay nan", "--weight-decay=nan must be a finite number"),
    "clip norm inf": ("--clip-norm inf", "--clip-norm=inf must be a finite number"),
    "empty out": ("--out=", "--out is empty"),
    "peak": ("--peak-tflops 0", "--peak-tflops=0.0 must be positive"),
    "empty wandb project": ("--wandb=", "--wandb is empty; name a W&B project"),
    "out is a file": ("--out {tmp}/bad.json", "bad.json' is a file; name a directory"),
    "out under a file": ("--out {tmp}/bad.json/run", "is under '{tmp}/bad.json', which is a file"),
    "unwritable out": ("--out {tmp}/locked/run", "is not a writable directory"),
    "optimizer in a config file": ("--config {tmp}/adam.toml",
                                   "unknown --optimizer='adam'; choose one of adamw, lion, "
                                   "adafactor, muon, lamb, sgd"),
    "resume step": ("--resume-step 7 --out {tmp}/old",
                    "--resume-step=7: no such checkpoint in '{tmp}/old/checkpoints'; its steps "
                    "are 5"),
    "resume past steps": ("--resume --steps 3 --out {tmp}/old",
                          "--steps=3 is below step 5, where the run in '{tmp}/old' resumes: "
                          "nothing to train; --steps is the total, so pass more than 5"),
    "no-resume with resume-step": ("--no-resume --resume-step 5 --out {tmp}/old",
                                   "--no-resume contradicts --resume-step=5 (which resumes from "
                                   "that step); drop one of them"),
    "coordinator": ("--coordinator bad --num-processes 2 --process-id 0",
                    "--coordinator='bad' is not HOST:PORT; give process 0's address and a free "
                    "port, e.g. --coordinator 10.0.0.1:12355"),
    "coordinator port": ("--coordinator host:99999 --num-processes 2 --process-id 0",
                         "--coordinator='host:99999' is not HOST:PORT"),
    "process id": ("--coordinator localhost:1234 --num-processes 2 --process-id 2",
                   "--process-id=2 must be in [0, --num-processes=2)"),
    "negative process id": ("--coordinator localhost:1234 --num-processes 2 --process-id=-1",
                            "--process-id=-1 must be a non-negative integer below 2**31"),
    "steps beyond the step counter": ("--steps 2147483648",
                                      "--steps=2147483648 must be a positive integer below "
                                      "2**31"),
    "text for an integer": ("--model-parallel two", "--model-parallel='two' must be an integer"),
    "text for a number": ("--peak-tflops abc", "--peak-tflops='abc' must be a number (or None)"),
    "not a stage": ("--stage=5", "--stage='5' is not one of 0, 1, 2, 3"),
    "not a dtype": ("--param-dtype fp8", "--param-dtype='fp8' is not one of float32, "
                                         "bfloat16, float16"),
    "no value": ("--steps --quiet", "--steps needs a value; see --help"),
    "unknown option": ("--bogus 1", "Unrecognized options: --bogus, 1; see --help"),
    "tensorboard is a file": ("--out {tmp}/tbfile",
                              "{tmp}/tbfile/tensorboard' is a file, where the TensorBoard event "
                              "files go; move it away or pass --no-tensorboard"),
    "data is a device": ("--data /dev/null",
                         "token file '/dev/null' is not a regular file; pass a .txt, .bin or "
                         ".npy file"),
}
NEEDS_USER = {"unreadable data", "unwritable out"}  # as root, chmod blocks nothing


@pytest.mark.parametrize("where", ["empty directory", "after the quick start"])
@pytest.mark.parametrize("case", [pytest.param(c, marks=SKIP_AS_ROOT) if c in NEEDS_USER else c
                                  for c in BAD])
def test_bad_options_exit_2_with_one_line_before_jax(case, where, tmp_path, capsys, monkeypatch,
                                                     request):
    if where == "after the quick start":  # what `python -m zerojax train` leaves in runs/train
        shutil.copytree(request.getfixturevalue("reference"), tmp_path / "runs" / "train")
    (tmp_path / "bad.json").write_text('{"stepz": 3}')
    (tmp_path / "adam.toml").write_text('optimizer = "adam"\n')
    (tmp_path / "old" / "checkpoints" / "5").mkdir(parents=True)
    (tmp_path / "dir.npy").mkdir()
    (tmp_path / "tbfile").mkdir()
    (tmp_path / "tbfile" / "tensorboard").write_text("x")
    (tmp_path / "garbage.npy").write_bytes(b"not a numpy file at all")
    np.save(tmp_path / "objects.npy", np.array([1, "two", None], dtype=object))
    ids = np.arange(100, dtype=np.int32) % 64
    ids[[3, 50]] = -1
    np.save(tmp_path / "neg.npy", ids)
    np.save(tmp_path / "locked.npy", np.arange(100, dtype=np.uint16) % 64)
    (tmp_path / "locked.npy").chmod(0)
    (tmp_path / "locked").mkdir(mode=0o500)
    argv, message = BAD[case]
    started = []
    monkeypatch.setattr(train, "start_runtime", started.append)
    monkeypatch.setattr(train, "train", lambda *args: started.append(args) or 0)  # never runs
    assert train.main(argv.format(tmp=tmp_path).split()) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zerojax train: error: "), err
    assert message.format(tmp=tmp_path) in err
    assert not started  # rejected before XLA flags, jax.distributed or any compilation
    assert not (tmp_path / "runs" / "train").exists() or where != "empty directory"


SAMPLE_BAD = {
    "no checkpoint": ("{tmp}", "no checkpoint in"),
    "a file": ("{tmp}/file.txt", "no checkpoint in"),
    "empty": ("", "CHECKPOINT is empty"),
    "temperature nan": ("{tmp} --temperature nan", "--temperature=nan"),
    "seed": ("{tmp} --seed -1", "--seed=-1"),
}


@pytest.mark.parametrize("case", list(SAMPLE_BAD))
def test_sample_bad_input_exits_2_with_one_line(case, tmp_path, capsys):
    (tmp_path / "file.txt").write_text("x")
    argv, message = SAMPLE_BAD[case]
    args = argv.format(tmp=tmp_path).split() or [""]
    assert sample.sample_main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zerojax sample: error: "), err
    assert message in err


@pytest.mark.slow
def test_offload_flag_parses_and_reaches_the_run(tmp_path, tokens64, capsys, monkeypatch):
    from test_measure import engine_offloads

    cfg = options.parse_args(["--stage", "2", "--offload", "optimizer"])
    assert (cfg.offload, options.TrainConfig().offload) == ("optimizer", None)
    assert options.validate(cfg).offload == "optimizer"
    if not engine_offloads():
        return
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main sets it; restore
    argv = ["--model", "test", "--batch", "8", "--eval-every", "0", "--data", str(tokens64),
            "--devices", "4", "--steps", "3", "--stage", "3", "--param-dtype", "bfloat16",
            "--offload", "optimizer", "--out", str(tmp_path)]
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    assert "offload optimizer (host memory)" in out and "memory/host" in out
    assert "one fused pass" in out  # the adamw preset's host update (offload/fused.py)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["config"]["offload"] == "optimizer" and s["steps_done"] == 3
    assert s["host_update"] == "fused"
    est = s["memory_per_device"]["estimate"]
    assert (est["offload"], est["host"]) == ("optimizer", 12 * s["num_params"] / 4)
    assert np.isfinite(losses(tmp_path)).all() and len(losses(tmp_path)) == 3
    # The process's host memory, each step and at the end: the OS's figures, peaks never
    # below what was resident (this process holds the suite's programs too: no closer bound).
    host = [(r["host_rss_bytes"], r["host_rss_peak_bytes"]) for r in records(tmp_path)
            if "loss" in r]
    assert len(host) == 3 and all(4 * est["host"] < rss <= peak for rss, peak in host)
    assert [p for _, p in host] == sorted(p for _, p in host)
    end = s["host_memory"]
    assert host[-1][1] <= end["host_rss_peak_bytes"] and end["host_rss_bytes"] > 0
    from zerojax.analysis.accounting import format_bytes

    assert f"host peak {format_bytes(end['host_rss_peak_bytes'])}, " in out.splitlines()[-1]


def test_offload_past_the_hosts_available_memory_is_refused_before_init(tmp_path, tokens64,
                                                                        capsys, monkeypatch):
    """With offload, this process's share of the host state at the update's peak against the
    host memory available: over it, one line and exit 2 before init makes anything; exactly
    it, no error. At stage 3 in bf16 a param takes 16 bytes there: the float32 master 4,
    Adam's moments 8, the gradient that came down and the compute shard that goes up 2 + 2."""
    import types

    import psutil

    from zerojax.analysis.accounting import format_bytes
    from zerojax.engine import Engine
    from zerojax.models import get_model

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main sets it; restore
    model = get_model("test")
    psi = sum(math.prod(x.shape)
              for x in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0))))
    need = 16 * psi  # over the 4 devices, all this process's
    argv = ["--model", "test", "--batch", "8", "--data", str(tokens64), "--devices", "4",
            "--steps", "3", "--stage", "3", "--param-dtype", "bfloat16", "--offload",
            "optimizer", "--out", str(tmp_path / "run")]
    available = lambda n: types.SimpleNamespace(available=n)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: available(need - 1))
    made = []
    monkeypatch.setattr(Engine, "init", lambda *a: made.append(a))
    assert train.main(argv) == 2 and not made
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"zerojax train: error: --offload optimizer: this process's 4 device(s) need about "
        f"{format_bytes(need)} of host memory while the update runs ({format_bytes(need / 4)} "
        f"each: the float32 master, the Adam moments, the gradient and compute shards"), err
    assert f"but {format_bytes(need - 1)} is available; train a smaller --model" in err
    assert not [p.name for p in (tmp_path / "run").rglob("*") if p.is_file()]  # nothing run
    # A resume is checked before its restore reads the state into host memory.
    (tmp_path / "run" / "checkpoints" / "2").mkdir(parents=True)
    monkeypatch.setattr(Engine, "restore", lambda *a: made.append(a))
    assert train.main([*argv, "--resume"]) == 2 and not made
    assert f"need about {format_bytes(need)} of host memory" in capsys.readouterr().err

    cfg = options.validate(options.parse_args(argv))
    optimizer, _ = recipe.make_optimizer(cfg)
    for free, refused in ((need, False), (need - 1, True)):
        monkeypatch.setattr(psutil, "virtual_memory", lambda free=free: available(free))
        try:
            train.check_host_memory(cfg, model, optimizer, jax.devices()[:4], 0)
        except options.UsageError:
            assert refused
        else:
            assert not refused
    # Twin-Flow at 0.5: the host holds and updates half the params, and moves half
    half = dataclasses.replace(cfg, offload_fraction=0.5)
    assert report.host_need(half, model, optimizer, jax.devices()[:4], 0)[0] == need / 2
    # A model axis: every param taken as split over data × model, the least the run needs
    # (a param the axis does not split has its state on each model device).
    axis = dataclasses.replace(cfg, model_parallel=2)
    assert report.host_need(axis, model, optimizer, jax.devices()[:4], 0)[0] == need
    # The delayed update: the pending bf16 gradient waits in host memory too, 2 bytes a param
    delayed = dataclasses.replace(cfg, delayed_update=1)
    assert report.host_need(delayed, model, optimizer, jax.devices()[:4], 0)[0] == 18 * psi
    assert report.host_need(dataclasses.replace(cfg, offload=None), model, optimizer,
                            jax.devices()[:4], 0) == (0.0, None)


@pytest.mark.slow
def test_delayed_update_flag_trains_and_resumes_as_uninterrupted(tmp_path, tokens64, monkeypatch,
                                                                 capsys):
    """`--offload optimizer --delayed-update 1`: a resume from a step saved in the delayed phase
    (on another stage, and with Twin-Flow's `--offload-fraction 0.5`) gives the uninterrupted
    run's losses: saved after step 2 (step 1's update pending), two steps resumed (the second
    runs on the params the pending update made). The fewest saves the CLI allows for that (it
    always saves the last step): 2, 4 and 4 again."""
    cfg = options.validate(options.parse_args(["--offload", "optimizer", "--delayed-update", "1"]))
    assert (cfg.delayed_update, options.TrainConfig().delayed_update) == (1, None)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main sets it; restore
    argv = ["--model", "test", "--batch", "2", "--eval-every", "0", "--data", str(tokens64),
            "--devices", "2", "--steps", "4", "--save-every", "2", "--offload", "optimizer",
            "--delayed-update", "1", "--quiet"]
    assert train.main([*argv, "--stage", "3", "--out", str(tmp_path / "a")]) == 0
    s = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert s["config"]["delayed_update"] == 1 and s["steps_done"] == 4
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")
    (tmp_path / "b" / "metrics.jsonl").write_text("")
    assert train.main([*argv, "--stage", "1", "--resume-step", "2", "--offload-fraction",
                       "0.5", "--out", str(tmp_path / "b")]) == 0
    assert len(losses(tmp_path / "b")) == 2
    s = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert s["config"]["offload_fraction"] == 0.5
    # --quiet shows no table, yet the records name the resume and the options it changed
    changed = {"stage": [3, 1], "offload_fraction": [None, 0.5],
               "out": [str(tmp_path / "a"), str(tmp_path / "b")]}
    assert s["resumed"] == {"from_step": 2, "changed": changed}
    assert [r.get("resumed") for r in records(tmp_path / "b")] == [s["resumed"], None]
    # K = 1 is legal, and warned of once per run, with the start to use
    err = capsys.readouterr().err
    assert err.count("zerojax train: warning: --delayed-update 1 starts the delayed update "
                     "within the first 40 steps") == 2 and "--delayed-update 40 or more" in err
    np.testing.assert_allclose(losses(tmp_path / "b"), losses(tmp_path / "a")[2:], rtol=1e-5)


# Each optimizer but the default (which the other runs here use) once, each meeting another
# feature: stages, offload, bf16, grad_accum, resume.
OPTIMIZER_RUNS = {"adafactor": "--stage 1", "muon": "--stage 2", "lamb": "--stage 0",
                  "sgd": "--stage 3 --grad-accum 2",
                  "lion": "--stage 3 --param-dtype bfloat16 --offload optimizer"}


def test_optimizer_option_lists_the_presets():
    from typing import get_args, get_type_hints

    hint = get_type_hints(options.TrainConfig, include_extras=True)["optimizer"]
    literal, none = get_args(get_args(hint)[0])  # Annotated[Literal[...] | None, help]
    assert (get_args(literal), none) == (presets.OPTIMIZERS, type(None))
    assert {"adamw", *OPTIMIZER_RUNS} == set(presets.OPTIMIZERS)
    assert options.validate(options.parse_args([])).optimizer == "adamw"
    assert options.validate(options.parse_args(["--resume"])).optimizer is None  # the saved one


def test_resume_takes_the_saved_optimizer_and_refuses_another():
    cfg = options.TrainConfig(resume=True, out="runs/x")
    assert recipe.resume_optimizer(cfg, {"optimizer": "muon"}).optimizer == "muon"
    assert recipe.resume_optimizer(cfg, {"steps": 5}).optimizer == "adamw"  # before the option
    same = dataclasses.replace(cfg, optimizer="muon")
    assert recipe.resume_optimizer(same, {"optimizer": "muon"}) == same
    with pytest.raises(options.UsageError) as e:
        recipe.resume_optimizer(same, {"steps": 5})
    assert str(e.value) == ("--optimizer muon: the run in 'runs/x' was trained with --optimizer "
                            "adamw, whose state muon cannot continue; resume without --optimizer "
                            "(or with --optimizer adamw), or start a new run in another --out")


@pytest.mark.parametrize("name", sweep(OPTIMIZER_RUNS, quick=["muon"]))
def test_each_optimizer_trains_and_the_table_names_its_state(name, tmp_path, tokens64, capsys,
                                                             monkeypatch):
    from test_measure import engine_offloads
    from test_presets import expected_bytes

    jax.devices()  # the backend starts with the suite's 8 devices, before main sets --devices
    extra = OPTIMIZER_RUNS[name].split()
    if "--offload" in extra and not engine_offloads():
        extra = extra[:2]
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main sets it; restore
    argv = ["--model", "test", "--batch", "8", "--eval-every", "0", "--data", str(tokens64),
            "--devices", "2", "--warmup", "0", "--out", str(tmp_path), *extra]
    assert train.main([*argv, "--steps", "3", "--optimizer", name]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert f"optimizer {presets.TITLE[name]} lr 0.003, 0 warm-up steps" in shown
    assert f"+ {presets.STATE[name]} " in shown and ("Adam moments" in shown) == (
        name == "muon")
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["config"]["optimizer"] == name
    params = jax.eval_shape(GPT.from_preset("test").init, jax.random.key(0))
    scalars = {"sgd": 4, "muon": 8}.get(name, 4)  # a schedule's count; sgd's only one
    k = (expected_bytes(name, params) + (4 if name == "sgd" else 0) - scalars) / 21_760
    est = s["memory_per_device"]["estimate"]
    assert (est["optimizer"], est["optimizer_state_bytes"]) == (name, k)
    if "--offload" in extra:  # the host keeps the master and Lion's momentum, 1/2 each
        assert est["host"] == (4 + 4) * 21_760 / 2
        assert s["host_update"] == "xla: the optimizer is not zerojax.adamw"
    else:
        assert s["host_update"] is None
    loss = losses(tmp_path)
    assert np.isfinite(loss).all() and len(loss) == 3 and loss[-1] < loss[0], loss
    if name != "lion":
        return
    # A resume continues the saved optimizer; naming another is refused before anything runs.
    assert train.main([*argv, "--steps", "4", "--resume", "--optimizer", "adamw"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was trained with --optimizer lion, whose state" in err
    assert train.main([*argv, "--steps", "4", "--resume", "--quiet"]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert (s["config"]["optimizer"], s["steps_done"]) == ("lion", 4)


def test_a_resume_records_the_options_it_changes(tmp_path):
    """`resume_changes`: every option the checkpoint recorded that the resume sets otherwise,
    but how the process resumes; the run log carries them into the resumed run's first
    record (metrics.jsonl only: not a scalar), and the summary holds them."""
    from zerojax.app.records import summary
    from zerojax.app.resume import resume_changes
    from zerojax.app.runlog import RunLog

    saved = dataclasses.asdict(options.TrainConfig(offload="optimizer", delayed_update=40))
    cfg = options.TrainConfig(offload="optimizer", delayed_update=80, offload_fraction=0.5,
                              stage=1, resume=True, resume_step=10, quiet=True, seq_len=128)
    changed = resume_changes(saved | {"gone": 1}, cfg)
    assert changed == {"stage": [3, 1], "delayed_update": [40, 80], "quiet": [False, True],
                       "offload_fraction": [None, 0.5], "seq_len": [None, 128]}
    log = RunLog(tmp_path, tensorboard=False, flops_per_step=1.0, peak_tflops=1.0)
    log._note(resumed={"from_step": 10, "changed": changed})
    for step in (11, 12):
        log.step(step, {"loss": 2.0, "grad_norm": 1.0}, seconds=1.0)
    log.close()
    first, second = records(tmp_path)
    assert first["resumed"] == {"from_step": 10, "changed": changed}
    assert "resumed" not in second and "resumed" not in scalars(first)
    s = summary(cfg, log.records, [1.0], 1, jax.devices()[:1], zj.make_mesh(data=1),
                report.estimate_for(1, 1, 1, cfg), 0, 1.0, 0.0, 12, False,
                resumed=first["resumed"])
    assert s["resumed"] == first["resumed"]


def test_cut_off_metrics_record_is_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.4}\n{"step": 3, "lo')
    note = resume.drop_cut_off_record(path)
    assert note == ("metrics.jsonl: dropped a cut-off last record (15 bytes) that an "
                    "interrupted write left")
    assert path.read_text() == '{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.4}\n'
    assert resume.drop_cut_off_record(path) is None
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')  # not what a crash leaves
    with pytest.raises(options.UsageError, match="line 2 is not a JSON record"):
        resume.drop_cut_off_record(path)


def full_disk(monkeypatch):
    """Every file opened for writing from now on is opened (so "w" truncates, as the kernel
    does), but its writes fail with ENOSPC."""
    import builtins
    import errno

    real = builtins.open

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        writelines = write

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def opened(file, mode="r", *args, **kwargs):
        f = real(file, mode, *args, **kwargs)
        return Full(f) if any(c in mode for c in "wax+") else f

    monkeypatch.setattr(builtins, "open", opened)


METRICS = b'{"step": 0, "eval_loss": 4.2}\n{"step": 1, "loss": 4.1}\n{"step": 2, "loss": 4.0}\n'


def test_resume_on_a_full_disk_keeps_metrics_byte_identical(tmp_path, capsys, monkeypatch):
    """Dropping the records past the resumed step replaces the file; a write that fails for
    lack of space leaves it as it was and stops `zerojax train` with one line."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(METRICS)
    log = MetricsLog(path, start=1)  # a normal resume drops step 2
    assert path.read_bytes() == METRICS[:METRICS.index(b'{"step": 2')]
    assert [r["step"] for r in log.records] == [0, 1]
    log.write({"step": 2, "loss": 3.9})
    assert [r["step"] for r in MetricsLog(path, start=2).records] == [0, 1, 2]

    path.write_bytes(METRICS)
    with monkeypatch.context() as m:
        full_disk(m)
        assert MetricsLog(path, start=2).records[-1] == {"step": 2, "loss": 4.0}
        with pytest.raises(RunFileError, match=(
                rf"^cannot write {path}: no space left on its device \([\d,.]+ (MB|bytes) "
                rf"free\); metrics.jsonl is as it was. Free some space and run again$")):
            MetricsLog(path, start=1)  # nothing to drop at 2: nothing written
        assert path.read_bytes() == METRICS
        m.setattr(train, "start_runtime", lambda cfg: None)
        m.setattr(train, "train", lambda *args: MetricsLog(path, start=1))
        assert train.main(["--model", "nano", "--steps", "2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"zerojax train: error: cannot write {path}")
    assert path.read_bytes() == METRICS
    # The move over the old file fails: the same, and no temporary file is left.
    monkeypatch.setattr(os, "replace", lambda *a: full_disk_error())
    with pytest.raises(RunFileError, match="metrics.jsonl is as it was"):
        MetricsLog(path, start=1)
    assert path.read_bytes() == METRICS and not list(tmp_path.glob("*.tmp"))


def full_disk_error():
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


def test_schedule_note_gives_the_lr_before_and_after():
    saved = options.TrainConfig(steps=200)
    note = resume.schedule_note(saved, dataclasses.replace(saved, steps=400), 200)
    # cosine from 3e-3 to 3e-4: ended at step 200; over 400 steps, step 201 is near the middle
    assert note == ("schedule re-planned for 400 steps (saved: 200): lr at step 201 3.00e-04 → "
                    "1.70e-03")
    assert resume.schedule_note(saved, saved, 200) is None
    constant = options.TrainConfig(steps=200, schedule="constant")
    assert resume.schedule_note(constant, dataclasses.replace(constant, steps=400), 200) is None


def test_non_finite_loss_stops_and_is_never_saved(tmp_path, tokens64, capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main sets it; restore
    ckpt = tmp_path / "checkpoints"
    args = [*SMALL, "--data", str(tokens64), "--devices", "4", "--steps", "30", "--lr", "1e30",
            "--warmup", "0", "--schedule", "constant", "--clip-norm", "None", "--eval-every",
            "0", "--save-every", "1", "--out", str(tmp_path)]
    code = train.main(args)
    err = capsys.readouterr().err
    assert code == 1, err
    assert err == (f"zerojax train: error: loss is nan at step 2 (lr 1e+30); stopped without "
                   f"saving; last good checkpoint: step 1 in {ckpt} (continue with --resume). "
                   f"Lower --lr, set --clip-norm, use --param-dtype float32, or pass "
                   f"--allow-nonfinite to go on\n")
    assert options.checkpoint_steps(ckpt) == [1]
    # --allow-nonfinite goes on past the NaN loss; the save of the diverged state is refused
    # and stops the run, naming the step and the last good checkpoint.
    code = train.main([*args, "--resume", "--allow-nonfinite"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err == (f"zerojax train: error: step 2: params['blocks']['attn']['out']['bias'] holds "
                   f"NaN or inf (the run has diverged), so it was not saved; last good "
                   f"checkpoint: step 1 in {ckpt} (continue with --resume)\n")
    assert options.checkpoint_steps(ckpt) == [1]
    assert [r["step"] for r in records(tmp_path) if "loss" in r] == [1, 2]
    assert math.isnan(records(tmp_path)[-1]["loss"])


@pytest.mark.slow
def test_float16_logs_the_loss_scale_and_skipped_steps(tmp_path, tokens64, monkeypatch):
    jax.devices()  # the backend starts with the suite's 8 devices, before main sets --devices
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main sets it; restore
    args = [*SMALL, "--data", str(tokens64), "--devices", "2", "--steps", "5", "--param-dtype",
            "float16", "--lr", "1e3", "--warmup", "0", "--schedule", "constant", "--clip-norm",
            "None", "--allow-nonfinite", "--eval-every", "0", "--out", str(tmp_path)]
    assert train.main(args) == 0
    scale = [r["loss_scale"] for r in records(tmp_path)]
    skipped = [r["skipped_steps"] for r in records(tmp_path)]
    # lr 1e3 overflows float16 from step 2 on: each such step is skipped and halves the scale.
    assert skipped == [0, 1, 2, 3, 4] and scale == [scale[0] / 2**i for i in range(5)]
    tb = tensorboard_scalars(tmp_path)
    for tag in ("learning/loss_scale", "learning/skipped_steps"):
        assert tb[tag] == logged(tmp_path)[tag]


@pytest.mark.slow
def test_a_full_disk_stops_the_run_with_one_line(tmp_path, tokens64, capsys, monkeypatch):
    """The save of step 16 fails for lack of space, found by the step after it: one line
    naming the directory, its free space and the last good step; step 8 is intact."""
    from helpers import full_disk_after

    from zerojax import checkpoint

    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main sets it; restore
    monkeypatch.setattr(*full_disk_after(1))
    monkeypatch.setattr(checkpoint, "check_saves", settled(checkpoint.check_saves))
    ckpt = tmp_path / "checkpoints"
    code = train.main([*SMALL, "--data", str(tokens64), "--devices", "2", "--steps", "24",
                       "--eval-every", "0", "--save-every", "8", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.count("\n") == 1, err
    assert err.startswith(f"zerojax train: error: cannot write step 16 to {ckpt}: no space "
                          f"left on its device (")
    assert err.endswith(f"free); the steps saved there before are intact; last good "
                        f"checkpoint: step 8 in {ckpt} (continue with --resume)\n")
    assert sorted(p.name for p in ckpt.iterdir()) == ["8"]
    # Found by the check before step 17, not at the next save (the final one, step 24).
    assert [r["step"] for r in records(tmp_path)] == list(range(1, 17))


def settled(check_saves):
    """`check_saves` once orbax's background writes have ended (at most a minute): when the
    failed write ends is the machine's business; what the loop does with it is the test's."""
    from zerojax.checkpoint import store

    def check(directory=None):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(
                mngr.is_saving_in_progress() for mngr, _ in list(store._MANAGERS.values())):
            time.sleep(0.01)
        check_saves(directory)

    return check


def on_a_full_disk(*args, fsize: int | None = None, enospc_after: int | None = None,
                   cwd=None) -> subprocess.CompletedProcess:
    """`python -m zerojax ARGS` whose files cannot grow past `fsize` bytes (RLIMIT_FSIZE: what
    `ulimit -f` sets; writes then fail with EFBIG), or whose orbax JSON writes after the first
    `enospc_after` go to /dev/full (ENOSPC from orbax's background threads). Without the
    suite's compilation cache, whose writes would fail and warn too."""
    env = _env()
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    code = ["import sys", "from zerojax.app.cli import main"]
    if fsize:  # Python ignores SIGXFSZ: a write past the limit fails with EFBIG
        code[:0] = ["import resource",
                    f"resource.setrlimit(resource.RLIMIT_FSIZE, ({fsize}, {fsize}))"]
    if enospc_after is not None:
        code[1:1] = [f"sys.path.insert(0, {str(ROOT / 'tests')!r})",
                     "from helpers import full_disk_after",
                     f"setattr(*full_disk_after({enospc_after}))"]
    code.append("sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", "; ".join(code), *map(str, args)],
                          cwd=cwd or Path.cwd(), env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ulimit -f", "ENOSPC"])
def test_a_save_on_a_full_disk_is_one_line_and_no_traceback(tmp_path, tokens64, how):
    """The CLI in its own process, its saves failing: one line and exit code 1, whatever
    orbax's threads and tensorstore's futures were doing; no 'Exception ignored' at exit."""
    if how == "ENOSPC" and not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    out, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    args = ["train", *SMALL, "--data", tokens64, "--devices", 2, "--steps", 6, "--eval-every",
            0, "--save-every", 2, "--out", out]
    if how == "ulimit -f":  # a step's larger files (8-105 KB) cannot be written; the run's can
        r = on_a_full_disk(*args, fsize=8_000)
        why = r"a file would exceed the file-size limit of 8,000 bytes \(ulimit -f; "
        failed, left = 2, "no checkpoint was saved"
    else:  # step 2 is written; the save of step 4 fails, found when step 6 saves
        r = on_a_full_disk(*args, enospc_after=1)
        why = r"no space left on its device \("
        failed, left = 4, f"last good checkpoint: step 2 in {ckpt} \\(continue with --resume\\)"
    assert (r.returncode, r.stdout) == (1, ""), r.stderr
    assert re.fullmatch(rf"zerojax train: error: cannot write step {failed} to {ckpt}: {why}"
                        rf"[\d,.]+ (MB|bytes) free\); the steps saved there before are intact; "
                        rf"{left}\n", r.stderr), r.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ([] if failed == 2 else ["2"])
    steps = [x["step"] for x in records(out)]  # a failed save is found by the next one
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= failed


@pytest.mark.slow
@pytest.mark.parametrize("resume", [["--resume"], ["--resume-step", "10"]])
def test_a_resume_on_a_full_disk_leaves_metrics_byte_identical(tmp_path, reference, tokens64,
                                                               resume):
    """The reference run resumed where its metrics.jsonl cannot grow (RLIMIT_FSIZE below its
    size): from the latest step (the first record's append fails) or from step 10 (the file's
    rewrite without steps 11-20 fails). One line, the file byte for byte as it was."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    before = (out / "metrics.jsonl").read_bytes()
    r = on_a_full_disk("train", *SMALL, "--data", tokens64, "--devices", 4, "--steps", 30,
                       *resume, "--out", out, fsize=len(before) // 2)
    assert (r.returncode, r.stdout, r.stderr.count("\n")) == (2, "", 1), r.stderr
    # From step 10 the rewrite of metrics.jsonl fails; from the latest step, the rewrite of
    # the TensorBoard event file from metrics.jsonl (about its size), which leaves the old one.
    failed = (out / "tensorboard" / "events.out.tfevents.*" if resume == ["--resume"] else
              out / "metrics.jsonl")
    assert re.match(rf"zerojax train: error: cannot write {re.escape(str(failed))}: a file "
                    rf"would exceed the file-size limit of {len(before) // 2:,} bytes \(ulimit "
                    rf"-f; ".replace(r"\*", ".*"), r.stderr), r.stderr
    assert (out / "metrics.jsonl").read_bytes() == before
    assert sorted(os.listdir(out / "tensorboard")) == sorted(os.listdir(reference / "tensorboard"))


def test_a_renamed_step_directory_is_named_by_resume(tmp_path, reference, capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main sets it; restore
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    os.rename(out / "checkpoints" / "20", out / "checkpoints" / "25")  # mv 20 25
    assert train.main([*SMALL, "--data", _data_of(reference), "--devices", "4", "--steps", "30",
                       "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    ckpt = out / "checkpoints"
    # Not "has no complete step 20; complete steps: [10, 25]", as before.
    assert err == (f"zerojax train: error: step directory {ckpt / '25'} holds the record of step "
                   f"20: it was renamed (or swapped with another); move it back to "
                   f"{ckpt / '20'} or delete it; intact older steps: 10; resume from one with "
                   f"--resume-step 10\n")


def test_lost_process_line_names_the_last_of_several_saves(tmp_path, monkeypatch):
    ckpt = tmp_path / "checkpoints"
    for step in (3, 6, 9, 12):
        (ckpt / str(step)).mkdir(parents=True)
    (ckpt / "15.orbax-checkpoint-tmp-7").mkdir()  # a save in progress is not saved
    watch = object.__new__(peers.PeerWatch)  # without a distributed runtime
    watch.processes, watch.ckpt, watch._lock = 3, ckpt, threading.Lock()
    lines = []
    monkeypatch.setattr(peers, "_exit_now", lambda line, code: lines.append((line, code)))
    watch.exit([1, 2])
    watch.exit([0])
    tail = (f"it stopped responding; last saved step 12 in {ckpt} (restart every process with "
            f"--resume)")
    assert lines == [(f"zerojax train: error: lost processes 1, 2 of 3; {tail}", 1),
                     (f"zerojax train: error: lost process 0 (the coordinator) of 3; {tail}", 1)]


# --------------------------------------------------------------------------------- runs


def test_tensorboard_holds_metrics_jsonl_and_the_flops(reference):
    """The reference run (20 steps on 4 devices, eval every 10) in TensorBoard: every value of
    metrics.jsonl under its tag at its step; the TFLOP/s from the GPT's model FLOPs."""
    tb = tensorboard_scalars(reference)
    assert tb == logged(reference)
    assert sorted(tb["eval/loss"]) == [0, 10, 20]
    for tag in ("learning/loss", "learning/grad_norm", "learning/current_learning_rate",
                "perf/step_time_seconds", "perf/per_device_tokens_per_sec",
                "perf/per_device_tflops_per_sec"):
        assert sorted(tb[tag]) == list(range(1, 21)), tag
    assert "perf/mfu" not in tb and "learning/loss_scale" not in tb  # a CPU, float32
    s = json.loads((reference / "summary.json").read_text())
    assert s["flops"]["per_step"] == GPT.from_preset("test").flops_per_token() * 8 * 16
    r = records(reference)[5]
    assert r["tflops_per_device"] == pytest.approx(s["flops"]["per_step"] / r["step_time_s"]
                                                   / 4 / 1e12)
    assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / 4)
    t = s["timings"]
    assert t["tflops_per_device"] == pytest.approx(s["flops"]["per_step"] / t["mean_step_s"]
                                                   / 4 / 1e12)
    assert t["mfu"] is None and s["flops"]["peak_tflops"] is None


@pytest.mark.slow
def test_a_script_with_the_run_log_writes_the_records_of_the_cli(reference, tokens64, tmp_path):
    """The reference run again, as a script writes it: its own loop, `zj.RunLog` and an
    optimizer that carries its learning rate (`optax.inject_hyperparams`). The same records:
    the same keys, values and TensorBoard tags, the throughput from the batch and the FLOPs."""
    import optax

    import zerojax as zj
    from zerojax.app.data import TokenBatches, eval_batches

    cfg = options.validate(options.TrainConfig(model="test", batch=8, data=str(tokens64),
                                               steps=20, eval_every=10, eval_batches=2))
    train_tokens, eval_tokens, _ = recipe.load_data(cfg)
    batches = TokenBatches(train_tokens, cfg.seq_len, cfg.batch, cfg.seed, 0, 1)
    evals = eval_batches(eval_tokens, cfg.seq_len, cfg.batch, cfg.eval_batches)
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))
    opt = adamw(learning_rate=recipe.make_schedule(cfg), b1=0.9, b2=0.95,
                weight_decay=cfg.weight_decay, mask=presets.by_leaf(presets.gpt_decay))
    engine = zj.Engine(GPT.from_preset("test"), opt, zj.make_mesh(data=4),
                       zj.ZeroConfig(stage=cfg.stage, clip_norm=cfg.clip_norm, remat=cfg.remat))
    state = engine.init(jax.random.key(cfg.seed), batches.batch(0))

    def evaluate(state):
        return float(np.mean([float(engine.evaluate(state, b)["loss"]) for b in evals]))

    with zj.RunLog(tmp_path, engine) as log:
        log.eval(0, evaluate(state))
        for step in range(1, 21):
            batch = batches.batch(step - 1)
            state, metrics = engine.step(state, batch)
            log.step(step, metrics, batch, eval_loss=evaluate(state) if step % 10 == 0 else None)
    mine, cli = records(tmp_path), records(reference)
    assert [list(r) for r in mine] == [list(r) for r in cli]
    for a, b in zip(mine, cli):
        for key in {"loss", "grad_norm", "lr", "eval_loss"} & set(a):
            assert a[key] == pytest.approx(b[key], rel=1e-6), (a["step"], key)
        if a["step"]:
            assert a["tokens_per_s"] * a["step_time_s"] == pytest.approx(8 * 16)
            assert a["tflops_per_device"] * a["step_time_s"] == pytest.approx(
                b["tflops_per_device"] * b["step_time_s"])
    assert sorted(tensorboard_scalars(tmp_path)) == sorted(tensorboard_scalars(reference))
    assert tensorboard_scalars(tmp_path) == logged(tmp_path)
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_thirty_steps_watched_in_tensorboard_and_wandb(tmp_path, tokens64, monkeypatch, capfd):
    """`train --devices 4 --eval-every 10` for 30 steps: TensorBoard holds metrics.jsonl at
    every step, the log lines give TFLOP/s, and `--wandb` (offline) the same history. In this
    process: the reference run's programs, compiled once."""
    has_wandb = importlib.util.find_spec("wandb") is not None
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    code = zerojax_here("train", *[a for a in SMALL if a != "--quiet"], "--data", tokens64,
                        "--devices", 4, "--steps", 30, "--out", out, "--peak-tflops", "1e-9",
                        *(["--wandb", "zerojax-tests"] if has_wandb else []))
    stdout, stderr = capfd.readouterr()
    assert code == 0, stderr
    # A peak below what the device runs: the MFU over 100 % is said once, in one line.
    (warning,) = [line for line in stderr.splitlines() if "MFU" in line]
    assert re.fullmatch(r"zerojax train: warning: MFU [\d.]+% at step 1 exceeds 100 %: the "
                        r"peak it is against, 1e-09 TFLOP/s per device, is below what the "
                        r"device runs; give the device's dense peak .*", warning), warning
    lines = stdout.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) >= 10 and all(re.search(r" TFLOP/s/device \(MFU [\d.]+%\)  eta ", line)
                                    for line in steps), lines
    assert "TFLOP/s/device" in lines[-1] and lines[-1].startswith("done: step 30")
    assert "host peak" not in lines[-1]  # offload's
    tb = tensorboard_scalars(out)
    assert tb == logged(out)
    assert sorted(tb["eval/loss"]) == [0, 10, 20, 30]
    assert all(sorted(tb[tag]) == list(range(1, 31)) for tag in tb if tag != "eval/loss")
    if not has_wandb:
        pytest.skip("wandb is not installed (pip install -e '.[wandb]'): W&B left unchecked")
    (run,) = wandb_history(out)
    assert run["project"] == "zerojax-tests" and run["history"] == logged(out, np.float64)
    assert (run["config"]["stage"], run["config"]["num_params"]) == (3, 21_760)


@pytest.mark.slow
def test_nano_stage3_learns_and_writes_outputs(tmp_path, capfd):
    """20 steps of 32 tokens (10 of warm-up, 10 of cosine) take the eval loss from 5.50 to
    3.03, past the 1.0 nats/token asked (2.1 already after 10 steps); the shorter sequences
    change no parameter (the context stays 128) and no byte of the state."""
    t = time.perf_counter()
    code = zerojax_here("train", "--model", "nano", "--stage", 3, "--devices", 4, "--steps",
                        20, "--eval-every", 10, "--seq-len", 32, "--out", tmp_path)
    wall = time.perf_counter() - t
    out, err = capfd.readouterr()
    assert code == 0, err
    recs = records(tmp_path)
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 21))
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s"):
        assert all(np.isfinite(r[key]) for r in steps), key
    evals = [(r["step"], r["eval_loss"]) for r in recs if "eval_loss" in r]
    assert [s for s, _ in evals] == [0, 10, 20]
    assert evals[0][1] - evals[-1][1] >= 1.0, evals  # nats/token
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_eval_loss"] == evals[-1][1]
    assert summary["devices"] == {"count": 4, "platform": "cpu", "processes": 1,
                                  "mesh": {"data": 4}}
    assert summary["num_params"] == 875_264
    # stage 3, fp32 Adam: master + 2 moments, a quarter each; padding only adds a little
    measured = summary["memory_per_device"]["measured_state_bytes"]
    assert 12 * 875_264 / 4 <= measured < 1.01 * 12 * 875_264 / 4
    assert "done: step 20" in out
    print(f"20-step nano run: {wall:.0f} s wall, {summary['timings']}")

    capfd.readouterr()
    code = zerojax_here("sample", tmp_path, "--prompt", "def ", "--tokens", 40,
                        "--temperature", 0)
    text, err = capfd.readouterr()
    assert code == 0, err
    assert text.startswith("def ") and len(text.encode()) >= 40


@pytest.mark.slow
def test_model_parallel_quick_start_reaches_the_same_eval_loss(tmp_path, capfd):
    """The quick start on 8 devices, with and without a model axis of 2: the same eval loss
    after 15 steps (float32; only the order of the reductions differs; they agree to ~4e-8
    and have learned ~2.24 nats/token). Sequences of 32 tokens: the same params (the context
    stays 128) at a quarter of the steps' cost. In this process: the runs are not about the
    process (two fresh processes took the test from 16 s to 27 s)."""
    argv = ["train", "--devices", 8, "--steps", 15, "--eval-every", 15, "--eval-batches", 2,
            "--seq-len", 32, "--no-tensorboard"]
    stdout = {}
    for name, more in (("flat", []), ("tp", ["--model-parallel", 2])):
        code = zerojax_here(*argv, *more, "--out", tmp_path / name)
        stdout[name], err = capfd.readouterr()
        assert code == 0, err
    summary = {n: json.loads((tmp_path / n / "summary.json").read_text()) for n in stdout}
    flat, tp = (summary[n]["final_eval_loss"] for n in ("flat", "tp"))
    assert tp == pytest.approx(flat, rel=1e-4) and tp != flat  # two programs, one model
    assert summary["tp"]["initial_eval_loss"] - tp > 2.0  # it learned
    assert summary["tp"]["devices"]["mesh"] == {"data": 4, "model": 2}
    out = stdout["tp"]
    assert "data=4 × model=2" in out and "(4 sequences per data-parallel device)" in out
    assert "split            855,552 params in 8 leaves, 1/2 per model device" in out
    assert "over model" in out
    # The state per device: split params over 8, the 19,712 replicated over 4 (fp32 Adam).
    measured = summary["tp"]["memory_per_device"]["measured_state_bytes"]
    assert measured == pytest.approx(12 * (855_552 / 8 + 19_712 / 4), rel=1e-3)
    print(f"eval loss after 15 steps: flat {flat!r}, data 4 x model 2 {tp!r}")


@pytest.mark.slow
def test_a_split_the_preset_does_not_divide_is_one_line(tmp_path, capfd):
    """gpt2-small's 50257-row vocabulary splits over no model axis: the engine's ConfigError,
    as one line."""
    code = zerojax_here("train", "--model", "gpt2-small", "--devices", 2, "--model-parallel", 2,
                        "--batch", 2, "--steps", 1, "--out", tmp_path / "run")
    err = capfd.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("zerojax train: error: parameter ")
    assert "of size 50257, which 2 model devices do not divide" in err


@pytest.mark.slow
@pytest.mark.parametrize("offload", [[], ["--offload", "optimizer", "--delayed-update", "10"]],
                         ids=["plain", "offload, delayed"])
def test_two_processes_match_one(tmp_path, tokens64, reference, offload):
    """Offloaded, each process updates its devices' shards on its own host's CPU devices, with
    zerojax.adamw's fused pass (the preset's AdamW), built or loaded by each process: ordinary
    offloaded steps up to step 10, then delayed ones, each process's host update beside its
    gradients program. The first ten equal the plain run; the rest, and the final eval (on
    the params with the pending update applied), equal one process's delayed run."""
    script = ROOT / "scripts" / "launch_local.sh"
    env = dict(_env(), PORT=str(free_port()), PYTHON=sys.executable)
    r = subprocess.run(["bash", str(script), "2", "2", *SMALL, "--data", str(tokens64),
                        "--steps", "20", *offload, "--out", str(tmp_path / "two")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["devices"]["processes"] == 2 and summary["devices"]["count"] == 4
    assert summary["host_update"] == ("fused" if offload else None)
    # process 0's host memory, in its records and at the end
    peaks = [r["host_rss_peak_bytes"] for r in records(tmp_path / "two") if "loss" in r]
    assert 0 < peaks[0] and peaks == sorted(peaks)
    assert peaks[-1] <= summary["host_memory"]["host_rss_peak_bytes"]
    got, plain = losses(tmp_path / "two"), losses(reference)
    if not offload:
        np.testing.assert_allclose(got, plain, rtol=0, atol=1e-5)
        return
    assert zerojax_here("train", *SMALL, "--data", tokens64, "--devices", 4, "--steps", 20,
                        *offload, "--out", tmp_path / "one") == 0
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    np.testing.assert_allclose(got[:10], plain[:10], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got, losses(tmp_path / "one"), rtol=0, atol=1e-5)
    assert np.abs(got[11:] - plain[11:]).min() > 1e-3  # the delay took effect from step 11
    assert summary["final_eval_loss"] == pytest.approx(one["final_eval_loss"], abs=1e-5)


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run(tmp_path, reference, capfd):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    shutil.rmtree(out / "checkpoints" / "20")  # as if the run had stopped after step 10
    code = zerojax_here("train", *SMALL, "--data", _data_of(reference), "--devices", 4,
                        "--steps", 20, "--save-every", 10, "--out", out, "--resume")
    assert code == 0, capfd.readouterr().err
    assert [r["step"] for r in records(out) if "loss" in r] == list(range(1, 21))
    np.testing.assert_array_equal(losses(out), losses(reference))
    # Resumed past --steps: nothing to train, so it is refused (not "done"), and step 20's
    # state is not saved as step 5.
    capfd.readouterr()
    code = zerojax_here("train", *SMALL, "--data", _data_of(reference), "--devices", 4,
                        "--steps", 5, "--out", out, "--resume")
    err = capfd.readouterr().err
    assert code == 2, err
    assert err == (f"zerojax train: error: --steps=5 is below step 20, where the run in "
                   f"'{out}' resumes: nothing to train; --steps is the total, so pass more "
                   f"than 20 to train on\n")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["10", "20"]


@pytest.mark.slow  # the library's words: test_checkpoint.py's damaged latest step
def test_resume_step_after_a_damaged_latest_step(tmp_path, reference, capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main sets it; restore
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    for f in (out / "checkpoints" / "20" / "state").rglob("*"):  # a damaged latest step
        if f.is_file() and f.stat().st_size > 1000:
            f.write_bytes(b"\0" * f.stat().st_size)
    metrics = out / "metrics.jsonl"
    cut = len(metrics.read_bytes().splitlines(keepends=True)[-1]) - 30
    metrics.write_bytes(metrics.read_bytes()[:-30])  # and a record cut off by the crash
    args = [a for a in SMALL if a != "--quiet"] + [
        "--data", _data_of(reference), "--devices", "4", "--save-every", "10", "--eval-every",
        "0", "--out", str(out)]
    assert train.main([*args, "--steps", "20", "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zerojax train: error: "), err
    assert "step 20" in err
    assert err.endswith("; intact older steps: 10; resume from one with --resume-step 10\n")
    assert "step=" not in err  # the API's advice is not the CLI's
    assert sample.sample_main([str(out)]) == 2
    err = capsys.readouterr().err
    assert err.endswith("intact older steps: 10; sample from one with --step 10\n"), err

    assert train.main([*args, "--steps", "20", "--resume-step", "10"]) == 0
    shown = " ".join(capsys.readouterr().out.split())  # the table may wrap long notes
    assert "optimizer AdamW lr 0.003" in shown and "+ Adam moments" in shown  # the default
    est = json.loads((out / "summary.json").read_text())["memory_per_device"]["estimate"]
    assert (est["optimizer"], est["optimizer_state_bytes"]) == ("adamw", 8)
    assert f"metrics.jsonl: dropped a cut-off last record ({cut} bytes)" in shown
    assert "resuming from step 10: later step(s) 20 moved to" in shown
    assert (out / "superseded" / "20" / "state").is_dir()
    assert options.checkpoint_steps(out / "checkpoints") == [10, 20]
    assert [r["step"] for r in records(out) if "loss" in r] == list(range(1, 21))
    np.testing.assert_allclose(losses(out), losses(reference), rtol=0, atol=1e-6)
    # TensorBoard: the reference's steps 1-10, this run's 11-20 (step times differ), once each.
    assert tensorboard_scalars(out) == logged(out)
    assert "TFLOP/s/device" in shown and "no MFU: float32 compute" in shown

    # A longer run re-plans the cosine schedule: the note gives step 21's lr before and after.
    # metrics.jsonl deleted before it: the table says the new file lacks steps 1-20.
    metrics.unlink()
    assert train.main([*args, "--steps", "21", "--resume"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert ("schedule re-planned for 21 steps (saved: 20): lr at step 21 3.00e-04 → 3.55e-04"
            in shown)
    assert ("metrics.jsonl was missing: it holds only the steps from 21 on (steps 1-20 were "
            "trained before this resume)" in shown)
    assert [r["step"] for r in records(out)] == [21]
    tb = tensorboard_scalars(out)  # its curves go on: steps 1-20 before, 21 now
    assert sorted(tb["learning/loss"]) == list(range(1, 22))
    assert tb["learning/loss"][21] == logged(out)["learning/loss"][21]
    assert records(out)[-1]["lr"] == pytest.approx(3e-4 + 2.7e-3 * (1 + math.cos(math.pi * 10 /
                                                                             11)) / 2)
    # Resumed at --steps: nothing to train, and the table says so.
    assert train.main([*args, "--steps", "21", "--resume"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "already at step 21 of --steps 21: nothing to train" in shown
    assert "metrics.jsonl" not in shown and [r["step"] for r in records(out)] == [21]


@pytest.mark.slow
def test_lost_process_ends_the_other_with_one_line(tmp_path, tokens64):
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "zerojax", "train", *SMALL, "--data", str(tokens64), "--devices",
         "1", "--steps", "100000", "--eval-every", "0", "--save-every", "3", "--out",
         str(tmp_path), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
         "--process-id", str(i)], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for i in range(2)]
    deadline = time.monotonic() + 120
    while not options.checkpoint_steps(tmp_path / "checkpoints"):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
        time.sleep(0.2)
    procs[1].kill()
    t = time.monotonic()
    _, err = procs[0].communicate(timeout=120)
    waited = time.monotonic() - t
    procs[1].communicate()
    print(f"process 0 ended {waited:.1f} s after process 1 was killed")
    assert procs[0].returncode == peers.LOST_EXIT, err
    last = err.strip().splitlines()[-1]
    step = max(options.checkpoint_steps(tmp_path / "checkpoints"))
    assert last == (f"zerojax train: error: lost process 1 of 2; it stopped responding; last "
                    f"saved step {step} in {tmp_path / 'checkpoints'} (restart every process "
                    f"with --resume)")
    assert waited <= 30


def _data_of(out: Path) -> str:
    return json.loads((out / "summary.json").read_text())["config"]["data"]


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_exits_130(tmp_path, tokens64):
    args = [sys.executable, "-m", "zerojax", "train", *SMALL, "--data", str(tokens64),
            "--devices", "2", "--steps", "100000", "--eval-every", "0", "--out", str(tmp_path)]
    proc = subprocess.Popen(args, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    last = records(tmp_path)[-1]["step"]
    assert f"interrupted at step {last}; checkpoint saved" in err
    assert options.checkpoint_steps(tmp_path / "checkpoints") == [last]
