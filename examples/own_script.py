"""Your own script: an unmodified Flax linen language model trained under ZeRO stage 3 on 4
simulated CPU devices, watched with `zj.RunLog`, saved, restored on 2 devices under stage 1,
and exported back to plain Flax. docs/own-script.md walks through it.

    .venv/bin/python examples/own_script.py --steps 60 --out runs/own_script
"""

import argparse
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402

VOCAB, SEQ = 64, 16


# --------------------------------------------------------------------------- 1. the model


class Block(nn.Module):
    """Pre-LN causal self-attention and MLP: one ZeRO unit."""

    d: int
    heads: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(x[..., 0])
        x = x + nn.MultiHeadDotProductAttention(self.heads)(nn.LayerNorm()(x), mask=mask)
        return x + nn.Dense(self.d)(nn.gelu(nn.Dense(4 * self.d)(nn.LayerNorm()(x))))


class LM(nn.Module):
    d: int = 32
    heads: int = 2
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, self.d)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (SEQ, self.d))
        x = x + pos[None, : tokens.shape[1]]
        for _ in range(self.layers):
            x = Block(self.d, self.heads)(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def loss_fn(apply, batch):
    """The mean over the batch's tokens (and so over its examples, which are all as long)."""
    logits = apply(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def make_batch(step: int, size: int = 16, length: int = SEQ) -> dict:
    """Sequences t -> (3t + 1) mod VOCAB from random starts: learnable in a few dozen steps."""
    rng = np.random.default_rng(step)
    tokens = np.empty((size, length + 1), np.int32)
    tokens[:, 0] = rng.integers(0, VOCAB, size)
    for t in range(length):
        tokens[:, t + 1] = (3 * tokens[:, t] + 1) % VOCAB
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default="runs/own_script")
    args = p.parse_args(argv)
    out = Path(args.out)

    # ----------------------------------------------------------------------- 2. train
    model = zj.from_linen(LM(), loss_fn, np.zeros((1, SEQ), np.int32), units=(Block,))
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 10, args.steps, 3e-4)
    # inject_hyperparams: the state carries the learning rate, so each step reports it
    optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.1)
    config = zj.ZeroConfig(stage=3, clip_norm=1.0)
    engine = zj.Engine(model, optimizer, zj.make_mesh(data=4), config)
    state = engine.init(jax.random.key(0), make_batch(0))
    held_out = make_batch(10**6, size=10)  # 10 sequences on 4 devices: evaluate takes any batch

    # ----------------------------------------------------------------------- 3. watch
    with zj.RunLog(out, engine) as log:  # metrics.jsonl, tensorboard/, loss.png
        log.eval(0, engine.evaluate(state, held_out)["loss"])
        for step in range(1, args.steps + 1):
            batch = make_batch(step)
            state, metrics = engine.step(state, batch)
            ev = engine.evaluate(state, held_out)["loss"] if step % 20 == 0 else None
            rec = log.step(step, metrics, batch, eval_loss=ev)
            if ev is not None:
                print(f"step {step:3d}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  "
                      f"{rec['tokens_per_s']:,.0f} tok/s  eval {rec['eval_loss']:.4f}")

    # ----------------------------------------------------------------------- 4. save
    ckpt = out / "checkpoints"
    engine.save(state, ckpt)
    final = float(engine.evaluate(state, held_out)["loss"])

    # ----------------------------------------------------------------------- 5. restore elsewhere
    # Another device count and stage (here: 2 of this machine's devices, stage 1); the same
    # model and optimizer. The state goes on exactly as it would have on 4 devices.
    two = jax.devices()[:2]  # chosen, so make_mesh does not warn of the idle ones
    there = zj.Engine(model, optimizer, zj.make_mesh(data=2, devices=two),
                      zj.ZeroConfig(stage=1, clip_norm=1.0))
    restored = there.restore(ckpt)
    again = float(there.evaluate(restored, held_out)["loss"])
    longer = make_batch(10**6 + 1, size=3, length=8)  # and another length: compiled once more
    short = float(there.evaluate(restored, longer)["loss"])
    print(f"restored step {int(restored.step)} on 2 devices: eval {again:.4f} (saved "
          f"{final:.4f}); 3 sequences of 8 tokens: {short:.4f}")

    # ----------------------------------------------------------------------- 6. export
    path = zj.checkpoint.export(ckpt, out / "params.safetensors")
    params = zj.checkpoint.load_exported(path)  # plain numpy arrays, the module's tree
    logits = LM().apply({"params": params}, held_out["inputs"])
    plain = float(optax.softmax_cross_entropy_with_integer_labels(
        logits, held_out["targets"]).mean())
    print(f"exported to {path}; plain LM().apply: eval {plain:.4f}")
    return {"records": log.records, "eval": final, "restored": again, "plain": plain,
            "restored_state": restored, "there": there}


if __name__ == "__main__":
    main()
