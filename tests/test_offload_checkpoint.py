"""Checkpoints of an offloaded engine: each logical leaf is made, written and read on the mesh
its state leaf lives on (`offload.OnMeshes`), so a save or restore never holds the host's
master and moments in the devices' memory. The host mesh is put on CPU devices 4-7 beside a
mesh on 0-3, as a GPU's host is apart from it (test_twin_flow's `apart`)."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import test_twin_flow
from helpers import CLIP, adamw, gpt_batch, tiny_gpt
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_offload import assert_placement
from test_state import assert_bitwise

import zerojax as zj
from zerojax.checkpoint import load
from zerojax.offload.meshes import OnMeshes

apart = test_twin_flow.apart  # the fixture: the host mesh on CPU devices 4-7


def spied(monkeypatch):
    """What the next save hands orbax and what the next restore reads into: {"saved": logical
    tree, "read": [(name, ShapeDtypeStruct)]}."""
    seen = {}
    save = ocp.args.PyTreeSave

    def on_save(tree, *a, **k):
        seen["saved"] = tree
        return save(tree, *a, **k)

    def on_read(stored, named, where):
        seen["read"] = [(name, x) for _, name, x in named]
        return read(stored, named, where)

    read = load.read_arrays
    monkeypatch.setattr(ocp.args, "PyTreeSave", on_save)
    monkeypatch.setattr(load, "read_arrays", on_read)
    return seen


def homes(tree) -> dict[str, str]:
    """Each leaf of a logical tree's params and optimizer state: "host" or "devices"."""
    out = {}
    for part in ("params", "opt_state"):
        for path, x in jax.tree.flatten_with_path(tree[part])[0]:
            out[part + jax.tree_util.keystr(path)] = \
                "host" if x.sharding.device_set <= set(jax.devices()[4:8]) else "devices"
    return out


# The quick tier restores offload's checkpoints through the same programs with the host mesh
# the mesh itself (test_offload's cross-offload test, the one-device test below).
@pytest.mark.slow  # a step, a save, a restore and a step on two meshes (~7 CPU s a case)
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_offloads_checkpoint_is_made_and_read_where_its_state_lives(apart, monkeypatch,
                                                                    tmp_path, fraction):
    """A save hands orbax the params and moments on the host mesh (Twin-Flow's share on the
    devices, as their master lives), and a restore reads them there: the restored state is
    the saved one bitwise, each leaf where the engine keeps it, and steps on as the original
    does."""
    mesh = zj.make_mesh(data=2, devices=apart[:2])
    eng = zj.Engine(tiny_gpt(), adamw(), mesh, zj.ZeroConfig(
        stage=3, clip_norm=CLIP, offload="optimizer", offload_fraction=fraction))
    batches = [gpt_batch(tiny_gpt().cfg, 4, s) for s in range(2)]
    state = eng.init(jax.random.key(0), batches[0])
    state, _ = eng.step(state, batches[0])
    seen = spied(monkeypatch)
    eng.save(state, tmp_path / "ckpt")
    kept = eng._offload.on_devices("master")
    want = {f"params{jax.tree_util.keystr(p)}": "devices" if i in kept else "host"
            for i, (p, _) in enumerate(jax.tree.flatten_with_path(eng.params(state))[0])}
    got = homes(seen["saved"])
    assert {k: v for k, v in got.items() if k.startswith("params")} == want
    assert ("devices" in got.values()) == (fraction < 1) and "host" in got.values()
    assert seen["saved"]["rng"].sharding.mesh == mesh  # the rest on the devices, as before

    back = eng.restore(tmp_path / "ckpt")
    read = dict(seen["read"])
    assert all(read[k].sharding.device_set <= set(jax.devices()[4:8]) for k in got)
    assert_placement_of(eng, back)
    for a, b in zip(jax.tree.leaves((state.master, state.opt_state, state.compute)),
                    jax.tree.leaves((back.master, back.opt_state, back.compute)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    state, m0 = eng.step(state, batches[1])
    back, m1 = eng.step(back, batches[1])
    assert float(m1["loss"]) == float(m0["loss"])
    assert_bitwise(eng.params(back), eng.params(state))


def assert_placement_of(eng, state):
    if eng._offload.on_devices("master"):  # Twin-Flow: each leaf where its home is
        got = jax.tree.leaves(state)
        assert [x.sharding for x in got] == jax.tree.leaves(eng.state_shardings())
    else:
        assert_placement(eng, state)


def test_on_meshes_runs_each_output_where_it_reads():
    """`OnMeshes` on two meshes: an output with a PartitionSpec lives on the mesh of what it
    reads (the default mesh where it reads nothing); an argument that only another mesh's
    outputs read moves there; an output reading both meshes is a ValueError."""
    a, b = (Mesh(np.array(jax.devices()[i:i + 2]), ("data",)) for i in (0, 4))
    x = jax.device_put(jnp.arange(4.0), NamedSharding(a, P("data")))
    y = jax.device_put(jnp.arange(4.0) + 10, NamedSharding(b, P("data")))
    z = jax.device_put(jnp.arange(4.0), NamedSharding(a, P("data")))
    out = OnMeshes(lambda x, y, z: {"twice": 2 * x, "next": y + 1, "zero": jnp.zeros(2),
                                    "moved": 3 * z},
                   {"twice": P("data"), "next": P("data"), "zero": P(),
                    "moved": NamedSharding(b, P("data"))}, default=a)(x, y, z)
    assert [out[k].sharding.mesh for k in ("twice", "next", "zero", "moved")] == [a, b, a, b]
    np.testing.assert_array_equal(out["twice"], [0, 2, 4, 6])
    np.testing.assert_array_equal(out["next"], [11, 12, 13, 14])
    np.testing.assert_array_equal(out["moved"], [0, 3, 6, 9])
    with pytest.raises(ValueError, match="reads arguments .* of 2 meshes"):
        OnMeshes(lambda x, y: x + y, P("data"))(x, y)
    with pytest.raises(ValueError, match="argument 0 is read on 2 meshes"):
        OnMeshes(lambda x: (x, x), (P("data"), NamedSharding(b, P("data"))))(x)


def test_one_devices_save_is_a_view_and_its_restore_frees_the_tree_as_it_goes(monkeypatch,
                                                                               tmp_path):
    """On one CPU device (one GPU's host), a save hands orbax the master and moments as views
    of the state's own buffers (nothing copied), and the next step still updates them in
    place; a restore in parts frees each read array once its part is made, and the restored
    master is the program's own, so the first step after it is in place too."""
    from zerojax.offload import host

    mesh = zj.make_mesh(data=1, devices=jax.devices()[:1])
    eng = zj.Engine(tiny_gpt(), adamw(), mesh, zj.ZeroConfig(stage=3, offload="optimizer"))
    batches = [gpt_batch(tiny_gpt().cfg, 2, s) for s in range(3)]
    state, _ = eng.step(eng.init(jax.random.key(0), batches[0]), batches[0])
    where = lambda st: [x.unsafe_buffer_pointer() for x in jax.tree.leaves((st.master,
                                                                          st.opt_state))]
    before = where(state)
    seen = spied(monkeypatch)
    eng.save(state, tmp_path / "ckpt")
    saved = [x for x in jax.tree.leaves((seen["saved"]["params"], seen["saved"]["opt_state"]))
             if x.ndim]
    assert len(saved) > 1 and {x.unsafe_buffer_pointer() for x in saved} <= set(before)
    del saved, seen["saved"]
    state, _ = eng.step(state, batches[1])
    assert where(state) == before  # in place: the views are gone with the save

    monkeypatch.setattr(host, "RESTORE_LEAST", 0)
    read = []
    spy = load.read_arrays
    monkeypatch.setattr(load, "read_arrays", lambda *a: read.append(spy(*a)) or read[-1])
    back = eng.restore(tmp_path / "ckpt")
    n = len(jax.tree.leaves(back.master))
    hosted = read[0][:n + len(jax.tree.leaves(back.opt_state))]  # params, then opt_state
    assert sum(x.is_deleted() for x in hosted) >= n  # the params and moments, read and freed
    parts = [k for k in eng._jit_cache if "from_logical" in str(k)]
    assert parts and len(eng._jit_cache[parts[0]][1]._made[0]) > 1  # the host's in parts
    first = where(back)
    back, m1 = eng.step(back, batches[1])
    assert where(back) == first
    np.testing.assert_array_equal(np.asarray(jax.tree.leaves(back.master)[0]),
                                  np.asarray(jax.tree.leaves(state.master)[0]))
