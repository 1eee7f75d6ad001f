"""What an offloaded step moves between the devices' mesh and the host mesh (host.py runs
them): the gradient down, the compute-dtype shards up (a fused update's as each of its parts
ends, `side_by_side.Sending`), a tree's leaves to the devices and the step's scalars to the host."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.offload.meshes import across, mesh_of


class HostMoves:
    """`HostOffload`'s moves: it gives `engine`, `mesh` (the host mesh), `_twins` (device to
    device, down and up), `_crosses` (whether the two are different backends), `_sends`
    (whether the host mesh is apart from the devices'), `_sending`, `_order`, `on_devices`
    and `_cached`."""

    def _moves(self):
        """(the gradient's shardings on the host mesh, the shards' on the devices' mesh):
        what each step moves between the two, made once per plan."""
        def build():
            leaves = jax.tree.leaves(self.engine.state_specs().master,
                                     is_leaf=lambda x: isinstance(x, P))
            return ([NamedSharding(self.mesh, s) for s in leaves],
                    [NamedSharding(self.engine.mesh, s) for s in leaves])

        return self._cached("moves", build)

    def down(self, leaves: list) -> list:
        """Gradient leaves from the devices' mesh (their pinned host memory) to the host mesh;
        Twin-Flow's stay where they are, for the devices' update."""
        on = self.on_devices("master")
        moved = iter(across([x for i, x in enumerate(leaves) if i not in on],
                            [s for i, s in enumerate(self._moves()[0]) if i not in on],
                            self._twins[0], self._crosses))
        return [x if i in on else next(moved) for i, x in enumerate(leaves)]

    def up(self, shards: list) -> list:
        """Compute-dtype shards from the host mesh to the devices' mesh, in the order the
        update's parts give them (`_parted`); Twin-Flow's are there already, and so are those
        the update sent as its runs ended (`Sending`)."""
        on = self.on_devices("master")
        sent = lambda x: self._sends and mesh_of(x) == self.engine.mesh
        order = [i for i in (self._order or range(len(shards)))
                 if i not in on and not sent(shards[i])]
        homes = self._moves()[1]
        moved = across([shards[i] for i in order], [homes[i] for i in order], self._twins[1],
                       self._crosses)
        out = list(shards)
        for i, x in zip(order, moved, strict=True):
            out[i] = x
        return out

    def to_devices(self, tree, shardings):
        """A tree on the host mesh put on `shardings` of the devices' mesh (a leaf already on
        the devices' mesh, Twin-Flow's, by a plain `device_put`)."""
        leaves, treedef = jax.tree.flatten(tree)
        homes = treedef.flatten_up_to(shardings)
        here = [x.sharding.mesh is self.engine.mesh and self.mesh is not self.engine.mesh
                for x in leaves]
        moved = iter(across([x for x, h in zip(leaves, here) if not h],
                            [s for s, h in zip(homes, here) if not h],
                            self._twins[1], self._crosses))
        return jax.tree.unflatten(treedef, [jax.device_put(x, s) if h else next(moved)
                                            for x, s, h in zip(leaves, homes, here)])

    def _host_scalars(self, scalars, mesh=None):
        """The gradient's scalars (divisor, norm, finite flag or None, loss) on the host mesh
        (or `mesh`)."""
        on = NamedSharding(self.mesh if mesh is None else mesh, P())
        return tuple(None if x is None else jax.device_put(x, on) for x in scalars)

    def _sent(self, parts, args) -> list:
        """The host's parts' results, each part run in turn, the largest first, with its
        shards on the devices' mesh (`Sending`): in the parts' order."""
        homes = self._moves()[1]
        size = lambda k: sum(x.size for x in args[k][2])  # the part's master, as stored
        mine = sorted((k for k, (part, _) in enumerate(parts) if not part.on_device),
                      key=lambda k: -size(k))

        def send(k, out):
            params = parts[k][0].params
            return across(out[2], [homes[i] for i in params], self._twins[1], self._crosses)

        outs, moved = self._sending([(parts[k][1], args[k], k) for k in mine], send)
        done = {k: (m, o, s) for k, (m, o, _), s in zip(mine, outs, moved, strict=True)}
        return [done[k] for k in sorted(done)]
