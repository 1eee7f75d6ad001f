"""An unmodified Flax NNX transformer (dropout, a head tied to the embedding) trained with
ZeRO stage 3 on 4 simulated CPU devices, each block one ZeRO unit.

    .venv/bin/python examples/nnx_transformer.py --steps 100
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import zerojax as zj  # noqa: E402

VOCAB, SEQ = 64, 16


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, rate: float, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.fc = nnx.Linear(d, 4 * d, rngs=rngs)
        self.out = nnx.Linear(4 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x):
        x = x + self.drop(self.attn(self.ln1(x), mask=nnx.make_causal_mask(x[..., 0])))
        return x + self.drop(self.out(jax.nn.gelu(self.fc(self.ln2(x)))))


class Transformer(nnx.Module):
    def __init__(self, d=64, heads=4, layers=4, rate=0.1, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (SEQ, d)))
        self.blocks = nnx.List([Block(d, heads, rate, rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[None, : tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.ln(x))  # tied head


def loss_fn(model, batch):
    logits = model(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def make_batch(step: int, size: int = 16) -> dict:
    """Sequences t -> (3t + 1) mod VOCAB from random starts: learnable in a few dozen steps."""
    rng = np.random.default_rng(step)
    tokens = np.empty((size, SEQ + 1), np.int32)
    tokens[:, 0] = rng.integers(0, VOCAB, size)
    for t in range(SEQ):
        tokens[:, t + 1] = (3 * tokens[:, t] + 1) % VOCAB
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)

    model = Transformer(layers=args.layers, rngs=nnx.Rngs(0))  # plain Flax, nothing added
    zm = zj.from_nnx(model, loss_fn, units=(Block,))
    mesh = zj.make_mesh(data=4)
    engine = zj.Engine(zm, optax.adamw(3e-3), mesh, zj.ZeroConfig(stage=3))
    state = engine.init(jax.random.key(0), make_batch(0))
    losses = []
    for step in range(args.steps):
        state, metrics = engine.step(state, make_batch(step))
        losses.append(float(metrics["loss"]))
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {losses[-1]:.4f}")
    eval_loss = float(engine.evaluate(state, make_batch(10_000))["loss"])
    print(f"eval loss (dropout off) {eval_loss:.4f}")

    trained = zm.merge(engine.params(state))  # a Transformer again, with the trained weights
    trained.eval()
    batch = make_batch(10_000)
    plain = float(loss_fn(trained, batch))
    print(f"the same batch in the plain Flax module: {plain:.4f}")
    return {"losses": losses, "eval": eval_loss, "plain": plain}


if __name__ == "__main__":
    main()
