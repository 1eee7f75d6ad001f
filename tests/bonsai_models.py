"""Small models in the shapes of jax-ml/bonsai's Gemma3, LLaDA, Mamba2 and Qwen3-VL, for
test_tied.py. They import nothing from zerojax.

What they share with bonsai's files, and what zerojax must meet as it is:

- the tensor-parallel plan written on the arrays, not in NNX metadata: `ShardedLinear` /
  `ShardedEmbedding` (bonsai's stand-ins for `nnx.Linear` / `nnx.Embed`) give their
  initializers `out_sharding=`, norms make `nnx.Param(jax.nn.initializers.zeros(key, dim,
  out_sharding=P("tp")))`, a projection `nnx.Param(jnp.zeros(shape, out_sharding=...))`, flax
  layers take `kernel_init=partial(init, out_sharding=...)`; built under the authors' mesh,
  the arrays are split over "tp";
- a scaled embedding module holding a `ShardedEmbedding(nnx.Embed)` that is the output head
  too, through `attend` (Gemma3), or whose table the model reads itself (Qwen3-VL);
- blocks in Python loops beside many small modules of the model's own (five `RMSNorm`s for
  two `Mamba2Block`s), bias-free projections and one-table embeddings that hold a single
  `(n, m)` param each.
"""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.linear import default_embed_init
from jax.sharding import PartitionSpec as P

V, D, HEADS, HD, F, T = 32, 16, 2, 8, 32, 8


@dataclasses.dataclass(frozen=True)
class ShardConfig:
    """bonsai's TextShardConfig.default(use_fsdp=True, use_tp=True)."""

    attn_kernel: P = P("tp", "fsdp")
    up_gate_kernel: P = P("fsdp", "tp")
    down_kernel: P = P("tp", "fsdp")
    bias: P = P("tp")
    activation: P = P("fsdp", None, "tp")
    decoder_norm: P = P("tp")
    emb_kernel: P = P(None, "tp")


class ShardedLinear(nnx.Module):
    def __init__(self, in_dim, out_dim, *, use_bias=True, kernel_sharding, bias_sharding, rngs):
        init = jax.nn.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (in_dim, out_dim),
                                     out_sharding=kernel_sharding))
        if use_bias:
            self.bias = nnx.Param(jnp.zeros((out_dim,), out_sharding=bias_sharding))
        else:
            self.bias = nnx.data(jnp.zeros((out_dim,), out_sharding=bias_sharding))

    def __call__(self, x, *, out_sharding):
        y = jnp.matmul(x, self.kernel, out_sharding=out_sharding)
        return y + last(jnp.asarray(self.bias), y)


class ShardedEmbedding(nnx.Embed):
    def __call__(self, inputs, *, out_sharding):
        (embedding,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
        return embedding.at[inputs].get(out_sharding=out_sharding)

    def attend(self, query, *, out_sharding):
        query, embedding = self.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
        return jnp.dot(query, embedding.T, out_sharding=out_sharding)


def last(w, x):
    """`w` over the last axes of `x` (the tests run with rank promotion off)."""
    return w.reshape((1,) * (x.ndim - w.ndim) + w.shape)


def attention(q, k, v):
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) * q.shape[-1] ** -0.5
    causal = jnp.tril(jnp.ones((1, 1, q.shape[1], q.shape[1]), bool))
    probs = jax.nn.softmax(jnp.where(causal, logits, -1e9).astype(jnp.float32), -1)
    return jnp.einsum("BNTS,BSNH->BTNH", probs, v)


# --------------------------------------------------------------------------- Gemma3


class Gemma3RMSNorm(nnx.Module):
    def __init__(self, dim, *, shd, rngs):
        self.scale = nnx.Param(jax.nn.initializers.zeros(rngs.params(), dim, out_sharding=shd))

    def __call__(self, x):
        out = x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + 1e-6)
        return out * last(1.0 + self.scale[...], out)


class Gemma3TextScaledWordEmbedding(nnx.Module):
    def __init__(self, shd, *, rngs):
        ei = partial(default_embed_init, out_sharding=shd.emb_kernel)
        self.weight = ShardedEmbedding(V, D, embedding_init=ei, rngs=rngs)
        self.embed_scale = D**0.5
        self.shd = shd

    def __call__(self, input_ids):
        return self.weight(input_ids, out_sharding=self.shd.activation) * self.embed_scale


class Gemma3Attention(nnx.Module):
    def __init__(self, shd, *, rngs):
        lin = partial(ShardedLinear, use_bias=False, kernel_sharding=shd.attn_kernel,
                      bias_sharding=shd.bias, rngs=rngs)
        self.q_proj, self.k_proj, self.v_proj = (lin(D, HEADS * HD) for _ in range(3))
        self.o_proj = lin(HEADS * HD, D)
        self.q_norm = Gemma3RMSNorm(HD, shd=P(), rngs=rngs)
        self.k_norm = Gemma3RMSNorm(HD, shd=P(), rngs=rngs)
        self.shd = shd

    def __call__(self, x):
        shape, act = (*x.shape[:-1], HEADS, HD), self.shd.activation
        q = self.q_norm(self.q_proj(x, out_sharding=act).reshape(shape))
        k = self.k_norm(self.k_proj(x, out_sharding=act).reshape(shape))
        v = self.v_proj(x, out_sharding=act).reshape(shape)
        return self.o_proj(attention(q, k, v).reshape(x.shape), out_sharding=act)


class Gemma3MLP(nnx.Module):
    def __init__(self, shd, *, rngs):
        lin = partial(ShardedLinear, use_bias=False, bias_sharding=shd.bias, rngs=rngs)
        self.gate_proj = lin(D, F, kernel_sharding=shd.up_gate_kernel)
        self.up_proj = lin(D, F, kernel_sharding=shd.up_gate_kernel)
        self.down_proj = lin(F, D, kernel_sharding=shd.down_kernel)
        self.shd = shd

    def __call__(self, x):
        act = self.shd.activation
        gx = jax.nn.gelu(self.gate_proj(x, out_sharding=act))
        return self.down_proj(gx * self.up_proj(x, out_sharding=act), out_sharding=act)


class Gemma3DecoderLayer(nnx.Module):
    def __init__(self, shd, *, rngs):
        self.self_attn = Gemma3Attention(shd, rngs=rngs)
        self.mlp = Gemma3MLP(shd, rngs=rngs)
        norm = partial(Gemma3RMSNorm, D, shd=shd.decoder_norm, rngs=rngs)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def __call__(self, x):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3(nnx.Module):
    """Text only; the word embedding is the output head (`embed_tokens.weight.attend`). A
    soft-token projection (bonsai's `mm_input_projection_weight`, zeros) and a LayerNorm whose
    initializers are given `out_sharding=` carry the other forms of the plan on the arrays."""

    def __init__(self, layers=2, *, rngs, shd=ShardConfig()):
        self.embed_tokens = Gemma3TextScaledWordEmbedding(shd, rngs=rngs)
        self.mm_input_projection_weight = nnx.Param(jnp.zeros((D, D), out_sharding=P(None, "tp")))
        self.soft_norm = nnx.LayerNorm(
            D, scale_init=partial(jax.nn.initializers.ones, out_sharding=P("tp")),
            bias_init=partial(jax.nn.initializers.zeros, out_sharding=P("tp")), rngs=rngs)
        self.layers = nnx.List([Gemma3DecoderLayer(shd, rngs=rngs) for _ in range(layers)])
        self.norm = Gemma3RMSNorm(D, shd=shd.decoder_norm, rngs=rngs)
        self.shd = shd

    def __call__(self, input_ids):
        x = self.embed_tokens(input_ids)
        x = x + self.soft_norm(x) @ self.mm_input_projection_weight[...]
        for layer in self.layers:
            x = layer(x)
        return self.embed_tokens.weight.attend(self.norm(x), out_sharding=P("fsdp"))


# --------------------------------------------------------------------------- LLaDA


class LLaDARMSNorm(nnx.Module):
    def __init__(self, dim, *, shd, rngs):
        self.weight = nnx.Param(jax.nn.initializers.ones(rngs.params(), dim, out_sharding=shd))

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + 1e-5) * last(
            self.weight[...], x)


class LLaDALlamaBlock(nnx.Module):
    def __init__(self, shd, *, rngs):
        self.attn_norm = LLaDARMSNorm(D, shd=shd.decoder_norm, rngs=rngs)
        self.ff_norm = LLaDARMSNorm(D, shd=shd.decoder_norm, rngs=rngs)
        self.dropout = nnx.Dropout(0.0, deterministic=False)
        lin = partial(ShardedLinear, use_bias=False, bias_sharding=shd.bias, rngs=rngs)
        self.q_proj, self.k_proj, self.v_proj, self.attn_out = (
            lin(D, D, kernel_sharding=shd.attn_kernel) for _ in range(4))
        self.ff_proj = lin(D, F, kernel_sharding=shd.up_gate_kernel)
        self.up_proj = lin(D, F, kernel_sharding=shd.up_gate_kernel)
        self.ff_out = lin(F, D, kernel_sharding=shd.down_kernel)
        self.shd = shd

    def __call__(self, x, key):
        act, shape = self.shd.activation, (*x.shape[:-1], HEADS, D // HEADS)
        h = self.attn_norm(x)
        q, k, v = (p(h, out_sharding=act).reshape(shape)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        key, subkey = jax.random.split(key)
        x = x + self.dropout(self.attn_out(attention(q, k, v).reshape(x.shape),
                                           out_sharding=act), rngs=subkey)
        h = self.ff_norm(x)
        h = jax.nn.silu(self.ff_proj(h, out_sharding=act)) * self.up_proj(h, out_sharding=act)
        return x + self.ff_out(h, out_sharding=act), key


class LLaDA(nnx.Module):
    """The plan only on the arrays; a head of its own; a key argument for its dropout."""

    def __init__(self, layers=2, *, rngs, shd=ShardConfig()):
        ei = partial(default_embed_init, out_sharding=shd.emb_kernel)
        self.wte = ShardedEmbedding(V, D, embedding_init=ei, rngs=rngs)
        self.blocks = nnx.List([LLaDALlamaBlock(shd, rngs=rngs) for _ in range(layers)])
        self.ln_f = LLaDARMSNorm(D, shd=shd.decoder_norm, rngs=rngs)
        self.ff_out = ShardedLinear(D, V, use_bias=False, kernel_sharding=shd.up_gate_kernel,
                                    bias_sharding=shd.bias, rngs=rngs)
        self.shd = shd

    def __call__(self, input_ids, key):
        x = self.wte(input_ids, out_sharding=self.shd.activation)
        for block in self.blocks:
            x, key = block(x, key)
        return self.ff_out(self.ln_f(x), out_sharding=self.shd.activation), key


# --------------------------------------------------------------------------- Mamba2


class RMSNorm(nnx.Module):
    def __init__(self, hidden, gate_residual=False, *, rngs):
        self.gate_residual = gate_residual
        self.weight = nnx.Param(jnp.ones((hidden,)))

    def __call__(self, x, residual=None):
        if residual is not None and self.gate_residual:
            x = x * nnx.silu(residual)
        return x * jax.lax.rsqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-5) * last(
            self.weight[:], x)


class DepthwiseConv1d(nnx.Module):
    def __init__(self, features, kernel_size, *, rngs):
        self.kernel_size = kernel_size
        self.conv = nnx.Conv(features, features, (kernel_size,), padding=((0, 0),),
                             feature_group_count=features, rngs=rngs)

    def __call__(self, x):
        return self.conv(jnp.pad(x, ((0, 0), (self.kernel_size - 1, 0), (0, 0))))


class Mamba2Mixer(nnx.Module):
    """The mixer's params as bonsai's (projections, causal conv, per-head dt, A, D, a gated
    norm); its scan is a cumulative decay, enough for these tests."""

    def __init__(self, *, rngs):
        inner = 2 * D
        self.in_proj = nnx.Linear(D, 2 * inner + HEADS, use_bias=False, rngs=rngs)
        self.conv1d = DepthwiseConv1d(inner, 4, rngs=rngs)
        self.dt_bias = nnx.Param(jnp.full((HEADS,), -2.0))
        self.A_log = nnx.Param(jnp.zeros((HEADS,)))
        self.D = nnx.Param(jnp.ones((HEADS,)))
        self.norm = RMSNorm(inner, gate_residual=True, rngs=rngs)
        self.out_proj = nnx.Linear(inner, D, use_bias=False, rngs=rngs)

    def __call__(self, h):
        z, x, dt = jnp.split(self.in_proj(h), [2 * D, 4 * D], axis=-1)
        x = nnx.silu(self.conv1d(x)).reshape(*x.shape[:-1], HEADS, -1)
        rate = last(jnp.exp(self.A_log[:]), dt) * jax.nn.softplus(dt + last(self.dt_bias[:], dt))
        decay = jnp.exp(-rate)[..., None]
        y = jnp.cumsum(x * decay, axis=1) + x * last(self.D[:][:, None], x)
        return self.out_proj(self.norm(y.reshape(z.shape), residual=z))


class Mamba2Block(nnx.Module):
    def __init__(self, *, rngs):
        self.norm = RMSNorm(D, rngs=rngs)
        self.mixer = Mamba2Mixer(rngs=rngs)

    def __call__(self, h):
        return h + self.mixer(self.norm(h))


class Mamba2(nnx.Module):
    """Two blocks, five RMSNorms; the head is flax's `nnx.Embed` (`attend`)."""

    def __init__(self, layers=2, *, rngs):
        self.embedder = nnx.Embed(V, D, rngs=rngs)
        self.layers = nnx.List([Mamba2Block(rngs=rngs) for _ in range(layers)])
        self.final_norm = RMSNorm(D, rngs=rngs)

    def __call__(self, input_ids):
        h = self.embedder(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.embedder.attend(self.final_norm(h))


# --------------------------------------------------------------------------- Qwen3-VL


class VisionBlock(nnx.Module):
    def __init__(self, width, *, rngs):
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
        self.proj = nnx.Linear(width, width, rngs=rngs)
        self.fc1 = nnx.Linear(width, 2 * width, rngs=rngs)
        self.fc2 = nnx.Linear(2 * width, width, rngs=rngs)

    def __call__(self, x):
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        a = jax.nn.softmax(q @ k.swapaxes(-1, -2) / q.shape[-1] ** 0.5) @ v
        x = x + self.proj(a)
        return x + self.fc2(nnx.gelu(self.fc1(self.norm2(x))))


class VisionModel(nnx.Module):
    def __init__(self, width=8, depth=2, *, rngs):
        self.patch_embed = nnx.Linear(4, width, rngs=rngs)
        self.blocks = nnx.List([VisionBlock(width, rngs=rngs) for _ in range(depth)])
        self.merger = nnx.Linear(width, D, rngs=rngs)

    def __call__(self, patches):
        x = self.patch_embed(patches)
        for block in self.blocks:
            x = block(x)
        return self.merger(x)


class Qwen3VLDecoderLayer(nnx.Module):
    def __init__(self, *, rngs):
        lin = partial(ShardedLinear, use_bias=False, kernel_sharding=None, bias_sharding=None,
                      rngs=rngs)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (lin(D, D) for _ in range(4))
        self.q_norm, self.k_norm = RMSNorm(D // HEADS, rngs=rngs), RMSNorm(D // HEADS, rngs=rngs)
        self.gate_proj, self.up_proj, self.down_proj = lin(D, F), lin(D, F), lin(F, D)
        self.input_layernorm = RMSNorm(D, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(D, rngs=rngs)

    def __call__(self, x):
        shape = (*x.shape[:-1], HEADS, D // HEADS)
        h = self.input_layernorm(x)
        q = self.q_norm(self.q_proj(h, out_sharding=None).reshape(shape))
        k = self.k_norm(self.k_proj(h, out_sharding=None).reshape(shape))
        v = self.v_proj(h, out_sharding=None).reshape(shape)
        x = x + self.o_proj(attention(q, k, v).reshape(x.shape), out_sharding=None)
        h = self.post_attention_layernorm(x)
        h = nnx.silu(self.gate_proj(h, out_sharding=None)) * self.up_proj(h, out_sharding=None)
        return x + self.down_proj(h, out_sharding=None)


class Qwen3VLTextModel(nnx.Module):
    def __init__(self, layers=2, *, rngs):
        self.embed_tokens = ShardedEmbedding(V, D, rngs=rngs)
        self.layers = nnx.List([Qwen3VLDecoderLayer(rngs=rngs) for _ in range(layers)])
        self.norm = RMSNorm(D, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Qwen3VLModel(nnx.Module):
    def __init__(self, *, rngs):
        self.visual = VisionModel(rngs=rngs)
        self.language_model = Qwen3VLTextModel(rngs=rngs)


class Qwen3VLForConditionalGeneration(nnx.Module):
    """Tied: the root reads the embedding table itself for the logits."""

    def __init__(self, *, rngs):
        self.model = Qwen3VLModel(rngs=rngs)

    def __call__(self, input_ids, patches):
        embeds = self.model.language_model.embed_tokens(input_ids, out_sharding=None)
        embeds = embeds.at[:, :2].add(self.model.visual(patches))  # the image's two tokens
        hidden = self.model.language_model(embeds)
        embedding = self.model.language_model.embed_tokens.embedding[...]
        return jnp.matmul(hidden, embedding.T)
