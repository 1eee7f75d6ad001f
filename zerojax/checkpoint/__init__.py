"""Persistence: orbax checkpoints in the logical layout (`store` writes them, `load` reads
them back) and safetensors export (`export`). All read and write the same step directories;
none is imported by the core until a save, restore or export asks for it."""

from zerojax.checkpoint.export import export, load_exported
from zerojax.checkpoint.load import read_metadata, restore, steps
from zerojax.checkpoint.store import check_saves, save, wait_until_finished

__all__ = ["check_saves", "export", "load_exported", "read_metadata", "restore", "save", "steps",
           "wait_until_finished"]
