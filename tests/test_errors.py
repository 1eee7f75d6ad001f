"""Bad input gets one clear exception at the public boundary, naming the value and the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import gpt_batch, tiny_gpt

import zerojax as zj
from zerojax.models import SeedMLP


def engine(stage=1, n=4, **cfg):
    return zj.Engine(tiny_gpt(), optax.adam(1e-3), zj.make_mesh(data=n),
                     zj.ZeroConfig(stage=stage, **cfg))


def test_batch_not_divisible_by_data_parallel_size():
    batch = gpt_batch(tiny_gpt().cfg, 6, 0)
    with pytest.raises(zj.BatchError, match=r"6 .*divisible.* 4"):
        engine(n=4).init(jax.random.key(0), batch)


def test_batch_leaves_with_different_leading_sizes():
    batch = gpt_batch(tiny_gpt().cfg, 8, 0)
    batch["targets"] = batch["targets"][:4]
    with pytest.raises(zj.BatchError, match=r"different leading.*8.*4"):
        engine().init(jax.random.key(0), batch)


def test_step_checks_the_batch_too():
    e = engine(n=4)
    state = e.init(jax.random.key(0), gpt_batch(tiny_gpt().cfg, 8, 0))
    with pytest.raises(zj.BatchError, match="10"):
        e.step(state, gpt_batch(tiny_gpt().cfg, 10, 0))


@pytest.mark.parametrize("stage", [-1, 4, "1", True])
def test_unknown_stage(stage):
    with pytest.raises(zj.ConfigError, match=f"stage={stage!r}"):
        zj.ZeroConfig(stage=stage)


def test_unknown_dtype():
    with pytest.raises(zj.ConfigError, match="float8.*bfloat16"):
        zj.ZeroConfig(param_dtype="float8")
    with pytest.raises(zj.ConfigError, match="int8"):
        zj.ZeroConfig(reduce_dtype="int8")


def test_mesh_without_data_axis():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("batch",))
    with pytest.raises(zj.MeshError, match="no 'data' axis"):
        zj.Engine(tiny_gpt(), optax.adam(1e-3), mesh, zj.ZeroConfig())


def test_mesh_larger_than_devices():
    with pytest.raises(zj.MeshError, match="needs 32 devices but only 8"):
        zj.make_mesh(data=16, replica=2)


def test_a_mesh_on_fewer_devices_than_exist_says_so(caplog):
    """data=2 × model=3 on 8 devices leaves 2 idle: one warning naming the count, none when
    `devices=` chose them."""
    with caplog.at_level("WARNING", logger="zerojax"):
        mesh = zj.make_mesh(data=2, model=3)
    assert mesh.devices.size == 6
    assert [r.getMessage() for r in caplog.records] == [
        "mesh replica=1 × data=2 × model=3 uses 6 of the 8 devices (2 idle); pass "
        "devices=jax.devices()[:6] to choose them"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="zerojax"):
        zj.make_mesh(data=2, model=3, devices=jax.devices()[:6])
        zj.make_mesh(model=2)
    assert not caplog.records


def test_grad_accum_not_dividing_device_batch():
    batch = gpt_batch(tiny_gpt().cfg, 8, 0)  # 2 per device on 4 devices
    with pytest.raises(zj.BatchError, match=r"per-device batch 2.*grad_accum=4"):
        engine(n=4, grad_accum=4).init(jax.random.key(0), batch)


@pytest.mark.parametrize("bad", [dict(grad_accum=0), dict(clip_norm=-1.0),
                                 dict(loss_scale="static"), dict(prefetch=True, stage=2)])
def test_bad_config_values(bad):
    with pytest.raises(zj.ConfigError):
        zj.ZeroConfig(**bad)


class ForgetsBias(SeedMLP):
    """Never gathers layer2.b."""

    def loss(self, params, batch, units):
        l1 = units.gather(params["layer1"])
        w = units.gather({"w": params["layer2"]["w"]})["w"]
        return ((batch["x"] @ l1["w"]) * w - batch["y"]).mean()


class ComputesOnHandle(SeedMLP):
    def loss(self, params, batch, units):
        return (batch["x"] @ params["layer1"]["w"]).mean()


SEED_BATCH = {"x": np.ones((2, 2), np.float32), "y": np.ones((2,), np.float32)}


def test_param_never_gathered_is_named():
    """As plain JAX would, the engine trains it with a zero gradient, and says so once."""
    e = zj.Engine(ForgetsBias(), optax.sgd(0.1), zj.make_mesh(data=2), zj.ZeroConfig(stage=3))
    with pytest.warns(UserWarning, match=r"never gathers.*\['layer2'\]\['b'\].*zero gradient"):
        e.init(jax.random.key(0), SEED_BATCH)


def test_computing_on_an_ungathered_param_is_named():
    e = zj.Engine(ComputesOnHandle(), optax.sgd(0.1), zj.make_mesh(data=2),
                  zj.ZeroConfig(stage=1))
    with pytest.raises(zj.ModelError, match=r"\['layer1'\]\['w'\].*units.gather"):
        e.init(jax.random.key(0), SEED_BATCH)


def test_init_from_wrong_structure_names_leaves():
    e = zj.Engine(SeedMLP(), optax.sgd(0.1), zj.make_mesh(data=2), zj.ZeroConfig(stage=1))
    params = SeedMLP().init(None)
    params["layer1"]["w"] = np.zeros(3, np.float32)
    with pytest.raises(zj.ModelError, match=r"\['layer1'\]\['w'\]: expected \(2,\), got \(3,\)"):
        e.init_from(params, SEED_BATCH)


def test_step_before_init():
    with pytest.raises(RuntimeError, match="init"):
        engine().step(None, gpt_batch(tiny_gpt().cfg, 8, 0))


# ---------------------------------------------------------------- types as well as values


@pytest.mark.parametrize("bad, match", [
    (dict(stage=3.0), r"stage=3\.0 \(float\) must be an integer"),
    (dict(grad_accum=2.0), r"grad_accum=2\.0 \(float\) must be a positive integer"),
    (dict(remat="yes"), r"remat='yes' \(str\) must be True or False"),
    (dict(stage=3, prefetch="no"), r"prefetch='no' \(str\) must be True or False"),
    (dict(loss_scale_init=-5.0), r"loss_scale_init=-5\.0 must be a positive finite number"),
    (dict(loss_scale_init=float("nan")), r"loss_scale_init=nan must be a positive finite"),
    (dict(param_dtype="float16", loss_scale_init=float("inf")), r"loss_scale_init=inf must"),
    (dict(loss_scale_init=1e39), r"loss_scale_init=1e\+39 must"),  # inf as float32
    (dict(loss_scale=float("inf")), r"loss_scale=inf must be 'dynamic', a positive finite"),
    (dict(clip_norm="1.0"), r"clip_norm='1\.0' \(str\) must be a positive number"),
    (dict(loss_scale_interval=1.5), r"loss_scale_interval=1\.5 \(float\) must be an integer"),
])
def test_config_refuses_wrong_types_and_non_finite_values(bad, match):
    with pytest.raises(zj.ConfigError, match=match):
        zj.ZeroConfig(**bad)


def test_config_keeps_numpy_scalars_as_python_values():
    cfg = zj.ZeroConfig(stage=np.int64(3), remat=np.bool_(False), clip_norm=np.float32(1.0))
    assert (cfg.stage, cfg.remat, cfg.clip_norm) == (3, False, 1.0)
    assert type(cfg.stage) is int and type(cfg.remat) is bool and type(cfg.clip_norm) is float
    assert cfg == zj.ZeroConfig(stage=3, remat=False, clip_norm=1.0)


def test_a_seed_is_not_a_key_and_a_mesh_is_a_mesh():
    e = seed_engine()
    for rng in (0, np.zeros(2, np.int32), jax.random.split(jax.random.key(0))):
        with pytest.raises(zj.ArgumentError, match="PRNG key.*jax.random.key"):
            e.init(rng, SEED_BATCH)
    assert e.plan is None  # refused before the loss was traced
    with pytest.raises(zj.ArgumentError, match=r"rng='0' is not a PRNG key"):
        e.init_from(SeedMLP().init(None), SEED_BATCH, rng="0")
    with pytest.raises(zj.MeshError, match=r"mesh=None is not a jax.sharding.Mesh; .*make_mesh"):
        zj.Engine(tiny_gpt(), optax.adam(1e-3), None, zj.ZeroConfig())
    assert isinstance(zj.ArgumentError("x"), TypeError)  # what jax would raise, and a ValueError
    e.init(jax.random.PRNGKey(0), SEED_BATCH)  # raw key data (jax.random.PRNGKey) is a key too


@pytest.fixture(scope="module")
def stepped():
    """A stage-3 engine on 4 devices, its init batch and a state."""
    e = engine(stage=3)
    batch = gpt_batch(tiny_gpt().cfg, 8, 0)
    return e, batch, e.init(jax.random.key(0), batch)


def seed_engine(stage=3, n=2, **cfg):
    return zj.Engine(SeedMLP(), optax.adam(0.1), zj.make_mesh(data=n),
                     zj.ZeroConfig(stage=stage, **cfg))


def test_a_state_must_be_a_live_state_of_this_engine(tmp_path):
    e, batch = seed_engine(), SEED_BATCH  # the walkthrough's MLP: 3 leaves, quick to compile
    state = e.init(jax.random.key(0), batch)
    for call in (e.step, e.evaluate, e.params, e.model_state):
        with pytest.raises(zj.StateError, match=r"state is None \(NoneType\), not a "
                                                r"zerojax.TrainState"):
            call(None, batch) if call in (e.step, e.evaluate) else call(None)
    with pytest.raises(zj.StateError, match=r"not a zerojax.TrainState"):
        e.params({"master": state.master})
    other = seed_engine(stage=1)  # stage 1 keeps replicated compute params, stage 3 none (fp32)
    with pytest.raises(zj.StateError, match=r"stage 3, float32, 2 devices\): state.compute "
                                            r"holds 3 arrays, this engine's none"):
        e.step(other.init(jax.random.key(0), batch), batch)
    bf16 = seed_engine(param_dtype="bfloat16")  # a compute copy that fp32 does not keep
    with pytest.raises(zj.StateError, match=r"state.compute holds 3 arrays, this engine's none"):
        e.evaluate(bf16.init(jax.random.key(0), batch), batch)
    fewer = seed_engine(n=1)  # here the same shard shapes, on other devices
    with pytest.raises(zj.StateError, match=r"state is on devices \[0\], this engine's mesh "
                                            r"on \[0, 1\]: a state of another mesh"):
        e.step(fewer.init(jax.random.key(0), batch), batch)
    delayed = seed_engine(param_dtype="bfloat16", offload="optimizer", delayed_update=0)
    pending = delayed.init(jax.random.key(0), batch)  # a field whose leaves are nested
    pending = pending._replace(pending=pending.pending._replace(grads=jax.tree.map(
        lambda g: g.astype(jnp.float32), pending.pending.grads)))
    with pytest.raises(zj.StateError, match=r"state.pending.grads\['layer1'\]\['w'\] is "
                                            r"float32\(2,\), this engine's bfloat16\(2,\)"):
        delayed.params(pending)
    new, _ = e.step(state, batch)
    with pytest.raises(zj.StateError, match=r"state.step was donated to an earlier engine.step "
                                            r"\(its buffers are deleted\); pass the state that "
                                            r"step returned"):
        e.step(state, batch)
    with pytest.raises(zj.StateError, match="donated"):
        e.save(state, tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert int(e.step(new, batch)[0].step) == 2


@pytest.mark.parametrize("case, match", [
    ("missing", r"missing batch\['targets'\]\); pass batches with the keys of the init batch "
                r"\(\['inputs'\], \['targets'\]\)"),
    ("extra", r"extra batch\['mask'\]"),
    ("list", r"the batch is a list; the engine was initialized with a dict"),
    ("shape", r"batch\['inputs'\] is int32\[B, 8\]; the engine was initialized with "
              r"int32\[B, 16\] \(any batch size B"),
    ("dtype", r"batch\['targets'\] is float32\[B, 16\]; .* int32\[B, 16\]"),
])
def test_a_batch_must_look_like_the_init_batch(stepped, case, match):
    e, batch, state = stepped
    bad = {"missing": {"inputs": batch["inputs"]},
           "extra": {**batch, "mask": batch["inputs"]},
           "list": [batch["inputs"], batch["targets"]],
           "shape": {k: v[:, :8] for k, v in batch.items()},
           "dtype": {**batch, "targets": batch["targets"].astype(np.float32)}}[case]
    # evaluate takes any sizes (another sequence length); the step only another batch size.
    for call in (e.step, e.evaluate) if case != "shape" else (e.step,):
        with pytest.raises(zj.BatchError, match=match):
            call(state, bad)
    assert e.evaluate(state, {k: v[:4] for k, v in batch.items()})["loss"].shape == ()


def test_init_names_the_batch_key_the_model_reads():
    batch = gpt_batch(tiny_gpt().cfg, 8, 0)
    with pytest.raises(zj.BatchError, match=r"the model reads batch\['targets'\], which the "
                                            r"batch lacks \(its keys: \['inputs'\]\)"):
        engine().init(jax.random.key(0), {"inputs": batch["inputs"]})
    with pytest.raises(zj.BatchError, match=r"a batch that is a list, not a dict"):
        engine().init(jax.random.key(0), [batch["inputs"], batch["targets"]])


# --------------------------------------------------------------------------------- the run log

RUNLOG_BAD = {  # case: (RunLog keyword arguments, message)
    "negative start": ({"start": -1}, "RunLog: start=-1 must be a non-negative integer"),
    "string start": ({"start": "5"}, "RunLog: start='5' must be a non-negative integer"),
    "negative peak": ({"peak_tflops": -1}, "RunLog: peak_tflops=-1 must be a finite, positive"),
    "nan peak": ({"peak_tflops": float("nan")}, "RunLog: peak_tflops=nan must be a finite"),
    "string peak": ({"peak_tflops": "abc"}, "RunLog: peak_tflops='abc' must be a finite"),
    "zero flops": ({"flops_per_step": 0.0}, "RunLog: flops_per_step=0.0 must be a finite"),
    "empty project": ({"wandb": " "}, "RunLog: wandb=' ' must name a W&B project"),
    "config": ({"config": [1]}, "RunLog: config=[1] must be a dict"),
    "plot every": ({"plot_every": -1}, "RunLog: plot_every=-1 must be a finite number >= 0"),
}


@pytest.mark.parametrize("case", list(RUNLOG_BAD))
def test_run_log_checks_its_arguments_at_the_door(case, tmp_path):
    kwargs, message = RUNLOG_BAD[case]
    with pytest.raises(zj.ArgumentError) as e:
        zj.RunLog(tmp_path / "run", tensorboard=False, **kwargs)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_run_log_on_a_file_or_without_its_packages_is_one_error(tmp_path, monkeypatch):
    import importlib.util

    from zerojax.app.files import RunFileError

    (tmp_path / "file").write_text("x")
    with pytest.raises(RunFileError, match=r"^RunLog: out '.*/file' is a file; name a directory$"):
        zj.RunLog(tmp_path / "file", tensorboard=False)
    with pytest.raises(RunFileError, match=r"out '.*/file/run' is under '.*/file', which is a "):
        zj.RunLog(tmp_path / "file" / "run", tensorboard=False)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tensorboard").write_text("x")  # where the event files go: a file
    with pytest.raises(RunFileError, match=r"^cannot write TensorBoard event files in .*/run/"
                                           r"tensorboard: it is a file, not a directory; move "
                                           r"it away, or turn TensorBoard off"):
        zj.RunLog(tmp_path / "run")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "tensorboardX")
                        else real(name, *a))
    with pytest.raises(zj.ArgumentError, match=r"^RunLog: wandb='p' needs the wandb package: "
                                               r"pip install 'zerojax\[wandb\]', or drop"):
        zj.RunLog(tmp_path / "run", tensorboard=False, wandb="p")
    with pytest.raises(zj.ArgumentError, match=r"needs the tensorboardX package: pip install "
                                               r"tensorboardX, or pass tensorboard=False$"):
        zj.RunLog(tmp_path / "run")


def test_run_log_steps_increase_and_each_record_is_checked(tmp_path):
    import json

    one = {"loss": np.float32(2.0), "grad_norm": np.float32(1.0)}
    # No sinks but metrics.jsonl, and no plot (matplotlib): nothing to close.
    log = zj.RunLog(tmp_path, tensorboard=False, plot_every=1e9)
    log.eval(0, 3.0)
    log.step(5, one, seconds=0.1)
    for step in (5, 3):  # a repeated step, an earlier one
        with pytest.raises(zj.ArgumentError, match=rf"^step {step} after step 5: metrics."
                                                   r"jsonl takes each step once"):
            log.step(step, one, seconds=0.1)
    with pytest.raises(zj.ArgumentError, match="^step 5 after step 5"):
        log.eval(5, 1.0)
    bad = {"step 'a'": (("a", one), "RunLog.step: step='a' must be a non-negative integer"),
           "no loss": ((1, {}), "RunLog.step: metrics lack 'loss', 'grad_norm' (they have "
                                "[]); pass the dict engine.step returns"),
           "an array": ((6, one | {"acc": np.zeros(3)}), "RunLog.step: metrics['acc']="),
           "a record's key": ((6, one | {"step_time_s": 1.0, "host_rss_bytes": 2}),
                              "RunLog.step: metrics 'host_rss_bytes', 'step_time_s' have the "
                              "name of a key the record computes itself; rename the model's "
                              "aux metric (e.g. 'aux_host_rss_bytes')"),
           "the step": ((6, one | {"step": 6}), "RunLog.step: metrics 'step' have the name"),
           "negative time": ((6, one), "RunLog.step: seconds=-1 must be a finite number")}
    for case, (args, message) in bad.items():
        with pytest.raises(zj.ArgumentError) as e:
            log.step(*args, np.zeros((2, 4), np.int32),
                     seconds=-1 if case == "negative time" else 0.1)
        assert str(e.value).startswith(message), case
    log.step(jnp.asarray(6, jnp.int32), one, seconds=0.1)  # state.step as it comes
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 5, 6]
    # Reopened from step 5 (a resume): step 6 is superseded, so it may be written again.
    log = zj.RunLog(tmp_path, start=5, tensorboard=False, plot_every=1e9)
    assert [r["step"] for r in log.records] == [0, 5]
    log.step(6, one, seconds=0.2)
    assert [r["step"] for r in log.records] == [0, 5, 6] and log.records[2]["step_time_s"] == 0.2


def test_throughput_and_peaks_refuse_what_they_cannot_measure():
    for args, message in [((2e12, 0.0, 4), "throughput: seconds=0.0 must be a finite, positive"),
                          ((2e12, 0.5, 0), "throughput: devices=0 must be a positive integer"),
                          ((2e12, 0.5, 4, -1.0), "throughput: peak=-1.0 must be a finite"),
                          ((2e12, 0.5, 4, float("inf")), "throughput: peak=inf must be"),
                          ((-1.0, 0.5, 4), "throughput: flops=-1.0 must be a finite number >=")]:
        with pytest.raises(zj.ArgumentError) as e:
            zj.throughput(*args)
        assert str(e.value).startswith(message), args
    with pytest.raises(zj.ArgumentError, match=r"^peak_tflops\(42\): give a jax device or its "
                                               r"device_kind string"):
        zj.peak_tflops(42)
    from zerojax.analysis import flops

    with pytest.raises(zj.ArgumentError, match=r"^the MFU: peak_tflops=-1.0 must be a finite"):
        flops.run_peak(jax.devices()[0], "float32", -1.0)


def test_run_log_warns_once_when_the_mfu_exceeds_100_percent(tmp_path):
    from zerojax.app.runlog import PeakWarning, mesh_text

    assert mesh_text(zj.make_mesh(data=4, model=2)) == "data 4 × model 2"  # the plot's title
    assert mesh_text(zj.make_mesh(data=8)) == "data 8"

    one = {"loss": 2.0, "grad_norm": 1.0}
    log = zj.RunLog(tmp_path, tensorboard=False, plot_every=1e9, flops_per_step=8e12,
                    peak_tflops=1e-9)
    with pytest.warns(PeakWarning, match=r"^MFU .*% at step 1 exceeds 100 %: the peak it is "
                                         r"against, 1e-09 TFLOP/s per device, is below"):
        log.step(1, one, seconds=1.0)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log.step(2, one, seconds=1.0)  # once per run
