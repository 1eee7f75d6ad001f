"""What an experiment script does with an engine besides `engine.step`: steps compiled into
its own jitted loop, evaluation on any batch, the public run log."""

import functools

import jax
import numpy as np
import optax
import pytest
from helpers import adamw, gpt_batch, moved_error, sweep, tiny_gpt

import zerojax as zj
from zerojax.units import PlainUnits


@functools.cache
def engine(model: int) -> zj.Engine:
    return zj.Engine(tiny_gpt(), adamw(), zj.make_mesh(data=4, model=model),
                     zj.ZeroConfig(stage=3))


@functools.cache
def _initial(model: int) -> zj.TrainState:
    e = engine(model)
    return e.init(jax.random.key(0), gpt_batch(e.model.cfg, 8, 0))


def started(model: int) -> zj.TrainState:
    """A fresh copy of `engine(model)`'s initial state (a test may donate it)."""
    return jax.tree.map(lambda x: x.copy(), _initial(model))


def test_steps_compile_into_one_jitted_loop_on_a_model_axis():
    """`jax.jit(engine.step)` works, and so does a `lax.scan` of steps under one jit: the state
    check runs on tracers (shapes and dtypes), and the steps are those of `engine.step`."""
    e = engine(2)
    batches = [gpt_batch(e.model.cfg, 8, s) for s in range(3)]
    state = started(2)

    @jax.jit
    def three(state, stacked):
        return jax.lax.scan(e.step, state, stacked)

    looped, metrics = three(state, jax.tree.map(lambda *x: np.stack(x), *batches))
    assert not state.step.is_deleted()  # an outer jit donates nothing unless it is told to
    eager, m = jax.jit(e.step, donate_argnums=0)(state, batches[0])  # as engine.step does
    assert state.step.is_deleted()
    losses = [float(m["loss"])]
    for b in batches[1:]:  # engine.step itself: the reference
        eager, m = e.step(eager, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(np.asarray(metrics["loss"]), losses, rtol=1e-6)
    assert int(looped.step) == 3
    # Two programs, two reduction orders: 2e-6 of the movement here, a wrong step ~1.
    assert moved_error(e.params(looped), e.params(eager), e.params(_initial(2))) <= 1e-4
    # Under jit the check still refuses a state of another shape by name.
    cut = eager._replace(step=eager.step[None])
    with pytest.raises(zj.StateError, match=r"state.step is int32\(1,\), this engine's "
                                            r"int32\(\)"):
        jax.jit(e.step)(cut, batches[0])


def plain_mean(model, params, batch) -> float:
    """The mean of the per-example losses, each example a batch of its own."""
    one = lambda x, y: model.loss(params, {"inputs": x[None], "targets": y[None]}, PlainUnits())
    return float(np.mean(jax.jit(jax.vmap(one))(batch["inputs"], batch["targets"])))


@pytest.mark.parametrize("model", sweep([1, 2], quick=[2]))
def test_evaluate_takes_any_batch(model):
    """10 examples on 4 data devices (8 sharded, 2 padded to one per device) and another
    sequence length: the mean over exactly the real examples."""
    e, state = engine(model), started(model)
    params = e.params(state)
    ten = gpt_batch(e.model.cfg, 10, 7)
    for batch in (ten, {k: v[:7, :9] for k, v in ten.items()}, {k: v[:3] for k, v in
                                                               ten.items()}):
        got = float(e.evaluate(state, batch)["loss"])
        assert got == pytest.approx(plain_mean(e.model, params, batch), rel=1e-6)
    # The pads count for nothing: the 2 left-over examples weigh 2/10, not 4/10.
    sharded = float(e.evaluate(state, {k: v[:8] for k, v in ten.items()})["loss"])
    assert abs(sharded - got) > 1e-3
    # Under an outer jit too; and the training batch's shape is still the step's.
    assert float(jax.jit(e.evaluate)(state, ten)["loss"]) == pytest.approx(
        plain_mean(e.model, params, ten), rel=1e-6)
    with pytest.raises(zj.BatchError, match=r"batch\['inputs'\] is int32\[B, 10, 1\]; the "
                                            r"engine was initialized with int32\[B, 16\] "
                                            r"\(evaluate takes any sizes; the number of axes "
                                            r"and the dtype as at init\)"):
        e.evaluate(state, {k: v[:, :10, None] for k, v in ten.items()})
    with pytest.raises(zj.BatchError, match=r"is int32\[B, 9\]; .* int32\[B, 16\] \(any batch "
                                            r"size B"):
        e.step(state, {k: v[:8, :9] for k, v in ten.items()})
    with pytest.raises(zj.BatchError, match=r"the batch holds no examples"):
        e.evaluate(state, {k: v[:0] for k, v in ten.items()})


class Sum:
    """A loss that is a sum, not a mean, over the examples: evaluate weights each device's
    value by its examples, as the docs say (the mean of a mean-over-examples loss)."""

    def init(self, rng):
        return {"w": jax.random.normal(rng, (3,))}

    def loss(self, params, batch, units):
        return (batch["x"] @ units.gather(params)["w"]).sum()


def test_evaluate_weights_each_devices_loss_by_its_real_examples():
    e = zj.Engine(Sum(), optax.sgd(0.1), zj.make_mesh(data=4), zj.ZeroConfig(stage=1))
    x = np.arange(30, dtype=np.float32).reshape(10, 3)
    state = e.init(jax.random.key(0), {"x": x[:8]})
    v = x @ np.asarray(e.params(state)["w"])
    # Devices 0-3 hold examples [0,1], [2,3], [4,5], [6,7]; devices 0 and 1 then 8 and 9.
    per_device = [v[0:2].sum(), v[2:4].sum(), v[4:6].sum(), v[6:8].sum(), v[8], v[9]]
    want = (2 * sum(per_device[:4]) + per_device[4] + per_device[5]) / 10
    assert float(e.evaluate(state, {"x": x})["loss"]) == pytest.approx(want, rel=1e-6)


class Mean(Sum):
    """A loss that is the mean over the device-local examples, as the protocol asks."""

    def loss(self, params, batch, units):
        return (batch["x"] @ units.gather(params)["w"]).mean()


def test_evaluate_on_replica_by_data_is_the_plain_mean_and_pads_count_for_nothing():
    """On replica 2 × data 2 the batch splits over all 4 slices (not the 2 of `data`): 10, 7
    and 3 examples give the plain mean. A pad row the compiled evaluation is handed weighs
    nothing even when it holds NaN (a `where`, not a product with its zero weight)."""
    from zerojax.mesh import put_batch

    e = zj.Engine(Mean(), optax.sgd(0.1), zj.make_mesh(data=2, replica=2),
                  zj.ZeroConfig(stage=3))
    x = np.arange(30, dtype=np.float32).reshape(10, 3) / 7
    state = e.init(jax.random.key(0), {"x": x[:4]})
    v = x @ np.asarray(e.params(state)["w"])
    for n in (10, 7, 3):
        assert float(e.evaluate(state, {"x": x[:n]})["loss"]) == pytest.approx(
            float(np.mean(v[:n])), rel=1e-6), n
    part = {"x": np.concatenate([x[:2], np.full((2, 3), np.nan, np.float32)])}
    got = e._jit_cache["evaluate"][1](state, put_batch(part, e.mesh),  # the compiled evaluation
                                      put_batch(np.array([1, 1, 0, 0], np.float32), e.mesh), 0)
    assert float(got["loss"]) == pytest.approx(float(v[0] + v[1]), rel=1e-6)


def test_run_log_records_without_an_engine(tmp_path, monkeypatch):
    """What `RunLog.step` adds to a step's metrics: the lr an optimizer state carries, tokens
    from the batch, float16's skipped steps summed, the model's aux metrics under `metrics/`,
    device memory where the backend reports it, host memory; the plot drawn during the run."""
    from helpers import by_tag, tensorboard_scalars

    from zerojax.app import runlog

    class Device:
        def __init__(self, used):
            self.used = used

        def memory_stats(self):
            return {"bytes_in_use": self.used, "peak_bytes_in_use": 2 * self.used}

    monkeypatch.setattr(jax, "local_devices", lambda: [Device(5), Device(7)])
    monkeypatch.setattr(runlog, "host_memory",
                        lambda: {"host_rss_bytes": 11, "host_rss_peak_bytes": 13})
    batch = {"inputs": np.zeros((4, 16), np.int32), "targets": np.zeros((4, 16), np.int32)}
    with zj.RunLog(tmp_path, plot_every=0) as log:
        for step, skipped in ((1, 0), (2, 1), (3, 1)):
            metrics = {"loss": np.float32(3.0 / step), "grad_norm": np.float32(1.0),
                       "nonfinite": np.int32(0), "lr": np.float32(1e-3 * step),
                       "loss_scale": np.float32(2.0**15), "skipped": np.int32(skipped),
                       "accuracy": np.float32(0.25 * step)}
            rec = log.step(step, metrics, batch, seconds=0.5)
            assert (tmp_path / "loss.png").is_file()  # redrawn as the run goes
    assert rec == {"step": 3, "loss": 1.0, "grad_norm": 1.0, "lr": pytest.approx(3e-3),
                   "tokens_per_s": 128.0, "tokens_per_s_per_device": 128.0 / jax.device_count(),
                   "step_time_s": 0.5, "loss_scale": 2.0**15, "skipped_steps": 2,
                   "memory_bytes": 7, "peak_memory_bytes": 14, "host_rss_bytes": 11,
                   "host_rss_peak_bytes": 13, "accuracy": 0.75}
    tb = tensorboard_scalars(tmp_path)
    assert tb == by_tag(log.records) and tb["metrics/accuracy"][2] == 0.5
    assert tb["perf/device_memory_bytes_in_use"][1] == 7
    assert (tb["perf/host_memory_rss_bytes"][1], tb["perf/host_memory_peak_rss_bytes"][3]) == (
        11, 13)
    assert runlog.batch_tokens({"image": np.zeros((2, 8, 8, 3)), "label": np.zeros(2, int)}) == 2
    assert runlog.batch_tokens([np.zeros((3, 5)), np.zeros((3, 9), np.int32)]) == 27


def test_host_memory_is_the_processs_resident_set_and_its_peak():
    """`runlog.host_memory`: the OS's figures, moving as this process touches memory: 256 MiB
    written raise the resident set and its peak by about that, and freed, the peak stays."""
    import gc

    from zerojax.app import runlog

    before = runlog.host_memory()
    assert 0 < before["host_rss_bytes"] <= before["host_rss_peak_bytes"]
    block = np.ones(256 << 20, np.uint8)  # every page written
    held = runlog.host_memory()
    assert held["host_rss_bytes"] - before["host_rss_bytes"] > 200 << 20
    assert held["host_rss_peak_bytes"] >= held["host_rss_bytes"]
    assert held["host_rss_peak_bytes"] - before["host_rss_peak_bytes"] > 0
    del block
    gc.collect()
    after = runlog.host_memory()
    assert after["host_rss_bytes"] < held["host_rss_bytes"] - (200 << 20)  # given back
    assert after["host_rss_peak_bytes"] >= held["host_rss_bytes"]


@pytest.mark.slow
def test_the_own_script_example_runs_as_docs_own_script_shows(tmp_path):
    """examples/own_script.py (docs/own-script.md): trains, logs, saves, restores on 2 devices
    under another stage, and exports to plain Flax, all with the same numbers."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "examples" / "own_script.py"
    spec = importlib.util.spec_from_file_location("own_script", path)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    out = ex.main(["--steps", "20", "--out", str(tmp_path)])
    steps = [r["step"] for r in out["records"]]
    assert steps == list(range(21)) and out["records"][20]["eval_loss"] == out["eval"]
    assert out["records"][-1]["loss"] < 0.8 * out["records"][1]["loss"]
    # The lr each step used (warm-up to 3e-3 in 10 steps, cosine to 3e-4 at step 20).
    assert out["records"][1]["lr"] == 0.0 and out["records"][11]["lr"] == pytest.approx(3e-3)
    assert out["records"][12]["lr"] == pytest.approx(
        3e-4 + 2.7e-3 * 0.5 * (1 + np.cos(np.pi / 10)), rel=1e-5)
    assert out["restored"] == pytest.approx(out["eval"], rel=1e-6)
    assert out["plain"] == pytest.approx(out["eval"], rel=1e-5)
    assert {p.name for p in tmp_path.iterdir()} >= {"metrics.jsonl", "loss.png", "tensorboard",
                                                     "checkpoints", "params.safetensors"}
    state, m = out["there"].step(out["restored_state"], ex.make_batch(21))  # and goes on
    assert int(state.step) == 21 and np.isfinite(float(m["loss"]))
