"""The model axis: tensor parallelism composed with ZeRO (DESIGN.md section 8).

Every run here is compared with single-device optax on the same data (the parity bounds of
helpers.check_parity: losses 1e-5 relative, the global grad norm 1e-4, params within 1e-5 of
how far the reference moved them), with `optax.chain(clip_by_global_norm, adamw)` as the
optimizer so that the optimizer's own global norm runs over the model pieces (each logical
element counted once) and the clip engages. The plan comes from the models' own annotations:
the GPT's `param_specs()`, linen boxes with logical names and rules, NNX sharding metadata.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
    ATOL,
    CLIP,
    RTOL,
    adamw,
    assert_tree_close,
    engine_run,
    gpt_batch,
    reference_run,
    sweep,
)
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax.models import GPT
from zerojax.models.gpt import GPTConfig
from zerojax.units import PlainUnits

MESHES = {"4x2": dict(data=4, model=2), "2x4": dict(data=2, model=4),
          "2x2x2": dict(replica=2, data=2, model=2),
          "3x2": dict(data=3, model=2)}  # 3 divides few pieces: their storage is padded
BATCH, STEPS = 24, 8


def clipped():
    """The optimizer of every run: the clip inside optax, on the global norm of the pieces."""
    return optax.chain(optax.clip_by_global_norm(CLIP), adamw())


@functools.cache
def gpt(heads=4) -> GPT:
    """The test GPT with `heads` heads (4: whole heads on each of up to 4 model devices)."""
    return GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=heads, n_layers=2,
                         d_ff=64))


@functools.cache
def gpt_reference(heads=4):
    model = gpt(heads)
    batches = [gpt_batch(model.cfg, BATCH, s) for s in range(STEPS)]
    losses, params = reference_run(model, adamw(), batches)
    return batches, losses, reference_run.norms, params


@functools.cache
def plain_loss():
    """The GPT's loss, jitted once for host params (one program for every mesh's run)."""
    return jax.jit(gpt().loss, static_argnums=2)


def assert_parity(engine, heads=4):
    batches, ref_losses, ref_norms, ref_params = gpt_reference(heads)
    losses, params, state = engine_run(engine, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    np.testing.assert_allclose(engine_run.norms, ref_norms, rtol=1e-4)
    assert_tree_close(params, ref_params, rtol=RTOL, atol=ATOL)
    return state


@pytest.mark.parametrize(("mesh", "stage"), sweep(
    [("4x2", 3), ("4x2", 0), ("4x2", 1), ("4x2", 2), ("2x4", 3), ("2x2x2", 3), ("2x2x2", 1),
     ("3x2", 3), ("3x2", 1)],
    quick=[("4x2", 3)]))
def test_gpt_matches_single_device_optax(mesh, stage):
    engine = zj.Engine(gpt(), clipped(), zj.make_mesh(**MESHES[mesh]), zj.ZeroConfig(stage=stage))
    state = assert_parity(engine)
    split = [leaf for leaf in engine.layout.leaves if leaf.is_split]
    assert len(split) == 8 and engine.model_parallel == MESHES[mesh]["model"]
    # The split leaves are stored [L?, M, N·k] over ("model", "data"): 1/(D·M) per device.
    qkv = state.master["blocks"]["attn"]["qkv"]["kernel"]
    assert qkv.sharding.spec == (P(None, "model", None) if stage == 0
                                 else P(None, "model", "data"))
    if MESHES[mesh]["data"] == 3:  # MLP-up's pieces of 32·64/2 = 1024 pad to 3·342
        assert state.master["blocks"]["mlp"]["fc"]["kernel"].shape == (2, 2, 1026)
    # evaluate: the mean loss of a batch, as plain jax computes it
    batch = gpt_batch(gpt().cfg, BATCH, 99)
    want = plain_loss()(jax.device_get(engine.params(state)), batch, PlainUnits())
    np.testing.assert_allclose(float(engine.evaluate(state, batch)["loss"]), float(want),
                               rtol=1e-5)


@pytest.mark.slow
def test_clip_in_the_config_counts_each_element_once():
    """The step's own clip (ZeroConfig.clip_norm) on a data x model mesh: the norm sums the
    model pieces of the split leaves and each replicated leaf once."""
    engine = zj.Engine(gpt(), adamw(), zj.make_mesh(data=2, model=2, replica=2),
                       zj.ZeroConfig(stage=2, clip_norm=CLIP))
    assert_parity(engine)


# ---------------------------------------------------------------------------------------------
# Flax models: the plan from their own annotations

D, F, V, T = 16, 32, 24, 5
RULES = (("embed", None), ("mlp", "model"), ("vocab", "model"), ("layers", None),
         ("batch", "data"))
_init = nn.initializers.normal(0.1)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        x = nn.LayerNorm()(h)
        x = nn.Dense(F, kernel_init=nn.with_logical_partitioning(_init, ("embed", "mlp")),
                     bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)))(x)
        x = nn.with_logical_constraint(nn.gelu(x), ("batch", None, "mlp"))
        x = nn.Dense(D, kernel_init=nn.with_logical_partitioning(_init, ("mlp", "embed")))(x)
        return h + x, None


class LinenNet(nn.Module):
    """A MaxText-style model: logical names, an nn.scan stack, a vocab-parallel embedding."""

    @nn.compact
    def __call__(self, tok):
        emb = self.param("emb", nn.with_logical_partitioning(_init, ("vocab", "embed")), (V, D))
        h = jnp.take(emb, tok, axis=0)
        h, _ = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=3, metadata_params={nn.PARTITION_NAME: "layers"})()(h, None)
        return nn.Dense(V, kernel_init=nn.with_logical_partitioning(_init, ("embed", "vocab")))(h)


def token_batches(n=STEPS):
    r = np.random.default_rng(0)
    return [{"x": r.integers(0, V, (16, T)).astype(np.int32),
             "y": r.integers(0, V, (16, T)).astype(np.int32)} for _ in range(n)]


def xent(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def plain_run(loss, params, batches):
    """Single-device optax: (losses, final params)."""
    tx = optax.chain(optax.clip_by_global_norm(CLIP), adamw())
    state, losses = tx.init(params), []
    step = jax.jit(lambda p, s, b: (lambda l, g: (l, *tx.update(g, s, p)))(
        *jax.value_and_grad(loss)(p, b)))
    for b in batches:
        l, u, state = step(params, state, b)
        params = optax.apply_updates(params, u)
        losses.append(float(l))
    return np.array(losses), params


def check_against_plain(model, params, loss, batches, mesh, stage):
    want_losses, want = plain_run(loss, params, batches)
    engine = zj.Engine(model, clipped(), zj.make_mesh(**mesh), zj.ZeroConfig(stage=stage))
    state = engine.init_from(params, batches[0])
    losses = []
    for b in batches:
        state, m = engine.step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
    assert_tree_close(engine.params(state), want, rtol=RTOL, atol=ATOL)
    return engine


def test_linen_logical_names_and_rules_split_the_model():
    net = LinenNet()
    model = zj.from_linen(net, lambda apply, b: xent(apply(b["x"]), b),
                          (jnp.zeros((1, T), jnp.int32),), units=(LinenBlock,),
                          logical_axis_rules=RULES)
    specs = model.param_specs()
    assert specs["emb"] == P("model", None)
    assert specs["ScanLinenBlock_0"]["Dense_0"]["kernel"] == P(None, None, "model")
    assert specs["ScanLinenBlock_0"]["LayerNorm_0"]["scale"] is None
    params = jax.jit(model.init)(jax.random.key(0))  # one program, not op by op
    loss = lambda p, b: xent(net.apply({"params": p}, b["x"]), b)
    engine = check_against_plain(model, params, loss, token_batches(), dict(data=4, model=2), 3)
    split = {leaf.path: leaf.split for leaf in engine.layout.leaves if leaf.is_split}
    assert split == {"['Dense_0']['kernel']": 1, "['ScanLinenBlock_0']['Dense_0']['bias']": 0,
                     "['ScanLinenBlock_0']['Dense_0']['kernel']": 1,
                     "['ScanLinenBlock_0']['Dense_1']['kernel']": 0, "['emb']": 0}


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        w = nnx.initializers.normal(0.1)
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, F, kernel_init=nnx.with_partitioning(w, (None, "model")),
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("model",)),
                             rngs=rngs)
        self.down = nnx.Linear(F, D, kernel_init=nnx.with_partitioning(w, ("model", None)),
                               rngs=rngs)

    def __call__(self, h):
        return h + self.down(nnx.gelu(self.up(self.ln(h))))


class NNXNet(nnx.Module):
    def __init__(self, rngs):
        w = nnx.initializers.normal(0.1)
        self.emb = nnx.Embed(V, D, embedding_init=nnx.with_partitioning(w, ("model", None)),
                             rngs=rngs)
        self.blocks = nnx.List([NNXBlock(rngs) for _ in range(2)])
        self.head = nnx.Linear(D, V, kernel_init=nnx.with_partitioning(w, (None, "model")),
                               rngs=rngs)

    def __call__(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


@pytest.mark.parametrize("built", sweep(["eager sharding off", "under set_mesh"],
                                        quick=["eager sharding off"]))
def test_nnx_sharding_metadata_splits_the_model(built):
    if built == "under set_mesh":
        with jax.set_mesh(zj.make_mesh(data=4, model=2)):
            net = NNXNet(nnx.Rngs(0))
    else:
        with nnx.use_eager_sharding(False):
            net = NNXNet(nnx.Rngs(0))
    model = zj.from_nnx(net, lambda m, b: xent(m(b["x"]), b), units=(NNXBlock,))
    graph, template, rest = nnx.split(net, nnx.Param, ...)
    params = jax.device_get(nnx.to_pure_dict(template))

    def plain(p, b):  # the module as the user built it, with params p
        ps = jax.tree.map(lambda x: x, template)
        nnx.replace_by_pure_dict(ps, p)
        return xent(nnx.merge(graph, ps, rest)(b["x"]), b)

    engine = check_against_plain(model, params, plain, token_batches(), dict(data=4, model=2),
                                 3 if built == "eager sharding off" else 2)
    assert sum(leaf.is_split for leaf in engine.layout.leaves) == 8


# ---------------------------------------------------------------------------------------------
# Randomness and model state: the model axis changes no key and no statistic


class DropoutNorm:
    """A protocol model with a split hidden layer, per-example dropout keys
    (`units.example_rngs`) and a running mean of its hidden activations (model state)."""

    def init(self, rng):
        k1, k2 = jax.random.split(rng)
        return {"up": 0.3 * jax.random.normal(k1, (6, 8)),
                "down": 0.3 * jax.random.normal(k2, (8, 1))}

    def init_state(self, rng):
        return {"mean": jnp.zeros((8,))}

    def param_specs(self):
        return {"up": P(None, "model"), "down": P("model", None)}

    def loss(self, params, batch, units):
        p = units.gather(params)
        h = jnp.tanh(batch["x"] @ p["up"])
        keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.8, (8,)))(units.example_rngs())
        h = jnp.where(keep, h / 0.8, 0.0)
        units.set_state({"mean": 0.9 * units.state["mean"] + 0.1 * h.mean(0)})
        return jnp.mean((h @ p["down"] - batch["y"]) ** 2)


def test_dropout_and_model_state_are_the_same_on_one_device_and_on_data_x_model():
    r = np.random.default_rng(0)
    batches = [{"x": r.normal(size=(8, 6)).astype(np.float32),
                "y": r.normal(size=(8, 1)).astype(np.float32)} for _ in range(4)]
    runs = []
    for mesh in (dict(data=1, devices=jax.devices()[:1]), dict(data=4, model=2)):
        engine = zj.Engine(DropoutNorm(), clipped(), zj.make_mesh(**mesh),
                           zj.ZeroConfig(stage=3))
        losses, params, state = engine_run(engine, batches)
        runs.append((losses, params, engine.model_state(state)))
    (l1, p1, s1), (l2, p2, s2) = runs
    np.testing.assert_allclose(l2, l1, rtol=RTOL)
    assert_tree_close(p2, p1, rtol=RTOL, atol=ATOL)
    # per-device statistics, averaged after each step: the same mean of all examples
    np.testing.assert_allclose(s2["mean"], s1["mean"], rtol=1e-5, atol=1e-7)
    assert np.abs(s1["mean"]).max() > 1e-3  # the state moved


class Constant:
    """A split hidden layer plus a buffer the model reads and never changes, here a constant
    of the program; `Buffered` holds it in the model state (as bonsai's bias-free
    `ShardedLinear` keeps an `nnx.data` zeros vector)."""

    def init(self, rng):
        k1, k2 = jax.random.split(rng)
        return {"up": 0.3 * jax.random.normal(k1, (6, 8)),
                "down": 0.3 * jax.random.normal(k2, (8, 1))}

    def param_specs(self):
        return {"up": P(None, "model"), "down": P("model", None)}

    def buffer(self, units):
        return jnp.zeros((8,))

    def loss(self, params, batch, units):
        p = units.gather(params)
        h = jnp.tanh(batch["x"] @ p["up"] + self.buffer(units)[None])
        return jnp.mean((h @ p["down"] - batch["y"]) ** 2)


class Buffered(Constant):
    def init_state(self, rng):
        return {"bias": jnp.zeros((8,))}

    def buffer(self, units):
        return units.state["bias"]


def test_the_model_state_costs_no_collective_per_step():
    """The state is kept whole over `model` (P()); the step's shard_map leaves the automatic
    axis open, and a buffer added to a split activation was propagated split and gathered
    over `model` again at the step's end: one all-gather per buffer and step (14 in bonsai's
    Gemma3 shape). The compiled step with the buffer in the state runs the same collectives as
    with the buffer a constant."""
    from collections import Counter

    from zerojax.analysis.hlo import collective_sites, mesh_axis

    batch = {"x": np.zeros((8, 6), np.float32), "y": np.zeros((8, 1), np.float32)}

    def collectives(model):
        engine = zj.Engine(model, clipped(), zj.make_mesh(data=4, model=2),
                           zj.ZeroConfig(stage=3))
        state = engine.init(jax.random.key(0), batch)
        sites, _ = collective_sites(engine.lower(state, batch).compile().as_text(), 8)
        return Counter((s["kind"], mesh_axis(s["groups"], 1, 4, 2)) for s in sites
                       for _ in range(s["launches"]))

    held, constant = collectives(Buffered()), collectives(Constant())
    assert held == constant, (held, constant)
    assert constant[("all_gather", "model")] + constant[("all_reduce", "model")] > 0


# ---------------------------------------------------------------------------------------------
# Everything else composes


@pytest.mark.parametrize("variant", sweep(
    ["grad_accum", "prefetch", "offload", "hpz"], quick=[]))
def test_exact_features_compose_with_the_model_axis(variant):
    mesh, cfg = {"grad_accum": (dict(data=4, model=2), dict(stage=3, grad_accum=2)),
                 "prefetch": (dict(data=4, model=2), dict(stage=3, prefetch=True)),
                 "offload": (dict(data=4, model=2), dict(stage=1, offload="optimizer")),
                 "hpz": (dict(replica=2, data=2, model=2), dict(stage=3, hpz=True))}[variant]
    assert_parity(zj.Engine(gpt(), clipped(), zj.make_mesh(**mesh), zj.ZeroConfig(**cfg)))


@pytest.mark.parametrize("variant", sweep(["bfloat16", "float16", "qwz+qgz"], quick=[]))
def test_rounded_features_track_the_fp32_reference(variant):
    """Half precision (its model-axis all-reduces round too) and ZeRO++ quantization (its
    blocks are the model pieces') differ from fp32 by rounding only: losses within 2e-2."""
    cfg = {"bfloat16": dict(param_dtype="bfloat16"), "float16": dict(param_dtype="float16"),
           "qwz+qgz": dict(quantize_weights="int8", quantize_grads="int4")}[variant]
    batches, ref_losses, _, _ = gpt_reference()
    engine = zj.Engine(gpt(), clipped(), zj.make_mesh(data=4, model=2),
                       zj.ZeroConfig(stage=3, **cfg))
    losses, _, _ = engine_run(engine, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
    assert losses[-1] < losses[0] - 0.1


# ---------------------------------------------------------------------------------------------
# Checkpoints stay logical: restore on another data x model split, stage, or none


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """The run every restore below continues, made once: stage 3 on data 4 x model 2, saved
    after 3 of the 8 steps: (the checkpoint's directory, its params after all 8)."""
    batches, _, _, _ = gpt_reference()
    directory = tmp_path_factory.mktemp("model-axis-ckpt")
    saved = zj.Engine(gpt(), clipped(), zj.make_mesh(data=4, model=2), zj.ZeroConfig(stage=3))
    state = saved.init(jax.random.key(0), batches[0])
    for b in batches[:3]:
        state, _ = saved.step(state, b)
    saved.save(state, directory)
    for b in batches[3:]:
        state, _ = saved.step(state, b)
    return directory, jax.device_get(saved.params(state))


@pytest.mark.parametrize(("mesh", "stage"), sweep(
    [("2x4", 1), ("8", 3), ("1", 0), ("2x2x2", 2)], quick=[]))
def test_restore_on_another_model_axis_trains_on_as_uninterrupted(saved_run, mesh, stage):
    meshes = {"2x4": dict(data=2, model=4), "8": dict(data=8),
              "1": dict(data=1, devices=jax.devices()[:1]), "2x2x2": MESHES["2x2x2"]}
    batches, _, _, _ = gpt_reference()
    directory, want = saved_run
    engine = zj.Engine(gpt(), clipped(), zj.make_mesh(**meshes[mesh]),
                       zj.ZeroConfig(stage=stage))
    restored = engine.restore(directory)
    for b in batches[3:]:
        restored, _ = engine.step(restored, b)
    assert_tree_close(engine.params(restored), want, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# Bad plans: one clear error each, before anything compiles


class Annotated:
    """A protocol model whose plan the test chooses."""

    def __init__(self, specs, shape=(6, 8), stacked=False):
        self.specs, self.shape, self.stacked = specs, shape, stacked

    def init(self, rng):
        shape = (2, *self.shape) if self.stacked else self.shape
        return {"w": jax.random.normal(rng, shape), "b": jnp.zeros((self.shape[-1],))}

    def param_specs(self):
        return self.specs

    def loss(self, params, batch, units):
        if self.stacked:
            h = units.scan(lambda h, w: jnp.tanh(h @ w), batch["x"], params["w"])
            return jnp.mean(h) + jnp.sum(units.gather(params["b"]))
        p = units.gather(params)
        return jnp.mean(batch["x"] @ p["w"] + p["b"][None])


def init(model, mesh=None, width=6):
    engine = zj.Engine(model, optax.sgd(0.1), mesh or zj.make_mesh(data=4, model=2))
    return engine.init(jax.random.key(0), {"x": np.zeros((8, width), np.float32)})


@pytest.mark.parametrize(("specs", "kw", "error", "words"), [
    ({"w": P(None, "model"), "b": None}, dict(shape=(6, 5)), zj.ConfigError,
     ["['w']", "dimension 1 of size 5", "2 model devices"]),
    ({"w": None, "b": None}, {}, zj.ConfigError, ["splits none of its parameters", "model="]),
    ({"w": P("model", None, None), "b": None}, dict(stacked=True, shape=(6, 6)),
     zj.ConfigError, ["layer axis", "['w']"]),
    ({"w": P("model", "model"), "b": None}, {}, zj.ModelError, ["at most one dimension"]),
    ({"w": "model", "b": None}, {}, zj.ModelError, ["not a jax.sharding.PartitionSpec"]),
    ({"w": P(None, "model")}, {}, zj.ModelError, ["param_specs()", "structure"]),
])
def test_bad_plans_are_refused_by_name(specs, kw, error, words):
    with pytest.raises(error) as e:
        init(Annotated(specs, **kw))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_rule_naming_an_axis_no_zerojax_mesh_has_is_refused():
    with pytest.raises(zj.ModelError, match=r"'mlp' to the mesh axis 'tensor'.*'model'"):
        zj.from_linen(LinenNet(), lambda apply, b: 0.0, (jnp.zeros((1, T), jnp.int32),),
                      logical_axis_rules=(("mlp", "tensor"),))


def test_a_tuple_entry_naming_data_and_model_splits_over_model():
    """An annotation entry ("data", "model") (a dimension over both axes, as FSDP-style rules
    write it) splits that dimension over `model`, and the step's manual specs keep its
    `data` part alone; ("model",) alone, the same."""
    from zerojax.partition import LeafSpec, manual, model_plan

    for entry in (("data", "model"), ("model",), ("model", "data")):
        b, w = model_plan(Annotated({"w": P(None, entry), "b": None}),
                          (LeafSpec("['b']", (8,), False), LeafSpec("['w']", (6, 8), False)),
                          jax.tree.structure({"b": 0, "w": 0}), 2)
        assert (w.split, w.pieces, b.split) == (1, 2, None), entry
    assert manual(P(None, ("data", "model"))) == P(None, "data")
    assert manual(P(("model",), None)) == P(None, None)


def test_without_a_model_axis_the_annotations_change_nothing():
    engine = zj.Engine(Annotated({"w": P(None, "model"), "b": None}), optax.sgd(0.1),
                       zj.make_mesh(data=4))
    engine.init(jax.random.key(0), {"x": np.zeros((8, 6), np.float32)})
    assert not any(leaf.is_split for leaf in engine.layout.leaves)
    assert engine.model_parallel == 1


def test_make_mesh_puts_the_model_axis_innermost():
    mesh = zj.make_mesh(replica=2, data=2, model=2)
    assert mesh.axis_names == ("replica", "data", "model")
    assert [d.id for d in mesh.devices[0, 0]] == [0, 1]  # a model group: neighbours
    assert zj.make_mesh(model=2).shape == {"data": 4, "model": 2}
    assert zj.batch_axes(mesh) == ("replica", "data")
    with pytest.raises(zj.MeshError, match="model=3"):
        zj.make_mesh(model=3)
    with pytest.raises(zj.MeshError, match="model=0"):
        zj.make_mesh(data=2, model=0)
