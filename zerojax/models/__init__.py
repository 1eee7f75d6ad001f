"""Reference models: seed 000's MLP, seed 003's tiny transformer, and GPT presets."""

from __future__ import annotations

from zerojax.models.gpt import GPT, PRESETS, GPTConfig
from zerojax.models.seed_mlp import SeedMLP
from zerojax.models.tiny_transformer import TinyTransformer

__all__ = ["GPT", "PRESETS", "GPTConfig", "SeedMLP", "TinyTransformer", "get_model"]


def get_model(name: str) -> GPT:
    """The GPT model for preset `name` (see `PRESETS`)."""
    return GPT.from_preset(name)
