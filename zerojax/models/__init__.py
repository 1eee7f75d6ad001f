"""Reference models: the walkthrough's 4-weight MLP, a 260-parameter transformer, GPT presets."""

from __future__ import annotations

from zerojax.models.gpt import GPT, PRESETS, GPTConfig
from zerojax.models.seed_mlp import SeedMLP
from zerojax.models.tiny_transformer import TinyTransformer

__all__ = ["GPT", "PRESETS", "GPTConfig", "SeedMLP", "TinyTransformer", "get_model"]


def get_model(name: str) -> GPT:
    """The GPT model for preset `name` (see `PRESETS`)."""
    return GPT.from_preset(name)
