"""An unmodified Flax linen CNN with BatchNorm on synthetic images, trained with ZeRO stage 3 on
4 simulated CPU devices. Each conv block is one ZeRO unit; the BatchNorm statistics are the
model state, computed over the global batch (`axis_name=zj.batch_axes(mesh)`).

    .venv/bin/python examples/linen_cnn_batchnorm.py --steps 100
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

SIZE, CLASSES = 8, 4


class ConvBlock(nn.Module):
    features: int
    axis_name: tuple | None = None

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(self.features, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9,
                         axis_name=self.axis_name)(x)
        return nn.avg_pool(nn.relu(x), (2, 2), (2, 2))


class CNN(nn.Module):
    axis_name: tuple | None = None  # the batch axes: global-batch BatchNorm statistics

    @nn.compact
    def __call__(self, images, train: bool = False):
        x = ConvBlock(8, self.axis_name)(images, train)
        x = ConvBlock(16, self.axis_name)(x, train)
        return nn.Dense(CLASSES)(x.reshape(x.shape[0], -1))


def loss_fn(apply, batch):
    logits = apply(batch["images"], train=apply.training)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["labels"])}


def make_batch(step: int, size: int = 32) -> dict:
    """Images whose class is the quadrant holding a bright square, on noise."""
    rng = np.random.default_rng(step)
    labels = rng.integers(0, CLASSES, size)
    images = rng.normal(0.0, 0.3, (size, SIZE, SIZE, 1)).astype(np.float32)
    h = SIZE // 2
    for i, c in enumerate(labels):
        r, q = divmod(int(c), 2)
        images[i, r * h + 1:r * h + 3, q * h + 1:q * h + 3] += 2.0
    return {"images": images, "labels": labels.astype(np.int32)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)

    mesh = zj.make_mesh(data=4)
    module = CNN(axis_name=zj.batch_axes(mesh))
    sample = jnp.zeros((1, SIZE, SIZE, 1))  # one call's arguments, for module.init
    zm = zj.from_linen(module, loss_fn, sample, units=(ConvBlock,))
    engine = zj.Engine(zm, optax.adam(1e-2), mesh, zj.ZeroConfig(stage=3))
    state = engine.init(jax.random.key(0), make_batch(0))
    losses = []
    for step in range(args.steps):
        state, metrics = engine.step(state, make_batch(step))
        losses.append(float(metrics["loss"]))
        if step % 10 == 0 or step == args.steps - 1:
            accuracy = float(metrics["accuracy"])
            print(f"step {step:3d}  loss {losses[-1]:.4f}  accuracy {accuracy:.2f}")
    batch = make_batch(10_000, 64)
    metrics = engine.evaluate(state, batch)
    variables = zm.merge(engine.params(state), engine.model_state(state))  # plain linen
    logits = CNN().apply(variables, batch["images"])
    plain = float(jnp.mean(jnp.argmax(logits, -1) == batch["labels"]))
    print(f"eval accuracy (running statistics) {float(metrics['accuracy']):.2f}; "
          f"plain module.apply: {plain:.2f}")
    return {"losses": losses, "eval": float(metrics["accuracy"]), "plain": plain,
            "variables": variables}


if __name__ == "__main__":
    main()
