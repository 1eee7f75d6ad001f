"""Flax models as zerojax models: `from_nnx`, `from_linen`."""

from zerojax.adapters.linen import LinenModel, from_linen
from zerojax.adapters.nnx import NNXModel, from_nnx

__all__ = ["LinenModel", "NNXModel", "from_linen", "from_nnx"]
