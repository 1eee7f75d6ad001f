"""`python -m zerojax train` / `sample`: options, end-to-end runs, multi-process, resume, failures.

Runs that need their own device count are subprocesses (the count is fixed when jax starts);
option checks run in this process, since they must finish before jax is touched.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from zerojax.app import options, sample, train
from zerojax.app.data import embedded_corpus

ROOT = Path(__file__).resolve().parents[1]
# The "test" preset has a 64-token vocabulary: bytes folded into it keep the runs tiny.
SMALL = ["--model", "test", "--batch", "8", "--eval-every", "10", "--eval-batches", "2",
         "--quiet"]


def _env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)  # conftest's 8 devices; each run sets its own count
    return env


def zerojax(*args, timeout=300) -> subprocess.CompletedProcess:
    """`python -m zerojax ARGS` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "zerojax", *map(str, args)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


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
    r = zerojax("train", *SMALL, "--data", tokens64, "--devices", 4, "--steps", 20,
                "--save-every", 10, "--out", out)
    assert r.returncode == 0, r.stderr
    return out


# --------------------------------------------------------------------------------- options


def test_help_documents_every_option(capsys):
    assert train.main(["--help"]) == 0
    text = capsys.readouterr().out
    for field in options.TrainConfig.__dataclass_fields__:
        assert f"--{field.replace('_', '-')}" in text, field
    assert "Total optimizer steps" in text  # field docstrings are the help


def test_config_file_then_flags(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"steps": 7, "seq-len": 32, "stage": 1}))
    (tmp_path / "run.toml").write_text('steps = 9\nmodel = "small8"\n')
    cfg = options.parse_args(["--config", str(tmp_path / "run.json"), "--steps", "5"])
    assert (cfg.steps, cfg.seq_len, cfg.stage, cfg.model) == (5, 32, 1, "nano")
    cfg = options.parse_args([f"--config={tmp_path / 'run.toml'}"])
    assert (cfg.steps, cfg.model) == (9, "small8")


BAD = {  # case: (argv, expected message); {tmp} is the test's tmp_path
    "unknown preset": ("--model gpt5", "unknown GPT preset --model='gpt5'"),
    "batch vs devices": ("--devices 4 --batch 6", "--batch=6 is not divisible"),
    "batch vs grad accum": ("--devices 4 --batch 8 --grad-accum 4",
                            "not divisible by --grad-accum=4"),
    "missing data": ("--data {tmp}/nope.txt", "token file not found"),
    "data extension": ("--data {tmp}/bad.json", "extension '.json'"),
    "resume without checkpoint": ("--resume --out {tmp}", "no checkpoint"),
    "existing checkpoints": ("--out {tmp}/old", "pass --resume"),
    "seq-len": ("--seq-len 129", "context length 128"),
    "vocab": ("--model test", "vocab_size 64"),
    "config key": ("--config {tmp}/bad.json", "unknown option(s) ['stepz']"),
    "config file": ("--config {tmp}/none.json", "config file not found"),
    "half distributed": ("--coordinator localhost:1234", "go together"),
    "prefetch": ("--stage 2 --prefetch", "--prefetch needs --stage 3"),
    "steps": ("--steps 0", "--steps=0 must be a positive integer"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_options_exit_2_with_one_line_before_jax(case, tmp_path, capsys, monkeypatch):
    (tmp_path / "bad.json").write_text('{"stepz": 3}')
    (tmp_path / "old" / "checkpoints" / "5").mkdir(parents=True)
    argv, message = BAD[case]
    started = []
    monkeypatch.setattr(train, "start_runtime", started.append)
    assert train.main(argv.format(tmp=tmp_path).split()) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zerojax train: error: "), err
    assert message in err
    assert not started  # rejected before XLA flags, jax.distributed or any compilation


def test_sample_without_checkpoint_exits_2(tmp_path, capsys):
    assert sample.sample_main([str(tmp_path)]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_non_finite_loss_stops_naming_the_step(tmp_path, tokens64, capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main sets it; restore
    code = train.main([*SMALL, "--data", str(tokens64), "--devices", "4", "--steps", "30",
                       "--lr", "1e30", "--warmup", "0", "--clip-norm", "None",
                       "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "zerojax train: error: loss is nan at step 2" in err
    assert not (tmp_path / "checkpoints").exists()


# --------------------------------------------------------------------------------- runs


@pytest.mark.slow
def test_nano_stage3_learns_and_writes_outputs(tmp_path):
    t = time.perf_counter()
    r = zerojax("train", "--model", "nano", "--stage", 3, "--devices", 4, "--steps", 60,
                "--eval-every", 20, "--out", tmp_path)
    wall = time.perf_counter() - t
    assert r.returncode == 0, r.stderr
    recs = records(tmp_path)
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 61))
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s"):
        assert all(np.isfinite(r[key]) for r in steps), key
    evals = [(r["step"], r["eval_loss"]) for r in recs if "eval_loss" in r]
    assert [s for s, _ in evals] == [0, 20, 40, 60]
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
    assert "done: step 60" in r.stdout
    print(f"60-step nano run: {wall:.0f} s wall, {summary['timings']}")

    s = zerojax("sample", tmp_path, "--prompt", "def ", "--tokens", 40, "--temperature", 0)
    assert s.returncode == 0, s.stderr
    assert s.stdout.startswith("def ") and len(s.stdout.encode()) >= 40


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, tokens64, reference):
    script = ROOT / "scripts" / "launch_local.sh"
    env = dict(_env(), PORT=str(free_port()), PYTHON=sys.executable)
    r = subprocess.run(["bash", str(script), "2", "2", *SMALL, "--data", str(tokens64),
                        "--steps", "20", "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["devices"]["processes"] == 2 and summary["devices"]["count"] == 4
    np.testing.assert_allclose(losses(tmp_path), losses(reference), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run(tmp_path, reference):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    shutil.rmtree(out / "checkpoints" / "20")  # as if the run had stopped after step 10
    r = zerojax("train", *SMALL, "--data", _data_of(reference), "--devices", 4, "--steps", 20,
                "--save-every", 10, "--out", out, "--resume")
    assert r.returncode == 0, r.stderr
    assert [r["step"] for r in records(out) if "loss" in r] == list(range(1, 21))
    np.testing.assert_array_equal(losses(out), losses(reference))
    # Resumed past --steps: nothing to train, and step 20's state is not saved as step 5.
    r = zerojax("train", *SMALL, "--data", _data_of(reference), "--devices", 4, "--steps", 5,
                "--out", out, "--resume")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["10", "20"]


def _data_of(out: Path) -> str:
    return json.loads((out / "summary.json").read_text())["config"]["data"]


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_exits_130(tmp_path, tokens64):
    args = [sys.executable, "-m", "zerojax", "train", *SMALL, "--data", str(tokens64),
            "--devices", "2", "--steps", "100000", "--eval-every", "0", "--out", str(tmp_path)]
    proc = subprocess.Popen(args, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
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
