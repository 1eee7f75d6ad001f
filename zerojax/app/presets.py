"""Named optimizers for the command line (`train`, `measure`, `plan`, `estimate --optimizer`).

Every preset takes one learning rate (a float or a schedule), one weight decay and one decay
mask, so `--lr` and `--weight-decay` mean the same for all of them; the other hyperparameters
are fixed here (`HELP` says which). The bytes of state any optax optimizer allocates, these
or others, are `analysis.measurement.state_size`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from optax.contrib import MuonDimensionNumbers

from zerojax.offload.fused import adamw

OPTIMIZERS = ("adamw", "lion", "adafactor", "muon", "lamb", "sgd")

HELP = {
    "adamw": "AdamW, β = (0.9, 0.95), decoupled weight decay",
    "lion": "Lion, β = (0.9, 0.99), decoupled weight decay (Lion usually wants a 3-10x "
            "smaller --lr than AdamW)",
    "adafactor": "Adafactor: factored second moments (rows and columns of every matrix whose "
                 "two largest dims are >= 128), decay 0.8, update clipped at RMS 1, no "
                 "momentum, absolute step (no parameter scaling), decoupled weight decay",
    "muon": "Muon on the hidden matrices (Newton-Schulz, 5 steps, momentum 0.95, Nesterov, "
            "updates scaled to RMS 0.2 so AdamW's --lr fits), decoupled weight decay; AdamW "
            "β = (0.9, 0.95) without weight decay on embeddings, head, biases and norms",
    "lamb": "LAMB, β = (0.9, 0.999), eps 1e-6, decoupled weight decay",
    "sgd": "SGD with momentum 0.9 and L2 weight decay (added to the gradient)",
}

TITLE = {"adamw": "AdamW", "lion": "Lion", "adafactor": "Adafactor", "muon": "Muon",
         "lamb": "LAMB", "sgd": "SGD"}

# What the state of each preset holds, as the train start-up table names it.
STATE = {"adamw": "Adam moments", "lion": "Lion momentum",
         "adafactor": "Adafactor factored moments", "muon": "Muon momentum + Adam moments",
         "lamb": "LAMB moments", "sgd": "SGD momentum"}


def _names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                 for k in path)


def gpt_decay(path: tuple[str, ...], shape: tuple[int, ...]) -> bool:
    """Whether a leaf gets weight decay: matrices and embedding tables, not biases or norms.

    By name, as `zerojax.models.GPT` names its leaves (`kernel`, `tok`, `pos`)."""
    return bool(path) and path[-1] in ("kernel", "tok", "pos")


def gpt_matrix(path: tuple[str, ...], shape: tuple[int, ...]) -> MuonDimensionNumbers | None:
    """How Muon treats a leaf of `zerojax.models.GPT`: a stacked block kernel `[L, in, out]`
    is L matrices (reduction axis 1, output axis 2), another 2-D kernel one matrix; None
    (Adam) for embeddings, biases, norms and the output head.

    The head goes to Adam, as Muon's authors advise (Jordan et al. 2024; Liu et al. 2025,
    "Muon is scalable"): it maps to the vocabulary, not between hidden states."""
    if not path or path[-1] != "kernel" or "head" in path:
        return None
    if len(shape) == 3:
        return MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    if len(shape) == 2:
        return MuonDimensionNumbers(reduction_axis=0, output_axis=1)
    return None


Rule = Callable[[tuple[str, ...], tuple[int, ...]], Any]  # (leaf path names, shape) -> value


def by_leaf(rule: Rule) -> Callable[[Any], Any]:
    """`rule(path names, shape)` as a function of a params tree (an optax mask or label fn)."""
    return lambda params: jax.tree_util.tree_map_with_path(
        lambda path, x: rule(_names(path), tuple(x.shape)), params)


def _scaled(weight_decay: float, learning_rate):
    """`weight_decay × learning_rate` (a schedule if the rate is one)."""
    if callable(learning_rate):
        return lambda count: weight_decay * learning_rate(count)
    return weight_decay * learning_rate


def build(name: str, learning_rate, *, weight_decay: float = 0.0, decay: Rule = gpt_decay,
          matrices: Rule = gpt_matrix) -> optax.GradientTransformation:
    """The optimizer `name` (one of `OPTIMIZERS`; hyperparameters in `HELP`) with this learning
    rate or schedule; `decay(path, shape)` says which leaves get `weight_decay`, and, for muon,
    `matrices(path, shape)` which leaves are matrices (a `MuonDimensionNumbers`) or not (None).
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    mask = by_leaf(decay)
    if name == "adamw":
        # optax.adamw, which an offloaded engine runs as one fused pass (offload/fused.py)
        return adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=mask)
    if name == "lion":
        return optax.lion(learning_rate, b1=0.9, b2=0.99, weight_decay=weight_decay, mask=mask)
    if name == "adafactor":
        # optax.adafactor adds the decay after the learning rate: scale it by the rate, so that
        # --weight-decay is decoupled as in AdamW.
        return optax.adafactor(learning_rate, multiply_by_parameter_scale=False,
                               weight_decay_rate=_scaled(weight_decay, learning_rate),
                               weight_decay_mask=mask)
    if name == "muon":
        return optax.contrib.muon(learning_rate, beta=0.95, weight_decay=weight_decay,
                                  consistent_rms=0.2, adam_b1=0.9, adam_b2=0.95,
                                  adam_weight_decay=0.0,
                                  muon_weight_dimension_numbers=by_leaf(matrices))
    if name == "lamb":
        return optax.lamb(learning_rate, b1=0.9, b2=0.999, eps=1e-6, weight_decay=weight_decay,
                          mask=mask)
    return optax.chain(optax.add_decayed_weights(weight_decay, mask),
                       optax.sgd(learning_rate, momentum=0.9))


__all__ = ["HELP", "OPTIMIZERS", "STATE", "TITLE", "build", "by_leaf", "gpt_decay", "gpt_matrix"]
