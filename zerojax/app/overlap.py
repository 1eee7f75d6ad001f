"""GPU compute/communication overlap: the XLA flags, applied before jax starts its backend.

XLA reads `XLA_FLAGS` once, when the first backend is created, and aborts the process on a
flag it does not know; so this module sets only flags this jaxlib's XLA accepts (DESIGN §5)
and refuses to act once a backend exists, where the flags would be silently ignored.
`JAX_OPTIMIZATION_LEVEL=O1` is the alternative that enables the same passes.
"""

from __future__ import annotations

import importlib.util
import os

# One layer of the "1b" preset in bf16 is 12·2048²·2 B ≈ 100 MB; the threshold must cover a
# whole layer so that XLA combines a layer's gathers into one collective.
DEFAULT_COMBINE_BYTES = 256 * 2**20

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")
_GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                "jax_rocm7_plugin")


def xla_overlap_flags(combine_threshold_bytes: int = DEFAULT_COMBINE_BYTES) -> list[str]:
    """The XLA:GPU flags that overlap collectives with compute (latency-hiding scheduler,
    pipelined all-gather / reduce-scatter, all-gather combining up to one layer)."""
    if isinstance(combine_threshold_bytes, bool) or not isinstance(combine_threshold_bytes, int) \
            or combine_threshold_bytes < 1:
        raise ValueError(f"combine_threshold_bytes={combine_threshold_bytes!r} must be a positive "
                         f"int (at least one layer's bytes in compute dtype)")
    return [
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "--xla_gpu_enable_pipelined_all_gather=true",
        "--xla_gpu_enable_pipelined_reduce_scatter=true",
        f"--xla_gpu_all_gather_combine_threshold_bytes={combine_threshold_bytes}",
    ]


def guess_platform() -> str:
    """The platform jax will pick, guessed without starting a backend: "gpu" or "cpu"."""
    chosen = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if chosen:
        return "gpu" if chosen.split(",")[0] in _GPU_PLATFORMS else chosen.split(",")[0]
    for name in _GPU_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return "gpu"
        except (ImportError, ValueError):
            continue
    return "cpu"


def apply_overlap_flags(platform: str | None = None,
                        combine_threshold_bytes: int = DEFAULT_COMBINE_BYTES) -> list[str]:
    """Appends `xla_overlap_flags()` to `XLA_FLAGS` when the platform is a GPU.

    Call before the first jax computation. Returns the flags added ([] off GPU, or when
    `XLA_FLAGS` already sets them). `platform` overrides the guess ("gpu", "cuda", "cpu", ...).
    """
    flags = xla_overlap_flags(combine_threshold_bytes)
    platform = guess_platform() if platform is None else platform.lower()
    if platform not in _GPU_PLATFORMS:
        return []
    if _backend_started():
        raise RuntimeError("apply_overlap_flags() was called after jax started its backend; XLA "
                           "has read XLA_FLAGS already. Call it before the first jax computation "
                           "(or set JAX_OPTIMIZATION_LEVEL=O1 / XLA_FLAGS in the environment)")
    current = os.environ.get("XLA_FLAGS", "").split()
    names = {f.split("=", 1)[0] for f in current}
    added = [f for f in flags if f.split("=", 1)[0] not in names]
    os.environ["XLA_FLAGS"] = " ".join(current + added)
    return added


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge  # no public query for this in jax 0.10
    except ImportError:
        return False
    return xla_bridge.backends_are_initialized()
