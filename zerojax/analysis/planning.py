"""The planner (the cheapest ZeRO configuration that fits) and the `estimate`, `measure` and
`plan` commands.

`measure` and `plan` simulate devices on the CPU backend, whose device count is fixed when jax
starts its backend: the commands set XLA_FLAGS first, so they must run before anything in the
process has touched jax devices (as `python -m zerojax ...` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import sys
from typing import Any

from zerojax.analysis.accounting import (
    STAGES,
    EstimateError,
    comm_estimate,
    estimate,
    estimate_table,
    format_bytes,
)

TIE = 0.01  # communication within 1% of the least counts as equal


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
                                  param_dtype=self.param_dtype))

    def as_dict(self) -> dict[str, Any]:
        return {"devices": self.devices, "device_memory": self.device_memory,
                "param_dtype": self.param_dtype,
                "best": None if self.best is None else self.best.row(),
                "candidates": [c.row() for c in self.candidates]}


def plan(model, devices: int, device_memory: float, batch, *, optimizer=None,
         param_dtype: str = "bfloat16", stages=STAGES, remat=(True, False),
         grad_accum=(1, 2, 4)) -> PlanResult:
    """Tries every (stage, remat, grad_accum) by AOT compilation on `devices` and picks the
    configuration with the least communication whose peak memory fits in `device_memory`.

    Ties (within 1%) go to the one that does less extra work: no remat, then fewer
    micro-batches, then fewer collective launches, then the least peak memory. A candidate
    whose model state alone exceeds the budget is not compiled.
    """
    import jax
    import optax

    from zerojax.analysis.accounting import lower, measure_lowered, state_bytes
    from zerojax.analysis.hlo import collectives
    from zerojax.config import ZeroConfig
    from zerojax.engine import Engine
    from zerojax.errors import BatchError
    from zerojax.mesh import make_mesh

    optimizer = optax.adamw(3e-4) if optimizer is None else optimizer
    mesh = make_mesh(data=devices)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x),
                                                        jax.numpy.result_type(x)), batch)
    cands = []
    for stage, rm, accum in itertools.product(stages, remat, grad_accum):
        c = Candidate(stage, rm, accum)
        cands.append(c)
        cfg = ZeroConfig(stage=stage, param_dtype=param_dtype, remat=rm, grad_accum=accum)
        engine = Engine(model, optimizer, mesh, cfg)
        try:
            lowered = lower(engine, batch)
        except BatchError as e:
            c.reason = f"batch: {e}"
            continue
        c.state_bytes = state_bytes(engine)["total"]
        if c.state_bytes > device_memory:
            text = lowered.compiler_ir("hlo").as_hlo_text()
            found, c.launches, _ = collectives(text, devices)
            c.comm_bytes = found["total"]
            c.reason = (f"model state alone is {format_bytes(c.state_bytes)} > "
                        f"{format_bytes(device_memory)} (not compiled)")
            continue
        m = measure_lowered(engine, lowered)
        c.peak_bytes, c.comm_bytes = m.peak_bytes, m.collective_bytes["total"]
        c.launches = m.collective_launches
    return _choose(PlanResult(devices, int(device_memory), cands, param_dtype=param_dtype))


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


# --- Command line ----------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line on stderr, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgtp]?i?b?)?\s*$", re.I)


def parse_bytes(text: str) -> int:
    """'80GB' (1e9), '80GiB' (2**30), '8e10', '512MB' -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size; write e.g. 80GB, 80GiB or 8e10")
    unit = (m.group(2) or "").lower().rstrip("b")
    base = 1024 if unit.endswith("i") else 1000
    power = "kmgtp".find(unit[:1]) + 1 if unit else 0
    return int(float(m.group(1)) * base**power)


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return int(text)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated integers") from None


def _stages(text: str) -> tuple[int, ...]:
    stages = STAGES if text == "all" else _ints(text)
    if not set(stages) <= set(STAGES):
        raise argparse.ArgumentTypeError(f"{text!r}: stages are 0, 1, 2, 3 (or all)")
    return stages


def _print_table(title: str, rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for key in rows[0] if rows else []:
        table.add_column(key, justify="left" if key in ("reason", "config") else "right")
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    # Piped output is not wrapped at 80 columns.
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def estimate_main(argv: list[str]) -> int:
    """`python -m zerojax estimate --params 7.5e9 --devices 64 [--json]`."""
    p = _Parser(prog="zerojax estimate", description="ZeRO paper memory/comm per device")
    p.add_argument("--params", type=float, required=True, help="parameter count Ψ, e.g. 7.5e9")
    p.add_argument("--devices", type=_positive, required=True)
    p.add_argument("--replica", type=_positive, default=1, help="replica groups (hybrid)")
    p.add_argument("--param-bytes", type=float, default=2)
    p.add_argument("--grad-bytes", type=float, default=2)
    p.add_argument("--optimizer-bytes", type=float, default=12, help="K: master + moments")
    p.add_argument("--reduce-bytes", type=float, default=None)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    psi = int(a.params) if a.params == int(a.params) else a.params
    mem_kw = dict(param_bytes=a.param_bytes, grad_bytes=a.grad_bytes,
                  optimizer_bytes=a.optimizer_bytes, replica=a.replica)
    comm_kw = dict(param_bytes=a.param_bytes, grad_bytes=a.grad_bytes,
                   reduce_bytes=a.reduce_bytes, replica=a.replica)
    try:
        rows = estimate_table(psi, a.devices, **mem_kw, reduce_bytes=a.reduce_bytes)
        out = [{"stage": s, "memory": estimate(psi, a.devices, s, **mem_kw).as_dict(),
                "comm": comm_estimate(psi, a.devices, s, **comm_kw).as_dict()} for s in STAGES]
    except EstimateError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    if a.json:
        print(json.dumps({"params": psi, "devices": a.devices, "stages": out}, indent=1))
    else:
        _print_table(f"Ψ = {psi:,} params on {a.devices} devices (per device)", rows)
    return 0


def _start_devices(p: _Parser, devices: int) -> None:
    """Simulates `devices` CPU devices; must run before the process touches a jax device."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                   os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if len(jax.devices()) < devices:
        p.exit(2, f"{p.prog}: error: jax started with {len(jax.devices())} devices before "
                  f"--devices {devices} could be set; run it in a fresh process\n")


def _gpt_and_batch(preset: str, batch: int):
    import jax
    import jax.numpy as jnp

    from zerojax.models.gpt import GPT

    model = GPT.from_preset(preset)
    shape = (batch, model.cfg.seq_len)
    return model, {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("inputs", "targets")}


def _model_args(p: _Parser) -> None:
    from zerojax.models.gpt import PRESETS

    p.add_argument("--model", required=True, choices=sorted(PRESETS), help="GPT preset")
    p.add_argument("--devices", type=_positive, required=True, help="data-parallel devices")
    p.add_argument("--batch", type=_positive, default=None, help="global batch (sequences)")
    p.add_argument("--param-dtype", default="bfloat16",
                   choices=("bfloat16", "float16", "float32"))
    p.add_argument("--json", action="store_true")


def measure_main(argv: list[str]) -> int:
    """`python -m zerojax measure --model 7b --devices 64 --stage all [--json]`."""
    p = _Parser(prog="zerojax measure", description="memory/comm of compiled steps")
    _model_args(p)
    p.add_argument("--stage", default="all", type=_stages, help="all, one stage, or e.g. 0,3")
    p.add_argument("--grad-accum", type=_positive, default=1)
    p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--memory", type=_size, default=None, help="mark what fits, e.g. 80GB")
    a = p.parse_args(argv)
    _start_devices(p, a.devices)
    import optax

    from zerojax.analysis.accounting import measure
    from zerojax.config import ZeroConfig
    from zerojax.engine import Engine
    from zerojax.errors import ZeroError
    from zerojax.mesh import make_mesh

    model, batch = _gpt_and_batch(a.model, a.batch or a.devices * a.grad_accum)
    stages = a.stage
    results = []
    for stage in stages:
        cfg = ZeroConfig(stage=stage, param_dtype=a.param_dtype, remat=a.remat,
                         grad_accum=a.grad_accum)
        try:
            engine = Engine(model, optax.adamw(3e-4), make_mesh(data=a.devices), cfg)
            results.append(measure(engine, batch))
        except ZeroError as e:
            p.exit(2, f"{p.prog}: error: {e}\n")
    if a.json:
        out = []
        for m in results:
            mem, comm = m.estimates()
            out.append({**m.as_dict(), "estimate": {"memory": mem.as_dict(),
                                                    "comm": comm.as_dict()}})
        print(json.dumps({"model": a.model, "devices": a.devices, "memory": a.memory,
                          "measurements": out}, indent=1))
        return 0
    rows = []
    for m in results:
        mem, comm = m.estimates()
        row = {"stage": m.stage, "state": format_bytes(m.state["total"]),
               "state formula": format_bytes(mem.total - mem.grads),
               "temp": format_bytes(m.temp_bytes), "peak": format_bytes(m.peak_bytes),
               "sent": format_bytes(m.collective_bytes["total"]),
               "sent formula": format_bytes(comm.total),
               "sent compiled": format_bytes(m.collective_bytes_compiled["total"])}
        if a.memory:
            row["fits"] = "yes" if m.peak_bytes <= a.memory else "no"
        rows.append(row)
    n = results[0].num_params if results else 0
    _print_table(f"{a.model} ({n:,} params), {a.devices} devices, per device; state formula "
                 f"excludes grads (they live in temp); sent: bytes per step in "
                 f"{a.param_dtype}, compiled: as this backend sends them", rows)
    return 0


def plan_main(argv: list[str]) -> int:
    """`python -m zerojax plan --model 7b --devices 64 --memory 80GB [--json]`."""
    p = _Parser(prog="zerojax plan", description="the cheapest configuration that fits")
    _model_args(p)
    p.add_argument("--memory", type=_size, required=True, help="per device, e.g. 80GB")
    p.add_argument("--stages", type=_stages, default=STAGES, help="all or e.g. 0,3")
    p.add_argument("--remat", choices=("both", "on", "off"), default="both")
    p.add_argument("--grad-accum", type=_ints, default=(1, 2, 4))
    a = p.parse_args(argv)
    if min(a.grad_accum) < 1:
        p.error(f"--grad-accum {a.grad_accum}: every value must be >= 1")
    _start_devices(p, a.devices)
    from zerojax.errors import ZeroError

    model, batch = _gpt_and_batch(a.model, a.batch or a.devices * max(a.grad_accum))
    remat = {"both": (False, True), "on": (True,), "off": (False,)}[a.remat]
    try:
        result = plan(model, a.devices, a.memory, batch, param_dtype=a.param_dtype,
                      stages=a.stages, remat=remat, grad_accum=a.grad_accum)
    except ZeroError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    if a.json:
        print(json.dumps({"model": a.model, **result.as_dict()}, indent=1))
        return 0 if result.best else 1
    fmt = lambda v: "-" if v is None else format_bytes(v)
    rows = [{"stage": c.stage, "remat": "on" if c.remat else "off", "accum": c.grad_accum,
             "state": fmt(c.state_bytes), "peak": fmt(c.peak_bytes),
             "sent/step": fmt(c.comm_bytes), "launches": c.launches or "-",
             "fits": "yes" if c.fits else "no", "chosen": "<==" if c.chosen else "",
             "reason": c.reason} for c in result.candidates]
    _print_table(f"{a.model} on {a.devices} devices with {format_bytes(a.memory)} each", rows)
    if result.best is None:
        print("nothing fits: more devices, a smaller batch, or a smaller model", file=sys.stderr)
        return 1
    b = result.best
    print(f"chosen: stage {b.stage}, remat {'on' if b.remat else 'off'}, grad_accum "
          f"{b.grad_accum}: peak {format_bytes(b.peak_bytes)}, "
          f"sends {format_bytes(b.comm_bytes)} per step per device")
    return 0
