"""float16 dynamic loss scaling: a non-finite step is skipped everywhere alike; bf16 runs."""

import functools

import jax
import numpy as np
import optax
import pytest
from helpers import CLIP, adamw, engine_run, reference, sweep, tiny_gpt
from test_state import BATCHES, Norm

import zerojax as zj
from zerojax.models import SeedMLP

BATCH = {"x": np.array([[1.0, 3.0], [2.0, 1.0]], np.float32),
         "y": np.array([5.0, 7.0], np.float32)}


def seed_engine(stage, **cfg):
    opt = optax.adam(0.1, b1=0.9, b2=0.999, eps=1e-8)
    return zj.Engine(SeedMLP(), opt, zj.make_mesh(data=2),
                     zj.ZeroConfig(stage=stage, param_dtype="float16", **cfg))


@pytest.mark.parametrize("stage", sweep([0, 1, 2, 3], quick=[1, 3]))
def test_overflowing_steps_are_skipped_then_training_resumes(stage):
    # The seed's float16 backward overflows (max 65504) at 2**17 until the scale has halved
    # down to 2**13, on 2 devices as on one: each device differentiates its share of the
    # global mean, so every row's gradient is the scale / 2 there too (dividing after the
    # reduction, the 2 devices' rows had twice that, and skipped once more, down to 2**12).
    engine = seed_engine(stage, loss_scale_init=2.0**17, loss_scale_interval=1000)
    state = engine.init(jax.random.key(0), BATCH)
    before = jax.tree.map(np.asarray, (engine.params(state), state.opt_state))
    scales, skipped = [], []
    for _ in range(6):
        state, m = engine.step(state, BATCH)
        scales.append(float(m["loss_scale"]))
        skipped.append(int(m["skipped"]))
        if not skipped[-1]:
            break
        after = jax.tree.map(np.asarray, (engine.params(state), state.opt_state))
        jax.tree.map(np.testing.assert_array_equal, after, before)  # nothing moved
    assert skipped == [1, 1, 1, 1, 0]
    assert scales == [2.0**16, 2.0**15, 2.0**14, 2.0**13, 2.0**13]
    # The first finite step is the seed's first Adam step.
    np.testing.assert_allclose(SeedMLP.flat(engine.params(state)), [2.1, -2.9, 1.1, 0.6],
                               rtol=5e-6)


def test_scale_grows_after_the_interval():
    engine = seed_engine(1, loss_scale_init=4.0, loss_scale_interval=2)
    state = engine.init(jax.random.key(0), BATCH)
    scales = []
    for _ in range(5):
        state, m = engine.step(state, BATCH)
        scales.append(float(m["loss_scale"]))
        assert int(m["skipped"]) == 0
    assert scales == [4.0, 8.0, 8.0, 16.0, 16.0]


@pytest.mark.parametrize("stage", sweep([1, 3], quick=[3]))
def test_bfloat16_training_tracks_fp32_reference(stage):
    model = tiny_gpt()
    batches, (ref_losses, _), _ = reference(8, steps=10)
    cfg = zj.ZeroConfig(stage=stage, param_dtype="bfloat16", clip_norm=CLIP)
    losses, _, state = engine_run(zj.Engine(model, adamw(), zj.make_mesh(data=4), cfg), batches)
    assert jax.tree.leaves(state.compute)[0].dtype == np.dtype("bfloat16")
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
    assert losses[-1] < losses[0] - 0.1


def fp16_run(engine, batches):
    """A float16 engine's run over `batches` from init: (skipped, loss scales, losses, grad
    norms) of each step."""
    state = engine.init(jax.random.key(0), batches[0])
    out = ([], [], [], [])
    for b in batches:
        state, m = engine.step(state, b)
        for o, k in zip(out, ("skipped", "loss_scale", "loss", "grad_norm")):
            o.append(float(m[k]))
    return out


@functools.cache
def _norm_fp16_run(n: int):
    """BatchNorm (global-batch statistics) in float16 from the scale 2**18 on data=n, stage 3,
    12 steps."""
    mesh = zj.make_mesh(data=n, devices=jax.devices()[:n])
    return fp16_run(zj.Engine(Norm(zj.batch_axes(mesh)), optax.adam(1e-2), mesh, zj.ZeroConfig(
        stage=3, param_dtype="float16", loss_scale_init=2.0**18)), BATCHES * 2)


@pytest.mark.parametrize("n", sweep([2, 4, 8], quick=[8]))
def test_float16_skips_the_steps_one_device_skips_on_any_device_count(n):
    """Each device differentiates its share of the global mean, so a row's gradient is the
    same on any mesh and a float16 backward overflows where one device's does: the same steps
    skipped, the same loss scales. (Dividing after the reduction, each doubling of the devices
    doubled every row's gradient and skipped once more: 3, 4, 5 and 6 of these 12 steps on 1,
    2, 4 and 8 devices.)"""
    skipped, scales, losses, _ = _norm_fp16_run(n)
    one = _norm_fp16_run(1)
    assert 0 < sum(skipped) < 6 and skipped == one[0]
    assert scales == one[1]
    np.testing.assert_allclose(losses, one[2], rtol=2e-4)  # 7e-5 measured at 8


def _seed_fp16_run(mesh, **cfg):
    """The seed MLP on its batch tiled to 8 rows, float16 from the scale 2**17, 6 steps."""
    batch = jax.tree.map(lambda x: np.concatenate([x] * 4), BATCH)
    return fp16_run(zj.Engine(SeedMLP(), optax.adam(0.1, eps=1e-8), mesh, zj.ZeroConfig(
        param_dtype="float16", loss_scale_init=2.0**17, loss_scale_interval=1000, **cfg)),
        [batch] * 6)


@pytest.mark.parametrize("case", sweep(["offload, delayed, accumulation", "per-unit arrival"],
                                       quick=["per-unit arrival"]))
def test_float16_skips_as_one_device_where_offload_and_accumulation_meet(case):
    """The pre-division meets replica × data and micro-batches (stage 1, offload, the delayed
    update, grad_accum 2 on replica 2 × data 2) and the gradient's per-unit arrival in host
    memory, whose sums of squares divide by the same scale (stage 3 on 4 devices, offload):
    one device's skips, scales and, on the steps taken, loss and global norm (one device with
    the same delay: a step after a taken one runs on the params before its update)."""
    one_device = zj.make_mesh(data=1, devices=jax.devices()[:1])
    if case == "per-unit arrival":
        one = _seed_fp16_run(one_device, stage=0)
        run = _seed_fp16_run(zj.make_mesh(data=4, devices=jax.devices()[:4]), stage=3,
                             offload="optimizer")
    else:
        delayed = dict(offload="optimizer", delayed_update=1)
        one = _seed_fp16_run(one_device, stage=1, **delayed)
        run = _seed_fp16_run(zj.make_mesh(replica=2, data=2, devices=jax.devices()[:4]),
                             stage=1, grad_accum=2, **delayed)
    assert 0 < sum(one[0]) < 6 and run[0] == one[0] and run[1] == one[1]
    taken = [i for i, s in enumerate(one[0]) if not s]
    np.testing.assert_allclose([run[2][i] for i in taken], [one[2][i] for i in taken], rtol=1e-3)
    np.testing.assert_allclose([run[3][i] for i in taken], [one[3][i] for i in taken], rtol=1e-3)
