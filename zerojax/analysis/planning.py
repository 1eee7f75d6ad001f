"""The planner: the configuration with the least communication that fits, over stage × remat ×
grad_accum (and optimizer offload, searched only when nothing fits without it), each candidate
measured from its compiled step; and `largest`, the biggest GPT shape whose estimated peak fits,
per stage, with or without offload, from formulas alone (commands: commands.py)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from zerojax.analysis.accounting import (
    STAGES,
    EstimateError,
    format_bytes,
    state_estimate,
)

TIE = 0.01  # communication within 1% of the least counts as equal
LR = 3e-4  # the AdamW that `plan` and `measure` assume (the state does not depend on it)


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

# GPT-3's shapes (Brown et al. 2020, table 2.1; 16 heads of 128 for 1.3B, whose table row is not
# a whole head width) with d_ff = 4d, beside the presets; vocabulary and sequence length of the
# 1b/7b presets. Depths and widths of GPT-NeoX-20B and LLaMA-33B/65B (with d_ff = 4d), and a
# 4B between 2.7B and 6.7B, fill the gaps. (GPT-3 6.7B is the 7b preset.)
_GPT3_SHAPES = {"gpt3-125m": (12, 768, 12), "gpt3-350m": (24, 1024, 16),
                "gpt3-760m": (24, 1536, 16), "gpt3-1.3b": (24, 2048, 16),
                "gpt3-2.7b": (32, 2560, 32), "gpt-4b": (36, 3072, 24),
                "gpt3-13b": (40, 5120, 40), "neox-20b": (44, 6144, 48),
                "gpt-33b": (60, 6656, 52), "gpt-65b": (80, 8192, 64),
                "gpt3-175b": (96, 12288, 96)}
FAMILY_PRESETS = ("gpt2-small", "1b", "7b")


def gpt_family(vocab_size: int = 32000, seq_len: int = 2048) -> dict[str, Any]:
    """The GPT shapes `largest` searches (name -> `GPTConfig`), fewest params first: the presets
    of `FAMILY_PRESETS` and GPT-3's table (with `vocab_size` and `seq_len`)."""
    from zerojax.models.gpt import GPT, PRESETS, GPTConfig

    shapes = {name: PRESETS[name] for name in FAMILY_PRESETS}
    for name, (layers, d, heads) in _GPT3_SHAPES.items():
        shapes[name] = GPTConfig(vocab_size=vocab_size, seq_len=seq_len, d_model=d,
                                 n_heads=heads, n_layers=layers, d_ff=4 * d)
    return dict(sorted(shapes.items(), key=lambda kv: GPT(kv[1]).num_params()))


def _itemsize(param_dtype: str) -> int:
    import numpy as np

    from zerojax.precision import DTYPES

    if param_dtype not in DTYPES:
        raise EstimateError(f"param_dtype={param_dtype!r} is not supported; use one of "
                            f"{sorted(DTYPES)}")
    return np.dtype(DTYPES[param_dtype]).itemsize


def activation_bytes(cfg, batch_per_device: int, param_dtype: str = "bfloat16",
                     remat: bool = True) -> dict[str, float]:
    """Estimated per-device activation bytes of one GPT training step, by part.

    One layer's activations: Korthikanti et al. 2022's `b·T·d·(34 + 5·a·T/d)` bytes for 2-byte
    values (scaled to `param_dtype`). It counts the T×T attention scores, which XLA's attention
    keeps and cuDNN's flash attention does not, and dropout masks GPT does not have: an upper
    bound. With remat every layer keeps only its input and one layer is recomputed at a time;
    without, every layer keeps all of its activations. The head adds the logits in compute
    dtype and their float32 log-softmax and gradient.
    """
    size = _itemsize(param_dtype)
    if isinstance(batch_per_device, bool) or not isinstance(batch_per_device, int) \
            or batch_per_device < 1:
        raise EstimateError(f"batch_per_device={batch_per_device!r} must be an integer >= 1")
    b, T, d, L = batch_per_device, cfg.seq_len, cfg.d_model, cfg.n_layers
    layer = b * T * d * (34 + 5 * cfg.n_heads * T / d) * size / 2
    layers = L * b * T * d * size + layer if remat else L * layer
    logits = b * T * cfg.vocab_size * (size + 8)
    return {"layers": layers, "logits": logits, "total": layers + logits}


@dataclasses.dataclass(frozen=True)
class Fit:
    """The estimated per-device peak of one GPT shape at one stage: model state (params, grads,
    optimizer: `state_estimate`) + activations (`activation_bytes`) + stage 3's gathered unit
    (its compute params and their gradient, for the largest unit). With offload, `state` and
    `peak` are device bytes and the master and moments are `host` bytes."""

    name: str
    num_params: int
    stage: int
    remat: bool
    state: float
    activations: float
    gathered: float
    peak: float
    offload: str | None = None
    host: float = 0.0  # offload: master + moments in host memory, per device
    transfer: float = 0.0  # offload: host<->device bytes per step, per device

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def estimate_fit(name: str, cfg, devices: int, stage: int, batch_per_device: int,
                 param_dtype: str = "bfloat16", remat: bool = True,
                 offload: str | None = None) -> Fit:
    """`Fit` of the GPT `cfg` (called `name`) on `devices` at `stage`."""
    from zerojax.models.gpt import GPT

    psi = GPT(cfg).num_params()
    mem = state_estimate(psi, devices, stage, param_dtype, offload=offload)
    state = mem.total
    act = activation_bytes(cfg, batch_per_device, param_dtype, remat)["total"]
    # Stage 3 gathers one unit at a time: the largest is a layer or the vocabulary table.
    unit = max(cfg.layer_params, cfg.vocab_size * cfg.d_model)
    gathered = 2 * unit * _itemsize(param_dtype) if stage == 3 and devices > 1 else 0
    return Fit(name, psi, stage, remat, state, act, gathered, state + act + gathered, offload,
               mem.host, mem.transfer)


def largest(devices: int, device_memory: float, *, batch_per_device: int = 1,
            param_dtype: str = "bfloat16", stages=STAGES, remat=(True, False),
            family: dict[str, Any] | None = None, offload: str | None = None,
            host_memory: float | None = None) -> list[dict[str, Any]]:
    """Per (stage, remat): the largest shape of `family` (default `gpt_family()`) whose
    estimated peak fits `device_memory`, and the next larger one, which does not.

    With `offload` ("optimizer"), stage 0 (which cannot offload) is skipped and the peak is
    device memory; `host_memory`, if given, must also hold each device's host bytes.
    Rows: {"stage", "remat", "offload", "fits": Fit | None, "next": Fit | None}. Arithmetic
    only.
    """
    family = gpt_family() if family is None else family
    rows = []
    for stage, rm in itertools.product(stages, remat):
        if offload is not None and stage == 0:
            continue
        fits = [estimate_fit(n, c, devices, stage, batch_per_device, param_dtype, rm, offload)
                for n, c in family.items()]
        ok = [f for f in fits if f.peak <= device_memory
              and (host_memory is None or f.host <= host_memory)]
        best = max(ok, key=lambda f: f.num_params) if ok else None
        bigger = [f for f in fits if f not in ok
                  and (best is None or f.num_params > best.num_params)]
        rows.append({"stage": stage, "remat": rm, "offload": offload, "fits": best,
                     "next": min(bigger, key=lambda f: f.num_params) if bigger else None})
    return rows
