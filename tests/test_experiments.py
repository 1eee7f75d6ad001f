"""experiments/ holds maintained benchmarks: each script is listed in experiments/README.md
with its command, builds its own argparse parser, and answers --help."""

import ast
import json
import os
import pathlib
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = pathlib.Path(__file__).parents[1]
EXPERIMENTS = ROOT / "experiments"
SCRIPTS = sorted(p.name for p in EXPERIMENTS.glob("*.py"))


def listed(readme: str) -> dict[str, list[str]]:
    """{script: its row's cells} of the README's first table, whose rows open with the
    script's name as a link: | [`bench.py`](bench.py) | what | command | where |."""
    table = readme.split("\n\n| script |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        m = re.fullmatch(r"\[`([\w.]+)`\]\(([\w.]+)\)", cells[0])
        assert m and m.group(1) == m.group(2), f"a row that names no script: {line}"
        rows[m.group(1)] = cells
    return rows


def parses_its_arguments(source: str) -> bool:
    """Whether a script builds an argparse parser (or tyro's) and runs only as __main__."""
    tree = ast.parse(source)
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    main = any(isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'"
               for n in tree.body)
    return main and bool(calls & {"argparse.ArgumentParser", "tyro.cli"})


def test_every_script_is_listed_with_its_command_and_parses_its_arguments():
    rows = listed((EXPERIMENTS / "README.md").read_text())
    assert sorted(rows) == SCRIPTS, "experiments/README.md lists other scripts than the folder"
    for name, (_, what, command, where) in rows.items():
        assert what and where, name
        # the command runs this script (or the launcher that runs it) as the docs' set-up has it
        assert re.search(rf"\.venv/bin/python experiments/{re.escape(name)}\b|scripts/\w+\.sh",
                         command), (name, command)
        assert parses_its_arguments((EXPERIMENTS / name).read_text()), name


def test_the_checks_catch_a_missing_row_and_a_script_without_a_parser():
    readme = ("# x\n\n| script | what | command | where |\n|---|---|---|---|\n"
              "| [`a.py`](a.py) | it | `.venv/bin/python experiments/a.py` | there |\n\nmore\n")
    assert list(listed(readme)) == ["a.py"]
    with pytest.raises(AssertionError, match="names no script"):
        listed(readme.replace("[`a.py`](a.py)", "a.py"))
    assert parses_its_arguments("import argparse\np = argparse.ArgumentParser()\n"
                                "if __name__ == '__main__':\n    p.parse_args()\n")
    assert not parses_its_arguments("import sys\nif __name__ == '__main__':\n    print(sys.argv)\n")
    assert not parses_its_arguments("import argparse\nargparse.ArgumentParser().parse_args()\n")


def _help(name: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, str(EXPERIMENTS / name), "--help"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.slow  # a jax import per script (~2-5 s each on 2 cores)
def test_every_script_answers_help():
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(SCRIPTS, pool.map(_help, SCRIPTS)))
    for name, r in results.items():
        assert r.returncode == 0, (name, r.stderr[-2000:])
        assert r.stdout.startswith(f"usage: {name}"), (name, r.stdout[:200])
        assert "--help" in r.stdout and not r.stderr.strip(), (name, r.stderr[-2000:])


@pytest.mark.slow  # compiles the test GPT's step at 4 stages on 2 devices (~20 s)
def test_memory_scaling_writes_its_page_and_plot(tmp_path):
    # conftest's compile-speed flags kept, its device count dropped (the script sets its own)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}
    r = subprocess.run([sys.executable, str(EXPERIMENTS / "memory_scaling.py"), "--preset",
                        "test", "--devices", "2", "--out", str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    page = (tmp_path / "memory_scaling.md").read_text()
    assert (tmp_path / "memory_scaling.png").stat().st_size > 0
    # a row per device count and stage: the measured state is the formula without the grads
    # term (printed in MB: to the byte but for padding and a few scalars)
    rows = [line.strip("|").split(" | ") for line in page.splitlines()
            if re.match(r"\| 2 \| [0-3] \|", line)]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(2, s) for s in range(4)]
    assert all(r[3].strip() == r[4].strip() for r in rows), page


@pytest.mark.slow  # matplotlib's import and one plot (~3 s)
def test_zeropp_convergence_plots_the_two_runs(tmp_path):
    """--plot-only on two runs' records as `zerojax train` writes them: both eval curves
    printed, the final eval losses compared."""
    for name, final in (("plain", 2.5), ("quantized", 2.45)):
        (tmp_path / name).mkdir()
        records = [{"step": 0, "eval_loss": 5.5}, {"step": 1, "loss": 5.0},
                   {"step": 2, "loss": 4.0, "eval_loss": final}]
        (tmp_path / name / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records))
    r = subprocess.run([sys.executable, str(EXPERIMENTS / "zeropp_convergence.py"), "--out",
                        str(tmp_path), "--plot", str(tmp_path / "p.png"), "--plot-only"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "plain 0:5.5000 2:2.5000" in r.stdout
    assert "final eval: plain 2.5000, quantized 2.4500 (-2.00%)" in r.stdout
    assert (tmp_path / "p.png").stat().st_size > 0
