"""A transformer small enough to follow by hand: one pre-LN block, d=4, 2 heads, FFN 16, V=8,
T=3; 260 params."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.models.gpt import causal_attention, cross_entropy

D, HEADS, FFN, VOCAB, SEQ = 4, 2, 16, 8, 3


def _layer_norm(x_BxTxD, ln, eps: float = 1e-5):
    # statistics in fp32 so bf16/fp16 compute stays stable; the scale/shift stay in compute dtype
    x32 = x_BxTxD.astype(jnp.float32)
    mu = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mu), axis=-1, keepdims=True)
    y = ((x32 - mu) * jax.lax.rsqrt(var + eps)).astype(x_BxTxD.dtype)
    return y * ln["gamma"][None, None, :] + ln["beta"][None, None, :]


class TinyTransformer:
    """13 leaves, 260 params, two ZeRO units.

    Units: `block` (ln1, attn, ln2, mlp: 228 params) and `head` (W_vocab: 32 params).
    The 13 leaves include no embedding, so the input embedding is a *fixed* table
    (token + position, standard normal from `embed_seed`) stored on the model, not
    trained. Dict keys are chosen so the flattened leaf order puts ln1+attn+ln2 (80
    params) before W1, as in the worked example: a 130/130 flat split cuts W1 into 50 + 14.

    Batch: {"inputs": int32 [B, 3], "targets": int32 [B, 3]}; loss is mean token CE.
    """

    def __init__(self, embed_seed: int = 0):
        rng = np.random.default_rng(embed_seed)
        self.tok_embed = rng.standard_normal((VOCAB, D)).astype(np.float32)
        self.pos_embed = rng.standard_normal((SEQ, D)).astype(np.float32)

    def init(self, rng: jax.Array) -> dict:
        ks = iter(jax.random.split(rng, 7))

        def dense(shape):  # LeCun normal: a 4-wide model needs O(1) weights to learn fast
            return jax.random.normal(next(ks), shape, jnp.float32) / np.sqrt(shape[0])

        ln = lambda: {"gamma": jnp.ones((D,), jnp.float32), "beta": jnp.zeros((D,), jnp.float32)}
        return {
            "block": {
                "ln1": ln(),
                "attn": {k: dense((D, D)) for k in ("W_q", "W_k", "W_v", "W_o")},
                "ln2": ln(),
                "mlp": {
                    "W1": dense((D, FFN)),
                    "b1": jnp.zeros((FFN,), jnp.float32),
                    "W2": dense((FFN, D)),
                    "b2": jnp.zeros((D,), jnp.float32),
                },
            },
            "head": {"W_vocab": dense((D, VOCAB))},
        }

    def logits(self, params, inputs_BxT, units) -> jax.Array:
        """Logits [B, T, V] in compute dtype."""
        _check_tokens(inputs_BxT, "inputs")
        p = units.gather(params["block"])
        dtype = p["attn"]["W_q"].dtype
        T = inputs_BxT.shape[1]
        tok, pos = jnp.asarray(self.tok_embed, dtype), jnp.asarray(self.pos_embed[:T], dtype)
        x = tok[inputs_BxT] + pos[None]

        a, h = p["attn"], _layer_norm(x, p["ln1"])
        q, k, v = (jnp.einsum("btd,de->bte", h, a[n]) for n in ("W_q", "W_k", "W_v"))
        split = lambda z: z.reshape(z.shape[0], T, HEADS, D // HEADS)
        o = causal_attention(split(q), split(k), split(v)).reshape(x.shape)
        x = x + jnp.einsum("btd,de->bte", o, a["W_o"])

        m, h = p["mlp"], _layer_norm(x, p["ln2"])
        h = jax.nn.gelu(jnp.einsum("btd,df->btf", h, m["W1"]) + m["b1"][None, None, :])
        x = x + jnp.einsum("btf,fd->btd", h, m["W2"]) + m["b2"][None, None, :]

        head = units.gather(params["head"])
        return jnp.einsum("btd,dv->btv", x, head["W_vocab"])

    def loss(self, params, batch, units) -> jax.Array:
        _check_tokens(batch["targets"], "targets")
        return cross_entropy(self.logits(params, batch["inputs"], units), batch["targets"])


def _check_tokens(tok, name: str) -> None:
    if tok.ndim != 2 or tok.shape[1] > SEQ or not jnp.issubdtype(tok.dtype, jnp.integer):
        raise ValueError(
            f"TinyTransformer batch[{name!r}] must be int [B, T<={SEQ}], got {tok.dtype}{tok.shape}"
        )
