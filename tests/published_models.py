"""Four small models written the way published Flax code writes them, for test_published.py.

They import nothing from zerojax and are trained through `zj.from_linen` / `zj.from_nnx` as they
are: GSPMD sharding hints on the params (and on activations), a BatchNorm with a hard-coded
`axis_name="batch"` initialized in training mode, dropout switched by a config field, and NNX
dropout that takes its keys at call time.
"""

import dataclasses
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

# --------------------------------------------------------------------------- 1. boxed params


class MlpBlock(nn.Module):
    """A residual MLP layer; its params carry physical and logical partitioning hints."""

    d: int
    rate: float = 0.0

    @nn.compact
    def __call__(self, x, deterministic: bool):
        h = nn.LayerNorm(scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(),
                                                                 ("embed",)))(x)
        h = nn.Dense(2 * self.d, kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("embed", "mlp")))(h)
        h = nn.with_logical_constraint(nn.gelu(h), ("batch", "length", "mlp"))
        h = nn.Dense(self.d, kernel_init=nn.with_partitioning(
            nn.initializers.lecun_normal(), ("model", None)), bias_init=nn.with_partitioning(
            nn.initializers.zeros_init(), (None,)))(h)
        h = nn.Dropout(self.rate)(h, deterministic=deterministic)
        return x + h, None


class BoxedLM(nn.Module):
    """Tied embedding and an `nn.scan` stack whose boxes get a "layers" axis."""

    vocab: int
    d: int
    layers: int
    rate: float = 0.0

    @nn.compact
    def __call__(self, tokens, deterministic: bool = True):
        embed = nn.Embed(self.vocab, self.d, embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(1.0), ("vocab", "embed")))
        x = nn.with_logical_constraint(embed(tokens), ("batch", "length", "embed"))
        stack = nn.scan(MlpBlock, variable_axes={"params": 0},
                        split_rngs={"params": True, "dropout": True}, in_axes=nn.broadcast,
                        length=self.layers, metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = stack(self.d, self.rate, name="blocks")(x, deterministic)
        return embed.attend(nn.LayerNorm()(x))


LOGICAL_RULES = (("batch", "data"), ("length", None), ("embed", None), ("mlp", "model"),
                 ("vocab", "model"))


# --------------------------------------------------------------------------- 2. ResNet


class ResNetBlock(nn.Module):
    filters: int
    conv: Any
    norm: Any
    strides: tuple = (1, 1)

    @nn.compact
    def __call__(self, x):
        y = nn.relu(self.norm()(self.conv(self.filters, (3, 3), self.strides)(x)))
        y = self.norm(scale_init=nn.initializers.zeros_init())(self.conv(self.filters, (3, 3))(y))
        if x.shape != y.shape:
            x = self.norm(name="norm_proj")(self.conv(self.filters, (1, 1), self.strides,
                                                      name="conv_proj")(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    """BatchNorm statistics over the axis "batch" (as a pmap training script binds it)."""

    stage_sizes: tuple = (1, 1)
    filters: int = 4
    classes: int = 3

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = partial(nn.Conv, use_bias=False)
        norm = partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5,
                       axis_name="batch")
        x = nn.relu(norm(name="bn_init")(conv(self.filters, (3, 3), name="conv_init")(x)))
        for i, size in enumerate(self.stage_sizes):
            for j in range(size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ResNetBlock(self.filters * 2**i, conv, norm, strides)(x)
        return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


# --------------------------------------------------------------------------- 3. config dropout


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab: int = 16
    d: int = 8
    heads: int = 2
    layers: int = 2
    max_len: int = 8
    dropout_rate: float = 0.25
    deterministic: bool = False  # dropout on: the config, not the call, switches it


class DecoderBlock(nn.Module):
    config: LMConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        mask = nn.make_causal_mask(x[..., 0])
        # No biases: the key bias has an exactly zero gradient (softmax is shift-invariant),
        # where Adam turns reduction-order noise into steps no two runs agree on.
        h = nn.MultiHeadDotProductAttention(cfg.heads, dropout_rate=cfg.dropout_rate,
                                            deterministic=cfg.deterministic, use_bias=False)(
            nn.LayerNorm()(x), mask=mask)
        x = x + nn.Dropout(cfg.dropout_rate, deterministic=cfg.deterministic)(h)
        h = nn.Dense(cfg.d)(nn.gelu(nn.Dense(2 * cfg.d)(nn.LayerNorm()(x))))
        return x + nn.Dropout(cfg.dropout_rate, deterministic=cfg.deterministic)(h)


class ConfigLM(nn.Module):
    config: LMConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.config
        pos = self.param("pos", nn.initializers.normal(0.02), (cfg.max_len, cfg.d))
        x = nn.Embed(cfg.vocab, cfg.d)(tokens) + pos[None, : tokens.shape[1]]
        x = nn.Dropout(cfg.dropout_rate, deterministic=cfg.deterministic)(x)
        for _ in range(cfg.layers):
            x = DecoderBlock(cfg)(x)
        return nn.Dense(cfg.vocab)(nn.LayerNorm()(x))


# --------------------------------------------------------------------------- 4. NNX, call-time rngs


class Layer(nnx.Module):
    """Attention and MLP; dropout keys come with the call. Kernels carry sharding hints."""

    def __init__(self, d: int, heads: int, rate: float, *, rngs: nnx.Rngs):
        hint = lambda *names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)  # noqa: E731
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, dropout_rate=rate, decode=False,
                                           keep_rngs=False, use_bias=False,
                                           kernel_init=hint(None, "model", None), rngs=rngs)
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 2 * d, kernel_init=hint(None, "model"), rngs=rngs)
        self.down = nnx.Linear(2 * d, d, kernel_init=hint("model", None), rngs=rngs)
        self.dropout = nnx.Dropout(rate)

    def __call__(self, x, *, rngs: nnx.Rngs | None = None):
        mask = nnx.make_causal_mask(x[..., 0])
        x = x + self.dropout(self.attn(self.norm1(x), mask=mask, rngs=rngs), rngs=rngs)
        return x + self.dropout(self.down(jax.nn.gelu(self.up(self.norm2(x)))), rngs=rngs)


class Transformer(nnx.Module):
    """Layers stacked by `nnx.vmap` and run by `nnx.scan`, the keys split per layer."""

    def __init__(self, vocab=16, d=8, heads=2, layers=2, rate=0.25, *, rngs: nnx.Rngs):
        self.layers = layers
        self.embed = nnx.Embed(vocab, d, embedding_init=nnx.with_partitioning(
            nnx.initializers.normal(1.0), ("model", None)), rngs=rngs)
        self.dropout = nnx.Dropout(rate)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs):
            return Layer(d, heads, rate, rngs=rngs)

        self.stack = stack(rngs)
        self.norm = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, tokens, *, rngs: nnx.Rngs | None = None):
        x = self.dropout(self.embed(tokens), rngs=rngs)

        @nnx.split_rngs(splits=self.layers)
        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
        def body(x, layer, rngs):
            return layer(x, rngs=rngs)

        return self.embed.attend(self.norm(body(x, self.stack, rngs)))


class NormMLP(nnx.Module):
    """NNX BatchNorm over the axis "batch"."""

    def __init__(self, d_in: int = 6, d: int = 8, classes: int = 3, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(d_in, d, use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(d, momentum=0.9, axis_name="batch", rngs=rngs)
        self.head = nnx.Linear(d, classes, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.norm(self.up(x))))
