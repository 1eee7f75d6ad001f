"""The planner: the configuration that fits with the least communication, over stage × remat ×
grad_accum (optimizer offload and a tensor-parallel `model` axis searched when nothing fits
without them, or as asked); given link bandwidths, the shortest step (steptime.py: compute
plus the link time it does not hide), over meshes and ZeRO++ options too. Each candidate is
measured from its compiled step (`largest`: largest.py; the command and the tables:
plan_command.py)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from zerojax.analysis import plan_checks as check
from zerojax.analysis.accounting import format_bytes
from zerojax.analysis.estimate_args import STAGES
from zerojax.analysis.ranking import GAIN, TIE, best_per_group, budget_text, choose, cost_of
from zerojax.analysis.steptime import (
    EFFICIENCY,
    LATENCY,
    compute_seconds,
    link_seconds,
    target_peak,
)

MARGIN = 0.10  # the share of device memory kept free: a peak "fits" in the rest
# The learning rate and weight decay (train's default) of the optimizers `plan` and `measure`
# build; the state an optimizer allocates depends on neither.
LR = 3e-4
WEIGHT_DECAY = 0.1

__all__ = ["GAIN", "TIE", "Candidate", "PlanResult", "link_seconds", "named_optimizer", "plan"]


def named_optimizer(name: str):
    """The `zerojax.app.presets` optimizer `name` as `plan` and `measure` build it (at `LR`
    and train's default weight decay: what it allocates depends on neither)."""
    from zerojax.app.presets import build

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
    replica: int = 1  # the mesh: replica × data × model; 1: no replica axis
    quantize_weights: str | None = None  # the ZeRO++ options (ZeroConfig's fields)
    quantize_grads: str | None = None
    hpz: bool = False
    axis_bytes: dict[str, float] | None = None  # comm_bytes by the links they cross
    comm_seconds: float | None = None  # with a bandwidth: axis_bytes at each link's speed
    model: int = 1  # the tensor-parallel `model` axis's devices M
    overlap_bytes: dict[str, float] | None = None  # of axis_bytes: beside a loop's compute
    step_seconds: float | None = None  # with a bandwidth: compute + the link time not hidden

    @property
    def quantized(self) -> bool:
        """Whether it sends quantized values (and so does not give exact numbers)."""
        return bool(self.quantize_weights or self.quantize_grads)

    def zeropp(self) -> str:
        """Its ZeRO++ options, e.g. "qwZ int8 + qgZ int4 + hpZ" ("" for none)."""
        return " + ".join([f"qwZ {self.quantize_weights}"] * bool(self.quantize_weights)
                          + [f"qgZ {self.quantize_grads}"] * bool(self.quantize_grads)
                          + ["hpZ"] * self.hpz)

    def mesh_text(self, devices: int) -> str:
        """Its mesh in words: "8", "2x4" (replica x data), "4 x model 2"."""
        data = devices // (self.replica * self.model)
        text = f"{self.replica}x{data}" if self.replica > 1 else str(data)
        return text + (f" x model {self.model}" if self.model > 1 else "")

    def row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PlanResult:
    """Every candidate, and the chosen one (`best`, None if nothing fits). `str()` gives the
    `zerojax plan` command's table, notes and choice."""

    devices: int
    device_memory: int
    candidates: list[Candidate]
    best: Candidate | None = None
    param_dtype: str = "bfloat16"
    num_params: int = 0
    offload_searched: bool = False  # nothing fit without offload, so offload was tried
    replica: int = 1  # replica groups of the machine (e.g. nodes) given to the planner
    # Link bandwidth in bytes/s per mesh axis ("data"; "replica" where replica > 1; "model"):
    # the shortest step wins instead of the fewest bytes, and ZeRO++ is tried.
    bandwidth: dict[str, float] | None = None
    margin: float = MARGIN  # the share of device_memory kept free
    flops: float = 0.0  # model FLOPs of one step over all devices (0: compute not counted)
    peak_tflops: float | None = None  # per device, what compute is timed at
    peak_from: str = ""  # where the peak comes from
    efficiency: float = EFFICIENCY  # the fraction of the peak compute runs at (MFU)
    latency: float = LATENCY  # seconds each collective launch adds to a step
    model_searched: bool = False  # nothing fit on model = 1, so model axes were tried
    platform: str = "cpu"  # the backend that compiled the candidates (their peaks)
    name: str = ""  # the model's name in the table's title

    @property
    def budget(self) -> float:
        """The peak a candidate may reach: device memory less the margin."""
        return self.device_memory * (1 - self.margin)

    @property
    def compute_seconds(self) -> float:
        """Compute per step per device (0 where the FLOPs or the peak are not known)."""
        if not self.flops or not self.peak_tflops:
            return 0.0
        return compute_seconds(self.flops, self.devices, self.peak_tflops, self.efficiency)

    def notes(self) -> list[str]:
        """What the figures assume and why some look odd, one line each."""
        from zerojax.analysis.plan_report import notes

        return notes(self)

    def config(self, **overrides):
        """The chosen configuration as a `ZeroConfig` (overrides: e.g. clip_norm=1.0); its
        mesh is `mesh()`."""
        from zerojax.config import ZeroConfig

        b = self._chosen()
        return ZeroConfig(**{"stage": b.stage, "remat": b.remat, "grad_accum": b.grad_accum,
                             "param_dtype": self.param_dtype, "offload": b.offload,
                             "quantize_weights": b.quantize_weights,
                             "quantize_grads": b.quantize_grads, "hpz": b.hpz, **overrides})

    def mesh(self):
        """The chosen configuration's mesh (`make_mesh`) on this process's devices."""
        import jax

        from zerojax.mesh import make_mesh

        b = self._chosen()
        return make_mesh(data=self.devices // (b.replica * b.model), replica=b.replica,
                         model=b.model, devices=jax.devices()[:self.devices])

    def _chosen(self) -> Candidate:
        if self.best is None:
            raise ValueError("no configuration fits; see the candidates' reasons")
        return self.best

    def refit(self, device_memory: int | None = None,
              bandwidth: float | dict[str, float] | None = None, *,
              margin: float | None = None, peak_tflops: float | None = None,
              efficiency: float | None = None, latency: float | None = None) -> PlanResult:
        """The same candidates chosen among for another memory budget, other link bandwidths
        (bytes/s, as `plan` takes them), margin, peak, efficiency or latency per collective
        (nothing recompiled; candidates that were not compiled stay rejected)."""
        cands = [dataclasses.replace(c) for c in self.candidates]
        models = {c.model for c in cands}
        kw = {"margin": check.margin(self.margin if margin is None else margin),
              "efficiency": check.efficiency(self.efficiency if efficiency is None
                                             else efficiency),
              "latency": check.latency(self.latency if latency is None else latency)}
        if peak_tflops is not None:
            kw |= dict(zip(("peak_tflops", "peak_from"), target_peak(peak_tflops)))
        return choose(dataclasses.replace(
            self, candidates=cands, best=None,
            device_memory=self.device_memory if device_memory is None else int(device_memory),
            bandwidth=self.bandwidth if bandwidth is None else check.links(bandwidth, self.replica,
                                                                      models),
            **kw))

    def as_dict(self) -> dict[str, Any]:
        return {"devices": self.devices, "device_memory": self.device_memory,
                "margin": self.margin, "replica": self.replica, "bandwidth": self.bandwidth,
                "param_dtype": self.param_dtype, "num_params": self.num_params,
                "offload_searched": self.offload_searched,
                "model_searched": self.model_searched, "flops": self.flops,
                "peak_tflops": self.peak_tflops, "peak_from": self.peak_from,
                "efficiency": self.efficiency, "latency": self.latency,
                "compute_seconds": self.compute_seconds,
                "platform": self.platform,
                "best": None if self.best is None else self.best.row(),
                "candidates": [c.row() for c in self.candidates], "notes": self.notes()}

    def __str__(self) -> str:
        from zerojax.analysis.plan_report import report

        return report(self)


Progress = Callable[[Candidate, str, int, int], None]  # (candidate, phase, index, total)


def plan(model, devices: int, device_memory: float, batch, *, optimizer=None,
         param_dtype: str = "bfloat16", stages=STAGES, remat=(True, False),
         grad_accum=(1, 2, 4), offload: bool = True, replica: int = 1,
         bandwidth: float | dict[str, float] | None = None, quantize: str | None = "int4",
         model_parallel=None, margin: float = MARGIN, peak_tflops: float | None = None,
         device: str | None = None, efficiency: float = EFFICIENCY, latency: float = LATENCY,
         name: str = "", progress: Progress | None = None) -> PlanResult:
    """Tries every (stage, remat, grad_accum) by AOT compilation on `devices` and picks the
    configuration with the least communication whose peak memory fits in `device_memory`
    less the `margin` (a fraction, default 10%).

    Ties (within 1%) go to the one that does less extra work: no remat, then fewer
    micro-batches, then fewer collective launches, then the least peak memory. A candidate
    whose model state alone exceeds the budget is not compiled. `batch` is the global batch
    of every candidate (grad_accum splits it into micro-batches). `progress(candidate, phase,
    index, total)` is called with phase "lowering", "compiling" (only if it is compiled) and
    "done" for the index-th (from 1) of `total` candidates.

    `model_parallel`: the sizes M of a tensor-parallel `model` axis to try (mesh replica ×
    data × model), each with every (stage, remat, grad_accum); None (auto): M = 1, and only
    if nothing fits, every M > 1 that divides the devices (of a replica) and every dimension
    the model splits (and a GPT's heads); an M whose split the engine refuses is listed with
    its reason. Only if nothing fits then either (and `offload`) are the stages 1-3 of
    `stages` tried again with `offload="optimizer"`, whose peak counts device memory only
    (`offload_searched` says so).

    With `bandwidth` (bytes/s: one figure for every link, or {"data": ..., "replica": ...,
    "model": ...}; "model" defaults to "data"'s) the shortest step wins: compute (the model's
    FLOPs at `efficiency` × the peak of `peak_tflops`, or of the `device` kind named, or of
    this machine's GPU, or of an H100 when planning on CPU) plus the link time it does not
    hide and `latency` seconds per collective launched (steptime.py). ZeRO++ is tried on the
    best fitting candidate of each stage and mesh: hpZ (stage 3 with `replica` > 1; exact),
    and, unless `quantize` is None, qwZ int8 (stages 1-3) with qgZ `quantize` ("int4" or
    "int8"), with and without hpZ; qwZ or qgZ alone only where both together do not fit. A
    quantized option is chosen only if its step is at least 5% shorter than the best exact
    one's. `replica` > 1 (e.g. nodes): the devices are
    `replica` groups joined by the "replica" link, and every candidate is also tried on the
    `make_mesh(replica=..., data=...)` mesh. Without `bandwidth` nothing quantized is tried:
    quantization changes the numbers, and bytes alone cannot say it is worth it.
    """
    import jax
    import optax

    from zerojax.analysis.flops import step_flops
    from zerojax.analysis.hlo import axis_bytes, by_kind, collective_sites
    from zerojax.analysis.measurement import lower, measure_lowered, state_bytes
    from zerojax.config import ZeroConfig
    from zerojax.engine import Engine
    from zerojax.errors import BatchError, ConfigError
    from zerojax.mesh import make_mesh

    if quantize is not None and quantize not in ("int4", "int8"):
        raise ConfigError(f"quantize={quantize!r}: the gradient format plan may choose is "
                          f"'int4', 'int8', or None for exact options only")
    sizes = check.model_sizes(model, devices, replica, model_parallel)
    links = check.links(bandwidth, replica, sizes)
    margin, efficiency = check.margin(margin), check.efficiency(efficiency)
    latency = check.latency(latency)
    peak, peak_from = target_peak(peak_tflops, device, jax.devices()[0])
    optimizer = optax.adamw(LR) if optimizer is None else optimizer
    meshes: dict[tuple[int, int], Any] = {}
    groups = (1, replica) if replica > 1 else (1,)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x),
                                                        jax.numpy.result_type(x)), batch)
    report = progress or (lambda *_: None)
    cands, num_params, flops = [], 0, 0.0
    budget = device_memory * (1 - margin)

    def search(todo: list[Candidate], start: int, total: int) -> None:
        nonlocal num_params, flops
        for i, c in enumerate(todo, start):
            cands.append(c)
            report(c, "lowering", i, total)
            try:
                cfg = ZeroConfig(stage=c.stage, param_dtype=param_dtype, remat=c.remat,
                                 grad_accum=c.grad_accum, offload=c.offload,
                                 quantize_weights=c.quantize_weights,
                                 quantize_grads=c.quantize_grads, hpz=c.hpz)
                key = (c.replica, c.model)
                if key not in meshes:
                    meshes[key] = make_mesh(replica=c.replica, model=c.model,
                                            data=devices // (c.replica * c.model),
                                            devices=jax.devices()[:devices])
                engine = Engine(model, optimizer, meshes[key], cfg)
                lowered = lower(engine, batch)
            except ConfigError as e:
                if not c.zeropp() and c.model == 1:  # the caller's own options: theirs to fix
                    raise
                c.reason = f"config: {e}"  # a ZeRO++ variant, or a split the model refuses
                report(c, "done", i, total)
                continue
            except BatchError as e:
                c.reason = f"batch: {e}"
                report(c, "done", i, total)
                continue
            num_params = engine.layout.num_params
            flops = flops or step_flops(engine, batch)
            state = state_bytes(engine)
            c.state_bytes, c.host_bytes = state["device"], state["host"] if c.offload else None
            if c.state_bytes > budget:
                text = lowered.compiler_ir("hlo").as_hlo_text()
                sites, _ = collective_sites(text, devices)
                kinds, c.launches = by_kind(sites)
                r, d, m = engine.replica, engine.data, engine.model_parallel
                c.comm_bytes, found = kinds["total"], axis_bytes(sites, r, d, m)
                loops = axis_bytes([x for x in sites if x["beside_compute"]], r, d, m)
                c.reason = (f"model state alone is {format_bytes(c.state_bytes)} > "
                            f"{budget_text(device_memory, margin)} (not compiled)")
            else:
                report(c, "compiling", i, total)
                meas = measure_lowered(engine, lowered)
                c.peak_bytes, c.comm_bytes = meas.device_peak_bytes, meas.collective_bytes["total"]
                c.launches, found = meas.collective_launches, meas.collective_axis_bytes
                loops = meas.collective_overlap_bytes
            c.axis_bytes = on_links(found, c.replica, replica)
            c.overlap_bytes = on_links(loops, c.replica, replica)
            report(c, "done", i, total)

    def result(**kw) -> PlanResult:
        return choose(PlanResult(devices, int(device_memory), cands, param_dtype=param_dtype,
                                  num_params=num_params, replica=replica, bandwidth=links,
                                  margin=margin, flops=flops, peak_tflops=peak,
                                  peak_from=peak_from, efficiency=efficiency, latency=latency,
                                  platform=jax.devices()[0].platform, name=name, **kw))

    done = 0

    def run(todo: list[Candidate]) -> None:
        nonlocal done
        search(todo, done + 1, done + len(todo))
        done += len(todo)

    def product(ms, offloads=(None,), stage_list=stages) -> list[Candidate]:
        return [Candidate(s, rm, k, offload=o, replica=r, model=m) for m, r, o, s, rm, k in
                itertools.product(ms, groups, offloads, stage_list, remat, grad_accum)
                if devices % (r * m) == 0]

    first = sizes if model_parallel is not None else (1,)
    run(product(first))
    best = result()
    searched = {}
    more_models = [m for m in sizes if m not in first]
    if best.best is None and more_models:
        run(product(more_models))
        searched["model_searched"] = True
        best = result(**searched)
    # Offload helps only candidates that were rejected for memory (they lowered), not a batch
    # that does not split.
    tried = sorted({c.model for c in cands})
    more = product(tried, ("optimizer",), [s for s in stages if s >= 1])
    if best.best is None and offload and more and any(c.state_bytes is not None
                                                      for c in cands):
        run(more)
        searched["offload_searched"] = True
        best = result(**searched)
    if links is None:
        return best
    bases = best_per_group([c for c in cands if c.fits],
                            lambda c: (c.stage, c.replica, c.model, c.offload), cost_of(links))
    variants = [_zeropp(b, quantize) for b in bases]
    run([v for vs in variants for v in vs])
    result(**searched)  # marks what fits
    # qwZ or qgZ alone where both together did not fit.
    run([v for b, vs in zip(bases, variants) if not any(x.fits and x.quantized for x in vs)
         for v in _zeropp(b, quantize, alone=True)])
    return result(**searched)


def on_links(found: dict[str, float], mesh_replica: int, replica: int) -> dict[str, float]:
    """A candidate's bytes by mesh axis (`found`, on its mesh of `mesh_replica` groups) as the
    links of a machine of `replica` groups carry them: a mesh without a replica axis runs its
    batch-axis collectives over every group, so across groups ("all") where there are
    several; the `model` axis's groups are neighbours within a group either way."""
    if mesh_replica == 1 and replica > 1:
        out = {"all": sum(v for k, v in found.items() if k != "model")}
        return out | ({"model": found["model"]} if "model" in found else {})
    return dict(found)


def _zeropp(base: Candidate, quantize: str | None, alone: bool = False) -> list[Candidate]:
    """The ZeRO++ variants of a fitting candidate (see `plan`); `alone`: qwZ and qgZ apart."""
    like = dict(stage=base.stage, remat=base.remat, grad_accum=base.grad_accum,
                offload=base.offload, replica=base.replica, model=base.model)
    hpzs = [False, True] if base.stage == 3 and base.replica > 1 else [False]
    qw = "int8" if base.stage >= 1 else None
    if alone:
        if quantize is None or qw is None:
            return []
        return [Candidate(**like, quantize_weights=qw),
                Candidate(**like, quantize_grads=quantize)]
    out = [Candidate(**like, hpz=True)] if hpzs[-1] else []
    if quantize is not None:
        out += [Candidate(**like, quantize_weights=qw, quantize_grads=quantize, hpz=h)
                for h in hpzs]
    return out
