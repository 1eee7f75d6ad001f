"""Shared test helpers: a single-device optax reference and GPT batches."""

import functools
import json
import os

import jax
import numpy as np
import optax
import pytest

from zerojax.models import GPT
from zerojax.units import PlainUnits

STEPS = 20
LR, WD, CLIP = 3e-3, 0.1, 0.5

# conftest compiles without XLA:CPU's fusion emitters (faster); they change fusion and with it
# temp bytes by up to 1 %, so tests that read buffer figures compile with the default ones.
DEFAULT_BUFFERS = {"xla_cpu_use_fusion_emitters": True}


def gpt_batch(cfg, batch, step, seed=0):
    """A deterministic, learnable batch for `step`: random starts of t -> (3t + 1) mod V."""
    rng = np.random.default_rng([seed, step])
    tokens = np.empty((batch, cfg.seq_len + 1), np.int64)
    tokens[:, 0] = rng.integers(0, cfg.vocab_size, batch)
    for t in range(cfg.seq_len):
        tokens[:, t + 1] = (3 * tokens[:, t] + 1) % cfg.vocab_size
    tokens = tokens.astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def adamw():
    # eps=1e-6, not 1e-8: the attention key bias has an exactly-zero gradient (softmax is
    # shift-invariant), so with eps=1e-8 Adam turns rounding noise of any reduction order
    # into lr-sized steps of random sign and no two correct implementations agree there.
    return optax.adamw(LR, weight_decay=WD, eps=1e-6)


def fused_adamw():
    """`adamw()` as zerojax.adamw: the same optimizer, which an offloaded engine runs as one
    fused pass on the host (zerojax/offload/fused.py)."""
    import zerojax as zj

    return zj.adamw(LR, weight_decay=WD, eps=1e-6)


def reference_run(model, optimizer, batches, clip=CLIP, rng=0):
    """Plain single-device optax on the global batches: (per-step losses, final params)."""
    tx = optax.chain(optax.clip_by_global_norm(clip), optimizer) if clip else optimizer
    params = jax.jit(model.init)(jax.random.key(rng))  # as Engine.init: one program, not eager
    state = tx.init(params)

    @jax.jit
    def step(params, state, batch):
        loss, g = jax.value_and_grad(lambda p: model.loss(p, batch, PlainUnits()))(params)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss, optax.tree.norm(g)

    losses, norms = [], []
    for b in batches:
        params, state, loss, norm = step(params, state, b)
        losses.append(float(loss))
        norms.append(float(norm))
    reference_run.norms = np.array(norms)  # grad norms of the last run, before clipping
    return np.array(losses), params


def engine_run(engine, batches, rng=0, params=None):
    """`engine`'s run on `batches` from `engine.init(key(rng))`, or from `params` when given."""
    state = engine.init(jax.random.key(rng), batches[0]) if params is None else \
        engine.init_from(params, batches[0])
    losses, norms = [], []
    for b in batches:
        state, m = engine.step(state, b)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    engine_run.norms = np.array(norms)
    return np.array(losses), engine.params(state), state


def assert_tree_close(a, b, rtol, atol=0.0, leaf_rtol=None):
    """Params agree: relative L2 error of the whole vector <= rtol, of each leaf <= leaf_rtol
    (default 10·rtol), and every element within atol + rtol·|ref|.

    Adam divides by sqrt(v): where a gradient crosses zero, reduction-order noise of 1e-7
    moves single elements of small, zero-initialized leaves (biases) by ~lr·1e-3, so their
    per-leaf relative error sits near 1e-5 for any two correct implementations. A broken
    leaf (a missing or doubled reduction) is off by ~1e-1 and fails every bound.
    """
    leaf_rtol = 10 * rtol if leaf_rtol is None else leaf_rtol
    assert jax.tree.structure(a) == jax.tree.structure(b)
    num = den = 0.0
    for (path, x), y in zip(jax.tree.flatten_with_path(a)[0], jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        name = jax.tree_util.keystr(path)
        assert x.shape == y.shape, name
        rel = np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)
        assert rel <= leaf_rtol, f"{name}: relative L2 error {rel:.3g} > {leaf_rtol}"
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=name)
        num, den = num + np.sum((x - y) ** 2), den + np.sum(y**2)
    total = np.sqrt(num / den)
    assert total <= rtol, f"relative L2 error of all params {total:.3g} > {rtol}"


def moved_error(params, ref, start) -> float:
    """|params - ref| relative to how far the reference moved from `start` (L2, all leaves):
    unlike an absolute bound, it does not hide a wrong update when updates are small, and
    unlike a per-element one it does not fail on Adam's zero crossings (above)."""
    def dist(a, b):
        return np.sqrt(sum(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2)
                           for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))

    return float(dist(params, ref) / dist(ref, start))


def tiny_gpt():
    return GPT.from_preset("test")




# The parity set-up shared by test_parity.py and test_engine.py.
GLOBAL_BATCH = 24  # divisible by 1, 2, 3, 4, 8 and by 2 x 4 x ... (hybrid)
RTOL, ATOL = 1e-5, 1e-5


@functools.cache
def reference(batch, steps=STEPS):
    model = tiny_gpt()
    batches = [gpt_batch(model.cfg, batch, s) for s in range(steps)]
    out = reference_run(model, adamw(), batches)
    return batches, out, reference_run.norms


def check_parity(engine, batch=GLOBAL_BATCH):
    batches, (ref_losses, ref_params), ref_norms = reference(batch)
    losses, params, check_parity.state = engine_run(engine, batches)  # the final state
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    # The reported norm is the true global one (all shards, no padding), before clipping.
    np.testing.assert_allclose(engine_run.norms, ref_norms, rtol=1e-4)
    assert_tree_close(params, ref_params, rtol=RTOL, atol=ATOL)
    return losses


VARIANTS = {"0": {"stage": 0}, "1": {"stage": 1}, "2": {"stage": 2}, "3": {"stage": 3},
            "3-prefetch": {"stage": 3, "prefetch": True}}


def sweep(values, quick):
    """`values` for `pytest.mark.parametrize`, each one not in `quick` marked `slow` (run by
    CI's second tier, see conftest.py); a tuple is one case of several arguments."""
    return [v if v in quick else pytest.param(*(v if isinstance(v, tuple) else (v,)),
                                              marks=pytest.mark.slow)
            for v in values]


def by_tag(records: list[dict], dtype=np.float32) -> dict[str, dict[int, float]]:
    """What a run's sinks should hold of `records`: each value by tag and step, in `dtype`
    (TensorBoard keeps float32, W&B float64)."""
    from zerojax.app.sinks import scalars

    out: dict[str, dict[int, float]] = {}
    for r in records:
        for k, v in scalars(r).items():
            out.setdefault(k, {})[r["step"]] = float(dtype(v))
    return out


def tensorboard_scalars(out, path=None) -> dict[str, dict[int, float]]:
    """The scalars of a run's TensorBoard event files (or of one file, `path`) by tag and step,
    as TensorBoard's reader sees them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path or out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def wandb_history(out) -> list[dict]:
    """The offline W&B runs in `out/wandb` (not its `superseded/`), oldest first: each one's
    id, project, config and history ({tag: {step: value}}), from its transaction log
    (`run-ID.wandb`) as W&B's own reader (`wandb leet inspect --json`) gives its records."""
    import json
    import subprocess
    import sys

    import wandb

    wandb.teardown()  # `finish` leaves the writing to wandb's service; this waits for it
    runs = []
    for path in sorted(out.glob("wandb/offline-run-*/run-*.wandb")):
        lines = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                                str(path)], capture_output=True, text=True, check=True,
                               env=dict(os.environ, WANDB_MODE="offline")).stdout
        run = {"history": {}, "config": {}}
        for r in map(json.loads, lines.splitlines()):
            if r["type"] == "run":
                run |= {"id": r["run"]["run_id"], "project": r["run"]["project"]}
                run["config"] |= r["run"].get("config", {}).get("update", {})
            elif r["type"] == "history":
                row = dict(r["history"]["item"])
                step = row.pop("_step")
                for tag, v in row.items():
                    if not tag.startswith("_"):
                        run["history"].setdefault(tag, {})[step] = v
        runs.append(run)
    return runs


def full_disk_after(n):
    """A patch of orbax's JSON writer: the first `n` writes go through, then every write goes
    to /dev/full (the kernel's ENOSPC, from inside orbax's background save)."""
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as jh

    real, calls = jh.JsonCheckpointHandler._save_fn, []

    async def save_fn(self, x, directory):
        calls.append(directory)
        if len(calls) <= n:
            return await real(self, x, directory)
        with open("/dev/full", "w") as f:
            f.write(json.dumps(x))

    return jh.JsonCheckpointHandler, "_save_fn", save_fn
