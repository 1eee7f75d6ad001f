"""The offloaded AdamW update as one fused pass over the host state (ZeRO-Offload's CPU Adam).

XLA:CPU compiles optax.adamw's update into one loop per output (the two moments, the master,
the compute shard): 42 bytes a param read and written for a bf16 model, where one pass needs
28, and each loop on a few threads (docs/performance.md). `zerojax.adamw` is optax.adamw,
whose update the offloaded engine runs instead as one pass per leaf: an XLA:CPU custom call
(fused_adamw.cc) that reads each element of the gradient, master and moments once and writes
master, moments and the compute shard once, in place (all aliased), on every thread of
XLA's pool. Its arithmetic is optax's, in optax's order; the step's scalars (the gradient's
scale and clip, the bias corrections, the learning rate of the schedule, the skip flag) are
computed by the program around it, in jax, as optax computes them.

With Twin-Flow (`offload_fraction` < 1) the host's share of the leaves runs so, the devices'
share as the planned program. Everything else runs `zerojax.adamw` as the optax.adamw it is:
no offload, an optax.MultiSteps or chain around it, and a host without a C++ compiler (the
update then runs as XLA's program, and `Engine.host_update` says why).

The custom call is built at first use with the host's compiler (`CXX`, default g++) for this
CPU, into `$ZEROJAX_CACHE` (default `~/.cache/zerojax`), keyed by the source, jax's version,
the flags and the CPU, and registered with jax.ffi once per process.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import numbers
import os
import platform
import shutil
import subprocess
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zerojax.errors import ConfigError
from zerojax.update import grad_scale

SOURCE = Path(__file__).with_name("fused_adamw.cc")
HEADER = Path(__file__).with_name("adamw_math.h")  # the arithmetic, shared with the NVMe tier's
TARGET = "zerojax_adamw"
# No contraction into FMAs: optax's program, as XLA compiles it without fast math, rounds each
# multiply and add (docs/performance.md: "A one-pass update").
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c++17",
         "-shared", "-fPIC")


@dataclass(frozen=True)
class AdamWSpec:
    """The hyperparameters of a `zerojax.adamw`."""

    learning_rate: Any  # a float or an optax schedule
    b1: float
    b2: float
    eps: float
    eps_root: float
    weight_decay: float
    mask: Any  # None, a pytree of bools, or a callable of the params


_SPECS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # update fn -> AdamWSpec


def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, weight_decay: float = 1e-4, mask=None
          ) -> optax.GradientTransformationExtraArgs:
    """`optax.adamw(learning_rate, b1, b2, eps, eps_root, weight_decay, mask)`, itself (the
    same numbers wherever it runs), which an engine with `offload="optimizer"` runs on the
    host as one fused pass per leaf (this module's docstring)."""
    if isinstance(learning_rate, numbers.Real) and not math.isfinite(learning_rate):
        raise ConfigError(f"zerojax.adamw: learning_rate={learning_rate!r} must be a finite "
                          f"number or a schedule")
    for name, x in (("b1", b1), ("b2", b2), ("eps", eps), ("eps_root", eps_root),
                    ("weight_decay", weight_decay)):
        if not isinstance(x, numbers.Real):
            raise TypeError(f"zerojax.adamw: {name} must be a float, got {x!r}; for a "
                            f"schedule or an array use optax.adamw")
        if not math.isfinite(x):
            raise ConfigError(f"zerojax.adamw: {name}={x!r} must be a finite number (optax "
                              f"takes it as given: with nan every param is NaN after the "
                              f"first update)")
        if name in ("b1", "b2") and not 0 <= x < 1:
            raise ConfigError(f"zerojax.adamw: {name}={x!r} must be in [0, 1), a moment's "
                              f"decay (at 1 the bias correction 1 - {name}**t is zero)")
    tx = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                     weight_decay=weight_decay, mask=mask)
    _SPECS[tx.update] = AdamWSpec(learning_rate, float(b1), float(b2), float(eps),
                                  float(eps_root), float(weight_decay), mask)
    return tx


def spec_of(optimizer) -> AdamWSpec | None:
    """The hyperparameters of `optimizer` if it is a `zerojax.adamw`, else None."""
    update = getattr(optimizer, "update", None)
    try:
        return _SPECS.get(update)
    except TypeError:  # not weakly referenceable: not ours
        return None


def cache_dir() -> Path:
    return Path(os.environ.get("ZEROJAX_CACHE")
                or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zerojax")


def _cpu() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    keep = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({x for x in lines if x.split(":")[0].strip() in keep}))


def build(cxx: str, source: Path = SOURCE, stem: str = "fused-adamw"
          ) -> tuple[Path | None, str]:
    """(the shared library of `source` (the fused pass's; the NVMe tier's, which includes its
    arithmetic too), built with `cxx` for this CPU unless the cache has it, or None and why
    not)."""
    if shutil.which(cxx) is None:
        return None, f"no C++ compiler ({cxx}) on PATH to build {source.name}"
    key = hashlib.sha256("\0".join([source.read_text(), HEADER.read_text(), jax.__version__,
                                    cxx, *FLAGS, _cpu()]).encode()).hexdigest()[:16]
    for where in (cache_dir(), Path(tempfile.gettempdir()) / "zerojax"):
        lib = where / f"{stem}-{key}.so"
        if lib.exists():
            return lib, ""
        try:
            where.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")  # renamed when whole: no half library
        made = subprocess.run([cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{HEADER.parent}",
                               str(source), "-o", str(tmp)], capture_output=True, text=True)
        if made.returncode:
            tmp.unlink(missing_ok=True)
            last = (made.stderr.strip().splitlines() or ["no output"])[-1]
            return None, f"{cxx} could not build {source.name}: {last}"
        tmp.replace(lib)
        return lib, ""
    return None, f"no writable cache for the fused update's library ({cache_dir()})"


@functools.cache
def kernel() -> tuple[bool, str]:
    """(whether the custom call is built and registered with jax, the reason if not): once
    per process."""
    lib, why = build(os.environ.get("CXX", "g++"))
    if lib is None:
        return False, why
    try:
        handler = ctypes.cdll.LoadLibrary(str(lib)).ZerojaxAdamW
    except (OSError, AttributeError) as e:
        return False, f"could not load {lib}: {e}"
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    return True, ""


def _leafwise(tree, params) -> list:
    """A mask (a prefix tree of bools of `params`, as optax.masked takes it) per leaf."""
    return jax.tree.leaves(jax.tree.map(lambda m, sub: jax.tree.map(lambda _: bool(m), sub),
                                        tree, params))


class FusedAdamW:
    """The step's update (`update.step_update` of a `zerojax.adamw`) over flat shards, as the
    host update's shard_map runs it: each leaf one call of the fused pass. Whole (`__call__`,
    in place of `ShardedUpdate.__call__`) or for some params (`part`, Twin-Flow's host share
    in place of a part's program, update/parts.py)."""

    def __init__(self, spec: AdamWSpec, update):
        self.spec, self.how = spec, update.how
        logical = update.logical_params
        n = len(jax.tree.leaves(logical))
        if spec.mask is None:
            self.decay = [True] * n
        else:
            seen = []

            def read(params):  # as optax.masked reads it: a function of traced params
                mask = spec.mask(params) if callable(spec.mask) else spec.mask
                seen.append(_leafwise(mask, params))
                return 0

            try:
                jax.eval_shape(read, logical)
            except Exception as e:  # not a tree of bools: optax's program, which says so
                raise ValueError(f"its weight-decay mask is not a tree of bools of the params "
                                 f"({type(e).__name__}: {e})") from None
            self.decay = seen[0]
        # where optax.adamw's state keeps each thing, as indices into its leaves
        self.state_def = update.state_def
        adam, _, rate = jax.tree.unflatten(self.state_def, range(self.state_def.num_leaves))
        self.count, self.mu, self.nu = adam.count, jax.tree.leaves(adam.mu), jax.tree.leaves(
            adam.nu)
        self.rate = rate.count if callable(spec.learning_rate) else None

    def _rows(self, scalars, state):
        """(float32[13] of the pass for a decayed leaf, the same for one without decay, the
        new counts {state index: value}). `scalars`: (divisor, global norm, finite flag or
        None, loss); `state`: the optimizer state's leaves by index (the counts at least)."""
        s = self.spec
        denom, norm, finite, _ = scalars
        scale = grad_scale(denom, norm, self.how.clip_norm)  # the step's, as its program has it
        old = {self.count: state[self.count]}
        count = optax.safe_increment(old[self.count])
        # the reciprocals of optax.tree.bias_correction's 1 - decay**count, multiplied by as
        # XLA rewrites some programs' divide by a broadcast scalar (not every program's: the
        # numbers are optax's formula in another rounding, docs/stages.md)
        r1, r2 = 1 / (1 - s.b1 ** count), 1 / (1 - s.b2 ** count)
        new = {self.count: count}
        if self.rate is not None:  # scale_by_learning_rate's schedule: -1 * lr(count)
            old[self.rate] = state[self.rate]
            lr = jnp.asarray(-1 * s.learning_rate(old[self.rate]), jnp.float32)
            new[self.rate] = optax.safe_increment(old[self.rate])
        else:
            lr = jnp.float32(-1 * s.learning_rate)
        ok = jnp.ones((), jnp.bool_) if finite is None else finite
        if finite is not None:  # a skipped step leaves the counts as they were
            new = {j: jnp.where(ok, x, old[j]) for j, x in new.items()}
        f = jnp.float32
        row = lambda decay: jnp.stack([
            f(1 - s.b1), f(s.b1), f(1 - s.b2), f(s.b2), f(s.eps), f(s.eps_root),
            r1.astype(f), r2.astype(f), f(s.weight_decay), f(decay), lr,
            scale.astype(f), ok.astype(f)])
        return row(1.0), row(0.0), new

    def part(self, params, scalars, state, master, grads):
        """The update of the params `params` (indices): (their new master leaves, the new
        optimizer-state leaves they own and the counts {state index: value}, their
        compute-dtype shards). `state`: the state's leaves by index, theirs and the counts."""
        decayed, plain, new = self._rows(scalars, state)
        out = jnp.dtype(self.how.out_dtype)
        ps, shards = [], []
        for i, p, g in zip(params, master, grads, strict=True):
            f32 = jax.ShapeDtypeStruct(p.shape, jnp.float32)
            aliases = {1: 0, 2: 1, 3: 2} | ({4: 3} if g.dtype == out else {})
            call = jax.ffi.ffi_call(TARGET, (f32, f32, f32, jax.ShapeDtypeStruct(p.shape, out)),
                                    input_output_aliases=aliases)
            p, new[self.mu[i]], new[self.nu[i]], shard = call(
                decayed if self.decay[i] else plain, p, state[self.mu[i]], state[self.nu[i]], g)
            ps.append(p)
            shards.append(shard)
        return ps, new, shards

    def __call__(self, reduced, opt_state, master):
        """This device's (new master, new optimizer state, new compute-dtype shards), as
        `ShardedUpdate.__call__` gives them."""
        grads, *scalars = reduced
        leaves = jax.tree.leaves(opt_state)
        ps, new, shards = self.part(range(len(self.decay)), scalars, dict(enumerate(leaves)),
                                    jax.tree.leaves(master), jax.tree.leaves(grads))
        opt = jax.tree.unflatten(self.state_def, [new.get(j, x) for j, x in enumerate(leaves)])
        return jax.tree.unflatten(jax.tree.structure(master), ps), opt, shards


def for_update(optimizer, update) -> tuple[FusedAdamW | None, str]:
    """(the fused update of an offloaded engine's optimizer, or None with the reason)."""
    spec = spec_of(optimizer)
    if spec is None:
        return None, "the optimizer is not zerojax.adamw"
    ok, why = kernel()
    if not ok:
        return None, why
    try:
        return FusedAdamW(spec, update), ""
    except ValueError as e:
        return None, str(e)
