"""The model protocol: the model marks the ZeRO units, the engine supplies the collectives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax

PyTree = Any


@runtime_checkable
class Units(Protocol):
    """What `Model.loss` receives as `units`; the engine's stage decides what each call does."""

    def gather(self, subtree: PyTree) -> PyTree:
        """Marks one ZeRO unit; returns the full subtree in compute dtype."""
        ...

    def scan(self, body: Callable[[Any, PyTree], Any], carry: Any, stacked: PyTree) -> Any:
        """Runs `body(carry, layer_params) -> carry` over `stacked` (layer axis 0), a unit each."""
        ...


@runtime_checkable
class Model(Protocol):
    """A model zerojax can train.

    `init` returns the logical params (a pytree of arrays). `loss` receives *handles* in
    place of arrays: only `units.gather(subtree)` and `units.scan(body, carry, stacked)`
    turn them into arrays. It returns the mean loss over the device-local batch, or
    `(loss, aux)` with a dict of scalar metrics.
    """

    def init(self, rng: jax.Array) -> PyTree: ...

    def loss(self, params: PyTree, batch: PyTree, units: Units) -> Any: ...
