"""The README's set-up and test commands are the ones CI runs; its library example runs."""

import math
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]


def bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    setup, tests, slow = bash_blocks(readme)[:3]
    install = setup.split(" && .venv/bin/python -m zerojax")[0]
    assert install in ci, f"CI does not install as the README says: {install!r}"
    assert tests in ci, f"CI does not run the README's test command: {tests!r}"
    assert slow == f"{tests} -m slow" and slow in ci, f"CI does not run the slow tier: {slow!r}"
    assert "python -m zerojax train" in setup  # the first command runs the main job


def test_library_example_runs(tmp_path):
    # As a user runs it: saved to a file, a fresh interpreter that sets its own device count
    # (conftest's 8-device flag is dropped; its compile-speed flags are kept).
    section = (ROOT / "README.md").read_text().split("## Using the library", 1)[1]
    script = tmp_path / "example.py"
    script.write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(PYTHONPATH=str(ROOT), XLA_FLAGS=" ".join(flags))
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    losses = [float(x) for x in re.findall(r"^loss (\S+)$", r.stdout, re.M)]
    (eval_loss,) = [float(x) for x in re.findall(r"^eval (\S+)$", r.stdout, re.M)]
    assert len(losses) == 5, r.stdout
    assert abs(losses[0] - math.log(64)) < 0.1, losses  # a fresh model: near-uniform over V=64
    assert all(b < a for a, b in zip(losses, losses[1:])), losses  # one batch, memorized
    assert eval_loss < losses[-1], (eval_loss, losses)  # evaluated after the fifth update
    assert "restored step 5" in r.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["example.py"]  # the checkpoint was temporary
