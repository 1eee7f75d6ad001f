"""experiments/offload_split.py, the prototype of offload's update on the CPU backend: its
numbers against single-device optax (the GPU figures are in docs/performance.md)."""

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import CLIP, adamw

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def _split():
    spec = importlib.util.spec_from_file_location(
        "offload_split", ROOT / "experiments" / "offload_split.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reference(mod, model, params, batch, steps, clip, delayed, compute):
    """Single-device optax: the clip and AdamW on the float32 master, the gradient at its
    `compute` copy; with `delayed`, each step's gradient taken before the last one is
    applied."""
    tx = optax.chain(optax.clip_by_global_norm(clip), adamw())
    units = mod.PlainUnits(compute, False)

    @jax.jit
    def grad(master):
        low = jax.tree.map(lambda x: x.astype(compute), master)
        loss, g = jax.value_and_grad(lambda p: model.loss(p, batch, units))(low)
        g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
        return loss, g, optax.global_norm(g)

    @jax.jit
    def apply(master, opt, g):
        updates, opt = tx.update(g, opt, master)
        return optax.apply_updates(master, updates), opt

    master, opt, pending, losses, norms = params, tx.init(params), None, [], []
    for _ in range(steps):
        loss, g, norm = grad(master)
        losses.append(float(loss))
        norms.append(float(norm))
        if delayed:
            if pending is not None:
                master, opt = apply(master, opt, pending)
            pending = g
        else:
            master, opt = apply(master, opt, g)
    return master, losses, norms


# The delayed step in float32 for 4 steps (3 updates applied, each one step late); the plain
# step in bfloat16 for its first step only: later, a last-bit difference between two programs'
# AdamW arithmetic moves a master element across a bfloat16 rounding boundary, and the
# gradients part there.
@pytest.mark.parametrize("delayed, compute, steps", [(True, jnp.float32, 4),
                                                     (False, jnp.bfloat16, 1)])
def test_the_split_update_matches_single_device_optax(delayed, compute, steps):
    mod = _split()
    model = mod.GPT.from_preset("test")
    batch = mod.make_batch(model, 4)
    params = jax.jit(model.init)(jax.random.key(0))
    ref, ref_losses, norms = _reference(mod, model, params, batch, steps, CLIP, delayed,
                                        compute)
    assert max(norms) > CLIP  # the clip's scaling branch is taken
    split = mod.SplitOffload(model, params, slices=3, tx=adamw(), clip=CLIP, remat=False,
                             compute=compute)
    run = split.delayed_step if delayed else split.step
    losses = [float(run(batch)) for _ in range(steps)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    got = split.params()
    # distance from the reference relative to how far the reference moved
    dist = lambda a, b: float(optax.global_norm(jax.tree.map(jnp.subtract, a, b)))
    moved = dist(ref, params)
    assert moved > 1e-3
    assert dist(got, ref) <= 1e-5 * moved
    if delayed:  # the last gradient is pending, not applied: one update behind the plain run
        plain, _, _ = _reference(mod, model, params, batch, steps, CLIP, False, compute)
        assert dist(got, plain) > 1e-2 * moved


def test_offload_overlap_reports_every_form_and_updates_as_optax(tmp_path):
    """experiments/offload_overlap.py on CPU: every form of the host update, both call orders
    and the transfers reported; its sliced update is AdamW's."""
    import sys

    sys.path.insert(0, str(ROOT / "experiments"))
    import offload_overlap as ov

    out = tmp_path / "overlap.json"
    res = ov.main(["--params", "4096", "--slices", "1", "2", "--repeats", "1",
                   "--engine-update", "0", "--device-seconds", "0.001", "--device-size", "16",
                   "--out", str(out)])
    assert set(res["host_update"]) == {"1 slice(s), dispatch", "2 slice(s), dispatch",
                                       "2 slice(s), threads"}
    for r in res["host_update"].values():
        assert r["GBps"] > 0 and r["state_GB"] >= 0
    o = res["overlap"]
    assert o["sum_ms"] == pytest.approx(o["device_ms"] + o["host_ms"])
    assert min(o["device_first_ms"], o["host_first_ms"], o["device_dispatch_ms"]) > 0
    assert set(res["transfer_GBps"]) == {"device -> CPU backend", "CPU backend -> device"}
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    tx = optax.adamw(1e-3, weight_decay=0.1)
    upd = ov.HostUpdate(10, 2, tx)
    upd.run("threads")
    upd.run("dispatch")
    master, state = jnp.zeros(10), tx.init(jnp.zeros(10))
    for _ in range(2):
        u, state = tx.update(jnp.full(10, 1e-3, jnp.bfloat16).astype(jnp.float32), state, master)
        master = optax.apply_updates(master, u)
    assert float(jnp.abs(master).min()) > 0
    np.testing.assert_allclose(np.concatenate([np.asarray(m) for m in upd.master]), master,
                               rtol=1e-6)
