"""AdamW as one pass over the host state: each param's gradient, master and moments read once
and written once, in place, on every core; in numba (`adamw_bf16`) and as an XLA:CPU custom
call (`custom_call`, fused_adamw.cc).

XLA:CPU compiles the engine's host update into four loop fusions, one per output (42 bytes a
param read and written for a bf16 model, where 28 are needed: docs/performance.md). This pass
is what a fused update would move: the measure of what the engine would gain from one
(`update_bench.py` times it beside the engine's update, on the same state, and checks that it
gives the engine's numbers). It is not the engine's update.

The arithmetic is optax.adamw's, in its order, in float32 (`scale_by_adam`,
`add_decayed_weights`, the learning rate, `apply_updates`), so the numbers are bitwise the
engine's where XLA:CPU keeps that order (it does without fast math). The gradient and the
compute shard are bfloat16, as raw 16-bit words: numba has no bfloat16.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

SOURCE = Path(__file__).with_name("fused_adamw.cc")


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


@functools.cache
def custom_call():
    """The same pass as an XLA:CPU custom call (fused_adamw.cc), built with the host's C++
    compiler (`CXX`, default g++) for this CPU and registered with jax:
    `(scalars, master, mu, nu, g_bf16) -> (master, mu, nu, compute_bf16)`, the state and the
    gradient donated and aliased to the results (the gradient to the compute shard, as the
    engine writes the shards into the gradient's buffer), scalars float32[9] (a1 b1 a2 b2 eps
    r1 r2 wd lr). None, with the reason in `custom_call.why`, where no compiler builds it."""
    import jax
    import jax.numpy as jnp

    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        custom_call.why = f"no C++ compiler ({cxx}) on PATH"
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + jax.__version__.encode()).hexdigest()[:16]
    lib = Path(tempfile.gettempdir()) / f"zerojax-fused-adamw-{key}.so"
    if not lib.exists():
        tmp = lib.with_suffix(f".{os.getpid()}.so")
        cmd = [cxx, "-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c++17",
               "-shared", "-fPIC", f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(tmp)]
        built = subprocess.run(cmd, capture_output=True, text=True)
        if built.returncode:
            custom_call.why = f"{cxx} failed: {built.stderr.strip().splitlines()[-1:]}"
            return None
        tmp.replace(lib)
    jax.ffi.register_ffi_target("zerojax_fused_adamw",
                                jax.ffi.pycapsule(ctypes.cdll.LoadLibrary(str(lib)).ZjAdamW),
                                platform="cpu")

    def step(scalars, master, mu, nu, g):
        f32 = jax.ShapeDtypeStruct(master.shape, jnp.float32)
        out = (f32, f32, f32, jax.ShapeDtypeStruct(master.shape, jnp.bfloat16))
        return jax.ffi.ffi_call("zerojax_fused_adamw", out,
                                input_output_aliases={1: 0, 2: 1, 3: 2, 4: 3})(scalars, master,
                                                                               mu, nu, g)

    return jax.jit(step, donate_argnums=(1, 2, 3, 4))
