"""Persistence: orbax checkpoints in the logical layout (`store`) and safetensors export
(`export`). Both read and write the same step directories; neither is imported by the core
until a save, restore or export asks for it."""

from zerojax.checkpoint.export import export, load_exported
from zerojax.checkpoint.store import (
    check_saves,
    read_metadata,
    restore,
    save,
    steps,
    wait_until_finished,
)

__all__ = ["check_saves", "export", "load_exported", "read_metadata", "restore", "save", "steps",
           "wait_until_finished"]
