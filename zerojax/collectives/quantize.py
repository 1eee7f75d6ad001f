"""Block quantization of collective messages (ZeRO++: qwZ's weights, qgZ's gradients).

A message `[..., K]` is cut into segments (one per leaf of a unit: a block never straddles two
leaves, whose magnitudes differ by orders — a LayerNorm scale next to a weight matrix) and
each segment into blocks of `block` elements (the last one shorter). A block travels as its
values, symmetric integers `round(x / s)` with `s = max|x| / QMAX` (int8: ±127; int4: ±7,
packed two per byte), and its scale `s` in float32. Dequantized, each element is within
`s / 2` of the original: at most max|x|/254 (int8) or max|x|/14 (int4) of its block.

A non-finite element makes its block's scale NaN and every dequantized element of the block
NaN, so fp16 loss scaling still sees an overflow and skips the step.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

QMAX = {"int8": 127, "int4": 7}
FORMATS = tuple(QMAX)
SCALE_BYTES = 4  # a float32 scale per block


def num_blocks(segments: tuple[int, ...], block: int) -> int:
    """Scales of a message made of `segments` (elements per leaf piece)."""
    return sum(-(-k // block) for k in segments)


def value_bytes(elements: int, fmt: str) -> int:
    """Bytes of `elements` quantized values (int4: two per byte)."""
    return -(-elements // 2) if fmt == "int4" else elements


def message_bytes(segments: tuple[int, ...], fmt: str, block: int) -> int:
    """Bytes one message of `segments` sends: values + scales."""
    return value_bytes(sum(segments), fmt) + SCALE_BYTES * num_blocks(segments, block)


def bytes_per_element(fmt: str, block: int) -> float:
    """Bytes per element of a long segment: values + its share of a scale."""
    return (0.5 if fmt == "int4" else 1.0) + SCALE_BYTES / block


def _layout(segments: tuple[int, ...], block: int) -> tuple[np.ndarray, np.ndarray]:
    """(for each block slot `[nb·block]`, the element it holds, or K for padding; for each
    element `[K]`, its block)."""
    slots, owner, first, start = [], [], 0, 0
    for k in segments:
        nb = -(-k // block)
        idx = np.arange(nb * block) + start
        slots.append(np.where(idx < start + k, idx, sum(segments)))
        owner.append(np.arange(k) // block + first)
        first, start = first + nb, start + k
    return np.concatenate(slots), np.concatenate(owner)


def encode(x, fmt: str, segments: tuple[int, ...], block: int):
    """`[..., K]` (K = sum(segments)) -> (values, scales `[..., nb]` float32); values are int8
    `[..., K]`, or for int4 uint8 `[..., ceil(K/2)]` (two per byte, low nibble first)."""
    assert x.shape[-1] == sum(segments), (x.shape, segments)
    qmax = QMAX[fmt]
    slots, owner = _layout(segments, block)
    x = x.astype(jnp.float32)
    # Every value below is computed from `x` (no array constant): a nested shard_map (the
    # model axis) must not hold input-independent values, which partial evaluation would
    # hoist out of it with the wrong sharding.
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 1)])
    xb = _take(padded, slots)
    xb = xb.reshape(*x.shape[:-1], -1, block)  # [..., nb, B]
    # A non-finite element makes the scale NaN (XLA's max need not propagate NaN).
    amax = jnp.max(jnp.abs(xb), axis=-1)  # [..., nb]
    s = lax.select(jnp.all(jnp.isfinite(xb), axis=-1), amax / qmax, amax * jnp.nan)
    s_k = _take(s, owner)  # [..., K]
    q = jnp.clip(jnp.round(lax.select(s_k > 0, x / s_k, x * 0.0)), -qmax, qmax)
    if fmt == "int8":
        return q.astype(jnp.int8), s
    u = (q + 8).astype(jnp.uint8)  # [1, 15]
    if u.shape[-1] % 2:
        u = jnp.pad(u, [(0, 0)] * (u.ndim - 1) + [(0, 1)])
    return u[..., 0::2] | (u[..., 1::2] << 4), s


def decode(values, scales, fmt: str, segments: tuple[int, ...], block: int, dtype):
    """`encode`'s output -> `[..., K]` in `dtype` (each value times its block's scale)."""
    if fmt == "int8":
        q = values.astype(jnp.float32)
    else:
        u = jnp.stack([values & 15, values >> 4], axis=-1).reshape(*values.shape[:-1], -1)
        q = u[..., :sum(segments)].astype(jnp.float32) - 8
    owner = _layout(segments, block)[1]
    return (q * _take(scales, owner)).astype(dtype)


def _take(x, idx: np.ndarray):
    """`x[..., idx]` for in-bounds numpy indices, as one gather: no index arithmetic is traced
    (it would be an input-independent value, see `encode`)."""
    dims = lax.GatherDimensionNumbers(offset_dims=tuple(range(x.ndim - 1)),
                                      collapsed_slice_dims=(x.ndim - 1,),
                                      start_index_map=(x.ndim - 1,))
    return lax.gather(x, np.asarray(idx, np.int32)[:, None], dims, (*x.shape[:-1], 1),
                      mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)
