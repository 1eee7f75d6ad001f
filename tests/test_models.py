"""Reference models against the seeds' numbers and the plain single-device path."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import sweep

from zerojax.models import GPT, PRESETS, GPTConfig, SeedMLP, TinyTransformer, get_model
from zerojax.models import gpt as gpt_module
from zerojax.units import PlainUnits

# seed 000: one example per GPU
SEED_X = np.array([[1.0, 3.0], [2.0, 1.0]], np.float32)
SEED_Y = np.array([5.0, 7.0], np.float32)


def _size(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def _tokens(key, cfg_vocab, B, T):
    k1, k2 = jax.random.split(key)
    return {
        "inputs": jax.random.randint(k1, (B, T), 0, cfg_vocab, jnp.int32),
        "targets": jax.random.randint(k2, (B, T), 0, cfg_vocab, jnp.int32),
    }


@pytest.mark.parametrize(
    "i, loss, grad", [(0, 10.125, [0.0, 0.0, 0.0, -4.5]), (1, 15.125, [-11.0, -5.5, -5.5, -5.5])]
)
def test_seed_mlp_matches_seed_000(i, loss, grad):
    model = SeedMLP()
    params = model.init(jax.random.key(0))
    batch = {"x": SEED_X[i : i + 1], "y": SEED_Y[i : i + 1]}
    value, g = jax.value_and_grad(model.loss)(params, batch, PlainUnits())
    assert float(value) == loss
    np.testing.assert_array_equal(SeedMLP.flat(g), np.array(grad, np.float32))


def test_seed_mlp_mean_and_custom_weights():
    model = SeedMLP()
    params = model.init(jax.random.key(0))
    np.testing.assert_array_equal(SeedMLP.flat(params), [2.0, -3.0, 1.0, 0.5])
    batch = {"x": SEED_X, "y": SEED_Y}
    value, g = jax.value_and_grad(model.loss)(params, batch, PlainUnits())
    assert float(value) == (10.125 + 15.125) / 2
    np.testing.assert_array_equal(SeedMLP.flat(g), [-5.5, -2.75, -2.75, -5.0])  # seed's avg grads
    other = SeedMLP(w=(1.0, 1.0, 2.0, 0.0)).init(jax.random.key(0))
    # h = [4, 3] -> y = [8, 6]; 0.5 * mean([9, 1]) = 2.5
    assert float(SeedMLP().loss(other, batch, PlainUnits())) == 2.5
    with pytest.raises(ValueError, match="4 weights"):
        SeedMLP(w=(1.0, 2.0))


SEED_003_SHAPES = {
    "block/ln1/gamma": (4,),
    "block/ln1/beta": (4,),
    "block/attn/W_q": (4, 4),
    "block/attn/W_k": (4, 4),
    "block/attn/W_v": (4, 4),
    "block/attn/W_o": (4, 4),
    "block/ln2/gamma": (4,),
    "block/ln2/beta": (4,),
    "block/mlp/W1": (4, 16),
    "block/mlp/b1": (16,),
    "block/mlp/W2": (16, 4),
    "block/mlp/b2": (4,),
    "head/W_vocab": (4, 8),
}


def _paths(tree) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(k.key for k in path): leaf for path, leaf in flat}


def test_tiny_transformer_matches_seed_003_table():
    model = TinyTransformer()
    params = jax.eval_shape(model.init, jax.random.key(0))  # the shapes: traced, not run
    leaves = _paths(params)
    assert {k: v.shape for k, v in leaves.items()} == SEED_003_SHAPES
    assert _size(params) == 260
    # seed: the flat 130/130 split cuts W1 into 50 (GPU-0) + 14 (GPU-1)
    offsets = np.cumsum([0] + [v.size for v in leaves.values()])
    w1 = list(leaves).index("block/mlp/W1")
    assert (130 - offsets[w1], offsets[w1 + 1] - 130) == (50, 14)


def test_tiny_transformer_loss_and_grads():
    model = TinyTransformer()
    params = jax.jit(model.init)(jax.random.key(1))  # one program each, not op by op
    batch = _tokens(jax.random.key(2), 8, 4, 3)
    loss_fn = jax.jit(model.loss, static_argnums=2)
    logits = jax.jit(model.logits, static_argnums=2)
    value, g = jax.jit(jax.value_and_grad(model.loss), static_argnums=2)(
        params, batch, PlainUnits()
    )
    assert np.isfinite(float(value)) and 0.5 < float(value) < 6.0
    for name, leaf in _paths(jax.device_get(g)).items():
        assert np.all(np.isfinite(leaf)) and np.any(leaf != 0), name
    bf16 = loss_fn(params, batch, PlainUnits(dtype=jnp.bfloat16))
    assert abs(float(bf16) - float(value)) < 0.05
    # causal: changing the last input token leaves the first two positions' logits unchanged
    alt = batch["inputs"].at[:, 2].set((batch["inputs"][:, 2] + 1) % 8)
    units = PlainUnits()  # one static argument: one program for both
    a = logits(params, batch["inputs"], units)
    b = logits(params, alt, units)
    np.testing.assert_array_equal(a[:, :2], b[:, :2])
    assert np.any(a[:, 2] != b[:, 2])


@pytest.fixture(scope="module")
def gpt_test():
    model = get_model("test")
    params = jax.jit(model.init)(jax.random.key(0))
    batch = _tokens(jax.random.key(1), model.cfg.vocab_size, 4, model.cfg.seq_len)
    return model, params, batch


def test_gpt_param_tree_and_count(gpt_test):
    model, params, _ = gpt_test
    c = model.cfg
    L, d, f, V, T = c.n_layers, c.d_model, c.d_ff, c.vocab_size, c.seq_len
    shapes = {k: v.shape for k, v in _paths(params).items()}
    assert shapes == {
        "embed/tok": (V, d),
        "embed/pos": (T, d),
        "blocks/ln1/scale": (L, d),
        "blocks/ln1/bias": (L, d),
        "blocks/attn/qkv/kernel": (L, d, 3 * d),
        "blocks/attn/qkv/bias": (L, 3 * d),
        "blocks/attn/out/kernel": (L, d, d),
        "blocks/attn/out/bias": (L, d),
        "blocks/ln2/scale": (L, d),
        "blocks/ln2/bias": (L, d),
        "blocks/mlp/fc/kernel": (L, d, f),
        "blocks/mlp/fc/bias": (L, f),
        "blocks/mlp/out/kernel": (L, f, d),
        "blocks/mlp/out/bias": (L, d),
        "final/ln/scale": (d,),
        "final/ln/bias": (d,),
        "final/head/kernel": (d, V),
    }
    assert model.num_params() == _size(params) == 21760
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    np.testing.assert_array_equal(params["blocks"]["ln1"]["scale"], 1.0)
    np.testing.assert_array_equal(params["blocks"]["mlp"]["fc"]["bias"], 0.0)
    assert abs(float(jnp.std(params["blocks"]["mlp"]["fc"]["kernel"])) - 0.02) < 0.002
    # layers are independently initialised
    qkv = params["blocks"]["attn"]["qkv"]["kernel"]
    assert np.any(qkv[0] != qkv[1])


def test_gpt_loss_grad_dtype_and_apply(gpt_test):
    model, params, batch = gpt_test
    V = model.cfg.vocab_size
    value, g = jax.jit(jax.value_and_grad(model.loss), static_argnums=2)(
        params, batch, PlainUnits()
    )
    assert abs(float(value) - math.log(V)) < 0.1
    for name, leaf in _paths(jax.device_get(g)).items():
        assert np.all(np.isfinite(leaf)) and np.any(leaf != 0), name

    bf16 = jax.jit(model.loss, static_argnums=2)(params, batch, PlainUnits(dtype=jnp.bfloat16))
    assert np.isfinite(float(bf16)) and abs(float(bf16) - float(value)) < 0.05

    logits = jax.jit(model.apply)(params, batch["inputs"])
    assert logits.shape == (*batch["inputs"].shape, V) and logits.dtype == jnp.float32
    logp = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1))
    assert abs(float(ce) - float(value)) < 1e-5


def test_gpt_is_causal_and_accepts_short_sequences(gpt_test):
    model, params, batch = gpt_test
    x = batch["inputs"][:, :8]
    apply = jax.jit(model.apply)  # one program for both, not op by op
    a = apply(params, x)
    b = apply(params, x.at[:, 5].set((x[:, 5] + 1) % model.cfg.vocab_size))
    np.testing.assert_allclose(a[:, :5], b[:, :5], rtol=0, atol=1e-6)
    assert np.any(np.abs(a[:, 5:] - b[:, 5:]) > 1e-4)


def test_gpt_batch_validation(gpt_test):
    model, params, batch = gpt_test
    long = jnp.zeros((1, model.cfg.seq_len + 1), jnp.int32)
    with pytest.raises(ValueError, match="seq_len"):
        model.loss(params, {"inputs": long, "targets": long}, PlainUnits())
    with pytest.raises(ValueError, match="targets shape"):
        bad = {"inputs": batch["inputs"], "targets": batch["targets"][:, :3]}
        model.loss(params, bad, PlainUnits())
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(vocab_size=8, seq_len=4, d_model=10, n_heads=3, n_layers=1, d_ff=8)


def _reference_attention(q, k, v):
    """Causal attention written out, as GPT computed it before `jax.nn.dot_product_attention`."""
    T, K = q.shape[1], q.shape[3]
    s = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=jnp.float32) * (K**-0.5)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool))[None, None], s, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


@pytest.mark.parametrize("dtype, tol", sweep([(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2),
                                              (jnp.float16, 1e-3)],
                                             quick=[(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)]))
def test_gpt_attention_matches_the_written_out_formula(dtype, tol):
    q, k, v = (jax.random.normal(key, (3, 16, 4, 8), dtype)
               for key in jax.random.split(jax.random.key(7), 3))
    loss = lambda fn: lambda *qkv: jnp.sum(jnp.sin(fn(*qkv).astype(jnp.float32)))
    for fn in (gpt_module.dot_product_attention, gpt_module.causal_attention):
        out, ref = jax.jit(fn)(q, k, v), jax.jit(_reference_attention)(q, k, v)
        assert out.dtype == dtype
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                                   rtol=tol, atol=tol)
        # Jitted: one program each (op by op, every primitive of the backward compiles alone).
        grads = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k, v)
        ref_grads = jax.jit(jax.grad(loss(_reference_attention), argnums=(0, 1, 2)))(q, k, v)
        for g, r in zip(grads, ref_grads):
            assert np.any(np.asarray(r, np.float32) != 0)
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                       rtol=tol, atol=tol)
    # The first query sees only the first key: its output is v[:, 0] exactly.
    np.testing.assert_allclose(gpt_module.dot_product_attention(q, k, v)[:, 0], v[:, 0])


def test_gpt_uses_dot_product_attention_and_cudnn_only_where_it_can(gpt_test, monkeypatch):
    model, params, batch = gpt_test
    calls = []
    real = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    # One program, not op by op; a lambda of its own, so it is traced here with the spy in place
    # (a jit of `model.apply` itself could reuse another test's trace).
    jax.jit(lambda p, x: model.apply(p, x))(params, batch["inputs"])
    assert calls == [{"is_causal": True, "implementation": "xla"}]  # the layers are one scan
    pick = gpt_module.attention_implementation
    assert pick(jnp.bfloat16, 64) == "xla"  # CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert pick(jnp.bfloat16, 128) == pick(jnp.float16, 64) == "cudnn"
    assert pick(jnp.float32, 64) == pick(jnp.bfloat16, 12) == pick(jnp.bfloat16, 512) == "xla"
    # A "GPU" without cuDNN (this CPU): the trace-time check fails, XLA computes, with a warning.
    q = jax.random.normal(jax.random.key(0), (2, 8, 2, 8), jnp.bfloat16)
    with pytest.warns(UserWarning, match="cuDNN attention unavailable"):
        out = gpt_module.dot_product_attention(q, q, q)
    np.testing.assert_array_equal(out, real(q, q, q, is_causal=True, implementation="xla"))
    assert calls[-2:] == [{"is_causal": True, "implementation": "cudnn"},
                          {"is_causal": True, "implementation": "xla"}]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_shapes_match_num_params(name):
    model = get_model(name)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    assert _size(shapes) == model.num_params()
    c = model.cfg
    n_matmul = model.num_params() - (c.vocab_size + c.seq_len) * c.d_model
    assert model.flops_per_token() == 6 * n_matmul + 12 * c.n_layers * c.seq_len * c.d_model
    if name == "7b":
        assert 6e9 < model.num_params() < 8e9
    if name == "1b":
        assert 0.8e9 < model.num_params() < 1.2e9


def test_get_model_unknown_name_lists_presets():
    with pytest.raises(ValueError, match="available") as e:
        get_model("nope")
    for name in PRESETS:
        assert name in str(e.value)
    assert isinstance(GPT.from_preset("nano"), GPT)
