"""ZeRO-Offload (`offload="optimizer"`): master and optimizer state on the host mesh, the
update a program of the host's CPU devices, the same numbers as without offload."""

import functools
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    CLIP,
    DEFAULT_BUFFERS,
    adamw,
    assert_tree_close,
    check_parity,
    engine_run,
    fused_adamw,
    gpt_batch,
    moved_error,
    sweep,
    tiny_gpt,
)
from jax import lax
from test_precision import BATCH as SEED_BATCH
from test_state import BATCHES, Norm, assert_bitwise

import zerojax as zj
from zerojax.analysis.measurement import state_bytes
from zerojax.mesh import put_batch
from zerojax.models import SeedMLP
from zerojax.step import per_unit

DEVICE = "device"


def kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def assert_placement(engine, state):
    """Master and optimizer state where the engine says its host state lives (the host mesh:
    here the mesh's own CPU devices, or others where a test puts it); everything the device
    computes with on the mesh, in device memory."""
    want = engine.state_shardings()
    for part in ("master", "opt_state"):
        got = jax.tree.leaves(getattr(state, part))
        assert [x.sharding for x in got] == jax.tree.leaves(getattr(want, part))
        assert {x.sharding.mesh for x in got} == {engine.host_mesh}
    rest = (state.step, state.compute, state.loss_scale, state.rng, state.model_state)
    assert kinds(rest) == {DEVICE}
    assert {x.sharding.mesh for x in jax.tree.leaves(rest)} == {engine.mesh}


def learn_units(engine, batch):
    """What `engine.init(rng, batch)` learns (the units, so the state's layout), without
    compiling or running the init program: these tests only read the step's program."""
    state_bytes(engine, batch)


@functools.cache
def gpt_engine(n, stage, offload, optimizer=adamw):
    """The test GPT's engine with AdamW and clipping on N devices (one per process: tests that
    build the same one share its programs)."""
    return zj.Engine(tiny_gpt(), optimizer(), zj.make_mesh(data=n),
                     zj.ZeroConfig(stage=stage, clip_norm=CLIP, offload=offload))


def runs(engines, batches, params=None):
    """Each engine's run on `batches` (from `params` when given): [(losses, grad norms, params,
    state)]; the engines stay in `runs.engines`."""
    out, runs.engines = [], engines
    for eng in engines:
        losses, params_, state = engine_run(eng, batches, params=params)
        out.append((losses, engine_run.norms, params_, state))
    return out


def offload_pair(model, optimizer, mesh, batches, **cfg):
    """The same run without and with offload: [(losses, grad norms, params, state)] * 2."""
    return runs([zj.Engine(model, optimizer, mesh, zj.ZeroConfig(offload=offload, **cfg))
                 for offload in (None, "optimizer")], batches)


@pytest.mark.parametrize("stage", sweep([1, 2, 3], quick=[3]))
@pytest.mark.parametrize("n", sweep([1, 4], quick=[4]))
def test_offload_gives_the_same_numbers(stage, n):
    """The offload-free run's numbers to the last bits, the params by their distance against
    how far the run moved them (XLA:CPU's codegen differs between CPUs). The update is a
    program of the host's own, compiled apart from the step, so XLA rounds some of its float
    operations otherwise (stage 1, measured: losses 1.7e-7 relative over 20 steps); at
    stages 2-3 each unit's gradient also leaves for the host inside the backward, with its sum
    of squares taken there per unit (`units.arrive`): the global norm is the same sum in
    another order (measured: losses 1.6e-7, norms 1.9e-7 relative, params 1.2e-7 over 20
    steps). Apart from the step's, the device's program fuses its backward otherwise too: even
    the first step's norm may differ in its last bit."""
    batches = [gpt_batch(tiny_gpt().cfg, 8, s) for s in range(20)]
    (l0, n0, p0, _), (l1, n1, p1, state) = runs(
        [gpt_engine(n, stage, offload) for offload in (None, "optimizer")], batches)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    np.testing.assert_allclose(n1, n0, rtol=1e-6)
    # Each leaf's distance from the reference against how far the reference moved in the 20
    # steps (measured on two CPUs, all six runs: 1.9e-6 by L2, 2.1e-5 for the worst element
    # against the leaf's largest move; a wrong update is off by 1e-3 or more)
    start = runs.engines[0].params(runs.engines[0].init(jax.random.key(0), batches[0]))
    for (path, a), b, s in zip(jax.tree.flatten_with_path(p1)[0], jax.tree.leaves(p0),
                               jax.tree.leaves(start)):
        a, b, s = (np.asarray(x, np.float64) for x in (a, b, s))
        name = jax.tree_util.keystr(path)
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b - s), name
        assert np.abs(a - b).max() <= 1e-4 * np.abs(b - s).max(), name
    assert_placement(runs.engines[1], state)
    assert kinds(p1) == {DEVICE}  # engine.params reads the host master into device memory


@pytest.mark.parametrize("stage, n, fused", sweep(
    [(2, 4, False), (3, 3, False), (2, 3, False), (3, 3, True)], quick=[(2, 4, False)]))
def test_offload_matches_single_device_optax(stage, n, fused):
    """With each unit's gradient sent to the host in the backward (`step.per_unit`); on N = 3
    every leaf is padded, so the host shards and the per-unit sums of squares carry padding,
    and zerojax.adamw's fused pass (fused.py) leaves the padding at zero."""
    eng = gpt_engine(n, stage, "optimizer", fused_adamw if fused else adamw)
    check_parity(eng)
    assert eng.host_update == ("fused" if fused else
                               "xla: the optimizer is not zerojax.adamw")
    assert per_unit(eng.plan)
    state = check_parity.state  # the host shards' padding stays zero: master and moments
    real = jax.tree.leaves(eng.layout.to_flat(jax.tree.map(np.ones_like, eng.params(state))))
    if n == 3:
        assert sum(int((r == 0).sum()) for r in real) > 0
    trees = {"master": state.master, **{k: optax.tree_utils.tree_get(state.opt_state, k)
                                        for k in ("mu", "nu")}}
    for name, tree in trees.items():
        for x, r in zip(jax.tree.leaves(tree), real, strict=True):
            assert not np.asarray(x)[np.asarray(r) == 0].any(), name


@pytest.mark.parametrize("stage", [3, pytest.param(2, marks=pytest.mark.slow)])
def test_stage_3_computes_on_the_shards_that_came_up(monkeypatch, stage):
    """At stage 3 the compute params are the compute-dtype shards the host's update sent up,
    as they arrived: no refresh program runs (it would cast them to the dtype they have and
    copy the params), in a step, a delayed step or evaluate. Stages 1-2 gather them."""
    from zerojax.offload.host import HostOffload

    calls = []
    refresh = HostOffload._refresh_fn
    monkeypatch.setattr(HostOffload, "_refresh_fn",
                        lambda self, donate: calls.append(donate) or refresh(self, donate))
    batches = [gpt_batch(tiny_gpt().cfg, 8, s) for s in range(3)]
    eng = zj.Engine(tiny_gpt(), adamw(), zj.make_mesh(data=2, devices=jax.devices()[:2]),
                    zj.ZeroConfig(stage=stage, offload="optimizer", delayed_update=1))
    state = eng.init(jax.random.key(0), batches[0])
    for b in batches:
        state, _ = eng.step(state, b)
    eng.evaluate(state, batches[0])
    assert bool(calls) == (stage != 3)
    if stage == 3:  # the master the last update gave, in the compute dtype
        for c, m in zip(jax.tree.leaves(state.compute), jax.tree.leaves(state.master),
                        strict=True):
            np.testing.assert_array_equal(np.asarray(c), np.asarray(m).astype(c.dtype))


def test_model_state_stays_on_device_and_evaluate_reads_it():
    mesh = zj.make_mesh(data=4)
    (l0, _, p0, s0), (l1, _, p1, s1) = offload_pair(
        Norm(zj.batch_axes(mesh)), optax.adam(1e-2, eps=1e-6), mesh, BATCHES[:5], stage=3)
    np.testing.assert_array_equal(l1, l0)
    assert_bitwise(p1, p0)
    assert_bitwise(s1.model_state, s0.model_state)
    assert int(s1.model_state["count"]) == 5
    assert_placement(runs.engines[1], s1)
    # float32 stage 3 computes on the master without offload; offloaded, it keeps a device copy.
    assert s0.compute is None and s1.compute is not None
    eng = zj.Engine(Norm(zj.batch_axes(mesh)), optax.adam(1e-2), mesh,
                    zj.ZeroConfig(stage=3, offload="optimizer"))
    learn_units(eng, BATCHES[0])
    assert_placement(eng, eng.abstract_state())  # what AOT compilation and restore target
    ev = eng.evaluate(s1, BATCHES[5])
    ref = zj.Engine(Norm(zj.batch_axes(mesh)), optax.adam(1e-2), mesh, zj.ZeroConfig(stage=3))
    learn_units(ref, BATCHES[0])
    assert float(ev["loss"]) == float(ref.evaluate(s0, BATCHES[5])["loss"])


def test_the_devices_program_holds_no_host_state():
    """The step's program on the devices takes none of the master, optimizer state or pending
    update (the host's update takes them), and its gradient shards leave it in pinned host
    memory."""
    eng = zj.Engine(tiny_gpt(), adamw(), zj.make_mesh(data=4),
                    zj.ZeroConfig(stage=3, offload="optimizer", delayed_update=1))
    batch = gpt_batch(tiny_gpt().cfg, 8, 0)
    learn_units(eng, batch)
    low = eng.lower(None, put_batch(batch, eng.mesh))
    state = eng.abstract_state()
    args = jax.tree.leaves(low.args_info[0][0])
    assert len(args) == len(jax.tree.leaves(state)) - len(jax.tree.leaves(eng.host_part(state)))
    assert 'mhlo.memory_kind = "pinned_host"' in low.as_text()
    host = jax.tree.leaves(eng.lower_host_update().args_info[0][1:3])  # master, optimizer state
    assert len(host) == len(jax.tree.leaves((state.opt_state, state.master)))


@pytest.mark.parametrize("stage", sweep([1, 3], quick=[3]))
def test_fp16_skipped_steps_clip_accumulation_and_hybrid_mesh(stage):
    # SeedMLP's gradients overflow fp16 at a scale of 2**17: the first steps are skipped and
    # must leave the host's master and moments untouched, as on the device (a skipped step
    # that changed them would be off by the update, not by the last bits).
    mesh = zj.make_mesh(data=2, replica=2)
    batch = jax.tree.map(lambda x: np.concatenate([x] * 4), SEED_BATCH)
    out = offload_pair(SeedMLP(), optax.adam(0.1, eps=1e-8), mesh, [batch] * 8, stage=stage,
                       param_dtype="float16", loss_scale_init=2.0**17, clip_norm=5.0,
                       grad_accum=2)
    (l0, n0, p0, s0), (l1, n1, p1, s1) = out
    skipped = int((~np.isfinite(n1)).sum())
    assert 0 < skipped < 8 and np.isfinite(n1[skipped:]).all()  # skipped first, then trains
    assert np.array_equal(np.isfinite(n1), np.isfinite(n0))  # the same steps skipped
    # to the last bits, as every offloaded run (test_offload_gives_the_same_numbers)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    np.testing.assert_allclose(n1[skipped:], n0[skipped:], rtol=1e-6)
    assert_tree_close(p1, p0, rtol=1e-6, atol=1e-7)
    assert_tree_close(jax.device_get(s1.opt_state), jax.device_get(s0.opt_state), rtol=1e-6,
                      atol=1e-7)
    assert float(s1.loss_scale.scale) == float(s0.loss_scale.scale) < 2.0**17
    assert_placement(runs.engines[1], s1)


def test_checkpoints_cross_offload_and_device_counts(tmp_path):
    batches = [gpt_batch(tiny_gpt().cfg, 8, s) for s in range(3)]
    on = gpt_engine(4, 3, "optimizer")
    _, params, state = engine_run(on, batches[:2])
    on.save(state, tmp_path / "on")

    off = gpt_engine(2, 1, None)  # offload on -> off, N 4 -> 2
    restored = off.restore(tmp_path / "on")
    assert kinds((restored.master, restored.opt_state)) == {DEVICE}
    assert_bitwise(off.params(restored), params)
    state, m_on = on.step(state, batches[2])
    restored, m_off = off.step(restored, batches[2])
    np.testing.assert_allclose(float(m_off["loss"]), float(m_on["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m_off["grad_norm"]), float(m_on["grad_norm"]), rtol=1e-5)
    assert_tree_close(off.params(restored), on.params(state), rtol=1e-5, atol=1e-6)
    off.save(restored, tmp_path / "off")

    back = gpt_engine(1, 2, "optimizer")  # offload off -> on, N 2 -> 1
    again = back.restore(tmp_path / "off")
    assert_placement(back, again)
    assert_bitwise(back.params(again), off.params(restored))
    assert int(again.step) == 3
    again, m = back.step(again, batches[0])
    assert np.isfinite(float(m["loss"]))


@pytest.mark.slow  # two runs, a save and two restores (~50 CPU s); CI runs it
def test_a_host_mesh_of_other_devices_gives_the_same_run(monkeypatch, tmp_path):
    """On a GPU the host mesh is the host's CPU devices, apart from the mesh. Here CPU devices
    4-7 stand in for them beside a mesh on 0-3, so every program meets only its own mesh's
    arrays and every move between the two is a real copy: from the same params, the state's
    build (each part by its own mesh's program), delayed steps, evaluate, params, the
    optimizer state, the startup table's bytes, a save and its restores give the numbers of
    the run whose host mesh is the mesh itself. `init`'s random draw, compiled in the host
    mesh's program, rounds otherwise in its last bits."""
    from jax.sharding import Mesh

    import zerojax.offload.host as host
    from zerojax.app.report import state_bytes_split

    devices = jax.devices()
    mesh = zj.make_mesh(data=4, devices=devices[:4])
    cfg = zj.ZeroConfig(stage=2, clip_norm=CLIP, offload="optimizer", delayed_update=1)
    batches = [gpt_batch(tiny_gpt().cfg, 8, s) for s in range(4)]
    same = zj.Engine(tiny_gpt(), adamw(), mesh, cfg)
    twin = lambda m: Mesh(np.array(devices[4:8]).reshape(m.devices.shape), m.axis_names,
                          axis_types=m.axis_types)
    monkeypatch.setattr(host, "host_mesh", twin)
    apart = zj.Engine(tiny_gpt(), adamw(), mesh, cfg)
    assert set(apart.host_mesh.devices.flat) == set(devices[4:8])
    key = jax.random.key(0)
    drawn = [e.params(e.init(key, batches[0])) for e in (same, apart)]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2 ** -21, atol=0),
                 drawn[1], drawn[0])  # a few float32 ulps (measured: 2, in 1 % of elements)
    params = tiny_gpt().init(key)
    (l0, n0, p0, s0), (l1, n1, p1, s1) = runs([same, apart], batches[:3], params)
    np.testing.assert_array_equal(l1, l0)
    np.testing.assert_array_equal(n1, n0)
    assert_bitwise(p1, p0)
    assert_placement(apart, s1)
    assert kinds(p1) == {DEVICE} and {x.sharding.mesh for x in jax.tree.leaves(p1)} == {mesh}
    assert_bitwise(apart.optimizer_state(s1), same.optimizer_state(s0))
    assert float(apart.evaluate(s1, batches[3])["loss"]) == \
        float(same.evaluate(s0, batches[3])["loss"])
    total, hosted = state_bytes_split(apart, s1, devices[0])
    assert (total, hosted) == state_bytes_split(same, s0, devices[0]) and 0 < hosted < total
    apart.save(s1, tmp_path)
    back = apart.restore(tmp_path)
    assert_placement(apart, back)
    assert_bitwise(apart.params(back), p1)
    s0, m0 = same.step(same.restore(tmp_path), batches[3])
    back, m1 = apart.step(back, batches[3])
    assert float(m1["loss"]) == float(m0["loss"])
    assert_bitwise(apart.params(back), same.params(s0))


@pytest.mark.slow  # an engine's init on two meshes, its host build compiled twice (~10 CPU s)
def test_the_host_build_runs_in_parts_with_a_parts_temporaries(monkeypatch):
    """With the host mesh apart (CPU devices 4-7 here, as a GPU's host), init builds the host
    state in runs of its leaves (`runs`: at most 1/16 of the bytes each, or one leaf), so each
    program's temporaries are its own part's random draw (at most 3.5x the part: its bits,
    uniform and normal draws), measured from the compiled programs: as one program the build
    held temporaries of half the host state or more."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import zerojax.offload.host as host

    assert host.runs([4, 4, 4, 4], 2) == [[0, 1], [2, 3]]
    assert host.runs([1, 9, 1, 1, 1], 4) == [[0], [1], [2, 3, 4]]
    assert host.runs([], 4) == []
    devices = jax.devices()
    mesh = zj.make_mesh(data=4, devices=devices[:4])
    monkeypatch.setattr(host, "host_mesh", lambda m: Mesh(np.array(devices[4:8]).reshape(
        m.devices.shape), m.axis_names, axis_types=m.axis_types))
    temps, jit = [], jax.jit

    def measured(fn, **kw):
        jitted = jit(fn, **kw)

        def call(*args):
            if fn.__name__ == "some":  # one part of the host build
                m = jitted.lower(*args).compile().memory_analysis()
                temps.append((m.temp_size_in_bytes, m.output_size_in_bytes))
            return jitted(*args)
        return call

    eng = zj.Engine(tiny_gpt(), adamw(), mesh, zj.ZeroConfig(stage=3, offload="optimizer"))
    batch = gpt_batch(tiny_gpt().cfg, 8, 0)
    monkeypatch.setattr(host.jax, "jit", measured)
    state = eng.init(jax.random.key(0), batch)
    monkeypatch.setattr(host.jax, "jit", jit)
    hosted = sum(x.addressable_shards[0].data.nbytes  # per host device
                 for x in jax.tree.leaves((state.master, state.opt_state)))
    one = jit(lambda r: (lambda s: (s.master, s.opt_state))(eng._to_state(
        tiny_gpt().init(r), None, None)), out_shardings=tuple(
        getattr(eng.state_shardings(), f) for f in ("master", "opt_state"))).lower(
        jax.device_put(jax.random.key(0), NamedSharding(eng.host_mesh, P()))).compile()
    one = one.memory_analysis().temp_size_in_bytes
    # the parts' outputs are the host state (and a tuple's table of 8-byte pointers each)
    assert len(temps) >= 8 and hosted <= sum(out for _, out in temps) <= 1.01 * hosted
    assert one >= hosted / 2
    assert max(temp / out for temp, out in temps) <= 3.5, temps


@pytest.mark.slow  # two engines on a hybrid mesh, one with its host mesh apart (~15 CPU s)
def test_a_host_mesh_apart_builds_model_state_and_stage_1s_gathered_params(monkeypatch):
    """The build on two meshes where the parts meet other features: model state (made by the
    devices' program), stage 1 on replica 2 x data 2 (the compute params gathered by the
    refresh, not cast) and a skip flag (fp16): from the same params, the state and three
    steps are bitwise the run's whose host mesh is the mesh itself."""
    from jax.sharding import Mesh

    import zerojax.offload.host as host

    devices = jax.devices()
    mesh = zj.make_mesh(data=2, replica=2, devices=devices[:4])
    cfg = zj.ZeroConfig(stage=1, offload="optimizer", param_dtype="float16")
    model = Norm(zj.batch_axes(mesh))
    same = zj.Engine(model, optax.adam(1e-2, eps=1e-6), mesh, cfg)
    monkeypatch.setattr(host, "host_mesh", lambda m: Mesh(np.array(devices[4:8]).reshape(
        m.devices.shape), m.axis_names, axis_types=m.axis_types))
    apart = zj.Engine(model, optax.adam(1e-2, eps=1e-6), mesh, cfg)
    params = model.init(jax.random.key(0))
    (l0, _, p0, s0), (l1, _, p1, s1) = runs([same, apart], BATCHES[:3], params)
    np.testing.assert_array_equal(l1, l0)
    assert_bitwise(p1, p0)
    assert_bitwise(s1.model_state, s0.model_state)
    assert_bitwise(s1.compute, s0.compute)
    assert int(s1.model_state["count"]) > 0  # the steps fp16's loss scale did not skip
    assert {x.sharding.mesh for x in jax.tree.leaves(s1.master)} == {apart.host_mesh}


def test_the_host_mesh_twins_each_accelerator_with_a_cpu_device():
    """On a machine of accelerators each device of the mesh gets a CPU device of its process,
    in the mesh's shape and axes; too few CPU devices is one ConfigError naming the count and
    the flag that gives more. (Stand-in accelerators: this machine has only CPU devices.)"""
    from types import SimpleNamespace

    from jax.sharding import AxisType

    from zerojax.offload.meshes import host_mesh

    cpus = jax.devices("cpu")

    def accelerators(shape):
        devices = [SimpleNamespace(platform="gpu", process_index=0, id=100 + i)
                   for i in range(math.prod(shape))]
        return SimpleNamespace(devices=np.array(devices, dtype=object).reshape(shape),
                               axis_names=("replica", "data"),
                               axis_types=(AxisType.Auto, AxisType.Auto))

    twin = host_mesh(accelerators((2, 2)))
    assert twin.devices.tolist() == [[cpus[0], cpus[1]], [cpus[2], cpus[3]]]
    assert twin.axis_names == ("replica", "data")
    mesh = zj.make_mesh(data=4)
    assert host_mesh(mesh) is mesh  # CPU devices already: the mesh itself
    n = len(cpus) + 1
    with pytest.raises(zj.ConfigError, match=rf"process 0 has {n} devices in the mesh but "
                       rf"{n - 1} CPU device\(s\).*jax_num_cpu_devices', {n}\).*"
                       rf"xla_force_host_platform_device_count={n}"):
        host_mesh(accelerators((1, n)))


@pytest.mark.parametrize("by_shard", [True, False])
def test_arrays_cross_to_the_twin_mesh_shard_by_shard(by_shard):
    """The moves between the mesh and the host mesh: between two backends (an accelerator's
    and the CPU's) each shard goes to its twin device by itself and the array is assembled
    there (`by_shard=True` forces that path here, where both meshes are CPU devices: 0-3 and
    4-7 as replica 2 x data 2, one backend, so `crosses` is False). Sharded, partly sharded and
    replicated leaves arrive with their values, on the target shardings, and come back; a
    PRNG key array moves whole."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from zerojax.offload.meshes import across, crosses, twins

    devices = jax.devices()
    a = Mesh(np.array(devices[:4]).reshape(2, 2), ("replica", "data"))
    b = Mesh(np.array(devices[4:8]).reshape(2, 2), ("replica", "data"))
    specs = [P(("replica", "data")), P("data"), P(), P(None, "data")]
    values = [np.arange(8, dtype=np.float32) - 2.5, np.arange(6, dtype=np.float32).astype(
        jnp.bfloat16), np.float32(3.0) * np.ones((3,), np.float32),
        np.arange(12, dtype=np.float32).reshape(3, 4)]
    xs = [jax.device_put(v, NamedSharding(a, s)) for v, s in zip(values, specs)]
    there = [NamedSharding(b, s) for s in specs]
    assert not crosses(twins(a, b))
    moved = across(xs, there, twins(a, b), by_shard)
    for y, v, s in zip(moved, values, there):
        assert y.sharding == s and y.dtype == v.dtype
        np.testing.assert_array_equal(np.asarray(y), v)
        assert {p.device for p in y.addressable_shards} == set(devices[4:8])
    back = across(moved, [x.sharding for x in xs], twins(b, a), by_shard)
    for y, x in zip(back, xs):
        assert y.sharding == x.sharding
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    # a PRNG key array (an optimizer state may hold one) moves whole, with its key data
    keys = jax.device_put(jax.random.split(jax.random.key(1), 4), NamedSharding(a, specs[0]))
    [moved] = across([keys], [there[0]], twins(a, b), by_shard)
    assert moved.sharding == there[0]
    np.testing.assert_array_equal(jax.random.key_data(moved), jax.random.key_data(keys))


@pytest.mark.parametrize("cfg, match", [
    ({"stage": 0, "offload": "optimizer"}, "offload='optimizer' needs stage 1, 2 or 3"),
    ({"stage": 2, "offload": "cpu"}, r"offload='cpu' is not an offload mode; use one of "
                                     r"\('optimizer',\) or None"),
])
def test_bad_offload_is_one_config_error(cfg, match):
    with pytest.raises(zj.ConfigError, match=match):
        zj.ZeroConfig(**cfg)


@pytest.mark.parametrize("stage, dtype", [(3, "bfloat16"), (1, "float16")])
def test_the_updated_shard_comes_back_in_the_compute_dtype(stage, dtype):
    """What the host sends back each step is the compute-dtype shard (2 bytes a parameter), not
    the fp32 master cast on the device (twice the traffic, the same numbers)."""
    eng = zj.Engine(tiny_gpt(), adamw(), zj.make_mesh(data=4),
                    zj.ZeroConfig(stage=stage, param_dtype=dtype, offload="optimizer"))
    batch = gpt_batch(tiny_gpt().cfg, 8, 0)
    learn_units(eng, batch)
    back = jax.tree.leaves(eng.lower_host_update().out_info[2])  # the update's shards
    assert {a.dtype.name for a in back} == {dtype}
    layout = eng.layout  # one shard per leaf, [k] or [L, k] per device: [N·k] or [L, N·k]
    assert sorted(a.shape for a in back) == sorted(layout.flat_shape(leaf)
                                                   for leaf in layout.leaves)


class Flat:
    """One leaf of `size` elements: a step whose update is most of its work."""

    def __init__(self, size):
        self.size = size

    def init(self, rng):
        return {"w": jax.random.normal(rng, (self.size,))}

    def loss(self, params, batch, units):
        w = units.gather(params)["w"]
        return jnp.mean(jnp.square(w[None, :8].astype(jnp.float32) * batch["x"]))


def _entry(text):
    """(input_output_alias as {output index: parameter number}, the entry's parameter
    layouts) of a compiled module's text."""
    head = text.splitlines()[0]
    alias = {int(o): int(p) for o, p in re.findall(r"\{(\d+)\}: \((\d+), \{\}", head)}
    params = re.search(r"entry_computation_layout=\{\((.*?)\)->", head).group(1)
    return alias, re.sub(r"/\*index=\d+\*/", "", params).split(", ")


def _allocations(dump):
    """{parameter number: the values in its buffer} from XLA's buffer-assignment dump."""
    (path,) = dump.glob("*jit_body*after_optimizations-buffer-assignment.txt")
    out, param = {}, None
    for line in path.read_text().splitlines():
        if line.startswith("allocation"):
            m = re.search(r"parameter (\d+),.*maybe-live-out", line)
            param = int(m.group(1)) if m else None
            if param is not None:
                out[param] = []
        elif param is not None and line.startswith(" value:"):
            out[param].append(line.split()[2])
    return out


@pytest.mark.parametrize("donate, delayed", [(True, False), (True, True),
                                             pytest.param(False, False, marks=pytest.mark.slow)])
def test_the_host_update_runs_in_place(tmp_path, monkeypatch, donate, delayed):
    """The master and moments are donated, and the host's update program writes their new
    values into the same buffers: every host-state argument aliases its output, no copy of
    one is made, and XLA's buffer assignment holds the update's result in the argument's own
    buffer (so the host never holds a second master or moment). Without donation each check
    fails. A delayed update (or dynamic loss scaling) skips the update of a step that has
    none: a branch, which runs in place too, where a select would keep the old moments."""
    if not donate:
        jit = jax.jit
        monkeypatch.setattr(jax, "jit", lambda f, donate_argnums=(), **kw: jit(f, **kw))
    # A learning rate no earlier compile shares: XLA writes the dump only when it compiles the
    # step, not when the step is loaded from a persistent compilation cache.
    lr = 1e-3 * (1 + (time.time_ns() % 997) * 1e-6)
    eng = zj.Engine(Flat(1 << 12), optax.adamw(lr, weight_decay=0.1), zj.make_mesh(data=2),
                    zj.ZeroConfig(stage=3, param_dtype="bfloat16", offload="optimizer",
                                  delayed_update=1 if delayed else None))
    batch = {"x": np.ones((4, 8), np.float32)}
    learn_units(eng, batch)
    low = eng.lower_host_update()
    compiled = low.compile({"xla_dump_to": str(tmp_path), **DEFAULT_BUFFERS})
    alias, params = _entry(compiled.as_text())
    # The arguments: the gradient's scalars, the master, the optimizer state, the gradient.
    scalars, grads = len(jax.tree.leaves(low.args_info[0][0])), len(params) - 1
    host = set(range(scalars, grads))
    assert len(host) == len(jax.tree.leaves((eng.abstract_state().master,
                                             eng.abstract_state().opt_state)))
    names = re.findall(r"ENTRY %\S+ \((.*?)\) ->", compiled.as_text())[0]
    copied = [n for n in re.findall(r"(\S+): ", names)
              if re.search(rf" copy\(%{re.escape(n)}\)", compiled.as_text())]
    in_place = _allocations(tmp_path)
    big = {i for i in host if "[" in params[i] and "[]" not in params[i]}  # master, mu, nu
    assert len(big) == 3
    if donate:
        # each state argument's buffer is an output's; the gradient's (bf16 like the compute
        # params) takes the shards that go back to the device, the last output
        assert set(alias.values()) == host | {grads} and alias[max(alias)] == grads
        assert not copied
        # the argument and its update (with a flag, inside the branch that runs it, and the
        # branch's result)
        assert all(len(in_place[i]) == (3 if delayed else 2) for i in big), in_place
        assert all(in_place[i][-1].startswith("conditional") == delayed for i in big)
        # and no float32 gradient beside them: the branch scales the gradient where it reads
        # it (scaled before the branch, it was a buffer of 4 bytes a param: a third of the
        # 12 of the state)
        temp, state = compiled.memory_analysis().temp_size_in_bytes, 12 * (1 << 12) / 2
        assert temp <= 0.02 * state, temp
    else:
        assert not alias and all(len(in_place.get(i, [])) < 2 for i in big)


class Stack:
    """Two stacked leaves that units.scan consumes, one leaf units.gather consumes. `again`:
    "scan" scans the stack twice, "gather" uses the gathered leaf inside the scan body too,
    "loop" inside a loop of the model's own."""

    def __init__(self, again=None):
        self.again = again

    def init(self, rng):
        k = jax.random.split(rng, 3)
        return {"blocks": {"w": jax.random.normal(k[0], (3, 8, 8)) / 3,
                           "b": jax.random.normal(k[1], (3, 8)) / 3},
                "head": jax.random.normal(k[2], (8, 2))}

    def loss(self, params, batch, units):
        def mix(h):
            return h + 0.1 * jnp.tanh(h @ units.gather(params["head"]) @ jnp.ones((2, 8)))

        def body(h, p):
            h = jnp.tanh(h @ p["w"] + p["b"][None])
            return mix(h) if self.again == "gather" else h

        h = units.scan(body, batch["x"], params["blocks"])
        if self.again == "scan":
            h = units.scan(body, h, params["blocks"])
        if self.again == "loop":
            h = lax.fori_loop(0, 2, lambda i, h: mix(h), h)
        out = h @ units.gather(params["head"]).astype(jnp.float32)
        return jnp.mean(jnp.square(out - batch["y"]))


STACK_BATCH = {"x": np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8),
               "y": np.linspace(0, 1, 16, dtype=np.float32).reshape(8, 2)}


def _funcs(text):
    """{name: text} of the functions of a StableHLO module."""
    return {m.group(1): m.group(0) for m in re.finditer(
        r"^  func\.func (?:public|private) @(\w+)\(.*?^  }$", text, re.S | re.M)}


def _loop_bodies(text):
    """The text of each `stablehlo.while` body of the module's main function, with the
    functions it calls (transitively) appended."""
    funcs = _funcs(text)
    out, main = [], funcs["main"]
    for m in re.finditer(r"stablehlo\.while", main):
        start = main.index("} do {", m.end()) + len("} do {")
        depth, i = 1, start
        while depth:
            depth += {"{": 1, "}": -1}.get(main[i], 0)
            i += 1
        body, seen, todo = main[start:i], set(), [main[start:i]]
        while todo:
            for name in re.findall(r"func\.call @(\w+)", todo.pop()):
                if name not in seen:
                    seen.add(name)
                    todo.append(funcs[name])
                    body += funcs[name]
        out.append(body)
    return out


def _cuda_step(eng):
    """The engine's program on the devices as StableHLO lowered for CUDA."""
    off = eng._offload
    return off._grads_fn().trace(off.device_part(eng.abstract_state()),
                                 put_batch(STACK_BATCH, eng.mesh)) \
        .lower(lowering_platforms=("cuda",)).as_text()


TO_HOST = r"annotate_device_placement\(%[\w#]+\)[^\n]*pinned_host\"\}\} : \(tensor<([^>]*)>\)"


@pytest.mark.parametrize("stage, extra, inside", sweep([
    (3, {}, True), (2, {}, True), (2, {"grad_accum": 2}, False),
    (3, {"prefetch": True}, False)], quick=[(3, {}, True)]))
def test_each_units_gradient_goes_to_the_host_inside_the_backward(stage, extra, inside):
    """In the program XLA:GPU receives (StableHLO lowered for CUDA; on CPU a `device_put`
    lowers to nothing), the backward's loop moves each layer's reduced gradient shard of every
    stacked leaf to pinned host memory, after the layer's reduce-scatter and in the compute
    dtype: once per unit and iteration, so the device never holds the whole gradient. Where
    the step keeps the transfer after the backward (micro-batches, prefetch), no loop
    has one."""
    eng = zj.Engine(Stack(), optax.adam(1e-2), zj.make_mesh(data=2),
                    zj.ZeroConfig(stage=stage, param_dtype="bfloat16", offload="optimizer",
                                  **extra))
    eng.init(jax.random.key(0), STACK_BATCH)
    assert per_unit(eng.plan) == inside
    text = _cuda_step(eng)
    moved = [re.findall(TO_HOST, body) for body in _loop_bodies(text)]
    if not inside:
        assert moved and not any(moved)
        return
    backward = [b for b in _loop_bodies(text) if "stablehlo.reduce_scatter" in b]
    assert len(backward) == 1
    body = backward[0]
    # One shard per stacked leaf, [k] of each layer: w's 64 elements, b's 8, over 2 devices.
    assert sorted(re.findall(TO_HOST, body)) == ["32xbf16", "4xbf16"]
    assert body.index("stablehlo.reduce_scatter") < re.search(TO_HOST, body).start()


@pytest.mark.slow
@pytest.mark.parametrize("stage, again", [(2, "scan"), (3, "scan"), (2, "gather"),
                                          (3, "loop")])
def test_a_unit_used_again_keeps_the_transfer_after_the_backward(stage, again):
    """A stack scanned twice, a gathered leaf used inside a scan body or a loop of the model's
    own: a unit's gradient is complete only after all its uses, so the step sends it after the
    backward as before (`units.UnitReused`), with the offload-free run's numbers bitwise."""
    batches = [STACK_BATCH] * 3
    mesh = zj.make_mesh(data=2)
    eng0, eng = (zj.Engine(Stack(again), optax.adam(1e-2), mesh,
                           zj.ZeroConfig(stage=stage, offload=offload))
                 for offload in (None, "optimizer"))
    # the offloaded run's own engine: its plan, and its step lowered for CUDA
    (l0, n0, p0, _), (l1, n1, p1, state) = runs([eng0, eng], batches)
    assert per_unit(eng.plan)
    loops = _loop_bodies(_cuda_step(eng))
    assert loops and not any(re.findall(TO_HOST, body) for body in loops)
    np.testing.assert_array_equal(l1, l0)
    np.testing.assert_array_equal(n1, n0)
    assert_bitwise(p1, p0)
    assert_placement(runs.engines[-1], state)


@pytest.mark.slow
@pytest.mark.parametrize("stage, wire, inside", [(3, {"quantize_weights": "int8"}, True),
                                                 (2, {"quantize_grads": "int8"}, False)])
def test_quantized_collectives_with_the_per_unit_transfer(stage, wire, inside):
    """qwZ changes how a unit's weights travel, not the shard its backward produces: the
    per-unit transfer composes; a last-bit difference in the params can move a weight across
    a quantization step, so the offload-free run's numbers hold to 1e-5, not 1e-6. qgZ keeps
    the transfer after the backward; the host's update, compiled apart from the step, rounds
    otherwise in the last bits from the first update on, which its quantized reduction
    carries on (to 1e-5 too)."""
    model = tiny_gpt()
    batches = [gpt_batch(model.cfg, 8, s) for s in range(6)]
    mesh = zj.make_mesh(data=4)
    eng = zj.Engine(model, adamw(), mesh, zj.ZeroConfig(stage=stage, offload="optimizer",
                                                        **wire))
    learn_units(eng, batches[0])  # the plan, as init learns it (its program is not needed)
    assert per_unit(eng.plan) == inside
    (l0, n0, p0, _), (l1, n1, p1, state) = offload_pair(model, adamw(), mesh, batches,
                                                        stage=stage, clip_norm=CLIP, **wire)
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    # qgZ's norm is of the dequantized gradient: a block that rounds the other way moves it by
    # a step of its own (measured 6.0e-5 on one CPU, under 1e-5 on another; losses 1.2e-7)
    np.testing.assert_allclose(n1, n0, rtol=1e-5 if inside else 3e-4)
    # By their distance relative to how far the run moved the params: an element whose
    # quantized block rounds the other way moves by a step of its own (measured with qgZ: 4
    # of 2048 weights by 1.5e-5 after 6 steps), which an element-wise tolerance cannot tell
    # from a wrong update.
    assert moved_error(p1, p0, model.init(jax.random.key(0))) < 1e-3
    assert_placement(runs.engines[-1], state)


@pytest.mark.parametrize("offload", [pytest.param(None, marks=pytest.mark.slow), "optimizer"])
def test_init_from_reads_the_given_params_1_over_n_per_device(monkeypatch, offload):
    """`init_from` puts the given params on the mesh as a checkpoint's logical leaves are,
    1/N per device (with offload: per host device of a host mesh apart, CPU devices 4-7 here),
    not a whole fp32 copy on each, and builds the same state from them as from a replicated
    copy: the run's numbers are the apart-host run's (test above) and each stage's parity."""
    from jax.sharding import Mesh

    import zerojax.offload.host as host

    devices = jax.devices()
    mesh = zj.make_mesh(data=4, devices=devices[:4])
    monkeypatch.setattr(host, "host_mesh", lambda m: Mesh(np.array(devices[4:8]).reshape(
        m.devices.shape), m.axis_names, axis_types=m.axis_types))
    seen, jit, by_parts = [], jax.jit, host._by_parts

    def spying(fn, *a, **kw):  # the build's program: record its params argument
        jitted = jit(fn, *a, **kw)
        if fn.__name__ != "build":
            return jitted
        return lambda *args: seen.append(args[0]) or jitted(*args)

    monkeypatch.setattr(jax, "jit", spying)
    monkeypatch.setattr(host, "_by_parts", lambda fn, args, s, *sink: seen.append(args[0]) or
                        by_parts(fn, args, s, *sink))
    eng = zj.Engine(tiny_gpt(), adamw(), mesh, zj.ZeroConfig(stage=3, offload=offload))
    params = tiny_gpt().init(jax.random.key(0))
    state = eng.init_from(params, gpt_batch(tiny_gpt().cfg, 8, 0))
    monkeypatch.setattr(jax, "jit", jit)
    (given,) = seen
    want = {eng.mesh if offload is None else eng.host_mesh}
    assert {x.sharding.mesh for x in jax.tree.leaves(given)} == want
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(given))
    assert per_device <= 0.26 * total, (per_device, total)  # a few small leaves replicated
    assert_bitwise(eng.params(state), params)
