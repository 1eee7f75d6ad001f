"""The offloaded update as parts that read and write disjoint leaves (`zerojax/update/parts.py`):
found from the update's own jaxpr, each part in place, the numbers of the one program."""

import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import gpt_batch, tiny_gpt
from test_offload import learn_units

import zerojax as zj
import zerojax.update.parts as parts_module
from zerojax.app import presets
from zerojax.offload import side_by_side, twin_flow
from zerojax.update.reps import Flat


@pytest.fixture
def in_parts(monkeypatch):
    """Parts of any size: the test GPT's 0.1M params would be one part (`parts.LEAST`)."""
    monkeypatch.setattr(parts_module, "LEAST", 0)


def engine(optimizer, n=2, **cfg):
    eng = zj.Engine(tiny_gpt(), optimizer, zj.make_mesh(data=n, devices=jax.devices()[:n]),
                    zj.ZeroConfig(stage=3, offload="optimizer", **cfg))
    learn_units(eng, gpt_batch(tiny_gpt().cfg, 8, 0))
    return eng


def parts_of(eng, finite=False):
    return [part for part, _ in eng.plan.update.parts(finite, [jnp.float32] * len(
        eng.layout.leaves))]


@pytest.mark.parametrize("name, optimizer, one", [
    ("adamw", optax.adamw(1e-3, weight_decay=0.1), False),
    ("lamb: a trust ratio per leaf", optax.lamb(1e-3), False),
    ("a schedule injected", optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.cosine_decay_schedule(1e-3, 100)), False),
    ("a global norm inside the chain", optax.chain(optax.clip_by_global_norm(1.0),
                                                   optax.adam(1e-3)), True),
])
def test_parts_are_what_the_update_reads(in_parts, name, optimizer, one):
    """Every param and sharded state leaf in exactly one part; the replicated state leaves
    (the count, an injected schedule's values) read by every part and written by one; a
    norm over all leaves inside the optimizer ties them into one part. A part's jaxpr reads
    only its own leaves (split asserts it from the dead-code elimination)."""
    eng = engine(optimizer)
    parts = parts_of(eng)
    n = len(eng.layout.leaves)
    sharded = [isinstance(r, Flat) for r in eng.plan.update.state_reps]
    assert sorted(i for p in parts for i in p.params) == list(range(n))
    assert sorted(j for p in parts for j in p.owned) == [j for j, s in enumerate(sharded) if s]
    assert sorted(j for p in parts for j in p.writes) == [
        j for j, s in enumerate(sharded) if not s]
    assert (len(parts) == 1) == one, [p.params for p in parts]
    if not one:  # at most about PARTS of them, from the 17 leaves of the test GPT
        assert 2 <= len(parts) <= 8
    for p in parts:  # each its own moments: the leaves stored like the params
        assert len(p.owned) >= len(p.params) or name.startswith("lamb")


def test_each_part_runs_in_place(in_parts):
    """Each part's compiled program aliases every donated master and moment argument to its
    output, as the one program did (`test_offload.test_the_host_update_runs_in_place`), and
    the gradient's buffer to the shards where their dtypes agree."""
    eng = engine(optax.adamw(1e-3, weight_decay=0.1), param_dtype="bfloat16")
    state = eng.abstract_state()
    off = eng._offload
    master, opt = jax.tree.leaves(state.master), jax.tree.leaves(state.opt_state)
    sharded = [isinstance(r, Flat) for r in eng.plan.update.state_reps]
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    grads = [jax.ShapeDtypeStruct(m.shape, jnp.bfloat16, sharding=m.sharding) for m in master]
    parts = off._parts_fn(True, False, tuple(jnp.dtype(jnp.bfloat16) for _ in master), True)
    assert len(parts) > 1
    for part, fn in parts:
        low = fn.lower((scalar,) * 3, [opt[j] for j, s in enumerate(sharded) if not s],
                       [master[i] for i in part.params], [opt[j] for j in part.owned],
                       [grads[i] for i in part.params])
        head = low.compile().as_text().splitlines()[0]
        aliased = {int(p) for p in re.findall(r"\{\d+\}: \((\d+), \{\}", head)}
        shared = sum(not s for s in sharded)
        first = 3 + shared  # the scalars, the replicated leaves: not donated
        donated = len(part.params) * 2 + len(part.owned)
        assert aliased == set(range(first, first + donated)), (part.params, aliased)


@pytest.mark.parametrize("opt, cfg", [
    ("adamw", {}),
    pytest.param("adamw", {"param_dtype": "float16"}, marks=pytest.mark.slow),
    pytest.param("muon", {}, marks=pytest.mark.slow)],
    ids=["f32", "fp16 skip", "muon: whole matrices on owner devices"])
def test_the_parts_give_the_one_programs_numbers(in_parts, opt, cfg):
    """The same update as one program and as parts on the same state and gradient: the
    optimizer state bitwise, the master to two ulps of its update and of its value (XLA
    fuses a part's leaves otherwise than the whole's: measured on a fifth of one leaf's
    elements), the shards their own master in the compute dtype. With
    fp16's skip flag the parts branch as the one program does; Muon's Newton-Schulz runs on
    the owner devices of each part's matrices, its products rounding otherwise (by distance
    relative to the update)."""
    eng = engine(optax.adamw(1e-2, weight_decay=0.1) if opt == "adamw" else
                 presets.build("muon", 1e-2, weight_decay=0.1), **cfg)
    batch = gpt_batch(tiny_gpt().cfg, 8, 0)
    state = eng.init(jax.random.key(0), batch)
    state, _ = eng.step(state, batch)
    off = eng._offload
    _, reduced, _ = off._grads_fn()(off.device_part(state), zj.mesh.put_batch(batch, eng.mesh))
    grads, *scalars = reduced
    grads = jax.tree.unflatten(jax.tree.structure(grads), off.down(jax.tree.leaves(grads)))
    scalars = off._host_scalars(scalars)
    finite = scalars[2] is not None
    assert finite == ("param_dtype" in cfg)
    assert len(eng.plan.update.parts(finite, [g.dtype for g in jax.tree.leaves(grads)])) > 1
    one = off._update_fn(False, finite, False)(scalars, state.master, state.opt_state, grads)
    parted = off._parted(scalars, state, grads, False, False)
    jax.tree.map(np.testing.assert_array_equal, parted[1], one[1])
    flat = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float64))
                                     for x in jax.tree.leaves(t)])
    for a, b, start in zip(jax.tree.leaves(parted[0]), jax.tree.leaves(one[0]),
                           jax.tree.leaves(state.master)):
        a, b, start = (np.asarray(x, np.float64) for x in (a, b, start))
        assert np.abs(b - start).max() > 0  # the update moved every leaf
        if opt == "adamw":  # two ulps of the update (measured 1.25) and of the sum
            assert np.all(np.abs(a - b) <= 2 ** -22 * (np.abs(b - start) + np.abs(b))), \
                np.abs(a - b).max()
    # Newton-Schulz's matrix products sum in another order in a smaller program, and its
    # polynomial amplifies that: by distance relative to the update (measured 5.5e-7)
    distance = np.linalg.norm(flat(parted[0]) - flat(one[0]))
    assert distance <= 1e-5 * np.linalg.norm(flat(one[0]) - flat(state.master))
    for shards, master in ((parted[2], parted[0]), (one[2], one[0])):  # each its own master
        for s, m in zip(shards, jax.tree.leaves(master), strict=True):
            np.testing.assert_array_equal(np.asarray(s), np.asarray(m).astype(s.dtype))
    assert sorted(off._order) == list(range(len(parted[2])))
    # AdamW's parts hold no collective, so each ran from a thread of its own; Muon's gather
    # their matrices to owner devices, so those ran in turn from the caller's thread
    alone = off._side_by_side._alone  # the step's programs (donating) and this call's
    assert len(alone) == 2 * len(eng.plan.update.parts(finite, [g.dtype for g in
                                                                jax.tree.leaves(grads)]))
    assert any(alone.values()) == (opt == "muon"), alone


def test_programs_run_side_by_side_unless_they_wait_for_their_mesh():
    """`SideBySide` dispatches each program from a thread of its own (the CPU backend runs one
    thread's programs one after another), except a program of several devices holding a
    collective, which runs from the caller's thread in turn: two of those side by side could
    each hold the threads the other's devices wait for; and a program's first call, which
    traces and compiles it, is the caller's too. The results come back in order."""
    mesh = zj.make_mesh(data=2, devices=jax.devices()[:2])
    spec = jax.sharding.PartitionSpec("data")
    x = jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(mesh, spec))
    threads = []

    class Recorded:  # the program, and the thread that called it
        def __init__(self, fn):
            self.fn, self.lower = fn, fn.lower

        def __call__(self, *args):
            threads.append((self, threading.current_thread()))
            return self.fn(*args)

    double = Recorded(jax.jit(lambda x: 2 * x))
    local = Recorded(jax.jit(jax.shard_map(lambda x: x + 1, mesh=mesh, in_specs=spec,
                                           out_specs=spec)))
    summed = Recorded(jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
                                            in_specs=spec, out_specs=spec)))
    run = side_by_side.SideBySide()
    for first in (True, False):  # the second time from what the first found
        threads.clear()
        out = run([(double, (x,), 1), (local, (x,), 2), (summed, (x,), 2), (double, (x,), 1)])
        np.testing.assert_array_equal(out[0], 2 * np.arange(8.0))
        np.testing.assert_array_equal(out[1], np.arange(8.0) + 1)
        np.testing.assert_array_equal(out[2], np.tile(np.arange(4.0) + np.arange(4.0, 8), 2))
        np.testing.assert_array_equal(out[3], out[0])
        by = {id(fn): [t.name for f, t in threads if f is fn] for fn in (double, local, summed)}
        me = threading.current_thread().name
        assert by[id(summed)] == [me]
        if first:  # double's second call of the round is not its first
            assert by[id(local)] == [me] and by[id(double)][0] == me
        else:
            for fn in (double, local):
                assert by[id(fn)] and all(t.startswith("zerojax-part") for t in by[id(fn)]), by
    assert run._alone == {double: False, local: False, summed: True}


def test_a_small_model_is_one_part():
    """Below 2 x `parts.LEAST` params the update is one part, the one program as before (a
    part's dispatch and compile would cost more than its shards' head start)."""
    eng = engine(optax.adamw(1e-3))
    assert len(parts_of(eng)) == 1
    assert parts_module.runs([3, 3, 3, 3], 4, least=6) == [[0, 1], [2, 3]]
    assert parts_module.runs([3, 3, 3, 3], 4) == [[0], [1], [2], [3]]
    # a group below `least` between two large ones (a bias between kernels) joins a neighbour
    assert parts_module.runs([8, 10, 1, 10, 4], 5, least=3) == [[0], [1, 2], [3], [4]]
    assert parts_module.runs([10, 10, 1], 3, least=3) == [[0], [1, 2]]
    assert parts_module.runs([1, 10, 8], 3, least=3) == [[0, 1], [2]]
    # a run that lands exactly on the budget is whole (it is "at most" the budget), and the
    # next starts a run of its own; with no `least`, no merge would hide a split too early
    assert parts_module.runs([2, 2, 2, 2], 2) == [[0, 1], [2, 3]]
    assert parts_module.runs([1, 3, 2, 2], 2) == [[0, 1], [2, 3]]
    assert parts_module.runs([4, 1, 3, 4], 3) == [[0], [1, 2], [3]]


@pytest.mark.slow  # two runs of four steps, a save and a restore (~20 CPU s)
def test_a_run_in_parts_on_a_host_mesh_apart(monkeypatch, tmp_path):
    """Where the parts meet the rest: a host mesh of other CPU devices (as a GPU's host: the
    shards go up in the parts' order), replica 2 x data 2, the delayed update (the parts
    dispatched before the devices' program) and a save in the delayed phase restored halfway:
    the one program's run, its losses to 1e-6 and its params to 1e-5 of how far they moved."""
    from jax.sharding import Mesh

    import zerojax.offload.host as host

    devices = jax.devices()
    mesh = zj.make_mesh(data=2, replica=2, devices=devices[:4])
    cfg = zj.ZeroConfig(stage=2, clip_norm=1.0, offload="optimizer", delayed_update=1)
    model = tiny_gpt()
    batches = [gpt_batch(model.cfg, 8, s) for s in range(4)]
    params = model.init(jax.random.key(0))

    def run(eng, save=None):
        state, losses = eng.init_from(params, batches[0]), []
        for i, b in enumerate(batches):
            if save is not None and i == 2:
                eng.save(state, save)
                state = eng.restore(save)
            state, m = eng.step(state, b)
            losses.append(float(m["loss"]))
        return np.array(losses), eng.params(state)

    l0, p0 = run(zj.Engine(model, optax.adamw(1e-2, weight_decay=0.1), mesh, cfg))
    monkeypatch.setattr(parts_module, "LEAST", 0)
    monkeypatch.setattr(host, "host_mesh", lambda m: Mesh(np.array(devices[4:8]).reshape(
        m.devices.shape), m.axis_names, axis_types=m.axis_types))
    eng = zj.Engine(model, optax.adamw(1e-2, weight_decay=0.1), mesh, cfg)
    l1, p1 = run(eng, tmp_path / "ckpt")
    assert len(parts_of(eng)) > 1 and eng._offload._order
    assert {x.sharding.mesh for x in jax.tree.leaves(p1)} == {mesh}
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    flat = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float64))
                                     for x in jax.tree.leaves(t)])
    start = flat(params)
    assert np.linalg.norm(flat(p1) - flat(p0)) <= 1e-5 * np.linalg.norm(flat(p0) - start)


def test_twin_flows_share_is_whole_groups_and_leaves_the_host_some():
    """`device_share`: whole groups, the largest first, each where it brings the devices'
    share nearer 1 - fraction of the params; the smallest group stays on the host however
    small the fraction. Equal groups go in order."""
    found, sizes = [[0], [1, 2], [3]], [10, 5, 5, 10]
    share = twin_flow.device_share
    assert share(found, sizes, 1.0) == frozenset()
    assert share(found, sizes, 0.5) == {0}  # 10 of 30 on the devices, as near 15 as 20 is
    assert share(found, sizes, 0.3) == {0, 1, 2}  # 20: the nearest to 21
    assert share(found, sizes, 0.01) == {0, 1, 2}  # never the last (smallest) group
    assert share([[0, 1, 2, 3]], sizes, 0.01) == frozenset()
    # The 1b preset's groups (AdamW: one a leaf; M params): the devices take both MLP kernels,
    # which go past qkv's and the tables for a nearer share, and the host keeps qkv (226 M)
    # as its largest, where from the first on it kept an MLP kernel (302 M)
    names = ["out.b", "out.k", "qkv.b", "qkv.k", "ln1.b", "ln1.s", "ln2.b", "ln2.s", "fc.b",
             "fc.k", "mlp.b", "mlp.k", "pos", "tok", "head", "ln.b", "ln.s"]
    m = [0.037, 75.5, 0.111, 226.5, 0.037, 0.037, 0.037, 0.037, 0.147, 302.0, 0.037, 302.0,
         4.19, 65.5, 65.5, 0.002, 0.002]
    device = share([[i] for i in range(len(m))], m, 0.4)
    assert {"fc.k", "mlp.k", "pos"} <= {names[i] for i in device}
    host = [m[i] for i in range(len(m)) if i not in device]
    assert max(host) == 226.5 and abs(sum(m) - sum(host) - 0.6 * sum(m)) < 20
