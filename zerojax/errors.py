"""The exceptions raised at zerojax's public boundary; each names the bad value and the fix."""


class ZeroError(ValueError):
    """Base class of zerojax's bad-value errors."""


class ConfigError(ZeroError):
    """A `ZeroConfig` field, or a combination of fields, that zerojax cannot run."""


class MeshError(ZeroError):
    """A mesh that does not fit the devices or lacks the axes zerojax needs."""


class BatchError(ZeroError):
    """A batch whose leaves cannot be split over the data-parallel devices."""


class StateError(ZeroError, TypeError):
    """A state that is not a `TrainState` of this engine (None, another stage's or layout's,
    or one donated to an earlier step); also a `TypeError`."""


class ArgumentError(ZeroError, TypeError):
    """An argument of the wrong kind or out of its range (a seed where a PRNG key belongs, a
    string step, a negative peak, a step written twice); also a `TypeError`."""


class ModelError(ZeroError):
    """A model that breaks the `Model` protocol (e.g. a parameter it never gathers)."""


class CheckpointError(ZeroError):
    """A checkpoint that is incomplete, corrupted, or of another model or layout.

    `intact_steps`: when restoring the latest step failed because it is damaged, the older
    steps that restore, newest first (else empty); `damage`: then what is wrong with the
    latest step, without the advice on `step=` that the message adds. `nonfinite`: when a
    save refused a state holding NaN or inf, the first such leaf (e.g. "params['w']"), and
    `step` the step it would have saved (else both None)."""

    def __init__(self, *args, intact_steps=(), damage: str | None = None,
                 nonfinite: str | None = None, step: int | None = None):
        super().__init__(*args)
        self.intact_steps: list[int] = list(intact_steps)
        self.damage = damage
        self.nonfinite, self.step = nonfinite, step


def short(x) -> str:
    """`x` as an error message quotes it: its repr, cut to 40 characters."""
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


class StoreError(ZeroError, OSError):
    """An NVMe store (`nvme_path`) that cannot be used: one that belongs to another run or
    shape, or is in use by another process, a directory holding other files, a read-only path
    or a full disk; `errno` is the system's where one caused it (else None), `path` the store's
    directory. Also an `OSError`."""

    def __init__(self, message: str, path=None, errno: int | None = None):
        super().__init__(message)
        self.path, self.errno = path, errno
