"""The analytic estimates' arguments, checked (accounting.py): a bad one is one
`EstimateError` that names the value and the fix.
"""

from __future__ import annotations

import math
from typing import Any

from zerojax.collectives.quantize import FORMATS
from zerojax.config import OFFLOAD_DEVICES, OFFLOADS

STAGES = (0, 1, 2, 3)


class EstimateError(ValueError):
    """A bad argument to the analytic estimates; the message names the value and the fix."""


def check_args(num_params: Any, devices: Any, stage: Any, replica: Any, offload: Any = None,
               model: Any = 1, split_params: Any = None, **nbytes: Any) -> int:
    """Validates the common arguments; returns N, the devices the state is sharded over (the
    `data` axis: devices / (replica · model))."""
    if offload is not None and offload not in OFFLOADS:
        raise EstimateError(f"offload={offload!r} is not an offload mode; use one of "
                            f"{OFFLOADS} or None")
    if offload is not None and stage == 0:
        raise EstimateError(f"offload={offload!r} needs stage 1, 2 or 3 (got stage=0); stage 0 "
                            f"has no optimizer shard to offload")
    if isinstance(num_params, bool) or not isinstance(num_params, (int, float)):
        raise EstimateError(f"num_params={num_params!r} must be a number of parameters")
    if not (num_params >= 0 and math.isfinite(num_params)) or num_params != int(num_params):
        raise EstimateError(f"num_params={num_params!r} must be a non-negative whole number")
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise EstimateError(f"stage={stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
    for name, value in (("devices", devices), ("replica", replica), ("model", model)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EstimateError(f"{name}={value!r} must be an integer >= 1")
    if devices % replica:
        raise EstimateError(
            f"devices={devices} is not divisible by replica={replica}; "
            f"use a replica count that divides the device count"
        )
    if devices % (replica * model):
        raise EstimateError(f"devices={devices} do not split into replica={replica} x data x "
                            f"model={model}; use a model size that divides devices / replica")
    if split_params is not None and (isinstance(split_params, bool)
                                     or not isinstance(split_params, (int, float))
                                     or not 0 <= split_params <= num_params):
        raise EstimateError(f"split_params={split_params!r} must be a number of params between "
                            f"0 and num_params={num_params}")
    for name, value in nbytes.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise EstimateError(f"{name}={value!r} must be a non-negative number of bytes")
    return devices // (replica * model)


def check_fraction(offload_fraction: Any, offload: Any) -> None:
    f = offload_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
        raise EstimateError(f"offload_fraction={f!r} must be a number in (0, 1]: the host's "
                            f"share of the offloaded state")
    if f < 1 and offload is None:
        raise EstimateError(f"offload_fraction={f} needs offload='optimizer' (got "
                            f"offload=None): it splits the offloaded state")


def check_delayed(delayed_update: Any, offload: Any) -> None:
    if delayed_update is None:
        return
    if isinstance(delayed_update, bool) or not isinstance(delayed_update, int) \
            or delayed_update < 0:
        raise EstimateError(f"delayed_update={delayed_update!r} must be an integer K >= 0 "
                            f"(or None: no delay)")
    if offload is None:
        raise EstimateError(f"delayed_update={delayed_update} needs offload='optimizer' (got "
                            f"offload=None): the delayed update is the offloaded one")


def check_device(offload_device: Any, offload: Any, ring_bytes: Any, default: int) -> float:
    """Checks the offload device; returns the NVMe ring's bytes per device (0 for "cpu")."""
    if not isinstance(offload_device, str) or offload_device not in OFFLOAD_DEVICES:
        raise EstimateError(f"offload_device={offload_device!r} is not an offload device; use "
                            f"one of {OFFLOAD_DEVICES}")
    if offload_device == "cpu":
        if ring_bytes is not None:
            raise EstimateError(f"ring_bytes={ring_bytes!r} sizes the NVMe tier's buffers; give "
                                f"offload_device='nvme' or drop it")
        return 0.0
    if offload is None:
        raise EstimateError(f"offload_device={offload_device!r} needs offload='optimizer' (got "
                            f"offload=None): the NVMe tier holds the offloaded state")
    ring = default if ring_bytes is None else ring_bytes
    if isinstance(ring, bool) or not isinstance(ring, (int, float)) or not ring > 0:
        raise EstimateError(f"ring_bytes={ring!r} must be a positive number of bytes (the NVMe "
                            f"ring per device: buffer count x 3 x 4 x buffer size)")
    return float(ring)


def check_hpz(hpz: Any, stage: int, replica: int) -> None:
    if hpz and (stage != 3 or replica < 2):
        raise EstimateError(f"hpz=True needs stage 3 and replica >= 2 (got stage={stage}, "
                            f"replica={replica}): hpZ's secondary copy is sharded within a "
                            f"replica")


def check_formats(quantize_weights: Any, quantize_grads: Any, quant_block: Any) -> None:
    if quantize_weights not in (None, "int8"):
        raise EstimateError(f"quantize_weights={quantize_weights!r}: use 'int8' or None")
    if quantize_grads not in (None, *FORMATS):
        raise EstimateError(f"quantize_grads={quantize_grads!r}: use one of {FORMATS} or None")
    if isinstance(quant_block, bool) or not isinstance(quant_block, int) or quant_block < 1:
        raise EstimateError(f"quant_block={quant_block!r} must be a positive integer")
