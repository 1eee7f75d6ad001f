"""zerojax: ZeRO stages 0–3 as explicit shard_map programs on a JAX device mesh.

The ZeRO core is this folder's modules; `analysis/`, `checkpoint/` and `app/` are its wings
(they use the core, the core uses none of them), `models/` the reference models.
"""

import importlib

from zerojax.analysis.accounting import CommEstimate, MemoryEstimate, comm_estimate, estimate
from zerojax.analysis.estimate_args import EstimateError
from zerojax.analysis.flops import peak_tflops, step_flops, throughput
from zerojax.analysis.measurement import Measurement, measure
from zerojax.analysis.planning import PlanResult, plan
from zerojax.config import ZeroConfig
from zerojax.engine import Engine
from zerojax.errors import (
    ArgumentError,
    BatchError,
    CheckpointError,
    ConfigError,
    MeshError,
    ModelError,
    StateError,
)
from zerojax.mesh import batch_axes, initialize_distributed, make_mesh
from zerojax.offload.fused import adamw
from zerojax.protocol import Model, Units
from zerojax.state import TrainState

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
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
    "RunLog",
    "StateError",
    "TrainState",
    "Units",
    "ZeroConfig",
    "adamw",
    "batch_axes",
    "comm_estimate",
    "estimate",
    "from_linen",
    "from_nnx",
    "initialize_distributed",
    "make_mesh",
    "measure",
    "peak_tflops",
    "plan",
    "step_flops",
    "throughput",
]


def __getattr__(name: str):
    # `zerojax.checkpoint` without importing orbax for those who never checkpoint.
    if name == "checkpoint":
        return importlib.import_module("zerojax.checkpoint")
    if name in ("from_nnx", "from_linen"):  # flax only for those who bring a Flax model
        return getattr(importlib.import_module("zerojax.adapters"), name)
    if name == "RunLog":  # rich, tensorboardX and matplotlib only for those who log a run
        return importlib.import_module("zerojax.app.runlog").RunLog
    raise AttributeError(f"module 'zerojax' has no attribute {name!r}")
