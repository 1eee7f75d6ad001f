"""The model axis in the estimates: which parameters a model splits over `model` (its
`param_specs()`), which model-axis sizes it allows, and the bytes of Megatron's activation
all-reduces (Shoeybi et al. 2019) that tensor parallelism adds to a step.

Pure arithmetic except `split_sizes`, which reads the model's abstract params (nothing is
allocated or compiled).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# Per layer and step, the all-reduces of one [tokens, d] activation over `model`: one after
# attention and one after the MLP in forward, one for each of their input gradients in
# backward, and with remat the attention one again when the layer is recomputed (backward
# needs the attention's output, not the MLP's, so XLA drops the recomputed MLP reduction;
# read from the compiled program of the GPT, tests/test_tensor.py).
FORWARD, BACKWARD, RECOMPUTE = 2, 2, 1
# Outside the layers: the vocabulary-split embedding's lookup (forward) and the vocabulary-split
# head's input gradient (backward), each one [tokens, d] all-reduce; the cross-entropy over
# vocabulary pieces reduces a float32 [tokens] three times (max, sum of exponentials, the
# target's logit).
ENDS, SOFTMAX, SOFTMAX_BYTES = 2, 3, 4


def megatron_bytes(n_layers: int, d_model: int, tokens: float, model: int,
                   act_bytes: float = 2, remat: bool = True) -> float:
    """Bytes one device sends over the `model` axis per step (ring all-reduces,
    2(M−1)/M of each buffer): `tokens` is what one data-parallel group computes per step
    (the global batch's tokens over the replica × data devices, all micro-batches), each
    activation `act_bytes` per element (the compute dtype)."""
    if model <= 1:
        return 0.0
    per = n_layers * (FORWARD + BACKWARD + RECOMPUTE * bool(remat)) + ENDS
    sent = tokens * d_model * act_bytes * per + SOFTMAX * tokens * SOFTMAX_BYTES
    return 2 * (model - 1) / model * sent


@dataclasses.dataclass(frozen=True)
class Activations:
    """What Megatron's all-reduces move in one step: `n_layers` layers of width `d_model` over
    the `tokens` one data-parallel group computes per step (the global batch's tokens over
    replica × data), recomputed in backward under `remat`."""

    n_layers: int
    d_model: int
    tokens: float
    remat: bool = True

    @classmethod
    def of(cls, cfg: Any, global_tokens: float, groups: int, remat: bool = True) -> Activations:
        """A GPT config's (`n_layers`, `d_model`) with `global_tokens` per step over `groups`
        data-parallel groups (replica × data)."""
        return cls(cfg.n_layers, cfg.d_model, global_tokens / groups, remat)

    def bytes(self, model: int, act_bytes: float = 2) -> float:
        """`megatron_bytes` of these activations on a model axis of `model` devices."""
        return megatron_bytes(self.n_layers, self.d_model, self.tokens, model, act_bytes,
                              self.remat)


def piece_params(num_params: float, split_params: float, model: int) -> float:
    """Params one model piece holds: the split ones over `model`, the rest whole."""
    return split_params / model + (num_params - split_params)


def split_sizes(model) -> dict[str, tuple[int, int]]:
    """Per leaf the model splits over `model` (its `param_specs()`): `path -> (size of the
    split dimension, elements of the leaf)`; empty for a model without `param_specs`."""
    import jax

    from zerojax.partition import spec_split

    specs = getattr(model, "param_specs", None)
    if not callable(specs):
        return {}
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    leaves, treedef = jax.tree.flatten_with_path(shapes)
    flat = treedef.flatten_up_to(specs())
    out = {}
    for (path, x), spec in zip(leaves, flat):
        name = jax.tree_util.keystr(path)
        dim = spec_split(spec, x.shape, name)
        if dim is not None:
            out[name] = (x.shape[dim], math.prod(x.shape))
    return out


def split_count(model) -> int:
    """Params the model splits over `model` (0 if none)."""
    return sum(n for _, n in split_sizes(model).values())


def allowed_model_sizes(model, devices: int, heads: int | None = None) -> list[int]:
    """The model-axis sizes M (divisors of `devices`, 1 first) that divide every dimension
    the model splits, and `heads` if given (Megatron splits whole heads)."""
    dims = [s for s, _ in split_sizes(model).values()] + ([heads] if heads else [])
    return [m for m in range(1, devices + 1) if devices % m == 0
            and (m == 1 or (dims and all(d % m == 0 for d in dims)))]

