"""The planner: the configuration with the least communication that fits, over stage × remat ×
grad_accum (and optimizer offload, searched only when nothing fits without it), each candidate
measured from its compiled step (`largest`: largest.py; the commands: commands.py)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from zerojax.analysis.accounting import (
    STAGES,
    format_bytes,
)

TIE = 0.01  # communication within 1% of the least counts as equal
# The learning rate and weight decay (train's default) of the optimizers `plan` and `measure`
# build; the state an optimizer allocates depends on neither.
LR = 3e-4
WEIGHT_DECAY = 0.1


def named_optimizer(name: str):
    """The `zerojax.update.presets` optimizer `name` as `plan` and `measure` build it (at `LR`
    and train's default weight decay: what it allocates depends on neither)."""
    from zerojax.update.presets import build

    return build(name, LR, weight_decay=WEIGHT_DECAY)


@dataclasses.dataclass
class Candidate:
    """One configuration the planner tried."""

    stage: int
    remat: bool
    grad_accum: int
    fits: bool = False
    chosen: bool = False
    reason: str = ""  # why it was rejected (empty for the chosen one)
    peak_bytes: int | None = None  # None: not compiled (see reason)
    state_bytes: int | None = None  # the state in device memory
    comm_bytes: float | None = None  # requested dtype, per device per step
    launches: int | None = None  # collectives started per step
    offload: str | None = None  # the optimizer state in host memory (peak_bytes: device only)
    host_bytes: int | None = None  # offload: the state's bytes in host memory, per device

    def row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PlanResult:
    """Every candidate, and the chosen one (`best`, None if nothing fits)."""

    devices: int
    device_memory: int
    candidates: list[Candidate]
    best: Candidate | None = None
    param_dtype: str = "bfloat16"
    num_params: int = 0
    offload_searched: bool = False  # nothing fit without offload, so offload was tried

    def notes(self) -> list[str]:
        """Why some candidates' peaks look odd, one line each (read from compiled programs)."""
        n, psi = self.devices, self.num_params
        notes = []
        if self.offload_searched:
            notes.append("nothing fits without offload, so stages 1-3 were also tried with "
                         "offload='optimizer' (master and moments in host memory; peak is "
                         "device memory, host bytes per device in host_bytes)")
        if not any(c.stage <= 1 and c.grad_accum > 1 and c.peak_bytes for c in self.candidates):
            return notes
        # Stages 0-1 differentiate the full params, so the sum over micro-batches is full-size;
        # it is float32 so that adding micro-batch gradients loses no precision.
        return [*notes, f"grad_accum > 1 in stages 0-1 adds a full-size float32 gradient "
                f"accumulator (4 B x Ψ = {format_bytes(4 * psi)}) to the peak; stages 2-3 "
                f"accumulate a 1/N shard ({format_bytes(4 * psi / n)}), so there smaller "
                f"micro-batches lower it"]

    def config(self, **overrides):
        """The chosen configuration as a `ZeroConfig` (overrides: e.g. clip_norm=1.0)."""
        from zerojax.config import ZeroConfig

        if self.best is None:
            raise ValueError("no configuration fits; see the candidates' reasons")
        b = self.best
        return ZeroConfig(**{"stage": b.stage, "remat": b.remat, "grad_accum": b.grad_accum,
                             "param_dtype": self.param_dtype, "offload": b.offload,
                             **overrides})

    def refit(self, device_memory: int) -> PlanResult:
        """The same candidates chosen among for another memory budget (nothing recompiled;
        candidates that were not compiled stay rejected)."""
        cands = [dataclasses.replace(c) for c in self.candidates]
        return _choose(PlanResult(self.devices, device_memory, cands,
                                  param_dtype=self.param_dtype, num_params=self.num_params,
                                  offload_searched=self.offload_searched))

    def as_dict(self) -> dict[str, Any]:
        return {"devices": self.devices, "device_memory": self.device_memory,
                "param_dtype": self.param_dtype, "num_params": self.num_params,
                "offload_searched": self.offload_searched,
                "best": None if self.best is None else self.best.row(),
                "candidates": [c.row() for c in self.candidates], "notes": self.notes()}


Progress = Callable[[Candidate, str, int, int], None]  # (candidate, phase, index, total)


def plan(model, devices: int, device_memory: float, batch, *, optimizer=None,
         param_dtype: str = "bfloat16", stages=STAGES, remat=(True, False),
         grad_accum=(1, 2, 4), offload: bool = True,
         progress: Progress | None = None) -> PlanResult:
    """Tries every (stage, remat, grad_accum) by AOT compilation on `devices` and picks the
    configuration with the least communication whose peak memory fits in `device_memory`.

    Ties (within 1%) go to the one that does less extra work: no remat, then fewer
    micro-batches, then fewer collective launches, then the least peak memory. A candidate
    whose model state alone exceeds the budget is not compiled. Only if nothing fits (and
    `offload`) are the stages 1-3 of `stages` tried again with `offload="optimizer"`, whose
    peak counts device memory only (`offload_searched` says so). `batch` is the global batch
    of every candidate (grad_accum splits it into micro-batches). `progress(candidate, phase,
    index, total)` is called with phase "lowering", "compiling" (only if it is compiled) and
    "done" for the index-th (from 1) of `total` candidates.
    """
    import jax
    import optax

    from zerojax.analysis.accounting import lower, measure_lowered, state_bytes
    from zerojax.analysis.hlo import collectives
    from zerojax.config import ZeroConfig
    from zerojax.engine import Engine
    from zerojax.errors import BatchError
    from zerojax.mesh import make_mesh

    optimizer = optax.adamw(LR) if optimizer is None else optimizer
    mesh = make_mesh(data=devices)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x),
                                                        jax.numpy.result_type(x)), batch)
    report = progress or (lambda *_: None)
    cands, num_params = [], 0

    def search(combos, start, total):
        nonlocal num_params
        for i, (stage, rm, accum, off) in enumerate(combos, start):
            c = Candidate(stage, rm, accum, offload=off)
            cands.append(c)
            report(c, "lowering", i, total)
            cfg = ZeroConfig(stage=stage, param_dtype=param_dtype, remat=rm, grad_accum=accum,
                             offload=off)
            engine = Engine(model, optimizer, mesh, cfg)
            try:
                lowered = lower(engine, batch)
            except BatchError as e:
                c.reason = f"batch: {e}"
                report(c, "done", i, total)
                continue
            num_params = engine.layout.num_params
            state = state_bytes(engine)
            c.state_bytes, c.host_bytes = state["device"], state["host"] if off else None
            if c.state_bytes > device_memory:
                text = lowered.compiler_ir("hlo").as_hlo_text()
                found, c.launches, _ = collectives(text, devices)
                c.comm_bytes = found["total"]
                c.reason = (f"model state alone is {format_bytes(c.state_bytes)} > "
                            f"{format_bytes(device_memory)} (not compiled)")
            else:
                report(c, "compiling", i, total)
                m = measure_lowered(engine, lowered)
                c.peak_bytes, c.comm_bytes = m.device_peak_bytes, m.collective_bytes["total"]
                c.launches = m.collective_launches
            report(c, "done", i, total)

    combos = [(*c, None) for c in itertools.product(stages, remat, grad_accum)]
    search(combos, 1, len(combos))
    result = _choose(PlanResult(devices, int(device_memory), cands, param_dtype=param_dtype,
                                num_params=num_params))
    more = [(*c, "optimizer") for c in itertools.product([s for s in stages if s >= 1], remat,
                                                           grad_accum)]
    # Offload helps only candidates that were rejected for memory (they lowered), not a batch
    # that does not split.
    if result.best is not None or not offload or not more \
            or all(c.state_bytes is None for c in cands):
        return result
    search(more, len(combos) + 1, len(combos) + len(more))
    return _choose(PlanResult(devices, int(device_memory), cands, param_dtype=param_dtype,
                              num_params=num_params, offload_searched=True))


def _choose(result: PlanResult) -> PlanResult:
    mem = result.device_memory
    for c in result.candidates:
        c.chosen = False
        if c.peak_bytes is not None:
            c.fits = c.peak_bytes <= mem
            if not c.fits:
                c.reason = f"peak {format_bytes(c.peak_bytes)} > {format_bytes(mem)}"
    fitting = [c for c in result.candidates if c.fits]
    result.best = None
    if not fitting:
        return result
    least = min(c.comm_bytes for c in fitting)
    tied = [c for c in fitting if c.comm_bytes <= least * (1 + TIE)]
    # Offload moves bytes over PCIe every step: the last resort among equals.
    best = min(tied, key=lambda c: (c.offload is not None, c.remat, c.grad_accum, c.launches,
                                    c.peak_bytes))
    best.chosen, best.reason, result.best = True, "", best
    for c in fitting:
        if c is best:
            continue
        if any(c is t for t in tied):
            c.reason = "fits; same traffic, but more recompute, collectives or memory"
        else:
            c.reason = (f"fits; sends {format_bytes(c.comm_bytes)} vs "
                        f"{format_bytes(best.comm_bytes)}")
    return result


# --- The largest GPT that fits, from the estimator (nothing compiled) ---------------------------
