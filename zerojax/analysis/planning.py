"""The planner: the configuration with the least communication that fits, over stage × remat ×
grad_accum (and optimizer offload, searched only when nothing fits without it; given link
bandwidths, the least time on the links, over meshes and ZeRO++ options too), each candidate
measured from its compiled step (`largest`: largest.py; the command: plan_command.py)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from zerojax.analysis.accounting import STAGES, format_bytes

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
    replica: int = 1  # the mesh: replica × (devices / replica); 1: one flat data axis
    quantize_weights: str | None = None  # the ZeRO++ options (ZeroConfig's fields)
    quantize_grads: str | None = None
    hpz: bool = False
    axis_bytes: dict[str, float] | None = None  # comm_bytes by the links they cross
    comm_seconds: float | None = None  # with a bandwidth: axis_bytes at each link's speed

    @property
    def quantized(self) -> bool:
        """Whether it sends quantized values (and so does not give exact numbers)."""
        return bool(self.quantize_weights or self.quantize_grads)

    def zeropp(self) -> str:
        """Its ZeRO++ options, e.g. "qwZ int8 + qgZ int4 + hpZ" ("" for none)."""
        return " + ".join([f"qwZ {self.quantize_weights}"] * bool(self.quantize_weights)
                          + [f"qgZ {self.quantize_grads}"] * bool(self.quantize_grads)
                          + ["hpZ"] * self.hpz)

    def row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def link_seconds(axis_bytes: dict[str, float], bandwidth: dict[str, float]) -> float:
    """Seconds one device spends sending per step: each mesh axis's bytes at its link's
    bandwidth (bytes/s). A collective whose groups span both axes ("all", or another grouping)
    runs at the slower link, as a ring through devices of every replica does."""
    slow = min(bandwidth.values())
    return sum(sent / bandwidth.get(axis, slow) for axis, sent in axis_bytes.items())


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
    replica: int = 1  # replica groups of the machine (e.g. nodes) given to the planner
    # Link bandwidth in bytes/s per mesh axis ("data"; "replica" where replica > 1): the
    # least communication time wins instead of the fewest bytes, and ZeRO++ is tried.
    bandwidth: dict[str, float] | None = None

    def notes(self) -> list[str]:
        """Why some candidates' peaks look odd, one line each (read from compiled programs)."""
        n, psi = self.devices, self.num_params
        notes = []
        if self.offload_searched:
            notes.append("nothing fits without offload, so stages 1-3 were also tried with "
                         "offload='optimizer' (master and moments in host memory; peak is "
                         "device memory, host bytes per device in host_bytes)")
        if self.bandwidth:
            notes.append("time/step: the bytes each device sends over each mesh axis at that "
                         "link's bandwidth (a collective across replicas at the slower one); "
                         "compute, overlap and the quantization's own work are not counted")
        if self.best is not None and self.best.quantized:
            notes.append(f"the chosen {self.best.zeropp()} sends quantized values, so its "
                         f"numbers differ from the exact step's (see docs/performance.md); "
                         f"--quantize off chooses among exact options only")
        if not any(c.stage <= 1 and c.grad_accum > 1 and c.peak_bytes for c in self.candidates):
            return notes
        # Stages 0-1 differentiate the full params, so the sum over micro-batches is full-size;
        # it is float32 so that adding micro-batch gradients loses no precision.
        return [*notes, f"grad_accum > 1 in stages 0-1 adds a full-size float32 gradient "
                f"accumulator (4 B x Ψ = {format_bytes(4 * psi)}) to the peak; stages 2-3 "
                f"accumulate a 1/N shard ({format_bytes(4 * psi / n)}), so there smaller "
                f"micro-batches lower it"]

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
        from zerojax.mesh import make_mesh

        b = self._chosen()
        return make_mesh(data=self.devices // b.replica, replica=b.replica)

    def _chosen(self) -> Candidate:
        if self.best is None:
            raise ValueError("no configuration fits; see the candidates' reasons")
        return self.best

    def refit(self, device_memory: int | None = None,
              bandwidth: float | dict[str, float] | None = None) -> PlanResult:
        """The same candidates chosen among for another memory budget or other link
        bandwidths (bytes/s, as `plan` takes them; nothing recompiled; candidates that were
        not compiled stay rejected)."""
        cands = [dataclasses.replace(c) for c in self.candidates]
        return _choose(dataclasses.replace(
            self, candidates=cands, best=None,
            device_memory=self.device_memory if device_memory is None else int(device_memory),
            bandwidth=self.bandwidth if bandwidth is None else _links(bandwidth, self.replica)))

    def as_dict(self) -> dict[str, Any]:
        return {"devices": self.devices, "device_memory": self.device_memory,
                "replica": self.replica, "bandwidth": self.bandwidth,
                "param_dtype": self.param_dtype, "num_params": self.num_params,
                "offload_searched": self.offload_searched,
                "best": None if self.best is None else self.best.row(),
                "candidates": [c.row() for c in self.candidates], "notes": self.notes()}


Progress = Callable[[Candidate, str, int, int], None]  # (candidate, phase, index, total)


def plan(model, devices: int, device_memory: float, batch, *, optimizer=None,
         param_dtype: str = "bfloat16", stages=STAGES, remat=(True, False),
         grad_accum=(1, 2, 4), offload: bool = True, replica: int = 1,
         bandwidth: float | dict[str, float] | None = None, quantize: str | None = "int4",
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

    With `bandwidth` (bytes/s: one figure for every link, or {"data": ..., "replica": ...})
    the least communication *time* wins (`link_seconds`), and ZeRO++ is tried on the best
    fitting candidate of each stage and mesh: hpZ (stage 3 with `replica` > 1; exact), and,
    unless `quantize` is None, qwZ int8 (stages 1-3) with qgZ `quantize` ("int4" or "int8"),
    with and without hpZ; qwZ or qgZ alone only where both together do not fit. `replica` > 1
    (e.g. nodes): the devices are `replica` groups joined by the "replica" link, and every
    candidate is also tried on the `make_mesh(replica=..., data=...)` mesh. Among equal times,
    exact options win over quantized ones. Without `bandwidth` nothing quantized is tried:
    quantization changes the numbers, and bytes alone cannot say it is worth it.
    """
    import jax
    import optax

    from zerojax.analysis.hlo import axis_bytes, by_kind, collective_sites
    from zerojax.analysis.measurement import lower, measure_lowered, state_bytes
    from zerojax.config import ZeroConfig
    from zerojax.engine import Engine
    from zerojax.errors import BatchError, ConfigError
    from zerojax.mesh import make_mesh

    links = _links(bandwidth, replica)
    if quantize is not None and quantize not in ("int4", "int8"):
        raise ConfigError(f"quantize={quantize!r}: the gradient format plan may choose is "
                          f"'int4', 'int8', or None for exact options only")
    optimizer = optax.adamw(LR) if optimizer is None else optimizer
    meshes = {1: make_mesh(data=devices)}
    if replica > 1:
        meshes[replica] = make_mesh(replica=replica, data=devices // replica)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x),
                                                        jax.numpy.result_type(x)), batch)
    report = progress or (lambda *_: None)
    cands, num_params = [], 0

    def search(todo: list[Candidate], start: int, total: int) -> None:
        nonlocal num_params
        for i, c in enumerate(todo, start):
            cands.append(c)
            report(c, "lowering", i, total)
            try:
                cfg = ZeroConfig(stage=c.stage, param_dtype=param_dtype, remat=c.remat,
                                 grad_accum=c.grad_accum, offload=c.offload,
                                 quantize_weights=c.quantize_weights,
                                 quantize_grads=c.quantize_grads, hpz=c.hpz)
                engine = Engine(model, optimizer, meshes[c.replica], cfg)
            except ConfigError as e:
                if not c.zeropp():  # the caller's own options: theirs to fix
                    raise
                c.reason = f"config: {e}"
                report(c, "done", i, total)
                continue
            try:
                lowered = lower(engine, batch)
            except BatchError as e:
                c.reason = f"batch: {e}"
                report(c, "done", i, total)
                continue
            num_params = engine.layout.num_params
            state = state_bytes(engine)
            c.state_bytes, c.host_bytes = state["device"], state["host"] if c.offload else None
            if c.state_bytes > device_memory:
                text = lowered.compiler_ir("hlo").as_hlo_text()
                sites, _ = collective_sites(text, devices)
                kinds, c.launches = by_kind(sites)
                c.comm_bytes, found = kinds["total"], axis_bytes(sites, engine.replica,
                                                                engine.data)
                c.reason = (f"model state alone is {format_bytes(c.state_bytes)} > "
                            f"{format_bytes(device_memory)} (not compiled)")
            else:
                report(c, "compiling", i, total)
                m = measure_lowered(engine, lowered)
                c.peak_bytes, c.comm_bytes = m.device_peak_bytes, m.collective_bytes["total"]
                c.launches, found = m.collective_launches, m.collective_axis_bytes
            c.axis_bytes = on_links(found, c.replica, replica)
            report(c, "done", i, total)

    def result(**kw) -> PlanResult:
        return _choose(PlanResult(devices, int(device_memory), cands, param_dtype=param_dtype,
                                  num_params=num_params, replica=replica, bandwidth=links,
                                  **kw))

    done = 0

    def run(todo: list[Candidate]) -> None:
        nonlocal done
        search(todo, done + 1, done + len(todo))
        done += len(todo)

    run([Candidate(s, rm, k, replica=r) for r, s, rm, k in
         itertools.product(meshes, stages, remat, grad_accum)])
    best = result()
    # Offload helps only candidates that were rejected for memory (they lowered), not a batch
    # that does not split.
    more = [Candidate(s, rm, k, offload="optimizer", replica=r) for r, s, rm, k in
            itertools.product(meshes, [s for s in stages if s >= 1], remat, grad_accum)]
    offloaded = bool(best.best is None and offload and more
                     and any(c.state_bytes is not None for c in cands))
    if offloaded:
        run(more)
        best = result(offload_searched=True)
    if links is None:
        return best
    bases = _best_per_group([c for c in cands if c.fits],
                            lambda c: (c.stage, c.replica, c.offload), _cost(links))
    variants = [_zeropp(b, quantize) for b in bases]
    run([v for vs in variants for v in vs])
    result(offload_searched=offloaded)  # marks what fits
    # qwZ or qgZ alone where both together did not fit.
    run([v for b, vs in zip(bases, variants) if not any(x.fits and x.quantized for x in vs)
         for v in _zeropp(b, quantize, alone=True)])
    return result(offload_searched=offloaded)


def on_links(found: dict[str, float], mesh_replica: int, replica: int) -> dict[str, float]:
    """A candidate's bytes by mesh axis (`found`, on its mesh of `mesh_replica` groups) as the
    links of a machine of `replica` groups carry them: a flat mesh's collectives run over every
    device, so across groups ("all") where there are several."""
    if mesh_replica == 1 and replica > 1:
        return {"all": sum(found.values())}
    return dict(found)


def _links(bandwidth, replica: int) -> dict[str, float] | None:
    """`bandwidth` as {axis: bytes/s}, checked against `replica`."""
    from zerojax.errors import ConfigError

    if bandwidth is None:
        if replica > 1:
            raise ConfigError(f"replica={replica} weighs the link between replicas against the "
                              f"one within: give bandwidth={{'data': ..., 'replica': ...}}")
        return None
    axes = ("data", "replica") if replica > 1 else ("data",)
    links = dict.fromkeys(axes, bandwidth) if not isinstance(bandwidth, dict) else dict(bandwidth)
    if set(links) != set(axes):
        raise ConfigError(f"bandwidth={bandwidth!r}: with replica={replica} give one figure or "
                          f"one per mesh axis, {' and '.join(axes)}"
                          + ("" if replica > 1 else " (a replica link needs replica > 1)"))
    for axis, bw in links.items():
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not bw > 0:
            raise ConfigError(f"bandwidth for {axis!r} is {bw!r}: give bytes per second > 0")
    return {axis: float(bw) for axis, bw in links.items()}


def _zeropp(base: Candidate, quantize: str | None, alone: bool = False) -> list[Candidate]:
    """The ZeRO++ variants of a fitting candidate (see `plan`); `alone`: qwZ and qgZ apart."""
    like = dict(stage=base.stage, remat=base.remat, grad_accum=base.grad_accum,
                offload=base.offload, replica=base.replica)
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


def _cost(links: dict[str, float] | None) -> Callable[[Candidate], float]:
    """What `plan` minimizes: seconds on the links where their bandwidth is known (`_choose`
    sets `comm_seconds`), else bytes."""
    return (lambda c: c.comm_bytes) if links is None else (lambda c: c.comm_seconds)


def _order(c: Candidate) -> tuple:
    """Among equal traffic: offload last (it moves bytes over PCIe every step), exact before
    quantized, then the least extra work and memory."""
    return (c.offload is not None, c.quantized, c.remat, c.grad_accum, c.launches, c.peak_bytes)


def _best_per_group(fitting: list[Candidate], group, cost) -> list[Candidate]:
    """The candidate `_choose` would pick within each group of `fitting`."""
    groups: dict[Any, list[Candidate]] = {}
    for c in fitting:
        groups.setdefault(group(c), []).append(c)
    return [_least(g, cost)[0] for g in groups.values()]


def _least(fitting: list[Candidate], cost) -> tuple[Candidate, list[Candidate]]:
    """The best of `fitting` and those tied with it (within `TIE` of the least cost)."""
    least = min(cost(c) for c in fitting)
    tied = [c for c in fitting if cost(c) <= least * (1 + TIE)]
    return min(tied, key=_order), tied


def _choose(result: PlanResult) -> PlanResult:
    mem, links = result.device_memory, result.bandwidth
    cost = _cost(links)
    for c in result.candidates:
        c.chosen = False
        if links is not None and c.axis_bytes is not None:
            c.comm_seconds = link_seconds(c.axis_bytes, links)
        if c.peak_bytes is not None:
            c.fits = c.peak_bytes <= mem
            c.reason = "" if c.fits else f"peak {format_bytes(c.peak_bytes)} > {format_bytes(mem)}"
    fitting = [c for c in result.candidates if c.fits]
    result.best = None
    if not fitting:
        return result
    best, tied = _least(fitting, cost)
    best.chosen, best.reason, result.best = True, "", best
    for c in fitting:
        if c is best:
            continue
        if any(c is t for t in tied):
            c.reason = "fits; same traffic, but more recompute, collectives or memory" + (
                ", or quantized" if c.quantized and not best.quantized else "")
        elif links is not None:
            c.reason = (f"fits; {format_seconds(c.comm_seconds)} on the links vs "
                        f"{format_seconds(best.comm_seconds)}")
        else:
            c.reason = (f"fits; sends {format_bytes(c.comm_bytes)} vs "
                        f"{format_bytes(best.comm_bytes)}")
    return result


def format_seconds(s: float) -> str:
    """'1.23 ms', '456 us', '2.5 s'."""
    for unit, scale in (("s", 1), ("ms", 1e-3)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-6:.3g} us"

