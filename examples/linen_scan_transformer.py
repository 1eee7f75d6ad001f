"""An unmodified Flax linen transformer whose blocks are stacked by `nn.scan`, trained with ZeRO
stage 3 on 4 simulated CPU devices: each layer is gathered inside the scan, one at a time.

    .venv/bin/python examples/linen_scan_transformer.py --steps 100
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402

VOCAB, SEQ = 64, 16


class Block(nn.Module):
    heads: int
    rate: float

    @nn.compact
    def __call__(self, x, train: bool):
        mask = nn.make_causal_mask(x[..., 0])
        h = nn.MultiHeadDotProductAttention(self.heads)(nn.LayerNorm()(x), mask=mask)
        x = x + nn.Dropout(self.rate, deterministic=not train)(h)
        h = nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))))
        return x + nn.Dropout(self.rate, deterministic=not train)(h), None


class Transformer(nn.Module):
    d: int = 64
    heads: int = 4
    layers: int = 4
    rate: float = 0.1

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        embed = nn.Embed(VOCAB, self.d)
        pos = self.param("pos", nn.initializers.normal(0.02), (SEQ, self.d))
        blocks = nn.scan(Block, variable_axes={"params": 0}, in_axes=nn.broadcast,
                         split_rngs={"params": True, "dropout": True}, length=self.layers)
        x, _ = blocks(self.heads, self.rate, name="blocks")(embed(tokens) + pos[None], train)
        return embed.attend(nn.LayerNorm()(x))  # tied head


def loss_fn(apply, batch):
    logits = apply(batch["inputs"], train=apply.training)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def make_batch(step: int, size: int = 16) -> dict:
    """Sequences t -> (3t + 1) mod VOCAB from random starts."""
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

    module = Transformer(layers=args.layers)
    sample = jnp.zeros((1, SEQ), jnp.int32)  # what module.init(key, sample) would get
    zm = zj.from_linen(module, loss_fn, sample, units=(Block,))
    engine = zj.Engine(zm, optax.adamw(3e-3), zj.make_mesh(data=4), zj.ZeroConfig(stage=3))
    state = engine.init(jax.random.key(0), make_batch(0))
    losses = []
    for step in range(args.steps):
        state, metrics = engine.step(state, make_batch(step))
        losses.append(float(metrics["loss"]))
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {losses[-1]:.4f}")
    batch = make_batch(10_000)
    eval_loss = float(engine.evaluate(state, batch)["loss"])
    logits = module.apply(zm.merge(engine.params(state)), batch["inputs"])  # plain linen
    plain = float(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean())
    print(f"eval loss (dropout off) {eval_loss:.4f}; plain module.apply: {plain:.4f}")
    return {"losses": losses, "eval": eval_loss, "plain": plain}


if __name__ == "__main__":
    main()
