"""The checks of `plan`'s and `PlanResult.refit`'s arguments: each a `ConfigError` naming the
value and the fix, before anything compiles."""

from __future__ import annotations

from zerojax.analysis.steptime import EFFICIENCY, LATENCY
from zerojax.errors import ConfigError


def links(bandwidth, replica: int, models=(1,)) -> dict[str, float] | None:
    """`bandwidth` as {axis: bytes/s}, checked against `replica`; the "model" link, where a
    model axis is searched and not named, is the "data" link's."""
    if bandwidth is None:
        if replica > 1:
            raise ConfigError(f"replica={replica} weighs the link between replicas against the "
                              f"one within: give bandwidth={{'data': ..., 'replica': ...}}")
        return None
    axes = ("data", "replica") if replica > 1 else ("data",)
    out = dict.fromkeys(axes, bandwidth) if not isinstance(bandwidth, dict) else dict(bandwidth)
    named = set(out) - {"model"}
    if named != set(axes):
        raise ConfigError(f"bandwidth={bandwidth!r}: with replica={replica} give one figure or "
                          f"one per mesh axis, {' and '.join(axes)} (and model)"
                          + ("" if replica > 1 else " (a replica link needs replica > 1)"))
    for axis, bw in out.items():
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not bw > 0:
            raise ConfigError(f"bandwidth for {axis!r} is {bw!r}: give bytes per second > 0")
    if max(models) > 1 or "model" in out:
        out.setdefault("model", bandwidth if not isinstance(bandwidth, dict)
                         else out["data"])
    return {axis: float(bw) for axis, bw in out.items()}


def model_sizes(model, devices: int, replica: int, model_parallel) -> tuple[int, ...]:
    """The model-axis sizes `plan` may try (see `plan`), 1 first."""
    from zerojax.analysis.tensor import allowed_model_sizes
    per = devices // replica if devices % replica == 0 else devices
    if model_parallel is None:
        heads = getattr(getattr(model, "cfg", None), "n_heads", None)
        return tuple(allowed_model_sizes(model, per, heads))
    sizes = (model_parallel,) if isinstance(model_parallel, int) else tuple(model_parallel)
    for m in sizes:
        if isinstance(m, bool) or not isinstance(m, int) or m < 1 or per % m:
            raise ConfigError(f"model_parallel={model_parallel!r}: each size must be a positive "
                              f"integer that divides the {per} devices of a replica")
    if not sizes:
        raise ConfigError("model_parallel=(): give at least one model-axis size, e.g. (1, 2)")
    return tuple(sorted(set(sizes)))


def _number(name: str, value, within, advice: str) -> float:
    """`value` as a float where it is a real number (not a bool) that `within` accepts."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not within(value):
        raise ConfigError(f"{name}={value!r}: {advice}")
    return float(value)


def margin(margin) -> float:
    return _number("margin", margin, lambda x: 0 <= x < 1,
                   "give the share of device memory to keep free, in [0, 1) (e.g. 0.1)")


def efficiency(efficiency) -> float:
    return _number("efficiency", efficiency, lambda x: 0 < x <= 1,
                   f"give the fraction of the peak compute runs at (the MFU), in (0, 1], "
                   f"e.g. {EFFICIENCY}")


def latency(latency) -> float:
    return _number("latency", latency, lambda x: 0 <= x < 1,
                   f"give the seconds a collective launch costs, >= 0 (e.g. {LATENCY})")
