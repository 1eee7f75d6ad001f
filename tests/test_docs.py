"""The commands the README, docs/ and scripts/ show run as written after the README's set-up
line, which installs into .venv without activating it: no bare `python`, and the launch
scripts find the project's venv and write where their comments say."""

import os
import pathlib
import re
import shutil
import subprocess
import unicodedata

ROOT = pathlib.Path(__file__).parents[1]
DOCS = [ROOT / "README.md", ROOT / "experiments" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]
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


# A Markdown link or image whose target is in the repository: `[text](path#anchor)`.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# A section quoted by name in prose: docs/performance.md, "Offload on the H200"
QUOTED = re.compile(r"([\w./-]+\.md)[,:]? \"([^\"]+)\"")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without Markdown's marks, lower case, every
    character but letters, digits, `_`, `-` and spaces dropped, spaces made hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    keep = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return keep.replace(" ", "-")


def prose(path: pathlib.Path, spans: bool = False) -> list[str]:
    """The lines of a Markdown file, those of code blocks empty and inline code spans blanked
    (kept with `spans`: a heading's)."""
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        out.append("" if fenced or line.lstrip().startswith("```") else
                   line if spans else re.sub(r"`[^`]*`", "``", line))
    return out


def anchors(path: pathlib.Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated one numbered as GitHub does)."""
    seen: dict[str, int] = {}
    for line in prose(path, spans=True):
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            s = slug(m.group(1))
            seen[s] = seen.get(s, -1) + 1
    return {f"{s}-{i}" if i else s for s, n in seen.items() for i in range(n + 1)}


def leads(path: pathlib.Path) -> list[str]:
    """What a section can be quoted as: each heading's text and each bold paragraph lead."""
    lines = prose(path, spans=True)
    headings = [re.match(r"#{1,6} (.*)", line) for line in lines]
    return ([re.sub(r"[`*]", "", m.group(1)) for m in headings if m]
            + [m.group(1).replace("`", "") for line in lines
               for m in re.finditer(r"\*\*(.+?)\*\*", line)])


def broken_links(paths, root=ROOT) -> list[str]:
    """Each relative link of `paths` whose file, or whose anchor in it, does not exist, and
    each section quoted by name ("docs/x.md, "Title"") that no heading or bold lead of that
    doc (or, for a doc with a `-log.md` beside it, of its log) begins with."""
    bad = []
    for p in paths:
        lines = prose(p)
        for n, line in enumerate(lines, 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # https:, mailto:
                file, _, anchor = target.partition("#")
                dest = (p.parent / file).resolve() if file else p
                if not dest.exists():
                    bad.append(f"{p.relative_to(root)}:{n}: {target}: no such file")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    bad.append(f"{p.relative_to(root)}:{n}: {target}: no such heading")
        text = " ".join(lines)
        for doc, title in QUOTED.findall(text):
            dest = next((d for d in (p.parent / doc, root / doc) if d.exists()), None)
            if dest is None:
                bad.append(f"{p.relative_to(root)}: {doc}: no such file")
                continue
            log = dest.with_name(dest.stem + "-log.md")
            names = leads(dest) + (leads(log) if log.exists() else [])
            if not any(name.startswith(title) for name in names):
                bad.append(f'{p.relative_to(root)}: {doc}, "{title}": no such section')
    return bad


def test_every_relative_link_and_anchor_resolves():
    bad = broken_links(DOCS)
    assert not bad, "links to nothing:\n" + "\n".join(bad)


def test_the_link_check_finds_what_does_not_resolve(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A page\n\n## The `fused` host update: in place\n\n**A bold lead.** text\n\n"
        "```\n## not a heading\n```\n")
    (tmp_path / "docs" / "a-log.md").write_text("# Log\n\n### An old section\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "```\n[x](docs/none.md)\n```\n"
        "[a](docs/a.md) [b](docs/a.md#the-fused-host-update-in-place) [c](docs/b.md)\n"
        "[d](docs/a.md#not-a-heading) [e](https://example.com/x#y) `[f](docs/none.md)`\n"
        "[g](#here) ![h](docs/none.png)\n\n## Here\n\n"
        'See docs/a.md, "The fused host update" and docs/a.md: "A bold lead", docs/a.md,\n'
        '"An old section", docs/a.md, "Missing" and docs/c.md, "Any".\n')
    assert broken_links([readme], root=tmp_path) == [
        "README.md:4: docs/b.md: no such file",
        "README.md:5: docs/a.md#not-a-heading: no such heading",
        "README.md:6: docs/none.png: no such file",
        'README.md: docs/a.md, "Missing": no such section',
        "README.md: docs/c.md: no such file",
    ]
