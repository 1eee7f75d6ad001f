"""The optimizer over the shards, with the numbers of single-device optax on logical params.

`ShardedUpdate` traces the step's update (unscale, clip, `optimizer.update`, apply, skip) once
on the logical shapes and runs that trace over each device's flat shards (interpret.py): what
is elementwise stays local and costs nothing new, a norm or any other reduction of a leaf is a
local segment reduction plus one fused all-reduce per round (program.py), and whole-matrix
work (Muon's Newton–Schulz, any matmul, transpose or sort of a leaf) runs on an owner device
per matrix (owners.py). Mask and label functions see logical leaves, as in plain optax. The
offload wing (zerojax/offload/) runs this update on the host's CPU devices, whole or as the
parts it splits into (parts.py); nothing here knows of it beyond `StepUpdate.out_dtype`.

Modules: reps.py (how a value lives on the devices; the flat layout's index arithmetic),
interpret.py (the planner: a jaxpr walked over reps), rules.py (the rule of each kind of data
primitive: elementwise, reductions, dot, reshape, broadcast), control.py (cond, scan, while),
program.py (ops, rounds, fused collectives), owners.py and evaluate.py (owner regions),
placement.py (which device owns which instance, balanced by FLOPs), exchange.py (a wave of
owner groups as ops), parts.py (the update as parts of disjoint leaves: which leaves the
optimizer ties together).

Optimizer state: a leaf that the update computes elementwise from the params or gradients is
stored like them (flat, padded, 1/N per device); other leaves (counts, hyperparameters,
factored statistics, keys) are replicated, unless they are large (`LARGE`), in which case they
are stored flat too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zerojax.errors import ConfigError
from zerojax.mesh import DATA, MODEL
from zerojax.partition import Layout
from zerojax.update.interpret import shard_jaxpr
from zerojax.update.owners import Owners
from zerojax.update.parts import PARTS, Grouping, Part, split
from zerojax.update.placement import loads
from zerojax.update.program import Program
from zerojax.update.reps import WHOLE, Flat, Phys, from_pieces, leaf_phys, pad_global

LARGE = 1 << 16  # elements: a replicated optimizer-state leaf this large is stored flat instead


def as_transformation(optimizer) -> optax.GradientTransformation:
    """The optax transformation an `Engine` runs; ConfigError for anything else."""
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    if callable(getattr(optimizer, "gradient_transformation", None)):  # optax.MultiSteps
        return optimizer.gradient_transformation()
    raise ConfigError(f"optimizer must be an optax.GradientTransformation (or optax.MultiSteps), "
                      f"got {type(optimizer).__name__}")


def takes_value(optimizer) -> bool:
    """Whether `update` takes extra arguments (the step passes `value=`, the global loss)."""
    return isinstance(optimizer, optax.GradientTransformationExtraArgs)


@dataclass(frozen=True)
class StepUpdate:
    """What the update does besides the optimizer: the step's static choices."""

    clip_norm: float | None
    out_dtype: Any  # the dtype the new master leaves leave in (offload), or None
    extra: bool  # pass value= (the global loss)


def grad_scale(denom, norm, clip_norm: float | None):
    """The one factor an offloaded update multiplies each summed gradient element by: the mean's
    `1 / denom`, and clipping's `clip_norm / norm` where the global norm exceeds it."""
    scale = 1 / denom
    if clip_norm is not None:
        c = jnp.float32(clip_norm)
        scale = jnp.where(norm < c, scale, scale / norm * c)
    return scale


def step_update(optimizer, how: StepUpdate, reduced, opt_state, master):
    """The optimizer step on logical params: (new master, new optimizer state, new master
    leaves as the refresh reads them).

    `reduced`: (summed gradients, their divisor, the global norm, the finite flag of dynamic
    loss scaling or None, the global loss)."""
    grads, denom, norm, finite, value = reduced

    def scaled(grads):  # traced where the update reads them: inside a skip's branch
        if how.out_dtype is not None:
            # Offloaded: one scale a gradient element, multiplied where it is read. XLA keeps
            # a divide's result in a buffer of its own when several fusions read it (the
            # moments', the master's): a float32 gradient beside the host state; so would a
            # gradient scaled outside the branch that reads it.
            scale = grad_scale(denom, norm, how.clip_norm)
            return jax.tree.map(lambda g: g.astype(jnp.float32) * scale, grads)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) / denom, grads)
        if how.clip_norm is not None:
            c = jnp.float32(how.clip_norm)
            # Same arithmetic as optax.clip_by_global_norm, on the true global norm.
            grads = jax.tree.map(lambda g: jnp.where(norm < c, g, g / norm * c), grads)
        return grads

    kw = {"value": value} if how.extra else {}

    def update(master, opt_state):
        updates, new_opt = optimizer.update(scaled(grads), opt_state, master, **kw)
        return optax.apply_updates(master, updates), new_opt

    keys = any(jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
               for x in jax.tree.leaves(opt_state))
    if finite is None:
        new_master, new_opt = update(master, opt_state)
    elif how.out_dtype is not None and not keys:
        # Offloaded, the host updates the state in place: a skipped step as a branch, since a
        # select between the new and the old state keeps a copy of each old moment alive.
        # (Not for a state holding a PRNG key: the sharded branch would move the key between
        # devices in collectives of its words, which the program does not do yet.)
        new_master, new_opt = jax.lax.cond(finite, update, lambda m, o: (m, o), master,
                                           opt_state)
    else:
        new_master, new_opt = update(master, opt_state)
        keep = lambda n, o: jax.tree.map(lambda a, b: jnp.where(finite, a, b), n, o)
        new_master, new_opt = keep(new_master, master), keep(new_opt, opt_state)
    leaves = jax.tree.leaves(new_master)
    if how.out_dtype is not None:
        # A buffer of its own even where the dtype is the master's: the copy that leaves host
        # memory must not be the master's own buffer.
        leaves = [m.astype(how.out_dtype) if m.dtype != how.out_dtype else jnp.copy(m)
                  for m in leaves]
    return new_master, new_opt, leaves


class ShardedUpdate:
    """`step_update` over the flat shards of `layout`, and the optimizer state's layout."""

    def __init__(self, optimizer, layout: Layout, how: StepUpdate, axis: str = DATA,
                 owners: bool = True):
        self.optimizer, self.layout, self.how, self.axis = optimizer, layout, how, axis
        self.owners = owners  # whole-matrix work on owner devices (False: on every device)
        self.shards = layout.shards
        self.phys = [leaf_phys(leaf, layout.shards) for leaf in layout.leaves]
        self.param_reps = [Flat(ph, leaf.shape) for ph, leaf in zip(self.phys, layout.leaves)]
        logical = layout.unflatten(jax.ShapeDtypeStruct(leaf.shape, jnp.float32)
                                   for leaf in layout.leaves)
        self.logical_params = logical
        try:
            self.logical_state = jax.eval_shape(optimizer.init, logical)
        except Exception as e:
            raise ConfigError(f"the optimizer's init failed on the model's params "
                              f"({type(e).__name__}: {e})") from None
        self.state_def = jax.tree.structure(self.logical_state)
        self._programs: dict = {}
        self._traced: dict = {}
        self._by_path = {tuple(path): rep for (path, _), rep in zip(
            jax.tree.flatten_with_path(logical)[0], self.param_reps)}
        self.state_reps = self._state_reps()
        self.sharded = [isinstance(r, Flat) for r in self.state_reps]  # stored like the params

    # ------------------------------------------------------------------ tracing and planning

    def _args(self, finite: bool, gdtypes):
        scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)
        grads = self.layout.unflatten(jax.ShapeDtypeStruct(leaf.shape, d)
                                      for leaf, d in zip(self.layout.leaves, gdtypes))
        reduced = (grads, scalar(jnp.float32), scalar(jnp.float32),
                   scalar(jnp.bool_) if finite else None, scalar(jnp.float32))
        return reduced, self.logical_state, self.logical_params

    def _trace(self, finite: bool, gdtypes):
        key = (finite, tuple(jnp.dtype(d) for d in gdtypes))
        if key not in self._traced:
            self._traced[key] = self._trace_new(finite, gdtypes)
        return self._traced[key]

    def _trace_new(self, finite: bool, gdtypes):
        args = self._args(finite, gdtypes)
        fn = lambda *a: step_update(self.optimizer, self.how, *a)
        try:
            closed = jax.make_jaxpr(fn)(*args)
        except (TypeError, ValueError) as e:  # optax says so in either (sophia: ValueError)
            if "value_fn" in str(e) or "obj_fn" in str(e) or (
                    isinstance(e, TypeError) and "grad" in str(e)):
                raise ConfigError(f"this optimizer needs the loss function itself ({e}); the "
                                  f"engine passes value= (the global loss) only: use another "
                                  f"optimizer") from None
            raise
        return closed, jax.tree.structure(args)

    def _in_reps(self, state_reps, finite: bool) -> list:
        n = len(self.param_reps)
        reduced = [*self.param_reps, WHOLE, WHOLE, *([WHOLE] if finite else []), WHOLE]
        assert len(reduced) == n + 3 + finite
        return [*reduced, *state_reps, *self.param_reps]

    def _out_reps(self, state_reps) -> list:
        return [*self.param_reps, *state_reps, *self.param_reps]

    def _state_reps(self) -> list:
        """Per optimizer-state leaf: Flat (stored like the params) or WHOLE (replicated), the
        fixed point of what the update gives for it, starting from the leaves that sit where
        a param sits in a copy of the params tree (moments, copies of the initial params)."""
        closed, _ = self._trace(False, [jnp.float32] * len(self.param_reps))
        paths_avals = jax.tree.flatten_with_path(self.logical_state)[0]
        reps = [self._param_like(path, aval) for path, aval in paths_avals]
        n = len(self.param_reps)
        for _ in range(8):
            _, natural, _ = shard_jaxpr(closed, self._in_reps(reps, False), None,
                                        shards=self.shards, axis=self.axis)
            new = []
            for (_, aval), old, r in zip(paths_avals, reps, natural[n: n + len(reps)]):
                if isinstance(old, Flat):
                    new.append(old)  # any other rep converts to it locally
                elif isinstance(r, Flat):
                    new.append(r)
                elif math.prod(aval.shape) >= LARGE and self.shards > 1:
                    new.append(Flat(Phys(None, math.prod(aval.shape), self.shards),
                                    tuple(aval.shape)))
                else:
                    new.append(WHOLE)
            if new == reps:
                return reps
            reps = new
        return reps

    def _param_like(self, path, aval):
        """The param rep of a state leaf whose path ends with that param's path and whose shape
        is the param's; WHOLE otherwise."""
        for i in range(len(path)):
            rep = self._by_path.get(tuple(path[i:]))
            if rep is not None and tuple(aval.shape) == rep.shape:
                return rep
        return WHOLE

    def param_like(self, logical_state):
        """`logical_state` with only the leaves that sit where a param sits (moments, copies
        of the params); the others (counts, scalars, a best-so-far value) are None."""
        return jax.tree_util.tree_map_with_path(
            lambda path, x: None if self._param_like(path, x) is WHOLE else x, logical_state)

    def program(self, finite: bool, gdtypes=None) -> tuple[Program, Any, Any]:
        """The planned update for these gradient dtypes (default float32)."""
        gdtypes = tuple(jnp.dtype(d) for d in (gdtypes or [jnp.float32] * len(self.param_reps)))
        key = (finite, gdtypes)
        if key not in self._programs:
            closed, treedef = self._trace(finite, gdtypes)
            prog, _, planner = shard_jaxpr(
                closed, self._in_reps(self.state_reps, finite), self._out_reps(self.state_reps),
                shards=self.shards, axis=self.axis,
                hooks=Owners(self.layout.model) if self.shards > 1 and self.owners else None)
            self._programs[key] = (prog, treedef, planner)
        return self._programs[key]

    def grouping(self, finite: bool = False, gdtypes=None) -> Grouping:
        """The params in the finest groups the update allows (parts.py), made once a trace."""
        gdtypes = tuple(jnp.dtype(d) for d in (gdtypes or [jnp.float32] * len(self.param_reps)))
        key = ("grouping", finite, gdtypes)
        if key not in self._programs:
            closed, _ = self._trace(finite, gdtypes)
            n = len(self.param_reps)
            s = len(self._in_reps(self.state_reps, finite)) - len(self.state_reps) - 2 * n
            self._programs[key] = Grouping.of(closed, n, s, self.sharded)
        return self._programs[key]

    def parts(self, finite: bool, gdtypes, device: frozenset[int] = frozenset(),
              host_parts: int | None = None) -> list[tuple[Part, Program]]:
        """The update as parts that read and write disjoint leaves (parts.py), each planned
        over the shards: one part where the optimizer ties every leaf to every other; with
        `device` (Twin-Flow), first the part of those params; `host_parts`: the others in at
        most that many parts (default parts.PARTS)."""
        gdtypes = tuple(jnp.dtype(d) for d in gdtypes)
        key = ("parts", finite, gdtypes, device, host_parts)
        if key not in self._programs:
            closed, _ = self._trace(finite, gdtypes)
            sizes = [math.prod(leaf.shape) for leaf in self.layout.leaves]
            ins = self._in_reps(self.state_reps, finite)
            outs = self._out_reps(self.state_reps)
            hooks = lambda: Owners(self.layout.model) if self.shards > 1 and self.owners else None
            self._programs[key] = [
                (part, shard_jaxpr(part.closed, [ins[i] for i in part.inputs],
                                   [outs[o] for o in part.outputs], shards=self.shards,
                                   axis=self.axis, hooks=hooks())[0])
                for part in split(closed, self.grouping(finite, gdtypes), sizes,
                                  host_parts or PARTS, device=device)]
        return self._programs[key]

    # ------------------------------------------------------------------ the step

    def __call__(self, reduced, opt_state, master):
        """Inside the step's shard_map (or, offloaded, the host update's): this device's (new
        master, new optimizer state, new master leaves). `reduced` as `step_update` takes it,
        over flat shards."""
        finite = reduced[3] is not None
        prog, _, _ = self.program(finite, [g.dtype for g in jax.tree.leaves(reduced[0])])
        outs = prog(*jax.tree.leaves((reduced, opt_state, master)))
        n, m = len(self.param_reps), len(self.state_reps)
        master_out = self.layout.unflatten(outs[:n])
        opt_out = jax.tree.unflatten(self.state_def, outs[n:n + m])
        return master_out, opt_out, list(outs[n + m:])

    # ------------------------------------------------------------------ the state's layout

    def specs(self):
        """PartitionSpecs of the stored optimizer state."""
        def spec(rep):
            if not isinstance(rep, Flat):
                return P()
            dims = [None] * (rep.phys.lead is not None) + [MODEL] * (rep.phys.pieces > 1)
            return P(*dims, None if self.layout.replicated else self.axis)
        return jax.tree.unflatten(self.state_def, [spec(r) for r in self.state_reps])

    def abstract(self):
        """The stored optimizer state as ShapeDtypeStructs (global shapes)."""
        avals = jax.tree.leaves(self.logical_state)
        return jax.tree.unflatten(self.state_def, [
            jax.ShapeDtypeStruct(r.phys.global_shape if isinstance(r, Flat) else a.shape, a.dtype)
            for a, r in zip(avals, self.state_reps)])

    def stored(self, logical_state):
        """Logical optimizer state -> the stored layout (global view, inside jit)."""
        leaves = self.state_def.flatten_up_to(logical_state)
        return jax.tree.unflatten(self.state_def, [
            pad_global(x, r.phys) if isinstance(r, Flat) else x
            for x, r in zip(leaves, self.state_reps)])

    def logical(self, stored_state):
        """The stored optimizer state -> logical shapes (global view, inside jit)."""
        leaves = self.state_def.flatten_up_to(stored_state)
        return jax.tree.unflatten(self.state_def, [
            jnp.reshape(from_pieces(x[..., :r.phys.piece], r.phys), r.shape)
            if isinstance(r, Flat) else x
            for x, r in zip(leaves, self.state_reps)])

    def init(self, params):
        """The stored initial optimizer state of logical `params` (inside jit)."""
        return self.stored(self.optimizer.init(params))

    def report(self, finite: bool = False) -> dict:
        """What the update adds to a step: per round, its fused collectives (kind, dtype,
        elements per device); the owner groups of whole-matrix work (the wave they run in,
        instances, slots per owner, instances each device owns, split by layer, estimated
        FLOPs of one instance) and their estimated FLOPs (`total`, per device, and `busiest`:
        what the per-device program runs, each wave's busiest device); the primitives that
        assembled a leaf on every device; how many state leaves are sharded and how many
        replicated."""
        prog, _, planner = self.program(finite)
        rounds = []
        for _, comms in prog.rounds:
            fused: dict = {}
            for op in comms:
                aval = planner.aval[op.ins[0]]
                key = (op.kind, str(aval.dtype))
                fused[key] = fused.get(key, 0) + math.prod(aval.shape)
            if fused:
                rounds.append([{"kind": k, "dtype": d, "elements": n}
                               for (k, d), n in fused.items()])
        groups = planner.hooks.groups if planner.hooks is not None else []
        waves: dict[int, list] = {}
        for w, pl, _ in groups:
            waves.setdefault(w, []).append(pl)
        # per device: over data, or over data x model (device d·M + j) with a model axis
        per_wave = [loads(pls, len(pls[0].slots)) for pls in waves.values()]
        return {"rounds": rounds, "owner_groups": [
                    {"wave": w, "instances": pl.instances, "per_owner": pl.per_owner,
                     "owned": [len(s) for s in pl.slots], "by_layer": lay, "flops": pl.flops}
                    for w, pl, lay in groups],
                "owner_flops": {"total": sum(map(sum, per_wave)),
                                "devices": [sum(col) for col in zip(*per_wave)],
                                "busiest": sum(map(max, per_wave))},
                "assembled": sorted(set(planner.whole_ops + prog.whole_ops)),
                "control_flow_with_collectives": len(prog.syncs),
                "state": {"sharded": sum(self.sharded),
                          "replicated": len(self.sharded) - sum(self.sharded)}}


__all__ = ["ShardedUpdate", "StepUpdate", "as_transformation", "grad_scale", "step_update",
           "takes_value"]
