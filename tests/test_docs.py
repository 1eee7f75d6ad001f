"""The commands the README, docs/ and scripts/ show run as written after the README's set-up
line, which installs into .venv without activating it: no bare `python`, and the launch
scripts find the project's venv and write where their comments say."""

import os
import pathlib
import re
import shutil
import subprocess

ROOT = pathlib.Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPTS = sorted((ROOT / "scripts").iterdir())

# `python`, `python3` or `pip` as the command word (not the end of `.venv/bin/python`) running
# a module, a file, or an install.
BARE = re.compile(r"(?<![\w./$-])(?:python3?|pip3?)\s+(?:-[mc]\s|install\b|[\w./-]+\.py\b)")
ALLOWED = "python3 -m venv"  # the set-up line's one command before the venv exists


def shown_lines(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, text) of what a reader may copy: code-block lines and inline code spans
    of a Markdown file, the non-comment lines of a script."""
    lines = path.read_text().splitlines()
    if path.suffix != ".md":
        return [(n, s) for n, s in enumerate(lines, 1) if not s.lstrip().startswith("#")]
    shown, fenced = [], False
    for n, s in enumerate(lines, 1):
        if s.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            shown.append((n, s))
        else:
            shown += [(n, span) for span in re.findall(r"`([^`]+)`", s)]
    return shown


def bare_python(paths, root=ROOT) -> list[str]:
    return [f"{p.relative_to(root)}:{n}: {s.strip()}"
            for p in paths for n, s in shown_lines(p) if BARE.search(s.replace(ALLOWED, ""))]


def test_docs_and_scripts_run_the_venv_python():
    bad = bare_python(DOCS + SCRIPTS)
    assert not bad, ("the README's set-up does not activate .venv; use .venv/bin/python "
                     "(scripts: the venv lookup):\n" + "\n".join(bad))


def test_the_scan_finds_bare_python(tmp_path):
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "x.md"
    doc.write_text("Run `python -m zerojax train --help` or:\n\n```bash\n"
                   "python3 -m venv .venv && .venv/bin/pip install -e .\n"
                   ".venv/bin/python experiments/bench.py\n"
                   "python experiments/bench.py --json\n"
                   "pip install -e '.[cuda12]'\n```\n\n"
                   "`.venv/bin/python -m zerojax` is fine, and so is Python ≥ 3.11.\n")
    script = tmp_path / "docs" / "run.sh"
    script.write_text('#!/bin/bash\n# calls `python -m zerojax`\n"$PYTHON" -m zerojax\n'
                      "python -c 'import jax'\n")
    assert bare_python([doc, script], root=tmp_path) == [
        "docs/x.md:1: python -m zerojax train --help",
        "docs/x.md:6: python experiments/bench.py --json",
        "docs/x.md:7: pip install -e '.[cuda12]'",
        "docs/run.sh:4: python -c 'import jax'",
    ]


def _project(tmp_path) -> tuple[pathlib.Path, pathlib.Path]:
    """A copy of scripts/ beside a fake .venv/bin/python that logs its arguments."""
    proj = tmp_path / "proj"
    shutil.copytree(ROOT / "scripts", proj / "scripts")
    venv_python = proj / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    log = tmp_path / "calls.log"
    venv_python.write_text(f'#!/bin/sh\necho "$0 $*" >> {log}\n')
    venv_python.chmod(0o755)
    return proj, log


def _run(cmd, cwd, **env) -> None:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PYTHON", "PORT", "OUT") and not k.startswith("SLURM")}
    r = subprocess.run(["bash", *map(str, cmd)], cwd=cwd, env=clean | env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_launch_local_uses_the_venv_and_its_own_out(tmp_path):
    proj, log = _project(tmp_path)
    _run([proj / "scripts" / "launch_local.sh", 2, 1, "--steps", 4], tmp_path)
    calls = sorted(log.read_text().splitlines())
    log.unlink()
    assert len(calls) == 2
    for i, call in enumerate(calls):
        python, args = call.split(" ", 1)
        assert pathlib.Path(python).resolve() == proj / ".venv" / "bin" / "python"
        assert args == ("-m zerojax train --devices 1 --coordinator 127.0.0.1:12355 "
                        f"--num-processes 2 --process-id {i} --out runs/launch_local --steps 4")
    # --out (or --config, which may name one) given: the script adds none.
    for given in (["--out", "mine"], ["--out=mine"], ["--config", "run.toml"]):
        _run([proj / "scripts" / "launch_local.sh", 1, 1, *given], tmp_path)
        (call,) = log.read_text().splitlines()
        log.unlink()
        assert call.endswith("--process-id 0 " + " ".join(given)), call


def test_gpu_scripts_use_the_venv(tmp_path):
    proj, log = _project(tmp_path)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    srun = fake_bin / "srun"
    srun.write_text('#!/bin/sh\nshift\nexec "$@"\n')  # drops --kill-on-bad-exit, runs one task
    srun.chmod(0o755)
    path = f"{fake_bin}:{os.environ['PATH']}"

    _run([proj / "scripts" / "multi_gpu.sh", "--steps", 3], tmp_path)
    python, args = log.read_text().split(" ", 1)
    log.unlink()
    assert pathlib.Path(python).resolve() == proj / ".venv" / "bin" / "python"
    assert args.startswith("-m zerojax train --model gpt2-small")
    assert args.strip().endswith("--out runs/gpu --steps 3")

    # sbatch runs a copy of the script: the venv is the submit directory's, OUT the job's name
    # (so a resubmitted job under the same name finds its checkpoints).
    _run([proj / "scripts" / "slurm.sbatch", "--resume"], tmp_path, PATH=path,
         SLURM_JOB_NAME="gpt2-run", SLURM_JOB_ID="123", SLURM_SUBMIT_DIR=str(proj))
    python, args = log.read_text().split(" ", 1)
    assert pathlib.Path(python).resolve() == proj / ".venv" / "bin" / "python"
    assert args.startswith("-m zerojax train --model gpt2-small")
    assert args.strip().endswith("--out runs/gpt2-run --resume")
