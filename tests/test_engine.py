"""Accumulation, hybrid meshes, reduction dtype, optimizer structure, evaluation vs optax."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    ATOL,
    CLIP,
    GLOBAL_BATCH,
    RTOL,
    STEPS,
    VARIANTS,
    adamw,
    assert_tree_close,
    check_parity,
    engine_run,
    gpt_batch,
    reference,
    reference_run,
    sweep,
    tiny_gpt,
)
from jax.sharding import PartitionSpec as P

import zerojax as zj


@pytest.mark.parametrize("variant", sweep(VARIANTS, quick=[]))
def test_grad_accum_matches_one_big_batch(variant):
    cfg = zj.ZeroConfig(grad_accum=4, clip_norm=CLIP, **VARIANTS[variant])
    # The parity batch (24: micro-batches of 3 a device), whose optax reference the other
    # parity tests of this file already ran.
    check_parity(zj.Engine(tiny_gpt(), adamw(), zj.make_mesh(data=2), cfg))


# Also evaluate at stages 1 and 3, on the trained state (the engines' step and init programs
# are the ones compiled for parity); quick: test_scripts.py's evaluate on any batch, at stage
# 3 on a model axis.
@pytest.mark.parametrize("variant", sweep(VARIANTS, quick=[]))
def test_hybrid_mesh_2x4(variant):
    cfg = zj.ZeroConfig(clip_norm=CLIP, **VARIANTS[variant])
    engine = zj.Engine(tiny_gpt(), adamw(), zj.make_mesh(data=4, replica=2), cfg)
    check_parity(engine)
    if variant in ("1", "3"):  # stages 0 and 2 evaluate as stage 1 does
        check_evaluate(engine, check_parity.state)


def check_evaluate(engine, state):
    """`engine.evaluate` on a batch it never trained on: the mean loss plain jax computes from
    `engine.params(state)` (evaluate's own program: the batch over replica x data)."""
    from zerojax.units import PlainUnits

    model = engine.model
    batch = gpt_batch(model.cfg, 8, 99)
    want = float(jax.jit(model.loss, static_argnums=2)(engine.params(state), batch, PlainUnits()))
    np.testing.assert_allclose(float(engine.evaluate(state, batch)["loss"]), want, rtol=1e-6)


@pytest.mark.parametrize("stage", sweep([2, 3], quick=[3]))
def test_fp32_reduction_of_bf16_grads(stage):
    """reduce_dtype=float32 changes the reduction, not the result beyond bf16 noise."""
    model = tiny_gpt()
    batches, (ref_losses, _), _ = reference(GLOBAL_BATCH)
    cfg = zj.ZeroConfig(stage=stage, param_dtype="bfloat16", reduce_dtype="float32",
                        clip_norm=CLIP)
    losses, _, _ = engine_run(zj.Engine(model, adamw(), zj.make_mesh(data=4), cfg), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)


def _masked(params):
    """AdamW with weight decay on matrices only (a per-leaf pytree mask)."""
    mask = jax.tree_util.tree_map_with_path(
        lambda p, x: len(x.shape) - ("blocks" in jax.tree_util.keystr(p)) >= 2, params)
    return optax.adamw(3e-3, weight_decay=0.5, eps=1e-6, mask=mask)  # eps: see helpers.adamw


def _partitioned(params):
    """optax.multi_transform with per-leaf labels: Adam on blocks, SGD elsewhere."""
    labels = {k: jax.tree.map(lambda _, k=k: "adam" if k == "blocks" else "sgd", v)
              for k, v in params.items()}
    return optax.multi_transform({"adam": adamw(), "sgd": optax.sgd(0.1, momentum=0.9)}, labels)


@pytest.mark.parametrize("make_opt, stage, n", sweep([(_masked, 1, 4), (_partitioned, 3, 3)],
                                                        quick=[]))
def test_per_leaf_optimizers_on_shards(make_opt, stage, n):
    """Masks and partitions given as pytrees act on shards as on the unsharded params."""
    model = tiny_gpt()
    opt = make_opt(jax.eval_shape(model.init, jax.random.key(0)))
    batches = [gpt_batch(model.cfg, GLOBAL_BATCH, s) for s in range(STEPS)]
    ref_losses, ref_params = reference_run(model, opt, batches, clip=None)
    eng = zj.Engine(model, opt, zj.make_mesh(data=n), zj.ZeroConfig(stage=stage))
    losses, p, _ = engine_run(eng, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_tree_close(p, ref_params, rtol=RTOL, atol=ATOL)


def test_padding_exists_where_parity_is_checked():
    """At N = 3 the test GPT's leaves are padded, so parity there exercises padding."""
    model = tiny_gpt()
    eng = zj.Engine(model, adamw(), zj.make_mesh(data=3), zj.ZeroConfig(stage=3))
    eng._discover(jax.eval_shape(model.init, jax.random.key(0)), gpt_batch(model.cfg, 6, 0))
    layout = eng.layout
    assert any(leaf.size % 3 for leaf in layout.leaves)
    assert layout.padded_params > layout.num_params
    params = jax.jit(model.init)(jax.random.key(1))  # jitted: one program each, not op by op
    flat = jax.jit(layout.to_flat)(params)
    assert all(float(np.abs(np.asarray(x)[..., leaf.size:]).sum()) == 0.0  # zero padding
               for x, leaf in zip(jax.tree.leaves(flat), layout.leaves))
    jax.tree.map(np.testing.assert_array_equal, jax.jit(layout.from_flat)(flat), params)


class ScanAndGather:
    """A stack that units.scan consumes, and two leaves units.gather consumes, one of them
    3-D like a stack (a gathered leaf is one unit whatever its rank)."""

    def init(self, rng):
        k = jax.random.split(rng, 3)
        return {"stack": jax.random.normal(k[0], (4, 3, 3)),
                "cube": jax.random.normal(k[1], (2, 3, 3)), "w": jax.random.normal(k[2], (3, 1))}

    def loss(self, params, batch, units):
        h = units.scan(lambda h, s: jnp.tanh(h @ s), batch["x"], params["stack"])
        p = units.gather({"cube": params["cube"], "w": params["w"]})
        return jnp.mean(jnp.square(h @ p["cube"][0] @ p["cube"][1] @ p["w"] - batch["y"]))


def test_scanned_leaves_keep_their_layer_axis_and_gathered_ones_are_one_unit():
    """The engine learns from the loss which leaves are scanned: those are stored `[L, N·k]`
    over P(None, "data"), row l holding layer l's elements (zero-padded); a gathered leaf is
    stored `[N·k]` over P("data"), its elements in order, whatever its rank. N = 4: a layer
    of 9 elements takes k = 3, the 18-element cube k = 5, the 3-element w k = 1."""
    model = ScanAndGather()
    params = model.init(jax.random.key(1))
    batch = {"x": np.ones((4, 3), np.float32), "y": np.ones((4, 1), np.float32)}
    eng = zj.Engine(model, optax.sgd(0.1), zj.make_mesh(data=4), zj.ZeroConfig(stage=1))
    eng._discover(jax.eval_shape(model.init, jax.random.key(0)), batch)  # what init does
    assert {leaf.path: leaf.stacked for leaf in eng.layout.leaves} == {
        "['cube']": False, "['stack']": True, "['w']": False}
    stored = eng.abstract_state().master
    assert {k: (v.shape, v.sharding.spec) for k, v in stored.items()} == {
        "stack": ((4, 12), P(None, "data")), "cube": ((20,), P("data")), "w": ((4,), P("data"))}
    master = eng.layout.to_flat(params)
    stack = np.asarray(master["stack"])
    for layer in range(4):
        np.testing.assert_array_equal(stack[layer, :9], np.asarray(params["stack"][layer]).ravel())
        assert not stack[layer, 9:].any()
    np.testing.assert_array_equal(np.asarray(master["cube"])[:18],
                                  np.asarray(params["cube"]).ravel())
    assert not np.asarray(master["cube"])[18:].any()


class TwoStacks:
    """Two scanned stacks of different depths (2 and 3 layers) and one gathered unit of two
    leaves; every size is odd, so N = 3 pads every leaf."""

    def init(self, rng):
        k = jax.random.split(rng, 4)
        return {"io": {"inp": jax.random.normal(k[0], (5, 7)) * 0.5,
                       "out": jax.random.normal(k[1], (7, 1)) * 0.5},
                "enc": {"w": jax.random.normal(k[2], (2, 7, 7)) * 0.3, "b": jnp.zeros((2, 7))},
                "dec": {"w": jax.random.normal(k[3], (3, 7, 7)) * 0.3, "g": jnp.ones((3, 7))}}

    def loss(self, params, batch, units):
        io = units.gather(params["io"])
        h = batch["x"] @ io["inp"]
        h = units.scan(lambda h, p: jnp.tanh(h @ p["w"] + p["b"][None]), h, params["enc"])
        h = units.scan(lambda h, p: jnp.tanh(h @ p["w"]) * p["g"][None], h, params["dec"])
        return jnp.mean(jnp.square(h @ io["out"] - batch["y"]))


@functools.cache
def two_stacks_reference():
    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(GLOBAL_BATCH, 5)).astype(np.float32),
                "y": rng.normal(size=(GLOBAL_BATCH, 1)).astype(np.float32)} for _ in range(STEPS)]
    return batches, *reference_run(TwoStacks(), adamw(), batches)


@pytest.mark.parametrize("variant", sweep(VARIANTS, quick=["3"]))
def test_stacks_of_different_depths(variant):
    """Units of several leaves and stacks of unequal depth (each gathered, reduce-scattered
    and refreshed as its own bucket) train as single-device optax does."""
    batches, ref_losses, ref_params = two_stacks_reference()
    cfg = zj.ZeroConfig(clip_norm=CLIP, **VARIANTS[variant])
    engine = zj.Engine(TwoStacks(), adamw(), zj.make_mesh(data=3), cfg)
    losses, params, _ = engine_run(engine, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_tree_close(params, ref_params, rtol=RTOL, atol=ATOL)
    assert losses[-1] < losses[0]


def test_a_second_init_keeps_the_plan_and_programs_bitwise():
    """An engine initialized again on the units it has keeps its plan and its programs (its
    init, step and evaluation trace nothing again): its states, losses and params are
    bitwise those of its first init and of a fresh engine's, from `init` and from
    `init_from`. Other units make a plan of their own."""
    model = ScanAndGather()
    r = np.random.default_rng(0)
    batches = [{"x": r.normal(size=(8, 3)).astype(np.float32),
                "y": r.normal(size=(8, 1)).astype(np.float32)} for _ in range(2)]
    make = lambda: zj.Engine(model, adamw(), zj.make_mesh(data=4),  # noqa: E731
                             zj.ZeroConfig(stage=3, clip_norm=CLIP))

    def run(eng, init):
        states, losses = [init(eng)], []
        for b in batches:
            state, m = eng.step(jax.tree.map(jnp.copy, states[-1]), b)
            states.append(state)
            losses.append(m["loss"])
        evals = eng.evaluate(states[-1], batches[0])
        host = lambda t: [np.asarray(jax.random.key_data(x) if jnp.issubdtype(  # noqa: E731
            x.dtype, jax.dtypes.prng_key) else x) for x in jax.tree.leaves(t)]
        return [host(s) for s in states], host(losses), host(eng.params(states[-1])), host(evals)

    def bitwise(a, b):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(np.atleast_1d(x).view(np.uint8),
                                          np.atleast_1d(y).view(np.uint8))

    eng = make()
    first = run(eng, lambda e: e.init(jax.random.key(0), batches[0]))
    plan, programs = eng.plan, dict(eng._jit_cache)
    traced = {name: f._cache_size() for name, (_, f) in programs.items()}
    assert {"init", "step", "evaluate", "params"} <= set(programs)
    bitwise(run(eng, lambda e: e.init(jax.random.key(0), batches[0])), first)
    assert eng.plan is plan and all(eng._jit_cache[k][1] is f for k, (_, f) in programs.items())
    assert {name: f._cache_size() for name, (_, f) in programs.items()} == traced
    bitwise(run(make(), lambda e: e.init(jax.random.key(0), batches[0])), first)
    # init_from on the same units: the same plan, its own program made once
    tree = jax.tree.unflatten(jax.tree.structure(jax.eval_shape(model.init, jax.random.key(0))),
                              first[2])  # the trained params
    from_params = run(eng, lambda e: e.init_from(tree, batches[0]))
    assert eng.plan is plan
    bitwise(run(eng, lambda e: e.init_from(tree, batches[0])), from_params)
    bitwise(run(make(), lambda e: e.init_from(tree, batches[0])), from_params)
    # other units (the stack taken as one gathered leaf): a plan and programs of their own
    leaves = tuple(dataclasses.replace(leaf, stacked=False) for leaf in eng.layout.leaves)
    assert leaves != eng.layout.leaves
    eng.set_units(leaves, eng.layout.treedef)
    assert eng.plan is not plan and not any(leaf.stacked for leaf in eng.layout.leaves)
    assert eng._compiled_step() is not programs["step"][1]
