"""Run a command under a memory cap (a cgroup v1 memory controller), and report its peak and
whether the cap killed it: the harness of the NVMe tier's memory proof (docs/nvme.md).

    .venv/bin/python scripts/memcap.py --cap 1.5e9 -- .venv/bin/python train.py ...

The command runs in a new cgroup under this process's own (`memory.limit_in_bytes` = the cap,
and `memory.memsw.limit_in_bytes` where the kernel has it, so swap does not lift it), entered
before the command starts, so it and every process it starts are capped; the cgroup's
`memory.max_usage_in_bytes` is the peak (its page cache included: reads through the page
cache count until reclaimed, O_DIRECT's do not), and `memory.oom_control`'s oom_kill count
says whether the cap's OOM killer ended it. Needs root and cgroup v1's memory controller at
/sys/fs/cgroup/memory: `available()` says why not where they are missing (a test skips with
that reason). From Python: `run(cmd, cap)`; the CLI prints the result as JSON and exits with
the command's status.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")
_COUNT = itertools.count()


@dataclass
class Capped:
    """What a capped command did: its status (negative: the signal that ended it), whether
    the cap's OOM killer ended it, the cgroup's peak and the cap (bytes), its output."""

    rc: int
    oom_killed: bool
    peak: int
    cap: int
    stdout: str
    stderr: str


def _own() -> Path:
    """This process's memory cgroup (cgroup v1), where a capped one is made."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return ROOT / path.lstrip("/")
    return ROOT


def available() -> str:
    """"" if a capped cgroup can be made here, else why not."""
    if not (ROOT / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {ROOT}"
    if os.geteuid() != 0:
        return "making a cgroup needs root"
    try:
        group = _make(1 << 30)
    except OSError as e:
        return f"cannot make a cgroup under {_own()}: {e}"
    group.rmdir()
    return ""


def _make(cap: int) -> Path:
    for parent in (_own(), ROOT):
        group = parent / f"zerojax-memcap-{os.getpid()}-{next(_COUNT)}"
        try:
            group.mkdir()
        except OSError:
            if parent == ROOT:
                raise
            continue
        try:
            (group / "memory.limit_in_bytes").write_text(str(cap))
            if (group / "memory.memsw.limit_in_bytes").exists():
                try:
                    (group / "memory.memsw.limit_in_bytes").write_text(str(cap))
                except OSError:  # swap accounting off: no swap to lift the cap either
                    pass
        except OSError:
            group.rmdir()
            raise
        return group
    raise OSError("no cgroup")


def _oom_kills(group: Path) -> int:
    for line in (group / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def run(cmd: list[str], cap: int, *, timeout: float | None = None, env=None, cwd=None,
        capture: bool = True) -> Capped:
    """Runs `cmd` under a memory cap of `cap` bytes until it exits (or `timeout` seconds:
    then killed, rc -9, not counted as the cap's); raises OSError where `available()` is not
    empty."""
    why = available()
    if why:
        raise OSError(why)
    group = _make(int(cap))
    procs = group / "cgroup.procs"

    # The shell enters the cgroup and becomes the command: it and all it starts are capped
    # (not preexec_fn, which may deadlock in a process with threads, as jax's is).
    enter = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *cmd]
    out = subprocess.PIPE if capture else None
    p = subprocess.Popen(enter, env=env, cwd=cwd, stdout=out, stderr=out, text=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        stdout, stderr = p.communicate()
    try:
        killed = _oom_kills(group) > 0 and p.returncode == -signal.SIGKILL
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        for pid in procs.read_text().split():  # what the command started and left behind
            os.kill(int(pid), signal.SIGKILL)
    finally:
        _remove(group)
    return Capped(p.returncode, killed, peak, int(cap), stdout or "", stderr or "")


def _remove(group: Path):
    import time

    for _ in range(100):  # the killed processes leave the cgroup as they are reaped
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.05)
    group.rmdir()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cap", type=float, required=True, help="the memory cap (bytes)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds before it is killed")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command and its arguments")
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("give the command after --")
    why = available()
    if why:
        print(json.dumps({"skipped": why}))
        return 0
    res = run(cmd, int(args.cap), timeout=args.timeout, capture=False)
    print(json.dumps({k: v for k, v in asdict(res).items() if k not in ("stdout", "stderr")}))
    return res.rc if res.rc >= 0 else 128 - res.rc


if __name__ == "__main__":
    sys.exit(main())
