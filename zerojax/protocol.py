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

    def rng(self) -> jax.Array:
        """A fresh typed PRNG key on every call: different per step, device (its position on
        the batch axes), micro-batch, call and (inside `scan`) layer; the same on resume."""
        ...

    def example_rngs(self) -> jax.Array:
        """A typed key per example of the device's (micro-)batch, from the example's index in
        the global batch (and the step, call and layer): the same numbers on any number of
        devices and micro-batches."""
        ...

    @property
    def state(self) -> PyTree:
        """The model state as of this (micro-)step; None for a model without `init_state`."""
        ...

    def set_state(self, new_state: PyTree) -> None:
        """Records the updated model state (same structure, shapes and dtypes); outside any
        `scan` body. Not calling it keeps the state."""
        ...

    training: bool
    """True inside `Engine.step`, False inside `Engine.evaluate`."""


@runtime_checkable
class Model(Protocol):
    """A model zerojax can train.

    `init` returns the logical params (a pytree of arrays). `loss` receives *handles* in
    place of arrays: only `units.gather(subtree)` and `units.scan(body, carry, stacked)`
    turn them into arrays. It returns the mean loss over the device-local batch, or
    `(loss, aux)` with a dict of scalar metrics.

    Optional: `init_state(rng)` returns the model state, non-trained arrays such as
    BatchNorm statistics or counters, which `loss` reads as `units.state` and updates with
    `units.set_state`. A state left per device (statistics of the device's batch) is averaged
    over the batch axes after each step; a model that names `zerojax.batch_axes(mesh)` in a
    collective (`lax.pmean`) computes global-batch statistics instead.

    Optional: `param_specs()` returns the model's tensor-parallel plan, a pytree like `init`'s
    with a `jax.sharding.PartitionSpec` (or None) per param leaf, naming mesh axes for the
    leaf's dimensions (a stacked leaf's first is its layer axis), or None for no plan. On a
    mesh with a `model` axis (`make_mesh(model=M)`) the dimension named "model" is split over
    it, Megatron-style (docs/tensor-parallel.md); other names ("data", "replica") are ZeRO's
    business and ignored.
    """

    def init(self, rng: jax.Array) -> PyTree: ...

    def loss(self, params: PyTree, batch: PyTree, units: Units) -> Any: ...
