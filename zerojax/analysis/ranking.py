"""How `plan` chooses among the candidates that fit: the least cost (bytes, or with link
bandwidths the step's seconds), ties within 1% broken by the least extra work, and a quantized
option only where it shortens the step by at least 5%."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zerojax.analysis.accounting import format_bytes
from zerojax.analysis.steptime import link_seconds, step_seconds

TIE = 0.01  # costs within 1% of the least count as equal
GAIN = 0.05  # a quantized option must shorten the step by this much to be chosen


def budget_text(memory: float, margin: float) -> str:
    """The peak a candidate may reach, e.g. "72.0 GB (80.0 GB less the 10% margin)"."""
    return format_bytes(memory * (1 - margin)) + (
        f" ({format_bytes(memory)} less the {100 * margin:g}% margin)" if margin else "")


def cost_of(links: dict[str, float] | None) -> Callable[[Any], float]:
    """What `plan` minimizes: the step's seconds where the links' bandwidth is known
    (`choose` sets `step_seconds`), else bytes."""
    return (lambda c: c.comm_bytes) if links is None else (lambda c: c.step_seconds)


def order(c) -> tuple:
    """Among equal cost: offload last (it moves bytes over PCIe every step), exact before
    quantized, the smallest model axis, then the least extra work and memory."""
    return (c.offload is not None, c.quantized, c.model, c.remat, c.grad_accum, c.launches,
            c.peak_bytes)


def best_per_group(fitting: list[Any], group, cost) -> list[Any]:
    """The candidate `choose` would pick within each group of `fitting`."""
    groups: dict[Any, list[Any]] = {}
    for c in fitting:
        groups.setdefault(group(c), []).append(c)
    return [least(g, cost)[0] for g in groups.values()]


def least(fitting: list[Any], cost) -> tuple[Any, list[Any]]:
    """The best of `fitting` and those tied with it (within `TIE` of the least cost)."""
    low = min(cost(c) for c in fitting)
    tied = [c for c in fitting if cost(c) <= low * (1 + TIE)]
    return min(tied, key=order), tied


def choose(result):
    """Marks what fits in `result` (a `PlanResult`) and chooses its best; returns it."""
    links, cost = result.bandwidth, cost_of(result.bandwidth)
    compute = result.compute_seconds
    for c in result.candidates:
        c.chosen = False
        if links is not None and c.axis_bytes is not None:
            c.comm_seconds = link_seconds(c.axis_bytes, links)
            c.step_seconds = step_seconds(c.axis_bytes, c.overlap_bytes or {}, links, compute,
                                          c.launches or 0, result.latency)
        if c.peak_bytes is not None:
            c.fits = c.peak_bytes <= result.budget
            c.reason = "" if c.fits else (f"peak {format_bytes(c.peak_bytes)} > "
                                          f"{budget_text(result.device_memory, result.margin)}")
    fitting = [c for c in result.candidates if c.fits]
    result.best = None
    if not fitting:
        return result
    best, tied = least(fitting, cost)
    exact = [c for c in fitting if not c.quantized]
    slim = None  # a quantized option that fits but gains too little over the best exact one
    if best.quantized and exact and links is not None:
        plain, plain_tied = least(exact, cost)
        if cost(best) > (1 - GAIN) * cost(plain):
            slim, (best, tied) = best, (plain, plain_tied)
    best.chosen, best.reason, result.best = True, "", best
    for c in fitting:
        if c is best:
            continue
        if any(c is t for t in tied):
            c.reason = "fits; same cost, but more recompute, collectives or memory" + (
                ", or quantized" if c.quantized and not best.quantized else "") + (
                ", or a larger model axis" if c.model > best.model else "")
        elif c is slim or (c.quantized and not best.quantized
                           and (1 - GAIN) * cost(best) < cost(c) < cost(best)):
            gain = 1 - cost(c) / cost(best)
            c.reason = (f"fits; quantized, step {format_seconds(c.step_seconds)} is "
                        f"{100 * gain:.1f}% shorter than the exact "
                        f"{format_seconds(best.step_seconds)}, less than the "
                        f"{100 * GAIN:g}% it must gain")
        elif links is not None:
            c.reason = (f"fits; step {format_seconds(c.step_seconds)} vs "
                        f"{format_seconds(best.step_seconds)}")
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
