"""The planner: the configuration with the least communication that fits, over stage × remat ×
grad_accum, each candidate measured from its compiled step; and `largest`, the biggest GPT shape
whose estimated peak fits, per stage, from formulas alone (commands: commands.py)."""

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
    state_bytes: int | None = None
    comm_bytes: float | None = None  # requested dtype, per device per step
    launches: int | None = None  # collectives started per step

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

    def notes(self) -> list[str]:
        """Why some candidates' peaks look odd, one line each (read from compiled programs)."""
        n, psi = self.devices, self.num_params
        if not any(c.stage <= 1 and c.grad_accum > 1 and c.peak_bytes for c in self.candidates):
            return []
        # Stages 0-1 differentiate the full params, so the sum over micro-batches is full-size;
        # it is float32 so that adding micro-batch gradients loses no precision.
        return [f"grad_accum > 1 in stages 0-1 adds a full-size float32 gradient accumulator "
                f"(4 B x Ψ = {format_bytes(4 * psi)}) to the peak; stages 2-3 accumulate a 1/N "
                f"shard ({format_bytes(4 * psi / n)}), so there smaller micro-batches lower it"]

    def config(self, **overrides):
        """The chosen configuration as a `ZeroConfig` (overrides: e.g. clip_norm=1.0)."""
        from zerojax.config import ZeroConfig

        if self.best is None:
            raise ValueError("no configuration fits; see the candidates' reasons")
        b = self.best
        return ZeroConfig(**{"stage": b.stage, "remat": b.remat, "grad_accum": b.grad_accum,
                             "param_dtype": self.param_dtype, **overrides})

    def refit(self, device_memory: int) -> PlanResult:
        """The same candidates chosen among for another memory budget (nothing recompiled;
        candidates that were not compiled stay rejected)."""
        cands = [dataclasses.replace(c) for c in self.candidates]
        return _choose(PlanResult(self.devices, device_memory, cands,
                                  param_dtype=self.param_dtype, num_params=self.num_params))

    def as_dict(self) -> dict[str, Any]:
        return {"devices": self.devices, "device_memory": self.device_memory,
                "param_dtype": self.param_dtype, "num_params": self.num_params,
                "best": None if self.best is None else self.best.row(),
                "candidates": [c.row() for c in self.candidates], "notes": self.notes()}


Progress = Callable[[Candidate, str, int, int], None]  # (candidate, phase, index, total)


def plan(model, devices: int, device_memory: float, batch, *, optimizer=None,
         param_dtype: str = "bfloat16", stages=STAGES, remat=(True, False),
         grad_accum=(1, 2, 4), progress: Progress | None = None) -> PlanResult:
    """Tries every (stage, remat, grad_accum) by AOT compilation on `devices` and picks the
    configuration with the least communication whose peak memory fits in `device_memory`.

    Ties (within 1%) go to the one that does less extra work: no remat, then fewer
    micro-batches, then fewer collective launches, then the least peak memory. A candidate
    whose model state alone exceeds the budget is not compiled. `batch` is the global batch
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
    combos = list(itertools.product(stages, remat, grad_accum))
    cands, num_params = [], 0
    for i, (stage, rm, accum) in enumerate(combos, 1):
        c = Candidate(stage, rm, accum)
        cands.append(c)
        report(c, "lowering", i, len(combos))
        cfg = ZeroConfig(stage=stage, param_dtype=param_dtype, remat=rm, grad_accum=accum)
        engine = Engine(model, optimizer, mesh, cfg)
        try:
            lowered = lower(engine, batch)
        except BatchError as e:
            c.reason = f"batch: {e}"
            report(c, "done", i, len(combos))
            continue
        num_params = engine.layout.num_params
        c.state_bytes = state_bytes(engine)["total"]
        if c.state_bytes > device_memory:
            text = lowered.compiler_ir("hlo").as_hlo_text()
            found, c.launches, _ = collectives(text, devices)
            c.comm_bytes = found["total"]
            c.reason = (f"model state alone is {format_bytes(c.state_bytes)} > "
                        f"{format_bytes(device_memory)} (not compiled)")
        else:
            report(c, "compiling", i, len(combos))
            m = measure_lowered(engine, lowered)
            c.peak_bytes, c.comm_bytes = m.peak_bytes, m.collective_bytes["total"]
            c.launches = m.collective_launches
        report(c, "done", i, len(combos))
    return _choose(PlanResult(devices, int(device_memory), cands, param_dtype=param_dtype,
                              num_params=num_params))


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
    best = min(tied, key=lambda c: (c.remat, c.grad_accum, c.launches, c.peak_bytes))
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
    (its compute params and their gradient, for the largest unit)."""

    name: str
    num_params: int
    stage: int
    remat: bool
    state: float
    activations: float
    gathered: float
    peak: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def estimate_fit(name: str, cfg, devices: int, stage: int, batch_per_device: int,
                 param_dtype: str = "bfloat16", remat: bool = True) -> Fit:
    """`Fit` of the GPT `cfg` (called `name`) on `devices` at `stage`."""
    from zerojax.models.gpt import GPT

    psi = GPT(cfg).num_params()
    state = state_estimate(psi, devices, stage, param_dtype).total
    act = activation_bytes(cfg, batch_per_device, param_dtype, remat)["total"]
    # Stage 3 gathers one unit at a time: the largest is a layer or the vocabulary table.
    unit = max(cfg.layer_params, cfg.vocab_size * cfg.d_model)
    gathered = 2 * unit * _itemsize(param_dtype) if stage == 3 and devices > 1 else 0
    return Fit(name, psi, stage, remat, state, act, gathered, state + act + gathered)


def largest(devices: int, device_memory: float, *, batch_per_device: int = 1,
            param_dtype: str = "bfloat16", stages=STAGES, remat=(True, False),
            family: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Per (stage, remat): the largest shape of `family` (default `gpt_family()`) whose
    estimated peak fits `device_memory`, and the next larger one, which does not.

    Rows: {"stage", "remat", "fits": Fit | None, "next": Fit | None}. Arithmetic only.
    """
    family = gpt_family() if family is None else family
    rows = []
    for stage, rm in itertools.product(stages, remat):
        fits = [estimate_fit(n, c, devices, stage, batch_per_device, param_dtype, rm)
                for n, c in family.items()]
        ok = [f for f in fits if f.peak <= device_memory]
        best = max(ok, key=lambda f: f.num_params) if ok else None
        bigger = [f for f in fits if f.peak > device_memory
                  and (best is None or f.num_params > best.num_params)]
        rows.append({"stage": stage, "remat": rm, "fits": best,
                     "next": min(bigger, key=lambda f: f.num_params) if bigger else None})
    return rows
