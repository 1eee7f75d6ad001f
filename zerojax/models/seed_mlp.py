"""The four-weight MLP of experiments/seed_walkthrough.py: y = w3 * relu(w1*x1 + w2*x2) + w4,
half squared error."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

SEED_W = (2.0, -3.0, 1.0, 0.5)  # [w1, w2, w3, w4] of the walkthrough


class SeedMLP:
    """Two units: `layer1` = {w: [w1, w2]}, `layer2` = {w: [w3], b: [w4]}.

    Batch: {"x": float [B, 2], "y": float [B]}. `init` ignores `rng` and returns `w`.
    """

    def __init__(self, w: Sequence[float] = SEED_W):
        if len(w) != 4:
            raise ValueError(f"SeedMLP needs 4 weights [w1, w2, w3, w4], got {len(w)}: {w!r}")
        self.w = tuple(float(v) for v in w)

    def init(self, rng: jax.Array) -> dict:
        del rng
        w1, w2, w3, w4 = self.w
        return {
            "layer1": {"w": jnp.array([w1, w2], jnp.float32)},
            "layer2": {"w": jnp.array([w3], jnp.float32), "b": jnp.array([w4], jnp.float32)},
        }

    def loss(self, params, batch, units) -> jax.Array:
        x_Bx2, y_B = batch["x"], batch["y"]
        l1 = units.gather(params["layer1"])
        h_B = x_Bx2.astype(l1["w"].dtype) @ l1["w"]
        a_B = jax.nn.relu(h_B)
        l2 = units.gather(params["layer2"])
        pred_B = a_B * l2["w"] + l2["b"]
        err_B = pred_B.astype(jnp.float32) - y_B.astype(jnp.float32)
        return jnp.mean(0.5 * err_B**2)

    @staticmethod
    def flat(tree: dict) -> jax.Array:
        """The seed's vector [w1, w2, w3, w4] from a params-shaped tree (params or grads)."""
        return jnp.concatenate([tree["layer1"]["w"], tree["layer2"]["w"], tree["layer2"]["b"]])
