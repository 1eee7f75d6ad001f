"""ZeRO-Infinity's NVMe tier: the AdamW update streamed over state on disk (nvme_adamw.cc).

The fp32 master and the AdamW moments of each device's shard live in a file of a store
(store.py), never whole in host memory. A leaf's update is one XLA:CPU custom call,
`zerojax_adamw_nvme`: in, the step's 13 scalars (`FusedAdamW._rows`, as the host tier's fused
pass takes them), the device's shard index and the gradient shard; out, the compute-dtype
shard (in the gradient's buffer where the dtypes agree). Inside, the leaf's master and moments
stream through a ring of `count` aligned buffers of `block` elements each: the next blocks
read ahead and the last one written behind while one is updated with the fused pass's
per-element arithmetic (adamw_math.h, built with fused.py's flags), so the numbers are the
host tier's bitwise. The call has a side effect (the store), so XLA neither drops nor repeats
it; the store is an attribute (its handle in this process) and the shard an input, so one
program serves every device of a host mesh (`jax.lax.axis_index` in the shard_map).

So the host update of the NVMe tier is the host tier's program with the state's arrays
replaced by the store: `StreamedAdamW.part` in place of `FusedAdamW.part`, the counts (and
the schedule's) staying in the optimizer state in memory.

The library is built at first use with the host's compiler, as fused.py builds its own (the
same cache and flags), and loaded once per process.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.offload import fused

SOURCE = Path(__file__).with_name("nvme_adamw.cc")
TARGET = "zerojax_adamw_nvme"
COUNTERS = ("read", "written", "passes", "read_s", "write_s", "compute_s", "stall_s")

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "zjn_open": (_i64, [_i64, _i64]),
    "zjn_add_shard": (_int, [_i64, _i64, ctypes.c_char_p, _i64, _ptr, _ptr, _int,
                             ctypes.POINTER(_int), ctypes.c_char_p, _i64]),
    "zjn_configure": (_int, [_i64, _i64, _i64]),
    "zjn_transfer": (_int, [_i64, _i64, _i64, _int, _i64, _i64, _ptr, _int, ctypes.c_char_p,
                            _i64]),
    "zjn_sync": (_int, [_i64, ctypes.c_char_p, _i64]),
    "zjn_counters": (_int, [_i64, _ptr, _int]),
    "zjn_close": (None, [_i64]),
}


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str]:
    """(the NVMe pass's library, built and registered with jax as `zerojax_adamw_nvme`, or
    None and why not): once per process."""
    lib, why = fused.build(os.environ.get("CXX", "g++"), SOURCE, "nvme-adamw")
    if lib is None:
        return None, why
    try:
        dll = ctypes.CDLL(str(lib))
        handler = dll.ZerojaxAdamWNvme
    except (OSError, AttributeError) as e:
        return None, f"could not load {lib}: {e}"
    for name, (res, args) in _SIGNATURES.items():
        fn = getattr(dll, name)
        fn.restype, fn.argtypes = res, args
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    return dll, ""


def update_leaf(handle: int, leaf: int, row, shard, grad, out_dtype, dry: str | None = None):
    """The compute-dtype shard of one leaf's streamed update (the store's master and moments
    updated in place on disk): `row` the step's float32[13] (`FusedAdamW._rows`), `shard` the
    device's shard index (int32 []), `grad` its gradient shard (f32, bf16 or f16, flat or not).

    `dry` "master", "mu" or "nu": the store is only read, and out comes that part of the state
    as the update would leave it (the master in `out_dtype`, a moment in float32): the params
    or optimizer state with a pending update applied, the update still pending."""
    out = jnp.dtype(out_dtype)
    part = -1 if dry is None else ("master", "mu", "nu").index(dry)
    aliases = {2: 0} if grad.dtype == out and dry is None else {}
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(grad.shape, out), has_side_effect=True,
                            input_output_aliases=aliases)
    return call(row, jnp.asarray(shard, jnp.int32), grad, store=np.int64(handle),
                leaf=np.int64(leaf), part=np.int64(part))


class StreamedAdamW(fused.FusedAdamW):
    """A `zerojax.adamw`'s update over flat shards whose master and moments live in a store:
    `FusedAdamW`'s (its scalars, decay mask and counts) with each leaf's pass streamed
    (`update_leaf`). The optimizer state's counts stay in memory; its moments' leaves and the
    master are the store's (the caller passes none of them)."""

    def __init__(self, spec, update, handle: int):
        super().__init__(spec, update)
        self.handle = handle

    def part(self, params, scalars, state, grads, shard):
        """The update of the params `params` (indices): (the new counts {state index: value},
        their compute-dtype shards). `state`: the optimizer state's leaves by index (the counts
        at least); `shard`: the device's shard index in the store (int32 [])."""
        decayed, plain, new = self._rows(scalars, state)
        shards = [update_leaf(self.handle, i, decayed if self.decay[i] else plain, shard, g,
                              self.how.out_dtype)
                  for i, g in zip(params, grads, strict=True)]
        return new, shards

    def __call__(self, reduced, opt_state, shard):
        """This device's (new optimizer state: its counts stepped, its other leaves as they
        were; new compute-dtype shards), as `FusedAdamW.__call__` gives them without the
        master, which is the store's."""
        grads, *scalars = reduced
        leaves = jax.tree.leaves(opt_state)
        new, shards = self.part(range(len(self.decay)), scalars, dict(enumerate(leaves)),
                                jax.tree.leaves(grads), shard)
        return jax.tree.unflatten(self.state_def, [new.get(j, x) for j, x in enumerate(leaves)]
                                  ), shards
