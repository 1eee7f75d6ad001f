"""The jax runtime a `zerojax train` run starts on: the XLA flags (the simulated CPU device
count, GPU overlap) and `jax.distributed`, set before anything starts jax's backend; then the
devices the run uses.
"""

from __future__ import annotations

import os

import numpy as np

from zerojax.app.options import TrainConfig, UsageError
from zerojax.app.peers import HEARTBEAT_S
from zerojax.models import PRESETS

DEFAULT_CPU_DEVICES = 4
_FORCE = "--xla_force_host_platform_device_count"


def start_runtime(cfg: TrainConfig) -> None:
    """XLA flags and `jax.distributed`, before anything starts jax's backend."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if cfg.devices is not None or not any(f.startswith(_FORCE) for f in flags):
        flags = [f for f in flags if not f.startswith(_FORCE)]
        flags.append(f"{_FORCE}={cfg.devices or DEFAULT_CPU_DEVICES}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    if cfg.xla_overlap:
        from zerojax.app.overlap import DEFAULT_COMBINE_BYTES, apply_overlap_flags
        from zerojax.precision import DTYPES

        layer = PRESETS[cfg.model].layer_params * np.dtype(DTYPES[cfg.param_dtype]).itemsize
        apply_overlap_flags(combine_threshold_bytes=max(layer, DEFAULT_COMBINE_BYTES))

    from zerojax.mesh import initialize_distributed

    multi = any(int(os.environ.get(v, "1")) > 1 for v in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))
    if cfg.coordinator is not None or multi:
        import jax

        # The runtime would abort every process, with a C++ trace, once one is lost; instead
        # PeerWatch notices the loss and ends the run with one line.
        jax.config.update("jax_enable_recoverability", True)
        initialize_distributed(cfg.coordinator, cfg.num_processes, cfg.process_id,
                               heartbeat_timeout_s=HEARTBEAT_S)


def select_devices(per_process: int | None):
    """The first `per_process` local devices of every process (all of them when None)."""
    import jax

    devices = []
    for p in range(jax.process_count()):
        local = [d for d in jax.devices() if d.process_index == p]
        if per_process is not None and per_process > len(local):
            raise UsageError(f"--devices={per_process} but process {p} has only {len(local)} "
                             f"{local[0].platform} device(s)")
        devices += local[:per_process]
    return devices
