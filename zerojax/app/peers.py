"""Multi-process runs that lose a process: one line naming it and the last saved step, within
seconds, instead of a runtime abort a minute later."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from zerojax.app.options import UsageError, checkpoint_steps

# Seconds without a heartbeat after which the distributed runtime counts a process as lost
# (jax's default, 100 s, left the others blocked in a collective for over a minute).
HEARTBEAT_S = 10
LOST_EXIT = 1


class PeerWatch:
    """Ends a multi-process run with one line when the runtime has lost another process.

    A collective with a dead peer fails at once (gloo) or blocks; the coordinator notices the
    loss when the heartbeats stop (`HEARTBEAT_S`), and this thread polls it every second."""

    def __init__(self, processes: int, ckpt: Path):
        from jax._src import distributed

        self.client, self.processes, self.ckpt = distributed.global_state.client, processes, ckpt
        self._lock, self._stopped = threading.Lock(), threading.Event()
        threading.Thread(target=self._run, daemon=True, name="zerojax-peer-watch").start()

    def lost(self) -> list[int]:
        """The processes the coordinator no longer hears from ([0]: the coordinator itself)."""
        try:
            live = self.client.get_live_nodes(list(range(self.processes)))
        except Exception:  # the coordinator (process 0) is gone: no RPC reaches it
            return [0]
        return sorted(set(range(self.processes)) - set(live))

    def _run(self) -> None:
        while not self._stopped.wait(1):
            lost = self.lost()
            if lost and not self._stopped.is_set():  # not those leaving at the end of the run
                self.exit(lost)

    def leave(self, lead: bool) -> None:
        """The end of a run: process 0 (which hosts the coordinator) waits until the others
        have disconnected, since with recoverable tasks jax's shutdown no longer waits."""
        import jax
        from jax.experimental import multihost_utils

        self._stopped.set()
        multihost_utils.sync_global_devices("zerojax train: end")
        if not lead:
            jax.distributed.shutdown()
            return
        deadline = time.monotonic() + 60
        while len(self.client.get_live_nodes(list(range(self.processes)))) > 1:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)

    def settle(self) -> None:
        """After a failure in this process: if it is a lost process, exit naming it."""
        deadline = time.monotonic() + HEARTBEAT_S + 5
        while time.monotonic() < deadline:
            if lost := self.lost():
                self.exit(lost)
            time.sleep(0.5)

    def exit(self, lost: list[int]) -> None:
        with self._lock:  # the watch thread and the main thread may both get here
            try:
                steps = checkpoint_steps(self.ckpt)
            except UsageError:
                steps = []
            who = ("process 0 (the coordinator)" if lost == [0] else
                   f"process{'es' * (len(lost) > 1)} {', '.join(map(str, lost))}")
            saved = (f"last saved step {steps[-1]} in {self.ckpt} (restart every process with "
                     f"--resume)" if steps else "no checkpoint was saved")
            _exit_now(f"zerojax train: error: lost {who} of {self.processes}; it stopped "
                      f"responding; {saved}", LOST_EXIT)


def _exit_now(line: str, code: int) -> None:
    """Prints `line` last and exits, without waiting for collectives or saves that never end."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(2, (line + "\n").encode())
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)  # what dying runtime threads still print would come after the line
    os._exit(code)
