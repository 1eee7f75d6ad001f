"""Bad input gets one clear exception at the public boundary, naming the value and the fix."""

import jax
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
