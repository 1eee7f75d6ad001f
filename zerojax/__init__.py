"""zerojax: ZeRO stages 0–3 as explicit shard_map programs on a JAX device mesh."""

from zerojax.accounting import (
    CommEstimate,
    EstimateError,
    Measurement,
    MemoryEstimate,
    comm_estimate,
    estimate,
    measure,
)
from zerojax.config import ZeroConfig
from zerojax.engine import Engine
from zerojax.errors import BatchError, CheckpointError, ConfigError, MeshError, ModelError
from zerojax.mesh import initialize_distributed, make_mesh
from zerojax.planning import PlanResult, plan
from zerojax.protocol import Model, Units
from zerojax.step import TrainState

__version__ = "0.1.0"

__all__ = [
    "BatchError",
    "CheckpointError",
    "CommEstimate",
    "ConfigError",
    "Engine",
    "EstimateError",
    "Measurement",
    "MemoryEstimate",
    "MeshError",
    "Model",
    "ModelError",
    "PlanResult",
    "TrainState",
    "Units",
    "ZeroConfig",
    "comm_estimate",
    "estimate",
    "initialize_distributed",
    "make_mesh",
    "measure",
    "plan",
]
