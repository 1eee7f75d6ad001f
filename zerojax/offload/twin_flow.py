"""Where the hosted state lives: on the host mesh, or, Twin-Flow's share, on the devices'.

`offload="optimizer"` keeps the fp32 master, the optimizer state and a pending update (the
`HOSTED` fields) on the host mesh (meshes.py). Twin-Flow (`offload_fraction` < 1, ZeRO++'s
partial offload) keeps a share of the params' master and optimizer state in the devices' memory
instead, updated there by the devices as the first of the update's parts (update/parts.py):
whole groups of leaves as the optimizer ties them (`device_share`), so that each part reads
and writes the leaves of one mesh. `Homes` says, per field and leaf, which mesh that is, and
gives the engine its state's shardings (`Engine.state_shardings`, `view_shardings`).
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.errors import ConfigError

HOSTED = ("master", "opt_state", "pending")  # the TrainState fields on the host mesh
HOST_MEMORY = "pinned_host"  # a hosted leaf seen from the devices' mesh


def device_share(found: list[list[int]], sizes: list[int], fraction: float) -> frozenset[int]:
    """Twin-Flow's choice: the params updated on the devices, whole groups, the largest first,
    each taken where it brings the devices' share nearer `1 - fraction` of the params
    (`fraction`: the host's share); the smallest group (the last of equals) always the host's
    (`fraction` > 0: the host keeps something). The largest first because XLA:CPU updates one
    leaf with at most ceil(sqrt(cores)) threads: the host's update is bound by its largest
    leaf, while its many smaller ones run side by side (`SideBySide`)."""
    size = lambda g: sum(sizes[i] for i in g)
    by_size = sorted(range(len(found)), key=lambda k: (-size(found[k]), k))
    want, chosen, have = (1 - fraction) * sum(sizes), [], 0
    for k in by_size[:-1]:
        if abs(have + size(found[k]) - want) < abs(have - want):
            chosen += found[k]
            have += size(found[k])
    return frozenset(chosen)


class Homes:
    """`HostOffload`'s placement: it gives `engine`, `mesh` (the host mesh), `fraction` (the
    host's share) and `_cached`."""

    def shardings(self, specs):
        """NamedShardings on the host mesh of a tree of PartitionSpecs."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                            is_leaf=lambda x: isinstance(x, P))

    def split(self) -> tuple[frozenset[int], frozenset[int]]:
        """Twin-Flow (`offload_fraction` < 1): (the params whose master and optimizer state
        stay in the devices' memory and are updated there, their sharded optimizer-state
        leaves), whole groups of leaves as the update ties them (update/parts.py); empty at 1.0."""
        def build():
            if self.fraction >= 1:
                return frozenset(), frozenset()
            layout = self.engine.layout
            grouping = self.engine.plan.update.grouping()
            found = grouping.groups
            if len(found) < 2:
                raise ConfigError(
                    f"offload_fraction={self.fraction} splits the update between the host and "
                    f"the devices by leaves, but this optimizer ties every leaf to every other "
                    f"(a computation over all of them, such as optax.clip_by_global_norm in "
                    f"its chain); clip with ZeroConfig(clip_norm=...) instead, or use "
                    f"offload_fraction=1.0")
            device = device_share(found, [math.prod(leaf.shape) for leaf in layout.leaves],
                                  self.fraction)
            return device, grouping.owned(device)

        return self._cached("split", build)

    def on_devices(self, field: str) -> frozenset[int]:
        """The indices of `field`'s leaves (master, opt_state or pending) that Twin-Flow keeps
        on the devices; a pending update's gradient leaves come first, as the master's."""
        device, state = self.split()
        return state if field == "opt_state" else device

    def by_home(self, field: str, tree, host, device):
        """`tree` (a field's leaves or specs) with `host(x)` for each leaf that lives on the
        host mesh and `device(x)` for each that Twin-Flow keeps on the devices."""
        leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, P))
        on = self.on_devices(field)
        return jax.tree.unflatten(treedef, [device(x) if i in on else host(x)
                                            for i, x in enumerate(leaves)])

    def homes(self, field: str, specs):
        """NamedShardings of a hosted field's specs: the host mesh, or Twin-Flow's devices."""
        if specs is None:
            return None
        return self.by_home(field, specs, lambda s: NamedSharding(self.mesh, s),
                            lambda s: NamedSharding(self.engine.mesh, s))

    def hosted(self, state) -> tuple:
        """(master, optimizer state, pending update) of `state` with the leaves Twin-Flow
        keeps on the devices as None: what lives on the host mesh."""
        return tuple(None if getattr(state, f) is None else
                     self.by_home(f, getattr(state, f), lambda x: x, lambda x: None)
                     for f in HOSTED)

    @staticmethod
    def device_part(state):
        """`state` without what lives on the host mesh."""
        return state._replace(master=None, opt_state=None, pending=None)

    def state_shardings(self, shardings):
        """`Engine.state_shardings`: `shardings` (the state's on the devices' mesh) with the
        hosted fields on their homes."""
        specs = self.engine.state_specs()
        return shardings._replace(**{f: self.homes(f, getattr(specs, f)) for f in HOSTED})

    def view_shardings(self, shardings):
        """`Engine.view_shardings`: `shardings` (the state's on the devices' mesh) with the
        hosted leaves in that mesh's "pinned_host" memory, Twin-Flow's share in its device
        memory; a pending gradient waits in host memory, beside the master."""
        specs, mesh = self.engine.state_specs(), self.engine.mesh
        on = lambda kind: lambda s: NamedSharding(mesh, s, memory_kind=kind)
        host = lambda f, t: self.by_home(f, t, on(HOST_MEMORY), on(None))
        shardings = shardings._replace(master=host("master", specs.master),
                                       opt_state=host("opt_state", specs.opt_state))
        if specs.pending is not None:
            shardings = shardings._replace(pending=shardings.pending._replace(
                grads=host("master", specs.pending.grads)))
        return shardings
