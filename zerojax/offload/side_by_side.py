"""The update's parts run side by side on the host (ZeRO-Offload's update, host.py).

Each part of the update (update/parts.py: the leaves the optimizer does not tie together) is
dispatched as its own program of the CPU backend, from a thread of its own (`SideBySide`), so
the parts update side by side, and on a GPU's host each part's shards start their way to the
devices as soon as that part is done. A fused pass (fused.py) runs on every thread of the host
by itself and inline: on a GPU's host, with RUNS > 1, a step runs it in about RUNS parts in
turn, each part's shards sent up on a thread of its own as it ends (`Sending`).

Why threads: XLA:CPU splits an elementwise fusion that reads more bytes than it computes (an
optimizer's update) into at most ceil(sqrt(cores)) tasks, 4 on a 16-core host, about a quarter
of the host's copy bandwidth; and the CPU backend runs the programs one thread dispatches one
after the other. Programs dispatched from different threads run at the same time
(docs/performance.md has the figures).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from zerojax.update.parts import PARTS

# A fused update whose shards go to a GPU (`Sending`) in about this many parts; 1: in one, its
# shards up after it, as before (the default until a GPU measures the overlap: on a host whose
# memory bandwidth the pass fills, the uploads' copies take theirs from it; docs/performance.md)
RUNS = 1


# Ops of a lowered program that wait for every device of its mesh: two such programs run side
# by side could each hold the threads the other's devices wait for.
COLLECTIVES = ("all_reduce", "all_gather", "all_to_all", "collective_permute",
               "reduce_scatter", "collective_broadcast")


def holds_collective(lowered) -> bool:
    """Whether a lowered program holds one of `COLLECTIVES`."""
    text = lowered.as_text()
    return any(f"stablehlo.{op}" in text for op in COLLECTIVES)


class SideBySide:
    """Calls programs each from a thread of its own, so the CPU backend runs them at the same
    time; a program of several devices that holds a collective is called from the caller's
    thread, in turn (`COLLECTIVES`), and so is each program's first call (it traces and
    compiles under the caller's jax context, and its errors are the caller's). Gives the
    calls' results in order, each as a call from the caller's thread would: once dispatched,
    or once done for a program XLA:CPU runs inline (a fused pass's: `HostOffload._beside`)."""

    def __init__(self, workers: int = PARTS):
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._alone: dict = {}  # program -> whether it waits for its mesh's devices

    def __call__(self, calls: list[tuple]) -> list:
        """`calls`: [(jitted fn, args, its mesh's size)], each fn called with args of the
        same shapes every time."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="zerojax-part")
        out = [None] * len(calls)
        for k, (fn, args, devices) in enumerate(calls):
            first = fn not in self._alone
            if first:
                self._alone[fn] = devices > 1 and holds_collective(fn.lower(*args))
            out[k] = fn(*args) if first or self._alone[fn] or len(calls) == 1 else \
                self._pool.submit(fn, *args)
        return [x.result() if isinstance(x, Future) else x for x in out]


class Sending:
    """Programs that XLA:CPU runs inline, to their end, on the calling thread (a fused pass's),
    called one after the other, each one's results handed to `send` on a thread of its own as
    soon as it ends. On a GPU's host a run's compute-dtype shards so go up to the devices
    while the next run updates, and the step waits for the last run's upload alone (a move
    between the two backends copies on the thread that asks for it: `meshes.across`).
    Gives (the programs' results, what `send` gave for each), in order."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None

    def __call__(self, calls: list[tuple], send: Callable) -> tuple[list, list]:
        """`calls`: [(jitted fn, args, what `send` is called with beside fn's results)]."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="zerojax-send")
        out, sent = [], []
        for fn, args, what in calls:
            out.append(fn(*args))
            sent.append(self._pool.submit(send, what, out[-1]))
        return out, [x.result() for x in sent]
