"""Small models whose weights are used twice, for test_tied.py. They import nothing from zerojax.

- `GemmaLM`: flax's examples/gemma in its own style (JAX explicit sharding): a scaled
  `nnx.Embed` subclass (`ScaledEmbed`) that is the output head too, through `attend`; blocks
  of `nnx.Einsum` attention and `nnx.Linear` MLPs whose plan is `kernel_metadata=
  {"out_sharding": P(...)}` in the model's own axis names ("fsdp", "tp"); its own `RMSNorm`
  (zeros + 1, as gemma's); activations placed with `out_sharding=`.
- `LinenTiedLM`: linen blocks in a Python loop between an `nn.Embed` and its `attend` head,
  the plan in logical names.
- `SharedLM`: NNX blocks that share one `nnx.Linear` (the same instance in every block: its
  params sit in the first block's unit) and read the root's position table, the plan in
  `nnx.with_partitioning` mesh axes.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

V, D, HEADS, HD, F, T = 32, 16, 2, 8, 32, 8
RULES = (("tp", "model"), ("fsdp", "data"))  # the explicit-sharding models' names on zerojax's


def causal(t):
    return jnp.tril(jnp.ones((t, t), bool))


def last(w, x):
    """`w` over the last axis of `x` (the tests run with rank promotion off)."""
    return w.reshape((1,) * (x.ndim - w.ndim) + w.shape)


# --------------------------------------------------------------------------- flax's gemma


@dataclasses.dataclass(frozen=True)
class GemmaShards:
    """examples/gemma's ShardingConfig: the params' and activations' layout in its names."""

    emb_vd: P = P("tp", "fsdp")
    q_weight_ndh: P = P("tp", "fsdp", None)
    kv_weight_cndh: P = P(None, "tp", "fsdp", None)
    o_weight_nhd: P = P("tp", None, "fsdp")
    ffw_weight_df: P = P("fsdp", "tp")
    ffw_weight_fd: P = P("tp", "fsdp")
    rms_norm_weight: P = P("tp")
    act_btd: P = P("fsdp", None, None)
    act_btf: P = P("fsdp", None, "tp")
    act_btnh: P = P("fsdp", None, "tp", None)


class RMSNorm(nnx.Module):
    def __init__(self, dim, *, scale_metadata, rngs):
        self.scale = nnx.Param(nnx.initializers.zeros_init()(rngs.params(), (dim,)),
                               **scale_metadata)

    def __call__(self, x):
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-6) * last(1 + self.scale[...], x)


class ScaledEmbed(nnx.Embed):
    def __call__(self, x, out_sharding=None):
        x = super().__call__(x, out_sharding)
        x *= jnp.sqrt(x.shape[-1])
        return x


class Attention(nnx.Module):
    def __init__(self, shd, *, rngs):
        init = nnx.initializers.normal(0.2)
        self.q_einsum = nnx.Einsum("BTD,NDH->BTNH", (HEADS, D, HD), kernel_init=init,
                                   kernel_metadata={"out_sharding": shd.q_weight_ndh}, rngs=rngs)
        self.kv_einsum = nnx.Einsum("BTD,CKDH->CBTKH", (2, HEADS, D, HD), kernel_init=init,
                                    kernel_metadata={"out_sharding": shd.kv_weight_cndh},
                                    rngs=rngs)
        self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (HEADS, HD, D), kernel_init=init,
                                          kernel_metadata={"out_sharding": shd.o_weight_nhd},
                                          rngs=rngs)
        self.shd = shd

    def __call__(self, x):
        q = self.q_einsum(x, out_sharding=self.shd.act_btnh) * HD**-0.5
        k, v = self.kv_einsum(x)
        logits = jnp.einsum("BTNH,BSNH->BTNS", q, k)
        probs = jax.nn.softmax(jnp.where(causal(x.shape[1])[None, :, None], logits, -2.3e38), -1)
        return self.attn_vec_einsum(jnp.einsum("BTNS,BSNH->BTNH", probs, v),
                                    out_sharding=self.shd.act_btd)


class FeedForward(nnx.Module):
    def __init__(self, shd, *, rngs):
        init = nnx.initializers.normal(0.2)
        lin = lambda i, o, s: nnx.Linear(i, o, use_bias=False, kernel_init=init,  # noqa: E731
                                         kernel_metadata={"out_sharding": s}, rngs=rngs)
        self.gate_proj = lin(D, F, shd.ffw_weight_df)
        self.up_proj = lin(D, F, shd.ffw_weight_df)
        self.down_proj = lin(F, D, shd.ffw_weight_fd)
        self.shd = shd

    def __call__(self, x):
        gate = nnx.gelu(self.gate_proj(x, out_sharding=self.shd.act_btf))
        return self.down_proj(gate * self.up_proj(x, out_sharding=self.shd.act_btf),
                              out_sharding=self.shd.act_btd)


class Block(nnx.Module):
    def __init__(self, shd, *, rngs):
        norm = {"out_sharding": shd.rms_norm_weight}
        self.pre_attention_norm = RMSNorm(D, scale_metadata=norm, rngs=rngs)
        self.attn = Attention(shd, rngs=rngs)
        self.pre_ffw_norm = RMSNorm(D, scale_metadata=norm, rngs=rngs)
        self.mlp = FeedForward(shd, rngs=rngs)

    def __call__(self, x, cache=None):
        x = x + self.attn(self.pre_attention_norm(x))
        return cache, x + self.mlp(self.pre_ffw_norm(x))


class GemmaLM(nnx.Module):
    """The embedder is the output head (`self.embedder.attend`), as in examples/gemma."""

    def __init__(self, layers=2, *, rngs, shd=GemmaShards()):
        self.embedder = ScaledEmbed(V, D, embedding_init=nnx.initializers.normal(0.5),
                                    embedding_metadata={"out_sharding": shd.emb_vd}, rngs=rngs)
        self.layers = nnx.List([Block(shd, rngs=rngs) for _ in range(layers)])
        self.final_norm = RMSNorm(D, scale_metadata={"out_sharding": shd.rms_norm_weight},
                                  rngs=rngs)
        self.shd = shd

    def __call__(self, tokens):
        x = self.embedder(tokens, out_sharding=self.shd.act_btd)
        for layer in self.layers:
            _, x = layer(x)
        return self.embedder.attend(self.final_norm(x), out_sharding=self.shd.act_btd)


# --------------------------------------------------------------------------- linen, attend head

LOGICAL = (("vocab", "model"), ("mlp", "model"), ("embed", None))
_lp = nn.with_logical_partitioning


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.normal(0.2)
        h = nn.Dense(F, kernel_init=_lp(init, ("embed", "mlp")),
                     bias_init=_lp(nn.initializers.zeros, ("mlp",)))(nn.LayerNorm()(x))
        return x + nn.Dense(D, kernel_init=_lp(init, ("mlp", "embed")))(nn.gelu(h))


class LinenTiedLM(nn.Module):
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(V, D, embedding_init=_lp(nn.initializers.normal(0.5), ("vocab", "embed")))
        x = embed(tokens)
        for _ in range(self.layers):
            x = LinenBlock()(x)
        return embed.attend(nn.LayerNorm()(x))


# --------------------------------------------------------------------------- shared by blocks


class SharedBlock(nnx.Module):
    """Its own MLP input layer, and an output layer (`shared`) that every block holds."""

    def __init__(self, shared, pos, *, rngs):
        self.up = nnx.Linear(D, F, kernel_init=nnx.with_partitioning(
            nnx.initializers.normal(0.2), (None, "model")), rngs=rngs)
        self.shared = shared
        self.pos = pos  # the root's position table, read inside the block

    def __call__(self, x):
        x = x + self.pos[...][None, : x.shape[1]]
        return x + self.shared(jax.nn.gelu(self.up(x)))


class SharedLM(nnx.Module):
    def __init__(self, layers=2, *, rngs):
        self.embed = nnx.Embed(V, D, embedding_init=nnx.initializers.normal(0.5), rngs=rngs)
        # The root's own (its path sorts before the blocks'), read inside every block.
        self.abs_pos = nnx.Param(nnx.initializers.normal(0.1)(rngs.params(), (T, D)))
        shared = nnx.Linear(F, D, kernel_init=nnx.with_partitioning(
            nnx.initializers.normal(0.2), ("model", None)), rngs=rngs)
        self.blocks = nnx.List([SharedBlock(shared, self.abs_pos, rngs=rngs)
                                for _ in range(layers)])
        self.head = nnx.Linear(D, V, kernel_init=nnx.with_partitioning(
            nnx.initializers.normal(0.2), (None, "model")), rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
