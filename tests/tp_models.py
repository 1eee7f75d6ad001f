"""Small models in each way Flax and JAX models write their tensor-parallel plan, for
test_tp_styles.py. They import nothing from zerojax.

- `ExplicitLM`: JAX's explicit-sharding style, as flax's examples/gemma and jax-ml/bonsai's
  Qwen3 write it: params with `kernel_metadata={"out_sharding": P(...)}` in the model's own
  axis names ("tp", "fsdp"), activations placed with `out_sharding=` (on NNX layers' calls,
  `jnp.einsum`, `.at[].get`, `nnx.Embed`/`attend`) and `reshard`; written to run under
  `jax.set_mesh` with Explicit axes.
- `LinenZoo`: every linen layer that takes partitioned initializers, with logical names.
- `NNXZoo`: NNX layers with `nnx.with_partitioning` logical names, `MultiHeadAttention`
  among them.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from jax.sharding import get_abstract_mesh, reshard

V, D, F, HEADS, HD, T = 24, 16, 32, 4, 4, 8

# --------------------------------------------------------------------------- explicit sharding


@dataclasses.dataclass(frozen=True)
class ShardingCfg:
    emb_vd: P = P("tp", "fsdp")
    pos_td: P = P(None, "fsdp")
    q_dnh: P = P("fsdp", "tp", None)
    kv_dnh: P = P("fsdp", "tp", None)
    o_nhd: P = P("tp", None, "fsdp")
    up_df: P = P("fsdp", "tp")
    down_fd: P = P("tp", "fsdp")
    norm_d: P = P(None)
    act_btd: P = P("fsdp", None, None)
    act_btnh: P = P("fsdp", None, "tp", None)
    act_btf: P = P("fsdp", None, "tp")
    act_btv: P = P("fsdp", None, "tp")


EXPLICIT_RULES = (("tp", "model"), ("fsdp", "data"))  # the model's names on zerojax's mesh


def shard(x, spec):
    """bonsai's helper: a reshard under a mesh, the identity without one."""
    mesh = get_abstract_mesh()
    if not mesh.empty and len(mesh.axis_names) > 0:
        return reshard(x, spec)
    return x


class Attention(nnx.Module):
    def __init__(self, shd, rngs):
        init = nnx.initializers.normal(0.2)
        self.q = nnx.Einsum("btd,dnh->btnh", (D, HEADS, HD), kernel_init=init,
                            kernel_metadata={"out_sharding": shd.q_dnh}, rngs=rngs)
        self.kv = nnx.LinearGeneral(D, (2 * HEADS, HD), kernel_init=init, use_bias=False,
                                    kernel_metadata={"out_sharding": shd.kv_dnh}, rngs=rngs)
        self.o = nnx.Param(init(rngs.params(), (HEADS, HD, D)), out_sharding=shd.o_nhd)
        self.shd = shd

    def __call__(self, x):
        q = self.q(x, out_sharding=self.shd.act_btnh)
        kv = self.kv(x, out_sharding=self.shd.act_btnh)
        k, v = kv[:, :, :HEADS], kv[:, :, HEADS:]
        s = jnp.einsum("btnh,bsnh->bnts", q, k, out_sharding=P("fsdp", "tp", None, None))
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        a = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(jnp.where(causal, s, -1e9), -1), v,
                       out_sharding=self.shd.act_btnh)
        return jnp.einsum("btnh,nhd->btd", a, self.o[...], out_sharding=self.shd.act_btd)


class Block(nnx.Module):
    def __init__(self, shd, rngs):
        init = nnx.initializers.normal(0.2)
        self.norm1 = nnx.RMSNorm(D, scale_metadata={"out_sharding": shd.norm_d}, rngs=rngs)
        self.attn = Attention(shd, rngs)
        self.norm2 = nnx.LayerNorm(D, scale_metadata={"out_sharding": shd.norm_d}, rngs=rngs)
        self.up = nnx.Linear(D, F, kernel_init=init, kernel_metadata={"out_sharding": shd.up_df},
                             bias_metadata={"out_sharding": P("tp")}, rngs=rngs)
        self.down = nnx.Linear(F, D, kernel_init=init, use_bias=False,
                               kernel_metadata={"out_sharding": shd.down_fd}, rngs=rngs)
        self.shd = shd

    def __call__(self, x):
        x = shard(x + self.attn(self.norm1(x)), self.shd.act_btd)
        h = shard(jax.nn.gelu(self.up(self.norm2(x), out_sharding=self.shd.act_btf)),
                  self.shd.act_btf)
        return shard(x + self.down(h, out_sharding=self.shd.act_btd), self.shd.act_btd)


class ExplicitLM(nnx.Module):
    def __init__(self, layers=2, *, rngs, shd=ShardingCfg()):
        self.embed = nnx.Embed(V, D, embedding_init=nnx.initializers.normal(1.0),
                               embedding_metadata={"out_sharding": shd.emb_vd}, rngs=rngs)
        self.pos = nnx.Param(nnx.initializers.normal(0.1)(rngs.params(), (T, D)),
                             out_sharding=shd.pos_td)
        self.blocks = nnx.List([Block(shd, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(D, scale_metadata={"out_sharding": shd.norm_d}, rngs=rngs)
        self.shd = shd

    def __call__(self, tokens):
        x = self.embed(tokens, out_sharding=self.shd.act_btd)
        pos = self.pos[...].at[jnp.arange(tokens.shape[1])].get(out_sharding=P(None, None))
        x = x + pos[None]
        for block in self.blocks:
            x = block(x)
        return shard(self.embed.attend(self.norm(x), out_sharding=self.shd.act_btv), P())


# --------------------------------------------------------------------------- linen, logical names

ZOO_RULES = (("vocab", "model"), ("heads", "model"), ("mlp", "model"), ("embed", None),
             ("kv", None), ("batch", "data"), ("length", None))
_init = nn.initializers.normal(0.2)
_lp = nn.with_logical_partitioning


class LinenZoo(nn.Module):
    """Embed + attend, MultiHeadDotProductAttention, DenseGeneral (multi-dimensional features,
    `axis=`), Einsum, Conv, Dense, LayerNorm and RMSNorm with partitioned scales."""

    @nn.compact
    def __call__(self, tok):
        emb = nn.Embed(V, D,
                       embedding_init=_lp(nn.initializers.normal(1.0), ("vocab", "embed")))
        x = nn.with_logical_constraint(emb(tok), ("batch", "length", "embed"))
        h = nn.RMSNorm(scale_init=_lp(nn.initializers.ones, ("embed",)))(x)
        x = x + nn.MultiHeadDotProductAttention(
            HEADS, kernel_init=_lp(_init, ("embed", "heads", "kv")), use_bias=False,
            out_kernel_init=_lp(_init, ("heads", "kv", "embed")))(h, mask=nn.make_causal_mask(tok))
        h = nn.LayerNorm(scale_init=_lp(nn.initializers.ones, ("embed",)),
                         bias_init=_lp(nn.initializers.zeros, ("embed",)))(x)
        h = nn.DenseGeneral((HEADS, HD), kernel_init=_lp(_init, ("embed", "heads", "kv")),
                            bias_init=_lp(nn.initializers.zeros, ("heads", "kv")))(h)
        h = nn.with_logical_constraint(nn.gelu(h), ("batch", "length", "heads", "kv"))
        x = x + nn.DenseGeneral(D, axis=(-2, -1),
                                kernel_init=_lp(_init, ("heads", "kv", "embed")))(h)
        h = nn.Einsum((D, F), "btd,df->btf", kernel_init=_lp(_init, ("embed", "mlp")),
                      bias_init=_lp(nn.initializers.zeros, ("mlp",)))(x)
        h = nn.Conv(F, (3,), feature_group_count=1, kernel_init=_lp(_init, (None, "mlp", None)))(
            nn.gelu(h))
        x = x + nn.Dense(D, kernel_init=_lp(_init, ("mlp", "embed")))(nn.gelu(h))
        return emb.attend(x)


class DenseGeneralNet(nn.Module):
    """`nn.DenseGeneral` with a logical name on each output dimension (the attention
    projections' usual form): a flat kernel boxed with three names, reshaped in init."""

    @nn.compact
    def __call__(self, x):
        h = nn.DenseGeneral((HEADS, HD), kernel_init=_lp(_init, ("embed", "heads", "kv")))(x)
        return nn.DenseGeneral(1, axis=(-2, -1), kernel_init=_lp(_init, ("heads", "kv", None)))(
            jnp.tanh(h))[..., 0]


class DenseGeneralLast(nn.Module):
    """As `DenseGeneralNet`, its split name ("heads") the last of the kernel's three."""

    @nn.compact
    def __call__(self, x):
        h = nn.DenseGeneral((HD, HEADS), kernel_init=_lp(_init, ("embed", "kv", "heads")))(x)
        return nn.DenseGeneral(1, axis=(-2, -1), kernel_init=_lp(_init, ("kv", "heads", None)))(
            jnp.tanh(h))[..., 0]


# --------------------------------------------------------------------------- NNX, logical names


_NORMAL = nnx.initializers.normal(0.2)


class NNXZoo(nnx.Module):
    """Embed + attend, MultiHeadAttention, LinearGeneral, Einsum, Linear, LayerNorm and RMSNorm
    with partitioned scales, all through `nnx.with_partitioning` logical names."""

    def __init__(self, rngs):
        def w(names, init=_NORMAL):
            return nnx.with_partitioning(init, names)

        ones = nnx.initializers.ones
        self.emb = nnx.Embed(V, D, embedding_init=w(("vocab", "embed"),
                                                    nnx.initializers.normal(1.0)), rngs=rngs)
        self.ln = nnx.LayerNorm(D, scale_init=w(("embed",), ones), rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D, kernel_init=w(("embed", "heads", "kv")),
                                           out_kernel_init=w(("heads", "kv", "embed")),
                                           use_bias=False, decode=False, rngs=rngs)
        self.rms = nnx.RMSNorm(D, scale_init=w(("embed",), ones), rngs=rngs)
        self.up = nnx.LinearGeneral(D, (HEADS, HD), kernel_init=w(("embed", "heads", "kv")),
                                    bias_init=w(("heads", "kv"), nnx.initializers.zeros),
                                    rngs=rngs)
        self.down = nnx.LinearGeneral((HEADS, HD), D, axis=(-2, -1),
                                      kernel_init=w(("heads", "kv", "embed")), rngs=rngs)
        self.ein = nnx.Einsum("btd,df->btf", (D, F), kernel_init=w(("embed", "mlp")), rngs=rngs)
        self.out = nnx.Linear(F, D, kernel_init=w(("mlp", "embed")), rngs=rngs)

    def __call__(self, tok):
        x = self.emb(tok)
        x = x + self.attn(self.ln(x), mask=nnx.make_causal_mask(tok))
        x = x + self.down(jax.nn.gelu(self.up(self.rms(x))))
        x = x + self.out(jax.nn.gelu(self.ein(x)))
        return self.emb.attend(x)
