"""Any optax optimizer gives the numbers of single-device optax: the optimizer table
(optimizer_table.py) at stage 0 and at stage 1 on N = 3; checkpoints of every optimizer's state
restore on another N and stage. test_optimizers_sharded.py runs the table at stages 2 and 3,
N = 4, on a hybrid mesh, with grad_accum and offload.

The update a step runs depends on the stage only through the layout it sees (whole leaves at
stage 0, 1/N flat shards at stages 1-3), so the four configurations of the two files run every
optimizer over every layout and runner the engine has.
"""

import jax
import numpy as np
import optimizer_table as table
import pytest

import zerojax as zj


@pytest.mark.parametrize("bundle", range(len(table.BUNDLES)))
@pytest.mark.parametrize("config", ["stage0-n4", "stage1-n3"])
def test_optimizer_table_matches_single_device_optax(bundle, config):
    mesh_kw, cfg = {"stage0-n4": ({"data": 4}, {"stage": 0}),
                    "stage1-n3": ({"data": 3}, {"stage": 1})}[config]
    losses, params, _, _ = table.run(bundle, mesh_kw, cfg)
    table.assert_matches(bundle, losses, params)


def test_every_optimizer_state_restores_on_another_n_and_stage(tmp_path):
    """Saved after two steps at stage 3 on 4 devices (factored statistics, Muon's momentum,
    injected hyperparameters, copies of the initial params, MultiSteps' accumulators), restored
    at stage 1 on 3 devices for the third step: the numbers of the uninterrupted reference."""
    for bundle in range(len(table.BUNDLES)):
        _, _, engine, state = table.run(bundle, {"data": 4}, {"stage": 3}, steps=2)
        engine.save(state, tmp_path / str(bundle))
        other = zj.Engine(table.Bundle(table.BUNDLES[bundle]),
                          table.bundled(table.BUNDLES[bundle]), zj.make_mesh(data=3),
                          zj.ZeroConfig(stage=1))
        restored = other.restore(tmp_path / str(bundle))
        assert int(restored.step) == 2
        restored, m = other.step(restored, table.batches()[2])
        ref_losses = table.reference(bundle)[0]
        np.testing.assert_allclose(float(m["loss"]), ref_losses[2], rtol=table.LOSS_RTOL)
        table.assert_matches(bundle, None, other.params(restored))
        jax.clear_caches()
