"""The optimizer table (optimizer_table.py) at stage 0 on N = 4, at stage 3 on a 2x2 hybrid
mesh with grad_accum=2 and the optimizer state offloaded, and with the bundles' matrices split
over a model axis (stage 3 on data 4 x model 2, stage 1 on replica 2 x data 2 x model 2):
every optimizer, the numbers of single-device optax (test_optimizers.py has stages 1 and 2)."""

import optimizer_table as table
import pytest
from helpers import reference_run, sweep


@pytest.mark.parametrize("bundle", range(len(table.BUNDLES)))
@pytest.mark.parametrize("config", sweep(["stage0-n4", "stage3-hybrid2x2-accum2-offload"],
                                         quick=["stage3-hybrid2x2-accum2-offload"]))
def test_optimizer_table_matches_single_device_optax(bundle, config):
    losses, params, _ = table.run(bundle, config)
    table.assert_matches(bundle, losses, params)


# Bundle 0 holds the whole-matrix (Muon) and factored (Adafactor, SM3) optimizers.
@pytest.mark.parametrize(("bundle", "config"), sweep(
    [(b, c) for c in ("stage3-data4-model2", "stage1-hybrid2x2-model2")
     for b in range(len(table.BUNDLES))], quick=[]))
def test_optimizer_table_with_a_model_axis_matches_single_device_optax(bundle, config):
    losses, params, _ = table.run(bundle, config)
    table.assert_matches(bundle, losses, params, split=True)


@pytest.mark.parametrize("dtype", sweep(["bfloat16", "float16"], quick=["bfloat16"]))
def test_trust_ratio_optimizers_in_half_precision_at_stage_3_match_stage_0(dtype):
    """LAMB, LARS and Fromage with bf16 compute, and fp16 with loss scaling (the update's
    finite-step path): stage 3's sharded update (the per-leaf norms as segment sums, the
    `reshard` annotations half precision brings passed through) against stage 0's, where every
    device holds whole leaves; the same gradients on CPU. Measured in bf16: losses equal,
    params within 4e-7 of how far stage 0 moved them."""
    import jax
    import numpy as np

    import zerojax as zj

    names = ["lamb", "lars", "fromage"]
    runs = []
    for stage in (0, 3):
        engine = zj.Engine(table.Bundle(names), table.bundled(names), zj.make_mesh(data=4),
                           zj.ZeroConfig(stage=stage, param_dtype=dtype))
        bs = table.batches()
        state = engine.init(jax.random.key(0), bs[0])
        start, losses = jax.device_get(engine.params(state)), []
        for b in bs:
            state, m = engine.step(state, b)
            losses.append(float(m["loss"]))
        runs.append((losses, jax.device_get(engine.params(state)), start))
    (ref_losses, ref, start), (losses, params, _) = runs
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    dist = lambda a, b: np.sqrt(sum(np.sum((np.asarray(x, np.float64) - np.asarray(y)) ** 2)
                                    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))
    for n in names:
        assert dist(params[n], ref[n]) <= 1e-5 * dist(ref[n], start[n]), n


def test_muon_on_data_by_model_matches_single_device_optax():
    """Muon alone (its owner-based Newton-Schulz on a whole matrix split over `model`) at
    stage 3 on data 4 x model 2, two steps: the quick tier's check of what the table's
    model-axis runs (slow) check for every optimizer."""
    import jax
    import numpy as np

    import zerojax as zj

    class OneMatrix(table.Bundle):  # the matrix alone: no scanned stack to compile
        def init(self, rng):
            return {n: {k: v for k, v in p.items() if k != "stack"}
                    for n, p in super().init(rng).items()}

        def param_specs(self):
            return {n: {"w": s["w"], "t": None} for n, s in super().param_specs().items()}

    model, tx = OneMatrix(["muon"], split=True), table.bundled(["muon"])
    bs = table.batches()[:2]
    ref_losses, params = reference_run(model, tx, bs, clip=None)
    start = jax.jit(model.init)(jax.random.key(0))
    engine = zj.Engine(model, tx, zj.make_mesh(data=4, model=2), zj.ZeroConfig(stage=3))
    state = engine.init(jax.random.key(0), bs[0])
    losses = []
    for b in bs:
        state, m = engine.step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=table.LOSS_RTOL)
    got = engine.params(state)["muon"]
    for k in ("w",):  # the matrix moved as optax moved it
        moved = np.abs(np.asarray(params["muon"][k]) - np.asarray(start["muon"][k])).max()
        assert moved > 1e-3 and np.abs(np.asarray(got[k]) - np.asarray(params["muon"][k])).max() \
            <= table.MOVE_RTOL * moved, k
