"""Dtype policy and dynamic loss scaling (fp16), with a skip that every device agrees on."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.errors import ConfigError

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_name(dtype) -> str:
    """Canonical name of a supported compute dtype; ConfigError for anything else."""
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return name


class LossScale(NamedTuple):
    """Dynamic loss-scale state; replicated scalars."""

    scale: jax.Array  # f32 [] {replicated}
    good_steps: jax.Array  # i32 [] {replicated}: finite steps since the last change


def init_loss_scale(initial: float) -> LossScale:
    return LossScale(jnp.asarray(initial, jnp.float32), jnp.asarray(0, jnp.int32))


def update_loss_scale(ls: LossScale, finite: jax.Array, growth_interval: int,
                      factor: float = 2.0) -> LossScale:
    """Halves the scale on a non-finite step; doubles it after `growth_interval` finite steps."""
    grow = finite & (ls.good_steps + 1 >= growth_interval)
    scale = jnp.where(finite, jnp.where(grow, ls.scale * factor, ls.scale),
                      jnp.maximum(ls.scale / factor, 1.0))
    good = jnp.where(finite & ~grow, ls.good_steps + 1, 0)
    return LossScale(scale.astype(jnp.float32), good.astype(jnp.int32))
