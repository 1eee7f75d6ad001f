"""`from_nnx` / `from_linen`: unmodified Flax models against plain single-device optax."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import RTOL, assert_tree_close, sweep

import zerojax as zj
from zerojax.analysis.hlo import collective_bytes, matmul_flops
from zerojax.analysis.measurement import lower

V, T, D = 32, 8, 16
STEPS, N = 3, 4


def lm_batch(step, batch=8):
    tokens = np.random.default_rng(step).integers(0, V, (batch, T + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


BATCHES = [lm_batch(s) for s in range(STEPS)]


def xent(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def tx():
    return optax.adamw(3e-3, eps=1e-6)


# --------------------------------------------------------------------------- the NNX model


class Block(nnx.Module):
    def __init__(self, d, rngs, rate=0.0):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, d, use_bias=False, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.fc = nnx.Linear(d, 4 * d, rngs=rngs)
        self.out = nnx.Linear(4 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x), mask=nnx.make_causal_mask(x[..., 0]))
        return x + self.drop(self.out(jax.nn.gelu(self.fc(self.ln2(x)))))


class MLPBlock(nnx.Module):
    def __init__(self, d, rngs):
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.fc = nnx.Linear(d, 4 * d, rngs=rngs)
        self.out = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        return x + self.out(jax.nn.gelu(self.fc(self.ln(x))))


class NNXLM(nnx.Module):
    """Blocks in an nnx.List, called in a Python loop; the head is the embedding (tied)."""

    def __init__(self, rngs, layers=3, d=D, rate=0.0, block=None):
        self.embed = nnx.Embed(V, d, rngs=rngs)
        block = block or (lambda: Block(d, rngs, rate))
        self.blocks = nnx.List([block() for _ in range(layers)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.ln(x))


class ScannedNNXLM(nnx.Module):
    """Blocks stacked by nnx.vmap and run by nnx.scan."""

    def __init__(self, rngs, layers=3, d=D):
        self.embed = nnx.Embed(V, d, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs):
            return Block(d, rngs)

        self.blocks = stack(rngs)
        self.ln = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        return self.embed.attend(self.ln(body(self.embed(tokens), self.blocks)))


def nnx_loss(model, batch):
    return xent(model(batch["inputs"]), batch["targets"])


def nnx_reference(model):
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    fresh = lambda tree: jax.tree.map(lambda x: x, tree)  # noqa: E731 -- Variables of this trace
    losses, params = reference_run(lambda p, b: nnx_loss(nnx.merge(graph, p, fresh(rest)), b),
                                   params)
    return losses, nnx.to_pure_dict(params)


def reference_run(loss_fn, params):
    """Plain single-device optax on the global batches: (losses, final params)."""
    opt = tx()

    @jax.jit
    def step(params, state, b):
        loss, g = jax.value_and_grad(loss_fn)(params, b)
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    state, losses = opt.init(params), []
    for b in BATCHES:
        params, state, loss = step(params, state, b)
        losses.append(float(loss))
    return np.array(losses), params


def reference_with_state(loss_fn, params, stats, batches, opt):
    """Plain single-device optax with model state: `loss_fn(params, stats, batch) -> (loss,
    new stats)`; returns the final (params, stats)."""

    @jax.jit
    def step(params, stats, opt_state, b):
        g, stats = jax.grad(loss_fn, has_aux=True)(params, stats, b)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state

    opt_state = opt.init(params)
    for b in batches:
        params, stats, opt_state = step(params, stats, opt_state, b)
    return params, stats


# --------------------------------------------------------------------------- the linen model


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        mask = nn.make_causal_mask(x[..., 0])
        x = x + nn.MultiHeadDotProductAttention(2, use_bias=False)(nn.LayerNorm()(x), mask=mask)
        h = nn.gelu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x)))
        return x + nn.Dense(x.shape[-1])(h), None


class LinenLM(nn.Module):
    """Blocks stacked by nn.scan; the head is the embedding (tied)."""

    layers: int = 3
    d: int = D

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(V, self.d)
        blocks = nn.scan(ScanBlock, variable_axes={"params": 0},
                         split_rngs={"params": True}, length=self.layers)
        x, _ = blocks(name="blocks")(embed(tokens), None)
        return embed.attend(nn.LayerNorm()(x))


def linen_loss(apply, batch):
    return xent(apply(batch["inputs"]), batch["targets"])


def linen_reference(module):
    # jitted: one program, not flax's init op by op
    params = jax.jit(module.init)(jax.random.key(0), BATCHES[0]["inputs"][:1])["params"]
    return reference_run(lambda p, b: linen_loss(lambda *a: module.apply({"params": p}, *a), b),
                         params)


@functools.cache
def nnx_setup():
    model = NNXLM(nnx.Rngs(0))
    return model, nnx_reference(model)


@functools.cache
def linen_setup():
    module = LinenLM()
    return module, linen_reference(module)


@functools.cache
def linen_engine(stage):
    """The linen LM's engine at `stage`, its scanned blocks the units: the parity run trains
    it, the memory test reads its compiled step."""
    zm = zj.from_linen(LinenLM(), linen_loss, BATCHES[0]["inputs"][:1], units=(ScanBlock,))
    return zj.Engine(zm, tx(), zj.make_mesh(data=N), zj.ZeroConfig(stage=stage))


def run(zm, stage):
    return train(zj.Engine(zm, tx(), zj.make_mesh(data=N), zj.ZeroConfig(stage=stage)))


def train(engine):
    state = engine.init(jax.random.key(0), BATCHES[0])
    losses = []
    for b in BATCHES:
        state, m = engine.step(state, b)
        losses.append(float(m["loss"]))
    return np.array(losses), engine.params(state)


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("stage", sweep([0, 1, 2, 3], quick=[3]))
def test_nnx_parity(stage):
    model, (ref_losses, ref_params) = nnx_setup()
    zm = zj.from_nnx(model, nnx_loss, units=(Block,))
    assert zm.unit_paths == [("blocks", 0), ("blocks", 1), ("blocks", 2)]
    losses, params = run(zm, stage)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_tree_close(params, ref_params, rtol=RTOL, atol=RTOL)
    assert losses[-1] < losses[0]
    # The trained params go back into the user's module.
    trained = zm.merge(params)
    assert isinstance(trained, NNXLM)
    np.testing.assert_allclose(trained.blocks[1].fc.kernel[...],
                               params["blocks"][1]["fc"]["kernel"])


def test_nnx_unit_called_twice():
    """A block instance used twice (tied weights across depth) is one unit: gathered for
    each call, its gradient the sum of both uses."""
    model = NNXLM(nnx.Rngs(0), layers=2)
    model.blocks = nnx.List([model.blocks[0], model.blocks[1], model.blocks[0]])
    ref_losses, ref_params = nnx_reference(model)
    zm = zj.from_nnx(model, nnx_loss, units=(Block,))
    assert zm.unit_paths == [("blocks", 0), ("blocks", 1)]
    losses, params = run(zm, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_tree_close(params, ref_params, rtol=RTOL, atol=RTOL)


@pytest.mark.slow  # quick: test_published.py's nnx parity (an nnx.vmap stack run by nnx.scan)
def test_nnx_scan_parity():
    model = ScannedNNXLM(nnx.Rngs(0))
    ref_losses, ref_params = nnx_reference(model)
    zm = zj.from_nnx(model, nnx_loss, units=(Block,))
    assert zm.unit_paths == [("blocks",)]
    losses, params = run(zm, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_tree_close(params, ref_params, rtol=RTOL, atol=RTOL)


@pytest.mark.parametrize("stage", sweep([0, 1, 2, 3], quick=[3]))
def test_linen_scan_parity(stage):
    module, (ref_losses, ref_params) = linen_setup()
    engine = linen_engine(stage)
    zm = engine.model
    assert (zm.instances, list(zm.stacks)) == ([], [("blocks",)])
    losses, params = train(engine)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    # One kernel element whose gradient crosses zero moves by Adam's lr-sized noise (1.8e-5):
    # elementwise atol 1e-4; the relative L2 errors keep RTOL.
    assert_tree_close(params, ref_params, rtol=RTOL, atol=1e-4)
    # The merged variables apply as Flax's own (traced, not run: only the shape is checked).
    logits = jax.eval_shape(module.apply, zm.merge(params), BATCHES[0]["inputs"])
    assert logits.shape == (8, T, V)


# --------------------------------------------------------------------------- memory


def all_gathers(hlo_text):
    return len(re.findall(r"= \S+ all-gather(?:-start)?\(", hlo_text))


def stage3(zm, batch):
    """(peak bytes per device, param count, compiled HLO) of a stage-3 step, donated state;
    `zm` a model, or a stage-3 engine of one."""
    engine = zm if isinstance(zm, zj.Engine) else zj.Engine(zm, tx(), zj.make_mesh(data=N),
                                                           zj.ZeroConfig(stage=3))
    compiled = lower(engine, batch).compile()
    mem = compiled.memory_analysis()
    peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes)
    return peak, engine.layout.num_params, compiled.as_text()


L8 = 8


@pytest.mark.slow
def test_nnx_units_free_gathered_blocks():
    """Per-block units: each block gathered before its call and again in backward, never kept
    from forward to backward; the peak drops by most of the params' bytes."""
    rngs = nnx.Rngs(0)
    model = NNXLM(rngs, layers=L8, d=32, block=lambda: MLPBlock(32, rngs))
    batch = lm_batch(0)
    whole, num_params, _ = stage3(zj.from_nnx(model, nnx_loss, units=()), batch)
    per_block, _, hlo = stage3(zj.from_nnx(model, nnx_loss, units=(MLPBlock,)), batch)
    assert per_block <= whole - 0.5 * 4 * num_params  # fp32 compute params
    # Without units= the repeated block is found: the same program.
    auto = zj.from_nnx(model, nnx_loss)
    assert auto.classes == (MLPBlock,) and stage3(auto, batch)[0] == per_block
    assert all_gathers(hlo) == 1 + 2 * L8  # root; each block forward and in backward


def test_without_full_remat_a_unit_keeps_its_matmul_outputs_not_its_weights():
    """Stage 3 with `remat=False`: a unit's backward gathers its weights again (still 1 + 2
    per block) and recomputes the rest, but not its matrix products, whose outputs forward
    kept (as `units.scan`'s layers; before, an adapter's unit recomputed everything whatever
    `remat` said). Trains as single-device optax."""
    model = NNXLM(nnx.Rngs(0), layers=2)
    ref_losses, ref_params = nnx_reference(model)
    zm = zj.from_nnx(model, nnx_loss, units=(Block,))
    texts = {}
    for remat in (True, False):
        engine = zj.Engine(zm, tx(), zj.make_mesh(data=N), zj.ZeroConfig(stage=3, remat=remat))
        texts[remat] = stage3(engine, BATCHES[0])[2]
    assert all_gathers(texts[False]) == all_gathers(texts[True]) == 1 + 2 * 2
    # each block's forward products run once: its backward has only the gradients' own
    assert matmul_flops(texts[False])[0] < 0.85 * matmul_flops(texts[True])[0]
    losses, params = train(engine)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_tree_close(params, ref_params, rtol=RTOL, atol=RTOL)


def test_nnx_scan_units_free_gathered_layers(caplog):
    model = ScannedNNXLM(nnx.Rngs(0), layers=L8, d=32)
    batch = lm_batch(0)
    whole, num_params, hlo_whole = stage3(zj.from_nnx(model, nnx_loss, units=()), batch)
    with caplog.at_level("INFO", logger="zerojax"):
        auto = zj.from_nnx(model, nnx_loss)  # the nnx.vmap stack is found: one unit per layer
    assert auto.classes == (Block,) and "units=(Block) chosen: the stacked layers" in caplog.text
    assert auto.unit_paths == [("blocks",)]
    per_layer, _, hlo = stage3(auto, batch)
    assert per_layer <= whole - 0.5 * 4 * num_params
    sent = lambda text: collective_bytes(text, N)["all_gather"]  # noqa: E731
    assert sent(hlo) > 1.8 * sent(hlo_whole)  # each layer gathered forward and in backward


def test_linen_scan_units_free_gathered_layers():
    module = LinenLM()
    batch = lm_batch(0)
    sample = jax.ShapeDtypeStruct((1, T), jnp.int32)  # as for module.init: arrays or shapes
    whole, num_params, hlo_whole = stage3(zj.from_linen(module, linen_loss, sample, units=()),
                                          batch)
    per_layer, _, hlo = stage3(linen_engine(3), batch)  # units=(ScanBlock,)
    assert per_layer <= whole - 0.5 * 4 * num_params
    # Without units= the nn.scan stack is found: the per-layer program, its peak to the byte.
    auto = zj.from_linen(module, linen_loss, sample)
    assert auto.classes == (ScanBlock,) and stage3(auto, batch)[0] == per_layer
    # The layers are gathered inside the loops, once forward and once backward.
    sent = lambda text: collective_bytes(text, N)["all_gather"]  # noqa: E731
    assert sent(hlo) > 1.8 * sent(hlo_whole)


# --------------------------------------------------------------------------- rng and state


@pytest.mark.slow  # per step and device: test_nnx_dropout_differs_per_device_and_resumes_bitwise
def test_nnx_dropout_draws_new_masks_every_step():
    model = NNXLM(nnx.Rngs(0), layers=2, rate=0.5)
    zm = zj.from_nnx(model, nnx_loss, units=(Block,))
    engine = zj.Engine(zm, optax.sgd(0.0), zj.make_mesh(data=2), zj.ZeroConfig(stage=3))
    batch = BATCHES[0]
    state = engine.init(jax.random.key(0), batch)
    losses = []
    for _ in range(3):
        state, m = engine.step(state, batch)
        losses.append(float(m["loss"]))
    assert len(set(losses)) == 3, losses  # lr 0: only the dropout masks change
    # Evaluation is deterministic: the plain module in eval mode gives the same loss.
    evals = [float(engine.evaluate(state, batch)["loss"]) for _ in range(2)]
    model.eval()
    assert evals[0] == evals[1]
    # jitted: one program, not the module's forward op by op
    np.testing.assert_allclose(evals[0], float(nnx.jit(nnx_loss)(model, batch)), rtol=1e-5)


def test_nnx_dropout_differs_per_device_and_resumes_bitwise(tmp_path):
    """The same rows on every device: with shared masks the devices' losses would agree, so a
    positive spread over devices shows each draws its own; a resumed run repeats the masks."""
    def loss_fn(model, batch):
        loss = nnx_loss(model, batch)
        return loss, {"loss_sq": loss * loss}  # pmean(l²) - pmean(l)² = spread over devices

    rows = {k: np.tile(v[:2], (N, 1)) for k, v in BATCHES[0].items()}
    zm = zj.from_nnx(NNXLM(nnx.Rngs(0), layers=2, rate=0.5), loss_fn, units=(Block,))
    engine = zj.Engine(zm, optax.sgd(0.0), zj.make_mesh(data=N), zj.ZeroConfig(stage=3))
    state = engine.init(jax.random.key(0), rows)
    runs = []
    for i in range(4):
        if i == 2:
            engine.save(state, tmp_path / "ckpt")
        state, m = engine.step(state, rows)
        runs.append((float(m["loss"]), float(m["loss_sq"])))
    assert all(sq - loss * loss > 1e-6 for loss, sq in runs), runs
    assert len({loss for loss, _ in runs}) == 4, runs
    state = engine.restore(tmp_path / "ckpt")
    resumed = []
    for _ in range(2):
        state, m = engine.step(state, rows)
        resumed.append((float(m["loss"]), float(m["loss_sq"])))
    assert resumed == runs[2:]


def test_linen_model_state_restores_on_another_mesh_and_stage(tmp_path):
    """Saved under stage 3 on 4 devices, restored under stage 1 on 2: params, BatchNorm
    statistics and the base key come back bitwise."""
    ex, zm, src, state, _ = cnn_run(3)
    src.save(state, tmp_path / "ckpt")
    dst = zj.Engine(zm, optax.adam(1e-2), zj.make_mesh(data=2), zj.ZeroConfig(stage=1))
    back = dst.restore(tmp_path / "ckpt")
    assert_tree_close(dst.params(back), src.params(state), rtol=0, atol=0)
    assert_tree_close(dst.model_state(back), src.model_state(state), rtol=0, atol=0)
    assert float(jnp.abs(dst.model_state(back)["batch_stats"]["ConvBlock_0"]["BatchNorm_0"]
                         ["mean"]).max()) > 0
    np.testing.assert_array_equal(np.asarray(back.rng), np.asarray(state.rng))
    _, m2 = dst.step(back, ex.make_batch(STEPS, 16))  # and it trains on from there
    assert np.isfinite(float(m2["loss"]))


def load_example(name):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def cnn_run(stage):
    """(example, model, engine, state, batches) of the example CNN, its BatchNorm over the batch
    axes, in per-block units, trained `STEPS` steps on 4 devices at `stage`."""
    ex = load_example("linen_cnn_batchnorm")
    mesh = zj.make_mesh(data=N)
    batches = [ex.make_batch(s, 16) for s in range(STEPS)]
    sample = jnp.zeros((1, ex.SIZE, ex.SIZE, 1))
    zm = zj.from_linen(ex.CNN(axis_name=zj.batch_axes(mesh)), ex.loss_fn, sample,
                       units=(ex.ConvBlock,))
    engine = zj.Engine(zm, optax.adam(1e-2), mesh, zj.ZeroConfig(stage=stage))
    state = engine.init(jax.random.key(0), batches[0])
    for b in batches:
        state, _ = engine.step(state, b)
    return ex, zm, engine, state, batches


@pytest.mark.parametrize("stage", sweep([0, 1, 2, 3], quick=[3]))
def test_linen_batchnorm_matches_global_batch(stage):
    """BatchNorm over the batch axes inside per-block units: params and running statistics
    as one device's BatchNorm over the global batch."""
    ex, _, engine, state, batches = cnn_run(stage)
    sample = jnp.zeros((1, ex.SIZE, ex.SIZE, 1))
    ref = ex.CNN()
    variables = jax.jit(ref.init)(jax.random.key(0), sample)  # one program, not op by op
    params, stats = variables["params"], variables["batch_stats"]
    def loss(p, stats, b):
        logits, new = ref.apply({"params": p, "batch_stats": stats}, b["images"],
                                train=True, mutable=["batch_stats"])
        return xent(logits, b["labels"]), new["batch_stats"]

    params, stats = reference_with_state(loss, params, stats, batches, optax.adam(1e-2))
    assert_tree_close(engine.params(state), params, rtol=RTOL, atol=1e-5)
    assert_tree_close(engine.model_state(state), {"batch_stats": stats}, rtol=RTOL, atol=1e-6)


# --------------------------------------------------------------------------- the examples


@pytest.mark.parametrize("name", sweep(["nnx_transformer", "linen_scan_transformer"],
                                        quick=[]))  # end to end: CI's slow tier
def test_transformer_examples_train_and_go_back_to_flax(name):
    out = load_example(name).main(["--steps", "6", "--layers", "1"])
    assert out["losses"][-1] < 0.8 * out["losses"][0]
    # engine.evaluate and the plain Flax module with the trained params agree.
    np.testing.assert_allclose(out["eval"], out["plain"], rtol=1e-5)


@pytest.mark.slow  # end to end, as the transformer examples
def test_cnn_example_trains_and_goes_back_to_flax():
    out = load_example("linen_cnn_batchnorm").main(["--steps", "12"])
    assert out["losses"][-1] < 0.5 * out["losses"][0]
    assert out["eval"] == out["plain"] >= 0.9
    stats = out["variables"]["batch_stats"]["ConvBlock_0"]["BatchNorm_0"]
    assert float(jnp.abs(stats["mean"]).max()) > 0  # the running statistics moved


def test_unit_class_the_model_lacks_is_a_model_error():
    model, _ = nnx_setup()
    with pytest.raises(zj.ModelError, match="no instance of the unit class.*ScanBlock"):
        zj.from_nnx(model, nnx_loss, units=(ScanBlock,))
    module, _ = linen_setup()
    sample = BATCHES[0]["inputs"][:1]
    with pytest.raises(zj.ModelError, match="calls no instance of the unit class.*Block"):
        zj.from_linen(module, linen_loss, sample, units=(Block,))
    with pytest.raises(zj.ModelError, match="must name module classes"):
        zj.from_linen(module, linen_loss, sample, units=("ScanBlock",))


class BNLayer(nnx.Module):
    def __init__(self, d_in, d_out, axis_name, rngs):
        self.linear = nnx.Linear(d_in, d_out, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(d_out, momentum=0.9, axis_name=axis_name, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.bn(self.linear(x)))


class BNNet(nnx.Module):
    def __init__(self, axis_name, rngs):
        self.layers = nnx.List([BNLayer(8, 16, axis_name, rngs), BNLayer(16, 16, axis_name, rngs)])
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def bn_loss(model, batch):
    return xent(model(batch["x"]), batch["y"])


def test_nnx_batchnorm_matches_global_batch():
    mesh = zj.make_mesh(data=N)
    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(16, 8)).astype(np.float32),
                "y": rng.integers(0, 4, 16).astype(np.int32)} for _ in range(STEPS)]
    zm = zj.from_nnx(BNNet(zj.batch_axes(mesh), nnx.Rngs(0)), bn_loss, units=(BNLayer,))
    engine = zj.Engine(zm, tx(), mesh, zj.ZeroConfig(stage=3))
    state = engine.init(jax.random.key(0), batches[0])
    for b in batches:
        state, _ = engine.step(state, b)

    graph, params, stats = nnx.split(BNNet(None, nnx.Rngs(0)), nnx.Param, ...)
    def loss(p, stats, b):
        model = nnx.merge(graph, p, jax.tree.map(lambda x: x, stats))  # of this trace
        return bn_loss(model, b), nnx.state(model, nnx.BatchStat)

    params, stats = reference_with_state(loss, params, stats, batches, tx())
    assert_tree_close(engine.params(state), nnx.to_pure_dict(params), rtol=RTOL, atol=1e-5)
    model_state = engine.model_state(state)
    assert_tree_close(model_state, nnx.to_pure_dict(stats), rtol=RTOL, atol=1e-6)
    assert float(jnp.abs(model_state["layers"][0]["bn"]["mean"]).max()) > 0


def test_linen_scan_stack_on_another_axis_is_a_model_error():
    class Moved(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            blocks = nn.scan(ScanBlock, variable_axes={"params": 1},
                             split_rngs={"params": True}, length=2)
            return blocks(name="blocks")(nn.Embed(V, D)(tokens), None)[0].sum()

    from zerojax.units import PlainUnits

    sample = BATCHES[0]["inputs"][:1]
    zm = zj.from_linen(Moved(), lambda apply, b: apply(b["inputs"]), sample, units=(ScanBlock,))
    params = jax.jit(zm.init)(jax.random.key(0))  # jitted or traced below: not op by op
    with pytest.raises(zj.ModelError, match="on axis 0"):
        jax.eval_shape(lambda p: zm.loss(p, BATCHES[0], PlainUnits()), params)
    # Without the unit, the same model runs as one unit, exactly as plain linen.
    zm = zj.from_linen(Moved(), lambda apply, b: apply(b["inputs"]), sample)
    np.testing.assert_allclose(jax.jit(lambda p: zm.loss(p, BATCHES[0], PlainUnits()))(params),
                               jax.jit(Moved().apply)({"params": params}, BATCHES[0]["inputs"]),
                               rtol=1e-6)


def test_nnx_unit_never_called_is_a_model_error():
    from zerojax.units import PlainUnits

    model, _ = nnx_setup()
    zm = zj.from_nnx(model, lambda m, b: m.embed(b["inputs"]).sum(), units=(Block,))
    with pytest.raises(zj.ModelError, match=r"/blocks/0, /blocks/1, /blocks/2 were not run"):
        zm.loss(zm.init(None), BATCHES[0], PlainUnits())


# --------------------------------------------------------------------------- where scans meet xs


SCALES = np.array([0.5, -1.0, 2.0], np.float32)  # one per layer: xs of the scan
XD = 8


def xs_batch(step):
    rng = np.random.default_rng(step)
    return {"x": rng.normal(size=(8, XD)).astype(np.float32)}


def xs_loss(out, ys):
    """A loss that reads every layer's output in its place (weights 1, 2, 3)."""
    return jnp.mean(jnp.square(out)) + jnp.sum(ys * jnp.arange(1.0, 4.0)), {
        f"y{i}": ys[i] for i in range(3)}


class XsLayer(nn.Module):
    @nn.compact
    def __call__(self, x, scale):
        y = jnp.tanh(nn.Dense(XD)(x) * scale)
        return x + y, y.mean()


class XsLinen(nn.Module):
    @nn.compact
    def __call__(self, x):
        layers = nn.scan(XsLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                         in_axes=0, length=3)
        return layers(name="layers")(x, jnp.asarray(SCALES))


class XsBlock(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(XD, XD, rngs=rngs)

    def __call__(self, x):
        return self.fc(x)


class XsNNX(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs):
            return XsBlock(rngs)

        self.layers = stack(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
        def body(x, block, scale):
            y = jnp.tanh(block(x) * scale)
            return x + y, y.mean()

        return body(x, self.layers, jnp.asarray(SCALES))


def scan_pair(kind):
    """(zerojax model with the scanned layers as units, plain loss of (params, batch), params)."""
    if kind == "linen":
        module = XsLinen()
        params = jax.jit(module.init)(jax.random.key(0), xs_batch(0)["x"][:1])["params"]
        zm = zj.from_linen(module, lambda apply, b: xs_loss(*apply(b["x"])),
                           xs_batch(0)["x"][:1], units=(XsLayer,))
        plain = lambda p, b: xs_loss(*module.apply({"params": p}, b["x"]))  # noqa: E731
        return zm, plain, params
    model = XsNNX(nnx.Rngs(0))
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    zm = zj.from_nnx(model, lambda m, b: xs_loss(*m(b["x"])), units=(XsBlock,))
    plain = lambda p, b: xs_loss(*nnx.merge(graph, p, jax.tree.map(lambda x: x, rest))(b["x"]))  # noqa: E731
    return zm, plain, params


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_scanned_units_take_per_layer_inputs_and_give_per_layer_outputs(kind):
    """nn.scan / nnx.scan over unit layers with xs (a scale per layer) and a per-layer output:
    each layer gets its own slice of xs and its output lands in its own place, as in plain
    Flax, under stage 3's per-layer gathers."""
    zm, plain, params = scan_pair(kind)
    engine = zj.Engine(zm, optax.adam(1e-2), zj.make_mesh(data=2), zj.ZeroConfig(stage=3))
    state = engine.init(jax.random.key(0), xs_batch(0))
    opt = optax.adam(1e-2)
    opt_state = opt.init(params)
    grad = jax.jit(jax.value_and_grad(plain, has_aux=True))  # one program, not op by op
    update = jax.jit(opt.update)
    for s in range(2):
        (loss, aux), g = grad(params, xs_batch(s))
        state, m = engine.step(state, xs_batch(s))
        np.testing.assert_allclose(float(m["loss"]), float(loss), rtol=1e-5)
        got = [float(m[f"y{i}"]) for i in range(3)]
        np.testing.assert_allclose(got, [float(aux[f"y{i}"]) for i in range(3)], rtol=1e-5,
                                   atol=1e-7)
        assert len(set(np.round(got, 4))) == 3  # the layers' outputs are told apart
        updates, opt_state = update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
    want = nnx.to_pure_dict(params) if kind == "nnx" else params
    assert_tree_close(engine.params(state), want, rtol=1e-5, atol=1e-6)


class DropUnit(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        return x + nn.Dropout(0.5, deterministic=not train)(nn.Dense(x.shape[-1])(x))


class DirectDrop(nn.Module):
    """Two unit instances called directly (no nn.scan), each with dropout inside."""

    @nn.compact
    def __call__(self, x, train=True):
        return DropUnit()(DropUnit()(x, train), train).sum(-1)


def test_linen_dropout_inside_a_directly_called_unit():
    """A unit instance runs as its own apply: it must get the step's dropout keys (new each
    step, different per device), and none in evaluate."""
    def loss_fn(apply, b):
        loss = jnp.mean(jnp.square(apply(b["x"], train=apply.training) - b["y"]))
        return loss, {"loss_sq": loss * loss}  # pmean(l²) - pmean(l)² = spread over devices

    rng = np.random.default_rng(0)
    row = {"x": rng.normal(size=(1, XD)).astype(np.float32), "y": np.ones((1,), np.float32)}
    rows = {k: np.repeat(v, 8, 0) for k, v in row.items()}  # the same row on every device
    zm = zj.from_linen(DirectDrop(), loss_fn, rows["x"][:1], units=(DropUnit,))
    assert sorted(zm.instances) == [("DropUnit_0",), ("DropUnit_1",)] and not zm.stacks
    engine = zj.Engine(zm, optax.sgd(0.0), zj.make_mesh(data=4), zj.ZeroConfig(stage=3))
    state = engine.init(jax.random.key(0), rows)
    runs = []
    for _ in range(3):
        state, m = engine.step(state, rows)
        runs.append((float(m["loss"]), float(m["loss_sq"])))
    assert len({loss for loss, _ in runs}) == 3, runs  # lr 0: only the masks change
    assert all(sq - loss * loss > 1e-6 for loss, sq in runs), runs  # devices differ
    want = loss_fn(PlainApply(DirectDrop(), engine.params(state)), rows)[0]
    # Two float32 programs: against the float64 value, evaluate is 3.9e-7 off and the plain
    # apply 1.0e-6 (jax 0.10.2 on CPU), as (out - 1)² with out ≈ 0.35 magnifies rounding.
    assert float(engine.evaluate(state, rows)["loss"]) == pytest.approx(float(want), rel=4e-6)


class PlainApply:
    """What from_linen hands `loss_fn` in evaluate, for plain linen: `module.apply` with
    `params`, `training` False."""

    training = False

    def __init__(self, module, params):
        self.module, self.params = module, params

    def __call__(self, *args, **kwargs):
        return self.module.apply({"params": self.params}, *args, **kwargs)


# --------------------------------------------------------------------------- the loss's arguments


def test_linen_loss_flags_keep_their_defaults():
    """Only a parameter named `rngs` gets the step's keys: `deterministic=False` keeps dropout
    on (at lr 0 the steps' losses differ by their masks alone), `smoothing=0.0` stays 0.0."""
    from zerojax.units import PlainUnits

    def loss(apply, b, deterministic=False, smoothing=0.0):
        return jnp.mean(jnp.square(apply(b["x"], train=not deterministic) - 1)) + smoothing

    rows = xs_batch(0)
    zm = zj.from_linen(DirectDrop(), loss, rows["x"][:1])
    engine = zj.Engine(zm, optax.sgd(0.0), zj.make_mesh(data=2), zj.ZeroConfig(stage=0))
    state = engine.init(jax.random.key(0), rows)
    losses = []
    for _ in range(2):
        state, m = engine.step(state, rows)
        losses.append(float(m["loss"]))
    off = float(loss(PlainApply(DirectDrop(), engine.params(state)), rows, deterministic=True))
    assert losses[0] != losses[1], losses
    assert all(abs(v - off) > 0.01 * off for v in losses), (losses, off)
    # The second extra parameter alone: its default, not a dict of keys.
    smooth = lambda apply, b, smoothing=0.0: loss(apply, b, True, smoothing)  # noqa: E731
    params = engine.params(state)
    got = zj.from_linen(DirectDrop(), smooth, rows["x"][:1]).loss(params, rows, PlainUnits())
    assert float(got) == pytest.approx(off, rel=1e-6)


class NNXDrop(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(XD, XD, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x, deterministic=None, rngs=None):
        return self.drop(self.fc(x), deterministic=deterministic, rngs=rngs)


def test_nnx_loss_flags_keep_their_defaults_and_rngs_gets_the_keys():
    from zerojax.units import PlainUnits

    x = xs_batch(0)["x"]

    def values(loss):
        zm = zj.from_nnx(NNXDrop(nnx.Rngs(0)), loss)
        run = jax.jit(lambda p, k: zm.loss(p, x, PlainUnits(rng=k)))
        return [float(run(zm.init(None), jax.random.key(k))) for k in (0, 1)]

    on = values(lambda m, b, deterministic=False: m(b, deterministic).mean())
    off = values(lambda m, b, deterministic=True: m(b, deterministic).mean())
    assert on[0] != on[1] and off[0] == off[1], (on, off)
    assert all(abs(v - off[0]) > 1e-3 * abs(off[0]) for v in on), (on, off)
    # `rngs` by keyword (keyword-only, or with a default): the step's keys, used at call time.
    for loss in (lambda m, b, *, rngs: m(b, rngs=rngs).mean(),
                 lambda m, b, scale=1.0, rngs=None: scale * m(b, rngs=rngs).mean()):
        got = values(loss)
        assert got[0] != got[1] and all(abs(v - off[0]) > 1e-3 * abs(off[0]) for v in got)


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_loss_parameter_without_default_is_a_model_error(kind):
    x = xs_batch(0)["x"]

    def make(loss):
        if kind == "linen":
            return zj.from_linen(DirectDrop(), loss, x[:1])
        return zj.from_nnx(NNXDrop(nnx.Rngs(0)), loss)

    def loss(model, b, weights, rngs=None):
        return jnp.mean(weights * model(b["x"]))

    with pytest.raises(zj.ModelError, match=(
            r"^loss_fn's parameter 'weights' has no default: zerojax calls loss_fn\((apply|model), "
            r"batch\), .* bind weights first, e.g. functools.partial\(loss_fn, weights=...\)$")):
        make(loss)
    assert make(functools.partial(loss, weights=2.0))._loss_takes_rngs
    with pytest.raises(zj.ModelError, match=r"loss_fn\(b\) cannot be called as loss_fn"):
        make(lambda b: b)


class KwUnit(nn.Module):
    @nn.compact
    def __call__(self, x, *, train):
        return x + nn.Dropout(0.5, deterministic=not train)(nn.Dense(x.shape[-1])(x))


class KwNet(nn.Module):
    """A required keyword-only flag, on the model and on its units."""

    @nn.compact
    def __call__(self, x, *, train):
        return KwUnit()(KwUnit()(x, train=train), train=train).sum(-1)


def test_linen_keyword_only_call_flag():
    from zerojax.units import PlainUnits

    x = xs_batch(0)["x"]
    loss = lambda apply, b: jnp.mean(jnp.square(apply(b, train=apply.training)))  # noqa: E731
    zm = zj.from_linen(KwNet(), loss, x[:1], units=(KwUnit,), sample_kwargs={"train": False})
    assert sorted(zm.instances) == [("KwUnit_0",), ("KwUnit_1",)]
    params = jax.jit(zm.init)(jax.random.key(0))
    run = jax.jit(lambda p, k, training: zm.loss(p, x, PlainUnits(rng=k, training=training)),
                  static_argnums=2)
    on = [float(run(params, jax.random.key(k), True)) for k in (0, 1)]
    want = float(jnp.mean(jnp.square(KwNet().apply({"params": params}, x, train=False))))
    assert on[0] != on[1] and all(abs(v - want) > 1e-3 * want for v in on), (on, want)
    assert float(run(params, jax.random.key(0), False)) == pytest.approx(want, rel=1e-6)
    with pytest.raises(zj.ModelError, match=r"sample_kwargs=\('train', False\) must be a dict"):
        zj.from_linen(KwNet(), loss, x[:1], sample_kwargs=("train", False))
