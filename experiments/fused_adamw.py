"""AdamW as one pass over the host state: each param's gradient, master and moments read once
and written once, in place, on every core (numba).

XLA:CPU compiles the engine's host update into four loop fusions, one per output (42 bytes a
param read and written for a bf16 model, where 28 are needed: docs/performance.md). This loop
is what a fused update would move: the measure of what the engine would gain from one
(`update_bench.py` times it beside the engine's update, on the same state, and checks that it
gives the engine's numbers). It is not the engine's update.

The arithmetic is optax.adamw's, in its order, in float32 (`scale_by_adam`,
`add_decayed_weights`, the learning rate, `apply_updates`), so the numbers are bitwise the
engine's where XLA:CPU keeps that order (it does without fast math). The gradient and the
compute shard are bfloat16, as raw 16-bit words: numba has no bfloat16.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic


@intrinsic
def _f32_of_bits(typingctx, bits):
    """uint32 -> float32, the same bits."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))
    return types.float32(types.uint32), codegen


@intrinsic
def _bits_of_f32(typingctx, x):
    """float32 -> uint32, the same bits."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))
    return types.uint32(types.float32), codegen


@numba.njit(parallel=True, fastmath=False, nogil=True, cache=False)
def adamw_bf16(master, mu, nu, g_bf16, out_bf16, a1, b1, a2, b2, eps, r1, r2, wd, lr):
    """One AdamW step in place: `master`, `mu`, `nu` float32; `g_bf16` and `out_bf16` (the
    compute shard written) uint16 words of bfloat16; a1, a2 = 1 - b1, 1 - b2 (optax rounds
    them from float64); r1, r2 = 1 / (1 - b1**t), 1 / (1 - b2**t): XLA divides by the bias
    corrections as a multiply by their reciprocals, so does this."""
    for i in numba.prange(master.shape[0]):
        g = _f32_of_bits(np.uint32(g_bf16[i]) << np.uint32(16))
        m = a1 * g + b1 * mu[i]
        v = a2 * (g * g) + b2 * nu[i]
        mu[i] = m
        nu[i] = v
        u = (m * r1) / (np.sqrt(v * r2) + eps)
        p = master[i] + (-lr) * (u + wd * master[i])
        master[i] = p
        b = _bits_of_f32(p)  # to bfloat16, rounding to nearest even (p finite)
        out_bf16[i] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
                                >> np.uint32(16))


def bf16_words(x) -> np.ndarray:
    """A bfloat16 array's raw 16-bit words (a view)."""
    return np.asarray(x).view(np.uint16)
