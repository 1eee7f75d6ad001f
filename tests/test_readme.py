"""The README's set-up and test commands are the ones CI runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).parents[1]


def bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    setup, tests = bash_blocks(readme)[:2]
    install = setup.split(" && .venv/bin/python -m zerojax")[0]
    assert install in ci, f"CI does not install as the README says: {install!r}"
    assert tests in ci, f"CI does not run the README's test command: {tests!r}"
    assert "python -m zerojax train" in setup  # the first command runs the main job
