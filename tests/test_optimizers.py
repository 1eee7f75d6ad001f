"""Any optax optimizer gives the numbers of single-device optax: the optimizer table
(optimizer_table.py) at stage 1 on N = 3 and stage 2 on N = 4; the state of every kind of
optimizer restores on another N and stage. test_optimizers_sharded.py runs the table at stage 0
and at stage 3 on a hybrid mesh with grad_accum and offload.

The update a step runs depends on the stage only through the layout it sees (whole leaves at
stage 0, 1/N flat shards at stages 1-3), so the four configurations of the two files run every
optimizer over every layout and runner the engine has.
"""

import jax
import numpy as np
import optimizer_table as table
import pytest
from helpers import sweep


@pytest.mark.parametrize("bundle", range(len(table.BUNDLES)))
@pytest.mark.parametrize("config", sweep(["stage1-n3", "stage2-n4"], quick=[]))  # quick: stage 3
def test_optimizer_table_matches_single_device_optax(bundle, config):
    losses, params, _ = table.run(bundle, config)
    table.assert_matches(bundle, losses, params)


def test_optimizer_states_restore_on_another_n_and_stage(tmp_path):
    """Saved after two steps at stage 2 on 4 devices (factored statistics, Muon's momentum, a
    noise key, injected hyperparameters, MultiSteps' accumulators, copies of the initial
    params), restored at stage 1 on 3 devices for the third step: the numbers of the
    uninterrupted reference."""
    _, _, state = table.run(0, "stage2-n4", steps=2)
    table.engine(0, "stage2-n4").save(state, tmp_path)
    other = table.engine(0, "stage1-n3")
    restored = other.restore(tmp_path)
    assert int(restored.step) == 2
    restored, m = other.step(restored, table.batches()[2])
    np.testing.assert_allclose(float(m["loss"]), table.reference(0)[0][2], rtol=table.LOSS_RTOL)
    table.assert_matches(0, None, other.params(restored))
    # The optimizer state as single-device optax has it: moments, counts, keys, factors.
    got, want = other.optimizer_state(restored), table.reference.opt_state[0, False]
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree.flatten_with_path(got)[0], jax.tree.leaves(want)):
        if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))
