"""GPT-2-style pre-LN decoder in Flax linen, written against the zerojax model protocol."""

from __future__ import annotations

import dataclasses
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax.mesh import MODEL
from zerojax.units import PlainUnits

_init = nn.initializers.normal(0.02)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Decoder shape. Weights normal(0.02), biases zero, LayerNorm scales one."""

    vocab_size: int
    seq_len: int
    d_model: int
    n_heads: int
    n_layers: int
    d_ff: int

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"GPTConfig.{f.name} must be a positive int, got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads}"
            )

    @property
    def layer_params(self) -> int:
        """Parameters of one block: ln1, ln2, qkv, out, fc, mlp out (with biases)."""
        d, f = self.d_model, self.d_ff
        return 4 * d * d + 2 * d * f + 9 * d + f


PRESETS: dict[str, GPTConfig] = {
    # parity tests: compiles in seconds on CPU
    "test": GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2, d_ff=64),
    # smallest training preset, byte-level: the quick start's 200 steps of batch 16 take
    # about 25 s on an idle 2-core CPU
    "nano": GPTConfig(vocab_size=256, seq_len=128, d_model=128, n_heads=4, n_layers=4, d_ff=512),
    # memory/benchmark tests on 8 simulated devices: many layers, small width
    "small8": GPTConfig(vocab_size=256, seq_len=128, d_model=128, n_heads=4, n_layers=8, d_ff=512),
    # GPT-2 124M body; the untied head adds d*V
    "gpt2-small": GPTConfig(
        vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12, d_ff=3072
    ),
    "1b": GPTConfig(
        vocab_size=32000, seq_len=2048, d_model=2048, n_heads=16, n_layers=18, d_ff=8192
    ),
    # GPT-3 6.7B body with a 32k vocabulary
    "7b": GPTConfig(
        vocab_size=32000, seq_len=2048, d_model=4096, n_heads=32, n_layers=32, d_ff=16384
    ),
}


def causal_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK) -> jax.Array:
    """Causal softmax attention written out; scores and softmax in fp32, output in v's dtype.

    TinyTransformer's attention (its hand-checked numbers depend on this exact arithmetic);
    GPT uses `dot_product_attention`.
    """
    T, K = q_BxTxHxK.shape[1], q_BxTxHxK.shape[3]
    s_BxHxTxT = jnp.einsum(
        "bqhk,bshk->bhqs", q_BxTxHxK, k_BxTxHxK, preferred_element_type=jnp.float32
    ) * (K**-0.5)
    mask_TxT = jnp.tril(jnp.ones((T, T), bool))
    s_BxHxTxT = jnp.where(mask_TxT[None, None], s_BxHxTxT, jnp.finfo(jnp.float32).min)
    p_BxHxTxT = jax.nn.softmax(s_BxHxTxT, axis=-1).astype(v_BxTxHxK.dtype)
    return jnp.einsum("bhqs,bshk->bqhk", p_BxHxTxT, v_BxTxHxK)


# cuDNN's fused (flash) attention: half-precision inputs, head dims it has kernels for.
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_CUDNN_HEAD_DIMS = range(8, 257, 8)


def attention_implementation(dtype, head_dim: int) -> str:
    """The `jax.nn.dot_product_attention` backend GPT uses: "cudnn" (flash attention) on GPU
    for bf16/fp16 and a head dim cuDNN supports, else "xla" (the same arithmetic unfused)."""
    if (jax.default_backend() == "gpu" and jnp.dtype(dtype) in _CUDNN_DTYPES
            and head_dim in _CUDNN_HEAD_DIMS):
        return "cudnn"
    return "xla"


def dot_product_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK) -> jax.Array:
    """Causal softmax attention through `jax.nn.dot_product_attention`; scores and softmax in
    fp32, output in v's dtype, as `causal_attention` computes it (fused on GPU)."""
    impl = attention_implementation(q_BxTxHxK.dtype, q_BxTxHxK.shape[3])
    if impl == "cudnn":
        try:
            return jax.nn.dot_product_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK,
                                                is_causal=True, implementation="cudnn")
        except (NotImplementedError, RuntimeError, ValueError) as e:
            # An older cuDNN, or a shape it has no kernel for: the checks run at trace time.
            # (Python's default filter shows a warning once per call site.)
            warnings.warn(f"cuDNN attention unavailable ({str(e).splitlines()[0][:200]}); "
                          f"GPT attention runs unfused through XLA", stacklevel=2)
    if q_BxTxHxK.dtype == jnp.float16 and jax.default_backend() == "cpu":
        # jax's XLA attention asks for an F16_F16_F32 dot, which XLA:CPU rejects when the step
        # is lowered (too late for jax's own fallback); the written-out formula is the same.
        return causal_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK)
    return jax.nn.dot_product_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, is_causal=True,
                                        implementation="xla")


def cross_entropy(logits_BxTxV, targets_BxT) -> jax.Array:
    """Mean token cross-entropy, computed in fp32."""
    logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    nll_BxT = -jnp.take_along_axis(logp, targets_BxT[..., None], axis=-1)[..., 0]
    return jnp.mean(nll_BxT)


class Embed(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, inputs_BxT):
        c = self.cfg
        tok = self.param("tok", _init, (c.vocab_size, c.d_model))
        pos = self.param("pos", _init, (c.seq_len, c.d_model))
        T = inputs_BxT.shape[1]
        return jnp.take(tok, inputs_BxT, axis=0) + pos[None, :T]


class Attention(nn.Module):
    """Causal self-attention. The fused qkv projection's 3·D output columns are head-major,
    `[H, 3, K]` (Megatron's order): a contiguous split of them over the model axis gives each
    device whole heads with their q, k and v."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x_BxTxD):
        c = self.cfg
        B, T, D = x_BxTxD.shape
        qkv = nn.Dense(3 * D, kernel_init=_init, name="qkv")(x_BxTxD)
        qkv_BxTxHx3xK = qkv.reshape(B, T, c.n_heads, 3, D // c.n_heads)
        q, k, v = (qkv_BxTxHx3xK[:, :, :, i] for i in range(3))
        o_BxTxD = dot_product_attention(q, k, v).reshape(B, T, D)
        return nn.Dense(D, kernel_init=_init, name="out")(o_BxTxD)


class MLP(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x_BxTxD):
        h = nn.gelu(nn.Dense(self.cfg.d_ff, kernel_init=_init, name="fc")(x_BxTxD))
        return nn.Dense(self.cfg.d_model, kernel_init=_init, name="out")(h)


class Block(nn.Module):
    """Pre-LN block; computes in the params' dtype (LayerNorm statistics in fp32)."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x_BxTxD):
        x = x_BxTxD + Attention(self.cfg, name="attn")(nn.LayerNorm(1e-5, name="ln1")(x_BxTxD))
        return x + MLP(self.cfg, name="mlp")(nn.LayerNorm(1e-5, name="ln2")(x))


class Head(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x_BxTxD):
        h = nn.LayerNorm(1e-5, name="ln")(x_BxTxD)
        return nn.Dense(self.cfg.vocab_size, use_bias=False, kernel_init=_init, name="head")(h)


class GPT:
    """GPT-style decoder. Params: {"embed": {tok, pos}, "blocks": <Block stacked on L>,
    "final": {ln, head}}; units: `embed`, one per layer of `blocks`, `final`.

    Batch: {"inputs": int32 [B, T], "targets": int32 [B, T]} with T <= cfg.seq_len.
    """

    def __init__(self, cfg: GPTConfig):
        self.cfg = cfg

    @classmethod
    def from_preset(cls, name: str) -> GPT:
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; available: {sorted(PRESETS)}")
        return cls(PRESETS[name])

    def init(self, rng: jax.Array) -> dict:
        c = self.cfg
        k_embed, k_blocks, k_final = jax.random.split(rng, 3)
        x = jnp.zeros((1, 1, c.d_model), jnp.float32)
        block_init = lambda k: Block(c).init(k, x)["params"]
        return {
            "embed": Embed(c).init(k_embed, jnp.zeros((1, 1), jnp.int32))["params"],
            "blocks": jax.vmap(block_init)(jax.random.split(k_blocks, c.n_layers)),
            "final": Head(c).init(k_final, x)["params"],
        }

    def logits(self, params, inputs_BxT, units) -> jax.Array:
        """Logits [B, T, V] in compute dtype."""
        c = self.cfg
        if inputs_BxT.ndim != 2 or not jnp.issubdtype(inputs_BxT.dtype, jnp.integer):
            raise ValueError(
                f"GPT inputs must be int [B, T], got {inputs_BxT.dtype}{inputs_BxT.shape}"
            )
        if inputs_BxT.shape[1] > c.seq_len:
            raise ValueError(
                f"GPT inputs have T={inputs_BxT.shape[1]} > seq_len={c.seq_len}; crop the batch"
            )
        h = Embed(c).apply({"params": units.gather(params["embed"])}, inputs_BxT)
        body = lambda h, p: Block(c).apply({"params": p}, h)
        h = units.scan(body, h, params["blocks"])
        return Head(c).apply({"params": units.gather(params["final"])}, h)

    def loss(self, params, batch, units) -> jax.Array:
        inputs, targets = batch["inputs"], batch["targets"]
        if targets.shape != inputs.shape:
            raise ValueError(
                f"GPT batch targets shape {targets.shape} must equal inputs shape {inputs.shape}"
            )
        return cross_entropy(self.logits(params, inputs, units), targets)

    def apply(self, params, inputs_BxT) -> jax.Array:
        """Logits from plain (exported) param arrays, without an engine."""
        return self.logits(params, inputs_BxT, PlainUnits())

    def param_specs(self) -> dict:
        """The tensor-parallel plan, Megatron's: per param leaf, the PartitionSpec over the
        `model` mesh axis (DESIGN.md section 8). The qkv projection and the MLP's first layer
        are split by their output features (whole heads: the columns are head-major), the
        attention output and the MLP's second layer by their input features, the token
        embedding and the head by the vocabulary; position embeddings, LayerNorms and the
        biases added after a reduction are replicated. Per layer and step that is one
        all-reduce of the activations over `model` after attention and one after the MLP,
        forward and backward."""
        blocks = {"ln1": {"scale": None, "bias": None}, "ln2": {"scale": None, "bias": None},
                  "attn": {"qkv": {"kernel": P(None, None, MODEL), "bias": P(None, MODEL)},
                           "out": {"kernel": P(None, MODEL, None), "bias": None}},
                  "mlp": {"fc": {"kernel": P(None, None, MODEL), "bias": P(None, MODEL)},
                          "out": {"kernel": P(None, MODEL, None), "bias": None}}}
        return {"embed": {"tok": P(MODEL, None), "pos": None}, "blocks": blocks,
                "final": {"ln": {"scale": None, "bias": None}, "head": {"kernel": P(None, MODEL)}}}

    def num_params(self) -> int:
        c = self.cfg
        d, V = c.d_model, c.vocab_size
        return V * d + c.seq_len * d + c.n_layers * c.layer_params + 2 * d + d * V

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token: 6*N + 12*L*T*d (PaLM app. B), N without embedding tables,
        T the sequences' length (default: the context length).

        The token/position tables are lookups, not matmuls; the untied head is counted in N.
        """
        c = self.cfg
        return 6 * self.flops_params() + 12 * c.n_layers * (seq_len or c.seq_len) * c.d_model

    def flops_params(self) -> int:
        """N of `flops_per_token`'s 6·N: the params without the token and position tables."""
        c = self.cfg
        return self.num_params() - (c.vocab_size + c.seq_len) * c.d_model
