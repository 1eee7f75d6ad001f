"""The delayed parameter update (`ZeroConfig(offload="optimizer", delayed_update=K)`) against
a single-device optax loop with the same one-step delay (zerojax/delayed.py states the
recurrence)."""

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import CLIP, adamw, assert_tree_close, engine_run, fused_adamw, gpt_batch, moved_error
from test_model_axis import gpt
from test_precision import BATCH as SEED_BATCH
from test_state import BATCHES, Norm, assert_bitwise

import zerojax as zj
from zerojax.models import SeedMLP
from zerojax.units import PlainUnits

# K = 2 and 4 steps: one ordinary step, then three delayed ones, two of which apply the update
# the step before left pending (and engine.params applies the last).
STEPS = 4


def delayed_reference(model, tx, batches, k, rng=0, **units):
    """Single-device optax where step t >= k differentiates at the params before the previous
    step's update: (losses, grad norms, final params with every update applied, model state).
    `units`: PlainUnits' options (a compute dtype)."""
    params = jax.jit(model.init)(jax.random.key(rng))
    state = tx.init(params)
    ms = model.init_state(None) if hasattr(model, "init_state") else None

    @jax.jit
    def step(params, ran_on, state, ms, batch):
        def f(p):
            u = PlainUnits(state=ms, **units)
            return model.loss(p, batch, u).astype(jnp.float32), u.state

        (loss, ms), g = jax.value_and_grad(f, has_aux=True)(ran_on)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state, ms, loss, optax.tree.norm(g)

    before, losses, norms = params, [], []  # before: the params before the last update
    for t, b in enumerate(batches):
        new, state, ms, loss, norm = step(params, params if t < k else before, state, ms, b)
        before, params = params, new
        losses.append(float(loss))
        norms.append(float(norm))
    return np.array(losses), np.array(norms), params, ms


def check_delayed(model, optimizer, batches, mesh, k=2, clip=CLIP, ref_model=None, **cfg):
    """The engine's run against `delayed_reference` (of `ref_model`, default `model`):
    (engine, final state, params' error relative to the reference's move)."""
    tx = optax.chain(optax.clip_by_global_norm(clip), optimizer) if clip else optimizer
    ref_losses, ref_norms, ref_params, ref_ms = delayed_reference(ref_model or model, tx,
                                                                  batches, k)
    eng = zj.Engine(model, optimizer, mesh, zj.ZeroConfig(
        offload="optimizer", delayed_update=k, clip_norm=clip, **cfg))
    losses, params, state = engine_run(eng, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(engine_run.norms, ref_norms, rtol=1e-4)
    err = moved_error(params, ref_params, jax.jit(model.init)(jax.random.key(0)))
    assert err <= 1e-5, f"params off by {err:.3g} of the reference's move"
    if ref_ms is not None:
        assert_tree_close(eng.model_state(state), ref_ms, rtol=1e-5, atol=1e-6)
    return eng, state, err


# Every GPT run uses test_model_axis.gpt: the test preset's shape with 4 heads (whole heads
# on each of 2 model devices), so one reference program serves every mesh.
@functools.cache
def gpt_reference(k: int):
    """`delayed_reference` of `gpt()` with AdamW, clipping and `gpt_batches()`, once per K."""
    tx = optax.chain(optax.clip_by_global_norm(CLIP), adamw())
    return delayed_reference(gpt(), tx, gpt_batches(), k)


def gpt_batches(steps=STEPS, batch=8):
    return [gpt_batch(gpt().cfg, batch, s) for s in range(steps)]


def test_delayed_update_with_model_state_matches_the_delayed_loop():
    """The quick tier's point: stage 3 on 4 devices, K = 2, clipping, BatchNorm statistics."""
    mesh = zj.make_mesh(data=4)
    check_delayed(Norm(zj.batch_axes(mesh)), optax.adam(1e-2, eps=1e-6), BATCHES[:STEPS], mesh,
                  k=2, clip=1.0, ref_model=Norm(), stage=3)


def test_float16_delay_with_sgd_on_replicas_and_micro_batches():
    """The quick tier's float16 point of the delay, with a scale-sensitive optimizer (SGD: a
    pending gradient left times the loss scale moves it 2**13 times too far, where Adam's
    update would not change), on replica 2 × data 2 with 2 micro-batches (the loss
    pre-division over all three) at stage 1, from the scale 2**17: the seed's float16 backward
    overflows as on one device, until 2**13 (four skips), each overflowed step waiting as
    pending with `ok` False and the params untouched; then the single-device optax loop with
    the same delay from the untouched params, and `evaluate` reads the params with the pending
    update applied, not the lagging ones the next step runs on."""
    mesh = zj.make_mesh(replica=2, data=2, devices=jax.devices()[:4])
    batch = jax.tree.map(lambda x: np.concatenate([x] * 4), SEED_BATCH)
    eng = zj.Engine(SeedMLP(), optax.sgd(0.01), mesh, zj.ZeroConfig(
        stage=1, param_dtype="float16", loss_scale_init=2.0**17, loss_scale_interval=1000,
        grad_accum=2, offload="optimizer", delayed_update=1))
    state = eng.init(jax.random.key(0), batch)
    start, losses, skipped = eng.params(state), [], []
    for _ in range(8):
        state, m = eng.step(state, batch)
        losses.append(float(m["loss"]))
        skipped.append(int(m["skipped"]))
        if skipped[-1]:
            assert not bool(state.pending.ok)
            assert not all(np.isfinite(np.asarray(g)).all()
                           for g in jax.tree.leaves(state.pending.grads))
            assert_bitwise(eng.params(state), start)
    assert skipped == [1] * 4 + [0] * 4 and float(m["loss_scale"]) == 2.0**13
    ref_losses, _, ref_params, _ = delayed_reference(SeedMLP(), optax.sgd(0.01), [batch] * 4, 1,
                                                     dtype=jnp.float16)
    np.testing.assert_allclose(losses[4:], ref_losses, rtol=2e-3)
    err = moved_error(eng.params(state), ref_params, start)
    assert err <= 5e-3, f"params off by {err:.3g} of the reference's move"
    assert bool(state.pending.ok)
    applied, lagging = (jax.jit(lambda p: SeedMLP().loss(p, batch, PlainUnits(jnp.float16)))(p)
                        for p in (eng.params(state), eng._delay.lagging(state.compute)))
    got = float(eng.evaluate(state, batch)["loss"])
    assert abs(got - float(applied)) <= 1e-3 * abs(float(applied)) < abs(got - float(lagging))


def check_evaluate(eng, state):
    """evaluate reads the params with the pending update applied."""
    batch, model = gpt_batch(gpt().cfg, 8, 99), gpt()
    want = jax.jit(lambda p, b: model.loss(p, b, PlainUnits()))(eng.params(state), batch)
    np.testing.assert_allclose(float(eng.evaluate(state, batch)["loss"]), float(want),
                               rtol=1e-5)


# The slow tier: five engines, each run once (STEPS steps from init) and checked against the
# delayed loop, then shared by the tests below. With the quick test (stage 3 on 4 devices,
# model state) they cover stages 1-3, replica x data, grad_accum, hpZ, the model axis, clipping
# (every run), evaluate, K = 0, 1, 2 and plain offload, and a resume on another N and stage.
#   "stage1"  stage 1 on replica 2 x data 2, K = 2 (one ordinary step first)
#   "plain"   the same without the delay (plain offload)
#   "stage3"  stage 3 on replica 2 x data 2 with hpZ, K = 1; saves before step 2
#   "k0"      the same with K = 0
#   "stage2"  stage 2 on data 2 with grad_accum 2, K = 1; resumes "stage3"'s save
#   "axis"    stage 3 on data 2 x model 2, K = 1
RUNS = {"stage1": (2, dict(replica=2, data=2), dict(stage=1)),
        "plain": (None, dict(replica=2, data=2), dict(stage=1)),
        "stage3": (1, dict(replica=2, data=2), dict(stage=3, hpz=True)),
        "k0": (0, dict(replica=2, data=2), dict(stage=3, hpz=True)),
        "stage2": (1, dict(data=2), dict(stage=2, grad_accum=2)),
        "axis": (1, dict(data=2, model=2), dict(stage=3))}


# Runs whose host update is zerojax.adamw's fused pass (offload/fused.py), the others optax's
# program: the same reference for both, and the checkpoint test restores across the two.
FUSED = {"stage3", "k0", "stage2", "axis"}


def engine(name):
    k, mesh, cfg = RUNS[name]
    return zj.Engine(gpt(), fused_adamw() if name in FUSED else adamw(), zj.make_mesh(**mesh),
                     zj.ZeroConfig(offload="optimizer", delayed_update=k, clip_norm=CLIP, **cfg))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> the run of RUNS[name]: engine, losses, grad norms, params before each step (and
    after the last), final state; "ckpt": "stage3"'s save before step 2."""
    ckpt, out = tmp_path_factory.mktemp("delayed") / "ckpt", {}

    def run(name):
        if name not in out:
            eng, batches = engine(name), gpt_batches()
            state, r = eng.init(jax.random.key(0), batches[0]), dict(losses=[], norms=[],
                                                                     params=[])
            assert (eng.host_update == "fused") == (name in FUSED), eng.host_update
            for t, b in enumerate(batches):
                r["params"].append(eng.params(state))
                if name == "stage3" and t == 2:
                    eng.save(state, ckpt)  # step 1's update pending
                state, m = eng.step(state, b)
                r["losses"].append(float(m["loss"]))
                r["norms"].append(float(m["grad_norm"]))
            r["params"].append(eng.params(state))
            out[name] = dict(r, engine=eng, state=state)
        return out[name]

    run.ckpt = ckpt
    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", ["stage1", "stage2", "stage3", "axis"])
def test_delayed_update_matches_the_delayed_single_device_loop(runs, name):
    r = runs(name)
    ref_losses, ref_norms, ref_params, _ = gpt_reference(RUNS[name][0])
    np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-5)
    np.testing.assert_allclose(r["norms"], ref_norms, rtol=1e-4)
    err = moved_error(r["params"][-1], ref_params, r["params"][0])
    assert err <= 1e-5, f"params off by {err:.3g} of the reference's move"
    if name == "stage1":
        check_evaluate(r["engine"], r["state"])


@pytest.mark.slow
def test_the_first_k_steps_are_plain_offloads_and_k0_runs_as_k1(runs):
    plain, k2 = runs("plain"), runs("stage1")
    # K = 2: the first 2 steps are plain offload's (the update of the second is applied by
    # engine.params, not by the step: the same arithmetic in another program)
    np.testing.assert_array_equal(k2["losses"][:2], plain["losses"][:2])
    assert_tree_close(k2["params"][2], plain["params"][2], rtol=1e-6, atol=1e-7)
    assert abs(k2["losses"][2] - plain["losses"][2]) > 1e-4  # the third ran on stale params
    k0, k1 = runs("k0"), runs("stage3")
    np.testing.assert_array_equal(k0["losses"], k1["losses"])  # step 0 has no update to wait
    assert_bitwise(k0["params"][-1], k1["params"][-1])  # for


@pytest.mark.slow
def test_a_skipped_step_leaves_nothing_pending():
    """float16 loss scaling: the first steps overflow and are skipped. A skipped step's update
    is skipped: its gradient waits as it arrived, overflowed, with `ok` False, and the next
    update does not read it (the params stay finite and untouched); the run then equals one
    that started at the scale the skips left, from the untouched initial params."""
    mesh = zj.make_mesh(data=2, replica=2)
    batch = jax.tree.map(lambda x: np.concatenate([x] * 4), SEED_BATCH)

    def engine(scale):
        return zj.Engine(SeedMLP(), optax.adam(0.1, eps=1e-8), mesh, zj.ZeroConfig(
            stage=3, param_dtype="float16", loss_scale_init=scale, clip_norm=5.0,
            grad_accum=2, offload="optimizer", delayed_update=0))

    eng = engine(2.0**17)
    state, losses, skipped = eng.init(jax.random.key(0), batch), [], []
    for _ in range(8):
        state, m = eng.step(state, batch)
        losses.append(float(m["loss"]))
        skipped.append(int(m["skipped"]))
        if skipped[-1]:
            assert not bool(state.pending.ok)
            assert not all(np.isfinite(np.asarray(g)).all()
                           for g in jax.tree.leaves(state.pending.grads))
            assert_bitwise(eng.params(state), eng.params(eng.init(jax.random.key(0), batch)))
    s = sum(skipped)
    assert 0 < s < 8 and skipped == [1] * s + [0] * (8 - s)
    assert bool(state.pending.ok)

    again = engine(2.0**17 / 2**s)
    state2, losses2 = again.init(jax.random.key(0), batch), []
    for _ in range(8 - s):
        state2, m = again.step(state2, batch)
        losses2.append(float(m["loss"]))
    np.testing.assert_array_equal(losses2, losses[s:])
    assert_bitwise(again.params(state2), eng.params(state))
    assert_bitwise(again.optimizer_state(state2), eng.optimizer_state(state))


@pytest.mark.slow
def test_a_save_in_the_delayed_phase_resumes_on_another_n_and_stage(runs):
    saved = runs("stage3")  # stage 3 (hpZ) on 4 devices, saved before step 2
    other = runs("stage2")["engine"]  # -> stage 2 on 2 devices
    restored = other.restore(runs.ckpt)
    assert int(restored.step) == 2
    assert_bitwise(other.params(restored), saved["params"][2])  # the checkpoint's: all applied
    resumed = []
    for b in gpt_batches()[2:]:
        restored, m = other.step(restored, b)
        resumed.append(float(m["loss"]))
    np.testing.assert_allclose(resumed, saved["losses"][2:], rtol=1e-5)
    assert moved_error(other.params(restored), saved["params"][-1], saved["params"][0]) <= 1e-5

    # Without the delay, a restore continues from the params with every update applied.
    plain = runs("plain")["engine"]  # stage 1 on replica 2 x data 2
    assert_bitwise(plain.params(plain.restore(runs.ckpt)), saved["params"][2])


@pytest.mark.slow  # the whole-matrix bundle's compile (~20 CPU s)
def test_delayed_update_of_whole_matrix_and_keyed_optimizers_matches_the_delayed_loop():
    """The optimizer table's first bundle (Muon on owner devices, Adafactor's and SM3's
    factored statistics, noisy SGD's PRNG key, injected hyperparameters, MultiSteps, ...)
    under the delayed update, whose pending update a flag may skip, on replica 2 × data 2 at
    stage 3: the host's update keeps its branch for the skip except where the state holds a
    key, which the sharded branch cannot carry between devices."""
    import optimizer_table as table

    eng, state, err = check_delayed(table.Bundle(table.BUNDLES[0]),
                                    table.bundled(table.BUNDLES[0]), table.batches(),
                                    zj.make_mesh(replica=2, data=2), k=1, clip=None, stage=3)
    assert err <= 1e-5
    # Muon's owner devices gather whole matrices: an update that waits for every device, so
    # on these CPU devices it is called in turn with the gradients program, not beside it
    assert not eng._offload._apart(state)


def test_the_pending_update_is_dispatched_before_the_backward(monkeypatch):
    """In a delayed step the host's update of the pending gradient is dispatched before the
    devices' forward and backward and reads only the state (the pending gradient, the master
    and optimizer state), so the CPU backend runs it while the devices compute; an ordinary
    step dispatches it after, on that step's gradient."""
    mesh = zj.make_mesh(data=4)
    eng = zj.Engine(Norm(zj.batch_axes(mesh)), optax.adam(1e-2), mesh, zj.ZeroConfig(
        stage=3, offload="optimizer", delayed_update=2))
    state = eng.init(jax.random.key(0), BATCHES[0])
    off, calls = eng._offload, []
    class Spied:  # a program whose calls are noted (its lowering, `_apart`'s, is not)
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __call__(self, *args):
            calls.append((self.name, args))
            return self.fn(*args)

        def lower(self, *args):
            return self.fn.lower(*args)

    def spying(name, make):
        return lambda *a: Spied(name, make(*a))

    for name in ("_grads_fn", "_update_fn"):
        monkeypatch.setattr(off, name, spying(name, getattr(off, name)))
    state, _ = eng.step(state, BATCHES[0])  # step 0 < K - 1: ordinary
    assert [c for c, _ in calls] == ["_grads_fn", "_update_fn"]
    calls.clear()
    pending = state.pending.grads
    state, _ = eng.step(state, BATCHES[1])  # step 1: delayed
    assert [c for c, _ in calls] == ["_update_fn", "_grads_fn"]
    assert calls[0][1][3] is pending  # the update of the state's pending gradient
    # The checkpoint layout reads the state with its pending update applied, on the devices.
    with pytest.raises(zj.StateError, match=r"engine.saveable\(state\)"):
        eng.logical(state)
    assert int(eng.logical(eng.saveable(state))["step"]) == 2


@pytest.mark.parametrize("n", [4, 1])
def test_the_devices_program_is_dispatched_while_the_host_updates(monkeypatch, n):
    """XLA:CPU runs a fused pass's program inline, to its end, on the thread that calls it (its
    cost analysis counts no flops in a custom call: a "cheap" program); so a delayed step calls
    the pending update from a thread of its own and dispatches the gradients program while the
    host updates. Here the update waits until the gradients program has been dispatched: called
    on the step's own thread before it, it would wait for ever (20 s here). Also on a host mesh
    of one device (`make_mesh(data=1)`), where no collective can hold the two programs."""
    mesh = zj.make_mesh(data=n, devices=jax.devices()[:n])
    eng = zj.Engine(Norm(zj.batch_axes(mesh)), zj.adamw(1e-2), mesh, zj.ZeroConfig(
        stage=3, offload="optimizer", delayed_update=1))
    state = eng.init(jax.random.key(0), BATCHES[0])
    assert eng.host_update == "fused"
    off = eng._offload
    for b in BATCHES[:2]:  # the ordinary first step, then the first delayed one (the caller's)
        state, _ = eng.step(state, b)
    assert off._apart(state)  # no collective in AdamW's update: beside the devices' programs
    dispatched, waited = threading.Event(), []
    update, grads_fn = off._update, off._grads_fn

    def waiting(*a):
        waited.append(dispatched.wait(timeout=20))
        return update(*a)

    def dispatching():
        fn = grads_fn()
        return lambda *a: (fn(*a), dispatched.set())[0]

    monkeypatch.setattr(off, "_update", waiting)
    monkeypatch.setattr(off, "_grads_fn", dispatching)
    state, metrics = eng.step(state, BATCHES[2])
    assert waited == [True]
    ref = zj.Engine(Norm(zj.batch_axes(mesh)), zj.adamw(1e-2), mesh, zj.ZeroConfig(
        stage=3, offload="optimizer", delayed_update=1))
    ref_state = ref.init(jax.random.key(0), BATCHES[0])
    for b in BATCHES[:3]:
        ref_state, ref_metrics = ref.step(ref_state, b)
    assert float(metrics["loss"]) == float(ref_metrics["loss"])
    assert_bitwise(eng.params(state), ref.params(ref_state))


@pytest.mark.parametrize("cfg, match", [
    ({"stage": 3, "delayed_update": 2}, r"delayed_update=2 needs offload='optimizer' \(got "
                                        r"offload=None\).*add offload='optimizer'"),
    ({"stage": 1, "offload": "optimizer", "delayed_update": -1}, "must be an integer K >= 0"),
    ({"stage": 1, "offload": "optimizer", "delayed_update": 2.0}, r"\(float\) must be an "
                                                                  r"integer K >= 0"),
    ({"stage": 1, "offload": "optimizer", "delayed_update": True}, r"\(bool\) must be"),
])
def test_bad_delayed_update_is_one_config_error(cfg, match):
    with pytest.raises(zj.ConfigError, match=match):
        zj.ZeroConfig(**cfg)
    assert zj.ZeroConfig(stage=2, offload="optimizer", delayed_update=0).delayed_update == 0


def test_an_early_delay_is_legal_and_warned_of_with_the_recommendation():
    """A delay that starts within the first 40 steps (or, where the schedule is known, before
    its warm-up ends) is legal and warned of once, naming the start to use: measured with the
    command line's defaults (nano, lr 3e-3 after 10 warm-up steps), K = 2 spiked the loss to
    6.77 at step 19 and K = 10 to 5.49 at step 13, K = 20 and 40 did not."""
    import warnings

    from zerojax.config import DELAY_AFTER, DelayWarning, delay_advice

    for k in (0, 2, DELAY_AFTER - 1):
        with pytest.warns(DelayWarning, match=rf"delayed_update={k} starts the delayed update "
                          rf"within the first 40 steps.*use delayed_update=40 or more") as w:
            zj.ZeroConfig(stage=1, offload="optimizer", delayed_update=k)
        assert len(w) == 1 and w[0].filename == __file__  # the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error", DelayWarning)
        zj.ZeroConfig(stage=1, offload="optimizer", delayed_update=DELAY_AFTER)
        zj.ZeroConfig(stage=1, offload="optimizer")
    # the command line knows the warm-up: the later of the two
    assert delay_advice(40, 10) is None and delay_advice(99, 100) is not None
    assert "before the learning rate's 100-step warm-up ends" in delay_advice(60, 100)
    assert delay_advice(60, 100, "--delayed-update ").endswith(
        "use --delayed-update 100 or more (docs/training.md)")


@pytest.mark.parametrize("stage, accum, cfg", [
    (3, 1, {}), (1, 2, {}), (3, 2, {}),
    pytest.param(2, 1, {"quantize_grads": "int8"}, marks=pytest.mark.slow)])
def test_the_pending_gradient_waits_as_it_arrived(stage, accum, cfg):
    """No program stores the pending gradient: it is the reduced shard as the gradients
    program gave it, in `plan.reduced_dtype` (bf16 here; float32 where stages 2-3 sum their
    micro-batches' shards, or qgZ sums dequantized pieces), which is what init's empty pending
    update holds, so a state keeps its dtypes from step to step."""
    batch = jax.tree.map(lambda x: np.concatenate([x] * 4), SEED_BATCH)
    eng = zj.Engine(SeedMLP(), optax.adam(0.1), zj.make_mesh(data=2, devices=jax.devices()[:2]),
                    zj.ZeroConfig(stage=stage, param_dtype="bfloat16", grad_accum=accum,
                                  offload="optimizer", delayed_update=0, **cfg))
    want = np.dtype(jnp.float32 if (stage >= 2 and accum > 1) or cfg else jnp.bfloat16)
    state = eng.init(jax.random.key(0), batch)
    assert eng.plan.reduced_dtype == want
    assert {g.dtype for g in jax.tree.leaves(state.pending.grads)} == {want}
    # so it holds the gradient's bytes a param (2 in bf16, 4 summed in float32), laid out as
    # the float32 master (4): docs/training.md's host bytes
    mine = lambda tree: sum(s.data.nbytes for x in jax.tree.leaves(tree)
                            for s in x.addressable_shards if s.device == eng.mesh.devices.flat[0])
    assert mine(state.pending.grads) * 4 == mine(state.master) * want.itemsize
    off = eng._offload
    _, reduced, _ = off._grads_fn()(off.device_part(state), zj.mesh.put_batch(batch, eng.mesh))
    arrived = off.down(jax.tree.leaves(reduced[0]))
    assert {g.dtype for g in arrived} == {want}
    # the host update that `measure` compiles takes the gradient in that dtype too
    lowered = eng.lower_host_update().args_info[0][3]
    assert {g.dtype for g in jax.tree.leaves(lowered)} == {want}
    for _ in range(2):
        state, _ = eng.step(state, batch)
        assert {g.dtype for g in jax.tree.leaves(state.pending.grads)} == {want}
    assert bool(state.pending.ok)
