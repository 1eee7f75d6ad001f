"""Randomness and model state: per-step/device/micro-batch keys, exact resume, BatchNorm-like
statistics (global with the batch axes, averaged without), unused params, aux and mask errors."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import RTOL, assert_tree_close, sweep
from jax import lax

import zerojax as zj
from zerojax.checkpoint import export, load_exported
from zerojax.units import PlainUnits

RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 5)).astype(np.float32)
BATCHES = [{"x": RNG.normal(size=(16, 5)).astype(np.float32),
            "y": RNG.normal(size=(16, 1)).astype(np.float32)} for _ in range(6)]


def engine(model, n=4, stage=3, optimizer=None, **cfg):
    return zj.Engine(model, optimizer or optax.adam(1e-2), zj.make_mesh(data=n),
                     zj.ZeroConfig(stage=stage, **cfg))


def run(eng, state, batches):
    losses = []
    for b in batches:
        state, m = eng.step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


def assert_bitwise(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree.flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), jax.tree_util.keystr(path))


# ---------------------------------------------------------------------------------------------
# Dropout: a mask per step, device, micro-batch, call and layer; the same masks on resume.


class Dropout:
    """Dropout before and inside a scanned stack; aux "spread": max - min of the per-device
    losses (> 0 only if devices draw different masks: every device gets the same rows)."""

    def __init__(self, axes=()):
        self.axes = axes

    def init(self, rng):
        k = jax.random.split(rng)
        return {"w": jax.random.normal(k[0], (5, 4)), "s": jax.random.normal(k[1], (2, 4, 4))}

    def loss(self, params, batch, units):
        h = batch["x"] @ units.gather({"w": params["w"]})["w"]

        def drop(h):
            if not units.training:
                return h
            return jnp.where(jax.random.bernoulli(units.rng(), 0.5, h.shape), 2 * h, 0.0)

        h = units.scan(lambda h, w: drop(jnp.tanh(h @ w)), drop(h), params["s"])
        loss = jnp.mean(jnp.square(h.sum(-1, keepdims=True) - batch["y"]))
        if not self.axes:
            return loss
        same = lax.stop_gradient(loss)
        return loss, {"spread": lax.pmax(same, self.axes) - lax.pmin(same, self.axes)}


def same_rows(b):
    return {k: np.repeat(v[:1], len(v), 0) for k, v in b.items()}


def test_dropout_masks_differ_per_step_and_device():
    mesh = zj.make_mesh(data=4)
    eng = zj.Engine(Dropout(zj.batch_axes(mesh)), optax.sgd(0.0), mesh, zj.ZeroConfig(stage=1))
    b = same_rows(BATCHES[0])
    state = eng.init(jax.random.key(0), b)
    losses, spreads = [], []
    for _ in range(3):
        state, m = eng.step(state, b)  # lr = 0: only the masks change
        losses.append(float(m["loss"]))
        spreads.append(float(m["spread"]))
    assert len(set(losses)) == 3, losses
    assert min(spreads) > 0, spreads
    # evaluate: units.training is False, so no dropout: the plain loss of the params.
    want = Dropout().loss(eng.params(state), b, PlainUnits(training=False))
    np.testing.assert_allclose(float(eng.evaluate(state, b)["loss"]), float(want), rtol=1e-6)


@pytest.mark.parametrize("stage, prefetch", sweep([(1, False), (3, True)], quick=[(3, True)]))
def test_resume_draws_the_same_masks(stage, prefetch, tmp_path):
    """Save at step 3, restore: steps 4-6 bitwise equal to the uninterrupted run."""
    eng = engine(Dropout(), stage=stage, prefetch=prefetch)
    state = eng.init(jax.random.key(1), BATCHES[0])
    state, _ = run(eng, state, BATCHES[:3])
    eng.save(state, tmp_path)
    state, want = run(eng, state, BATCHES[3:])
    again = engine(Dropout(), stage=stage, prefetch=prefetch)
    restored = again.restore(tmp_path)
    restored, got = run(again, restored, BATCHES[3:])
    assert got == want
    assert_bitwise(again.params(restored), eng.params(state))
    np.testing.assert_array_equal(np.asarray(restored.rng), np.asarray(state.rng))


class ExampleDropout(Dropout):
    """Dropout with a key per example (`units.example_rngs()`), in and around a scan."""

    def loss(self, params, batch, units):
        def drop(h):
            bits = jax.vmap(lambda k, row: jax.random.bernoulli(k, 0.5, row.shape))
            return jnp.where(bits(units.example_rngs(), h), 2 * h, 0.0)

        h = batch["x"] @ units.gather({"w": params["w"]})["w"]
        h = units.scan(lambda h, w: drop(jnp.tanh(h @ w)), drop(h), params["s"])
        return jnp.mean(jnp.square(h.sum(-1, keepdims=True) - batch["y"]))


def test_example_keys_give_the_same_run_on_any_device_count():
    runs = []
    for n, stage, accum in [(1, 0, 1), (4, 3, 2)]:
        eng = engine(ExampleDropout(), n=n, stage=stage, grad_accum=accum)
        state = eng.init(jax.random.key(0), BATCHES[0])
        if not runs:  # the loss without dropout, of the reference run's (N = 1) initial params
            plain = jax.jit(lambda p: Dropout().loss(p, BATCHES[0], PlainUnits(training=False)))(
                eng.params(state))
        state, losses = run(eng, state, BATCHES[:3])
        runs.append((losses, eng.params(state)))
    assert abs(runs[0][0][0] - float(plain)) > 1e-3  # dropout is on
    for losses, params in runs[1:]:
        np.testing.assert_allclose(losses, runs[0][0], rtol=1e-5)
        assert_tree_close(params, runs[0][1], rtol=1e-5, atol=1e-6)


def test_keys_differ_per_call_and_layer():
    u = PlainUnits(rng=jax.random.key(0))
    a, b = (float(jax.random.uniform(u.rng())) for _ in range(2))

    def body(c, _):  # traced once for all layers, yet each layer draws its own number
        i, out = c
        return i + 1, out.at[i].set(jax.random.uniform(u.rng()))

    _, out = u.scan(body, (0, jnp.zeros(3)), jnp.zeros((3, 1)))
    assert len({a, b, *np.asarray(out).tolist()}) == 5


class Recorder:
    """State threads through the micro-batches in order: `seq <- 2 seq + mean(x)`, a counter,
    and one uniform draw per micro-step (into slot `n`)."""

    def init(self, rng):
        return {"w": jnp.ones((5, 1))}

    def init_state(self, rng):
        return {"n": jnp.zeros((), jnp.int32), "seq": jnp.zeros(()), "draws": jnp.zeros(4)}

    def loss(self, params, batch, units):
        w = units.gather(params)["w"]
        s = units.state
        units.set_state({"n": s["n"] + 1, "seq": 2 * s["seq"] + batch["x"].mean(),
                         "draws": s["draws"].at[s["n"]].set(jax.random.uniform(units.rng()))})
        return jnp.mean(jnp.square(batch["x"] @ w - batch["y"]))


def test_grad_accum_threads_the_state_in_order():
    eng = engine(Recorder(), n=2, stage=2, optimizer=optax.sgd(0.0), grad_accum=2)
    b = BATCHES[0]
    state = eng.init(jax.random.key(0), b)
    state, _ = eng.step(state, b)
    ms = eng.model_state(state)
    assert int(ms["n"]) == 2
    # device d holds rows 8d..8d+7: micro-batches of 4 rows; then the average over devices
    means = b["x"].reshape(2, 2, 4, 5).mean(axis=(2, 3))  # [device, micro]
    want = np.mean(2 * means[:, 0] + means[:, 1])
    np.testing.assert_allclose(float(ms["seq"]), want, rtol=1e-6)
    draws = np.asarray(ms["draws"])
    assert draws[0] != draws[1] and draws[2] == draws[3] == 0.0  # a key per micro-batch
    state, _ = eng.step(state, b)
    assert int(eng.model_state(state)["n"]) == 4
    assert len(set(np.asarray(eng.model_state(state)["draws"]).tolist())) == 4  # and per step


# ---------------------------------------------------------------------------------------------
# BatchNorm-like statistics in the model state.


class Norm:
    """Batch normalization of one hidden layer; running mean/var (momentum 0.9) in the model
    state. `axes`: the batch axes, for global-batch statistics (`lax.pmean`)."""

    def __init__(self, axes=None):
        self.axes = axes

    def init(self, rng):
        k = jax.random.split(rng)
        return {"w": jax.random.normal(k[0], (5, 4)) * 0.5,
                "out": jax.random.normal(k[1], (4, 1)) * 0.5}

    def init_state(self, rng):
        return {"mean": jnp.zeros(4), "var": jnp.ones(4), "count": jnp.zeros((), jnp.int32)}

    def loss(self, params, batch, units):
        p = units.gather(params)
        h = batch["x"] @ p["w"]
        s = units.state
        if units.training:
            mean = lambda v: lax.pmean(v, self.axes) if self.axes else v
            mu = mean(h.mean(0))
            var = mean(jnp.square(h).mean(0)) - jnp.square(mu)
            units.set_state({"mean": 0.9 * s["mean"] + 0.1 * mu,
                             "var": 0.9 * s["var"] + 0.1 * var, "count": s["count"] + 1})
        else:
            mu, var = s["mean"], s["var"]
        h = jnp.tanh((h - mu[None]) / jnp.sqrt(var[None] + 1e-5))
        return jnp.mean(jnp.square(h @ p["out"] - batch["y"]))


def opt():
    return optax.adam(1e-2, eps=1e-6)


@functools.cache
def norm_reference():
    """Single device, global batches: (params, model state) after each of 5 steps."""
    model, tx = Norm(), opt()
    params = model.init(jax.random.key(0))
    ms, ostate = model.init_state(None), tx.init(params)

    @jax.jit
    def step(params, ostate, ms, b):
        def f(p):
            u = PlainUnits(state=ms)
            return model.loss(p, b, u), u.state

        (_, ms), g = jax.value_and_grad(f, has_aux=True)(params)
        up, ostate = tx.update(g, ostate, params)
        return optax.apply_updates(params, up), ostate, ms

    for b in BATCHES[:5]:
        params, ostate, ms = step(params, ostate, ms, b)
    return params, ms


@pytest.mark.parametrize("stage, replica", sweep([(0, 1), (1, 1), (2, 1), (3, 1), (3, 2)],
                                                  quick=[(3, 2)]))
def test_global_batch_statistics_match_one_device(stage, replica):
    mesh = zj.make_mesh(data=4 // replica, replica=replica)
    eng = zj.Engine(Norm(zj.batch_axes(mesh)), opt(), mesh, zj.ZeroConfig(stage=stage))
    state = eng.init(jax.random.key(0), BATCHES[0])  # discovery binds the batch axes too
    state, _ = run(eng, state, BATCHES[:5])
    params, ms = norm_reference()
    assert_tree_close(eng.params(state), params, rtol=RTOL, atol=1e-5)
    got = eng.model_state(state)
    assert int(got["count"]) == 5
    np.testing.assert_allclose(got["mean"], ms["mean"], rtol=RTOL, atol=1e-6)
    np.testing.assert_allclose(got["var"], ms["var"], rtol=RTOL, atol=1e-6)


@functools.cache
def per_device_run():
    """(engine, state, batch, initial w) of `Norm()` without batch axes after one stage-3 step
    on a replica 2 x data 2 mesh."""
    eng = zj.Engine(Norm(), opt(), zj.make_mesh(data=2, replica=2), zj.ZeroConfig(stage=3))
    b = BATCHES[0]
    state = eng.init(jax.random.key(0), b)
    w = np.asarray(eng.params(state)["w"])
    state, _ = eng.step(state, b)
    return eng, state, b, w


def test_per_device_statistics_are_averaged_and_evaluate_reads_them(tmp_path):
    eng, state, b, w = per_device_run()
    h = (b["x"] @ w).reshape(4, 4, 4)  # [device (replica-major), row, feature]
    mu, var = h.mean(1), np.square(h).mean(1) - np.square(h.mean(1))
    ms = eng.model_state(state)
    np.testing.assert_allclose(ms["mean"], 0.1 * mu.mean(0), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ms["var"], 0.9 + 0.1 * var.mean(0), rtol=1e-5)
    # evaluate: the running statistics, read and left as they were (units.training is False)
    before = jax.tree.map(np.asarray, ms)
    want = Norm().loss(eng.params(state), b, PlainUnits(state=before, training=False))
    np.testing.assert_allclose(float(eng.evaluate(state, b)["loss"]), float(want), rtol=1e-6)
    assert_bitwise(eng.model_state(state), before)

    # Saved under stage 3 on 4 devices, restored under stage 1 on 2: state and key as saved.
    eng.save(state, tmp_path / "ckpt")
    other = engine(Norm(), n=2, stage=1)
    restored = other.restore(tmp_path / "ckpt")
    assert_bitwise(other.model_state(restored), before)
    assert_bitwise(other.params(restored), eng.params(state))
    np.testing.assert_array_equal(np.asarray(restored.rng), np.asarray(state.rng))
    meta = zj.checkpoint.read_metadata(tmp_path / "ckpt")
    assert [d["path"] for d in meta["model_state"]] == ["['count']", "['mean']", "['var']"]

    # Export writes the model state next to the params.
    out = export(tmp_path / "ckpt", tmp_path / "p.safetensors")
    params, exported = load_exported(out, with_state=True)
    assert_bitwise(params, eng.params(state))
    assert_bitwise(exported, before)
    assert_bitwise(load_exported(out), params)  # without the flag: the params, as before


def test_model_state_of_another_shape_is_refused(tmp_path):
    class Wider(Norm):
        def init_state(self, rng):
            return {**super().init_state(rng), "mean": jnp.zeros(5)}

    eng = engine(Norm(), n=2, stage=1)
    eng.save(eng.init(jax.random.key(0), BATCHES[0]), tmp_path)
    with pytest.raises(zj.CheckpointError, match=r"another model state.*\['mean'\]"):
        engine(Wider(), n=2, stage=1).restore(tmp_path)


def test_set_state_checks_the_structure():
    u = PlainUnits(state={"a": jnp.zeros(3)})
    with pytest.raises(zj.ModelError, match=r"\['a'\]: expected float32\(3,\), got float32\(4,\)"):
        u.set_state({"a": jnp.zeros(4)})
    with pytest.raises(zj.ModelError, match="no init_state"):
        PlainUnits().set_state({"a": jnp.zeros(3)})


def test_init_from_takes_rng_and_model_state():
    eng = engine(Norm(), n=2, stage=1)
    params = Norm().init(jax.random.key(3))
    ms = {"mean": jnp.full(4, 2.0), "var": jnp.ones(4), "count": jnp.asarray(7, jnp.int32)}
    a = eng.init_from(params, BATCHES[0], rng=jax.random.key(5), model_state=ms)
    assert_bitwise(eng.model_state(a), ms)
    b = eng.init_from(params, BATCHES[0], rng=jax.random.key(5))
    assert_bitwise(eng.model_state(b), Norm().init_state(None))
    np.testing.assert_array_equal(np.asarray(a.rng), np.asarray(b.rng))
    c = eng.init_from(params, BATCHES[0])
    assert not np.array_equal(np.asarray(c.rng), np.asarray(b.rng))


# ---------------------------------------------------------------------------------------------
# Unused params, aux values, optimizer masks.


class Unused:
    def init(self, rng):
        return {"w": jnp.ones((5, 1)), "spare": jnp.full((2, 3, 3), 0.5)}

    def loss(self, params, batch, units):
        w = units.gather({"w": params["w"]})["w"]
        return jnp.mean(jnp.square(batch["x"] @ w - batch["y"]))


@pytest.mark.parametrize("stage", sweep([0, 1, 2, 3], quick=[0, 3]))
def test_unused_param_gets_zero_gradient_and_one_warning(stage):
    eng = engine(Unused(), n=2, stage=stage, optimizer=optax.sgd(0.1))
    with pytest.warns(UserWarning, match=r"never gathers parameter\(s\) \['spare'\]"):
        state = eng.init(jax.random.key(0), BATCHES[0])
    assert not next(leaf for leaf in eng.layout.leaves if leaf.path == "['spare']").stacked
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, _ = run(eng, state, BATCHES[:2])
    p = eng.params(state)
    np.testing.assert_array_equal(np.asarray(p["spare"]), np.full((2, 3, 3), 0.5))
    assert not np.array_equal(np.asarray(p["w"]), np.ones((5, 1)))


class StatsInAux(Norm):
    def loss(self, params, batch, units):
        h = batch["x"] @ units.gather(params)["w"]
        return jnp.mean(h), {"stats": h.mean(0)}


def test_non_scalar_aux_is_named():
    with pytest.raises(zj.ModelError, match=r"aux value 'stats' has shape \(4,\).*init_state"):
        engine(StatsInAux(), n=2, stage=1).init(jax.random.key(0), BATCHES[0])


def test_mask_functions_see_logical_params():
    """Mask and label functions get the logical params, as in plain optax: one over names and
    one over shapes train exactly as the pytrees they give; one that fails is named."""
    labels = lambda params: {k: "a" if k == "w" else "b" for k in params}
    tx = lambda labels: optax.multi_transform({"a": optax.adam(1e-2), "b": optax.sgd(0.1)},
                                              labels)
    logical = jax.eval_shape(Norm().init, jax.random.key(0))
    by_shape = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
    for a, b in [(tx(labels), tx(labels(logical))),
                 (optax.adamw(1e-2, weight_decay=0.5, mask=by_shape),
                  optax.adamw(1e-2, weight_decay=0.5, mask=by_shape(logical)))]:
        states = []
        for opt in (a, b):
            eng = engine(Norm(), n=2, stage=3, optimizer=opt)
            state, _ = run(eng, eng.init(jax.random.key(0), BATCHES[0]), BATCHES[:2])
            states.append(eng.params(state))
        assert_bitwise(*states)
    fails = optax.adamw(1e-3, mask=lambda p: {"w": True, "out": p["out"].kernel})
    with pytest.raises(zj.ConfigError, match=r"optimizer's init failed on the model's params "
                                             r"\(AttributeError"):
        engine(Norm(), n=2, stage=1, optimizer=fails).init(jax.random.key(0), BATCHES[0])


# ---------------------------------------------------------------------------------------------
# Where model state meets loss scaling and hybrid meshes.


def test_a_skipped_fp16_step_leaves_the_model_state_as_it_was():
    """Dynamic loss scaling skips a step whose gradients are not finite on every device alike:
    the statistics and the counter that step computed are dropped with its update."""
    eng = engine(Norm(), n=2, stage=3, param_dtype="float16", grad_accum=2,
                 loss_scale_init=2.0**8)
    state = eng.init(jax.random.key(0), BATCHES[0])
    before = jax.tree.map(np.asarray, eng.model_state(state))
    bad = {**BATCHES[0], "x": np.where(np.eye(16, 5, dtype=bool), np.nan, BATCHES[0]["x"])}
    state, m = eng.step(state, bad)  # NaN rows on device 0: its statistics and all gradients
    assert int(m["skipped"]) == 1 and int(m["nonfinite"]) == 1
    assert_bitwise(eng.model_state(state), before)
    state, m = eng.step(state, BATCHES[0])  # at half the scale: taken
    assert int(m["skipped"]) == 0
    ms = eng.model_state(state)
    assert int(ms["count"]) == 2  # two micro-batches of the taken step
    assert not np.array_equal(np.asarray(ms["mean"]), before["mean"])


def test_per_device_statistics_are_averaged_over_replica_and_data():
    """Without batch axes in the model, each device's statistics are its own; on a replica ×
    data mesh the step averages them over both axes (and traces: the state is replicated)."""
    eng, state, b, w = per_device_run()
    h = (b["x"] @ w).reshape(4, 4, 4)  # [device (replica-major), row, feature]
    mu, var = h.mean(1), np.square(h).mean(1) - np.square(h.mean(1))
    assert np.abs(mu[:2].mean(0) - mu[2:].mean(0)).max() > 1e-2  # the replicas differ
    ms = eng.model_state(state)
    np.testing.assert_allclose(ms["mean"], 0.1 * mu.mean(0), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ms["var"], 0.9 + 0.1 * var.mean(0), rtol=1e-5)
    assert int(ms["count"]) == 1
