"""Published-style Flax models (published_models.py), trained as they are: params boxed with
sharding hints, BatchNorm with a hard-coded axis name initialized in training mode, dropout
switched by a config field, NNX dropout with call-time keys. Each against single-device optax at
stages 0-3 (dropout off), dropout masks per step and device, repeatable evaluation, and a
checkpoint saved at stage 3 on 4 devices restored at stage 1 on 2."""

import functools
import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import published_models as pm
import pytest
from flax import nnx
from helpers import RTOL, assert_tree_close, sweep
from jax import lax
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax.units import PlainUnits

V, T, N, B, STEPS = 16, 4, 4, 8, 2


def lm_batch(step):
    tokens = np.random.default_rng(step).integers(0, V, (B, T + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def image_batch(step):
    rng = np.random.default_rng(100 + step)
    return {"x": rng.normal(size=(B, 4, 4, 1)).astype(np.float32),
            "y": rng.integers(0, 3, B).astype(np.int32)}


LM_BATCHES = [lm_batch(s) for s in range(STEPS)]
IMAGE_BATCHES = [image_batch(s) for s in range(STEPS)]


def xent(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def tx():
    return optax.adamw(1e-2, eps=1e-6)


def on_batch_axis(f):
    """`f` with the axis "batch" bound to this one device, as a single-device script has it."""
    return lambda *args: jax.tree.map(
        lambda x: x[0], jax.vmap(lambda _: f(*args), in_axes=None, axis_size=1,
                                 axis_name="batch")(0))


def reference_run(loss, params, state, batches):
    """Single-device optax on the global batches; `loss(params, state, batch) -> (loss, new
    state)`. Returns (losses, params, state)."""
    opt = tx()

    @jax.jit
    def step(params, state, opt_state, b):
        (value, state), g = jax.value_and_grad(loss, has_aux=True)(params, state, b)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), state, opt_state, value

    opt_state, losses = opt.init(params), []
    for b in batches:
        params, state, opt_state, value = step(params, state, opt_state, b)
        losses.append(float(value))
    return np.array(losses), params, state


# --------------------------------------------------------------------------- the user code
# What a user writes around the model files: a loss and, for a named batch axis, batch_axis=.


def boxed_loss(apply, batch, rngs):  # the step's keys passed on, as a training script does
    with nn.logical_axis_rules(pm.LOGICAL_RULES):
        logits = apply(batch["inputs"], deterministic=not apply.training, rngs=rngs)
    return xent(logits, batch["targets"])


def resnet_loss(apply, batch):
    logits = apply(batch["x"], train=apply.training)
    accuracy = lax.pmean(jnp.mean(jnp.argmax(logits, -1) == batch["y"]), "batch")
    return xent(logits, batch["y"]), {"accuracy": accuracy}


def config_loss(apply, batch):
    return xent(apply(batch["inputs"]), batch["targets"])


def nnx_loss(model, batch, rngs):
    return xent(model(batch["inputs"], rngs=rngs), batch["targets"])


class Boxed:
    batches, units = LM_BATCHES, (pm.MlpBlock,)

    def module(self, dropout):
        return pm.BoxedLM(V, 8, 2, rate=0.5 if dropout else 0.0)

    def zm(self, dropout=False, loss=boxed_loss):
        return zj.from_linen(self.module(dropout), loss, self.batches[0]["inputs"][:1],
                             units=self.units)

    def initial(self):
        boxed = jax.jit(self.module(False).init)(jax.random.key(0), self.batches[0]["inputs"][:1])
        return nn.unbox(boxed["params"]), None

    def reference(self):
        module = self.module(False)
        loss = lambda p, s, b: (xent(module.apply({"params": p}, b["inputs"]),  # noqa: E731
                                     b["targets"]), s)
        return reference_run(loss, initial(self.name)[0], None, self.batches)


class ResNet:
    batches, units = IMAGE_BATCHES, (pm.ResNetBlock,)
    module = pm.ResNet(stage_sizes=(1,))

    def zm(self, dropout=False, loss=resnet_loss):
        # The sample call runs in training mode (the module's default), where BatchNorm
        # reduces over "batch".
        return zj.from_linen(self.module, loss, self.batches[0]["x"][:1], units=self.units,
                             batch_axis="batch")

    def initial(self):
        init = on_batch_axis(lambda k: self.module.init(k, self.batches[0]["x"][:1]))
        variables = jax.jit(init)(jax.random.key(0))
        return variables["params"], {"batch_stats": variables["batch_stats"]}

    def reference(self):
        module = self.module

        @on_batch_axis
        def loss(p, stats, b):
            logits, new = module.apply({"params": p, **stats}, b["x"],
                                       mutable=["batch_stats"])
            return xent(logits, b["y"]), {"batch_stats": new["batch_stats"]}

        return reference_run(loss, *initial(self.name), self.batches)


class ConfigLM:
    batches, units = LM_BATCHES, (pm.DecoderBlock,)

    def module(self, dropout):
        return pm.ConfigLM(pm.LMConfig(layers=1, deterministic=not dropout))

    def zm(self, dropout=False, loss=config_loss):
        return zj.from_linen(self.module(dropout), loss, self.batches[0]["inputs"][:1],
                             units=self.units)

    def initial(self):
        module = self.module(False)
        sample = self.batches[0]["inputs"][:1]
        return jax.jit(module.init)(jax.random.key(0), sample)["params"], None

    def reference(self):
        module = self.module(False)
        loss = lambda p, s, b: (xent(module.apply({"params": p}, b["inputs"]),  # noqa: E731
                                     b["targets"]), s)
        return reference_run(loss, initial(self.name)[0], None, self.batches)


class NNXTransformer:
    batches, units = LM_BATCHES, (pm.Layer,)

    def module(self, dropout):
        with nnx.use_eager_sharding(False):  # hints as metadata (see test_nnx_explicit_mesh)
            return pm.Transformer(V, rate=0.5 if dropout else 0.0, rngs=nnx.Rngs(0))

    def zm(self, dropout=False, loss=nnx_loss):
        return zj.from_nnx(self.module(dropout), loss, units=self.units)

    def initial(self):
        return nnx.to_pure_dict(nnx.state(self.module(False), nnx.Param)), None

    def reference(self):
        graph, params, rest = nnx.split(self.module(False), nnx.Param, ...)

        def loss(p, s, b):
            model = nnx.merge(graph, p, jax.tree.map(lambda x: x, rest))  # of this trace
            model.train()
            return nnx_loss(model, b, nnx.Rngs(0)), s

        losses, params, _ = reference_run(loss, params, None, self.batches)
        return losses, nnx.to_pure_dict(params), None


CASES = {"boxed": Boxed(), "resnet": ResNet(), "config_lm": ConfigLM(), "nnx": NNXTransformer()}
for _name, _case in CASES.items():
    _case.name = _name


@functools.cache
def initial(name):
    """The initial (params, model state) of `jax.jit(module.init)` (shared: it compiles slowly)."""
    return CASES[name].initial()


@functools.cache
def reference(name):
    return CASES[name].reference()


# The ResNet's stage 3 runs on a hybrid mesh: its batch axis spans replica x data.
MESHES = {("resnet", 3): (2, 2)}


@functools.cache
def trained(name, stage):
    """(engine, final state, losses) of the dropout-off model from the reference's initial
    params: `engine.init` at stage 3 (checked to give them; for the ResNet, with the sample
    call in training mode, BatchNorm reducing over "batch"), `init_from` elsewhere."""
    case = CASES[name]
    replica, data = MESHES.get((name, stage), (1, N))
    mesh = zj.make_mesh(data=data, replica=replica)
    engine = zj.Engine(case.zm(), tx(), mesh, zj.ZeroConfig(stage=stage))
    params, model_state = initial(name)
    if stage == 3:
        state = engine.init(jax.random.key(0), case.batches[0])
        assert_init_params(engine.params(state), params)
        assert_bitwise(engine.model_state(state), model_state)
    else:
        state = engine.init_from(params, case.batches[0], model_state=model_state)
    losses = []
    for b in case.batches:
        state, m = engine.step(state, b)
        losses.append(float(m["loss"]))
    return engine, state, np.array(losses)


def assert_bitwise(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree.flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), jax.tree_util.keystr(path))


def assert_init_params(a, b):
    """`engine.init`'s params are `module.init`'s computed in the engine's own program: equal up
    to the rounding of a few elements (XLA may fuse the initializers' arithmetic otherwise)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_max_ulp(np.asarray(x), np.asarray(y), maxulp=4,
                                        dtype=np.float32)


def check_parity(name, engine, state, losses):
    ref_losses, ref_params, ref_state = reference(name)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_tree_close(engine.params(state), ref_params, rtol=RTOL, atol=1e-5)
    if ref_state is not None:  # BatchNorm's running statistics, over the global batch
        assert_tree_close(engine.model_state(state), ref_state, rtol=RTOL, atol=1e-6)


# --------------------------------------------------------------------------- parity


# quick: config_lm's directly called units and its attention train as in test_adapters.py's
# CNN and linen LM parity; its own feature, dropout by config, is in the slow dropout test.
@pytest.mark.parametrize("name, stage", sweep(
    [(name, stage) for name in CASES for stage in (0, 1, 2, 3)],
    quick=[("boxed", 3), ("resnet", 3), ("nnx", 3)]))
def test_parity_with_single_device_optax(name, stage):
    check_parity(name, *trained(name, stage))


def test_nnx_batch_axis_on_a_hybrid_mesh():
    def loss(model, batch):
        logits = model(batch["x"])
        accuracy = lax.pmean(jnp.mean(jnp.argmax(logits, -1) == batch["y"]), "batch")
        return xent(logits, batch["y"]), {"accuracy": accuracy}

    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(B, 6)).astype(np.float32),
                "y": rng.integers(0, 3, B).astype(np.int32)} for _ in range(STEPS)]
    zm = zj.from_nnx(pm.NormMLP(rngs=nnx.Rngs(0)), loss, batch_axis="batch")
    engine = zj.Engine(zm, tx(), zj.make_mesh(replica=2, data=2), zj.ZeroConfig(stage=2))
    state = engine.init(jax.random.key(0), batches[0])
    for b in batches:
        state, m = engine.step(state, b)

    graph, params, stats = nnx.split(pm.NormMLP(rngs=nnx.Rngs(0)), nnx.Param, ...)

    @on_batch_axis
    def ref_loss(p, stats, b):
        model = nnx.merge(graph, p, jax.tree.map(lambda x: x, stats))  # of this trace
        return loss(model, b)[0], nnx.state(model, nnx.BatchStat)

    _, params, stats = reference_run(ref_loss, params, stats, batches)
    assert_tree_close(engine.params(state), nnx.to_pure_dict(params), rtol=RTOL, atol=1e-5)
    assert_tree_close(engine.model_state(state), nnx.to_pure_dict(stats), rtol=RTOL, atol=1e-6)
    assert float(jnp.abs(engine.model_state(state)["norm"]["mean"]).max()) > 0


# --------------------------------------------------------------------------- dropout, checkpoints


def with_spread(loss):
    """`loss` with aux "sq" = loss²: over devices, mean(sq) - mean(loss)² > 0 exactly when the
    devices' losses differ."""
    if loss in (boxed_loss, nnx_loss):
        return lambda a, b, rngs: (v := loss(a, b, rngs), {"sq": v * v})
    return lambda a, b: (v := loss(a, b), {"sq": v * v})


def same_rows(batch):
    return {k: np.tile(v[: B // N], (N,) + (1,) * (v.ndim - 1)) for k, v in batch.items()}


@pytest.mark.parametrize("name, accum", sweep([("boxed", 1), ("config_lm", 1), ("nnx", 2)],
                                              quick=[]))  # quick: test_adapters.py
def test_dropout_masks_per_step_and_device_and_resume(name, accum, tmp_path):
    """lr 0 and the same rows on every device: only the masks make the losses differ, per
    step and per device; restored from a checkpoint the run draws the same masks again.
    `engine.evaluate` with the model's dropout on is repeatable. The initial params are
    `jax.jit(module.init)`'s (boxes removed)."""
    case = CASES[name]
    loss = {"boxed": boxed_loss, "config_lm": config_loss, "nnx": nnx_loss}[name]
    zm = case.zm(dropout=True, loss=with_spread(loss))
    engine = zj.Engine(zm, optax.sgd(0.0), zj.make_mesh(data=N),
                       zj.ZeroConfig(stage=3, grad_accum=accum))
    b = same_rows(case.batches[0])
    state = engine.init(jax.random.key(0), b)
    assert_init_params(engine.params(state), initial(name)[0])  # dropout has no params
    runs = []
    for i in range(3):
        if i == 1:
            engine.save(state, tmp_path)
        state, m = engine.step(state, b)
        runs.append((float(m["loss"]), float(m["sq"])))
    assert all(sq - value * value > 1e-6 for value, sq in runs), runs
    assert len({value for value, _ in runs}) == 3, runs
    evals = [float(engine.evaluate(state, b)["loss"]) for _ in range(2)]
    assert evals[0] == evals[1]
    # lr 0: the initial params, whose loss on batches[0] the reference's first step reports.
    # Dropout in evaluate is the model's choice: on where its config says so.
    plain = float(engine.evaluate(state, case.batches[0])["loss"])
    if name == "config_lm":
        assert abs(plain - reference(name)[0][0]) > 1e-3
    else:
        np.testing.assert_allclose(plain, reference(name)[0][0], rtol=1e-5)
    state = engine.restore(tmp_path)
    resumed = []
    for _ in range(2):
        state, m = engine.step(state, b)
        resumed.append((float(m["loss"]), float(m["sq"])))
    assert resumed == runs[1:]
    # Saved at stage 3 on 4 devices, restored at stage 1 on 2.
    check_restores(engine, tmp_path)


def test_resnet_restores_at_stage1_on_2(tmp_path):
    src, state, _ = trained("resnet", 3)  # stage 3, replica 2 x data 2
    src.save(state, tmp_path)
    check_restores(src, tmp_path, state)


def check_restores(src, directory, state=None):
    """The checkpoint in `directory` (stage 3, 4 devices; `state`, or as `src` restores it)
    restores at stage 1 on 2 devices: the same params and model state; `merge` gives the model
    back as Flax has it, sharding hints included."""
    state = src.restore(directory) if state is None else state
    dst = zj.Engine(src.model, src.optimizer, zj.make_mesh(data=2), zj.ZeroConfig(stage=1))
    back = dst.restore(directory)
    params = dst.params(back)
    assert_bitwise(params, src.params(state))
    assert_bitwise(dst.model_state(back), src.model_state(state))
    merged = src.model.merge(params, dst.model_state(back))
    if isinstance(src.model, zj.adapters.LinenModel):  # the boxes module.init makes
        boxed = jax.eval_shape(lambda: src.model.module.init(jax.random.key(0),
                                                             *src.model.sample_args))
        assert nn.get_partition_spec(merged) == nn.get_partition_spec(dict(boxed))
    else:  # the module keeps its variables' sharding metadata
        assert merged.stack.up.kernel.get_metadata()["out_sharding"] == (None, "model")


def test_nnx_explicit_mesh_params():
    """An NNX model built with eager sharding on an explicit-axes mesh of its own (its hints
    name "model") starts from the same values."""
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        model = pm.Transformer(V, rate=0.0, rngs=nnx.Rngs(0))
    assert model.stack.up.kernel[...].sharding.spec == P(None, None, "model")
    zm = zj.from_nnx(model, nnx_loss, units=(pm.Layer,))
    engine = zj.Engine(zm, tx(), zj.make_mesh(data=N), zj.ZeroConfig(stage=3))
    assert_bitwise(engine.params(engine.init(jax.random.key(0), LM_BATCHES[0])),
                   initial("nnx")[0])


# --------------------------------------------------------------------------- keys, errors


class Block(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)

    def __call__(self, x, *, rngs=None):
        return self.dropout(jnp.tanh(self.linear(x)), rngs=rngs)


class Loop(nnx.Module):
    """Blocks in a Python loop, each given the call-time rngs."""

    def __init__(self, rngs):
        self.blocks = nnx.List([Block(rngs) for _ in range(3)])

    def __call__(self, x, *, rngs=None):
        for block in self.blocks:
            x = block(x, rngs=rngs)
        return x


def test_nnx_call_time_rngs_count_through_unit_calls():
    """A unit call hands the rngs' advanced counters back: per-block units draw the keys the
    whole model as one unit draws (else every block would repeat the first one's mask)."""
    model = Loop(nnx.Rngs(0))
    loss = lambda m, b, rngs: jnp.mean(m(b["x"], rngs=rngs) ** 2)  # noqa: E731
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    b = {"x": np.ones((4, 4), np.float32)}
    whole, per_block = (jax.jit(lambda p, k, zm=zm: zm.loss(p, b, PlainUnits(rng=k)))
                        for zm in (zj.from_nnx(model, loss),
                                   zj.from_nnx(model, loss, units=(Block,))))
    value = float(whole(params, jax.random.key(0)))
    assert float(per_block(params, jax.random.key(0))) == value
    assert float(whole(params, jax.random.key(1))) != value  # the keys are the units'


class Drop(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        return nn.Dropout(0.5, deterministic=not train)(nn.Dense(4)(x))


def test_linen_keys_passed_to_apply_are_used():
    """`apply(..., rngs=...)`: the user's keys for the streams they name; a third parameter of
    the loss gets the step's keys."""
    x = np.ones((4, 4), np.float32)
    step_keys = lambda apply, b, rngs: apply(b, rngs=rngs).sum()  # noqa: E731
    own_keys = lambda apply, b: apply(b, rngs={"dropout": jax.random.key(7)}).sum()  # noqa: E731
    losses = []
    for loss in (step_keys, own_keys):
        zm = zj.from_linen(Drop(), loss, x)
        run = jax.jit(lambda p, k, zm=zm: zm.loss(p, x, PlainUnits(rng=k)))
        params = jax.jit(zm.init)(jax.random.key(0))  # one program, not op by op
        losses += [float(run(params, jax.random.key(k))) for k in (0, 1)]
    assert losses[0] != losses[1]  # the step's keys
    assert losses[2] == losses[3]  # the user's own


def test_unbound_axis_names_are_model_errors():
    sample = IMAGE_BATCHES[0]["x"][:1]
    with pytest.raises(zj.ModelError, match=r"axis 'batch'.*batch_axis='batch'"):
        zj.from_linen(pm.ResNet(), resnet_loss, sample)
    for bad, match in [("data", "mesh axes"), (("batch",), "a string")]:
        with pytest.raises(zj.ModelError, match=match):
            zj.from_linen(pm.ResNet(), resnet_loss, sample, batch_axis=bad)

    class TensorParallel(nn.Module):  # a second name, the model's tensor-parallel axis
        @nn.compact
        def __call__(self, x):
            return lax.psum(nn.Dense(3)(pm.ResNet()(x)), "model")

    with pytest.raises(zj.ModelError, match=r"axis 'model'"):
        zj.from_linen(TensorParallel(), resnet_loss, sample, batch_axis="batch")
    zm = zj.from_nnx(pm.NormMLP(rngs=nnx.Rngs(0)), lambda m, b: m(b["x"]).mean())
    engine = zj.Engine(zm, tx(), zj.make_mesh(data=2), zj.ZeroConfig(stage=1))
    with pytest.raises(zj.ModelError, match=r"axis 'batch'.*batch_axis='batch'"):
        engine.init(jax.random.key(0), {"x": np.zeros((4, 6), np.float32)})


# --------------------------------------------------------------------------- the docs


def doc_snippets():
    text = (pathlib.Path(__file__).parents[1] / "docs" / "models.md").read_text()
    section = text.split("## Published models, as they are", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.mark.slow  # end to end: the docs' snippets as a reader runs them
def test_doc_snippets_run(capsys):
    """docs/models.md shows each pattern with a snippet that runs as it is (their asserts
    included); the boxed one prints the hint module.init made."""
    snippets = doc_snippets()
    assert len(snippets) == 4
    for code in snippets:
        exec(compile(code, "docs/models.md", "exec"), {"__name__": "snippet"})
    assert "P(None, 'model')" in capsys.readouterr().out
