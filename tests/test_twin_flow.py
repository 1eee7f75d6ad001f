"""Twin-Flow (`ZeroConfig(offload="optimizer", offload_fraction=f)`): the host holds and updates
its share f of the params' master and optimizer state, the devices the rest, whole groups of
leaves as the update's own computations tie them (update/parts.py); the numbers of full
offload. The host mesh is put on CPU devices 4-7 beside a mesh on 0-3, as a GPU's host is
apart from it, so every leaf's home is a mesh of its own."""

import math
import re

import jax
import numpy as np
import optax
import pytest
from helpers import CLIP, adamw, check_parity, fused_adamw, gpt_batch, sweep, tiny_gpt
from jax.sharding import Mesh
from test_offload import STACK_BATCH, TO_HOST, Stack, _cuda_step, _loop_bodies, learn_units
from test_state import BATCHES, Norm

import zerojax as zj
import zerojax.offload.host as host
from zerojax.analysis.measurement import state_bytes, twin_flow_bytes
from zerojax.app import options, report
from zerojax.step import per_unit


@pytest.fixture
def apart(monkeypatch):
    devices = jax.devices()
    monkeypatch.setattr(host, "host_mesh", lambda m: Mesh(np.array(
        devices[4:4 + m.devices.size]).reshape(m.devices.shape), m.axis_names,
        axis_types=m.axis_types))
    return devices[:4]


def flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def close_run(a, b, start, rtol=1e-5):
    """Params `a` within `rtol` of how far run `b` moved them from `start`."""
    moved = np.linalg.norm(flat(b) - flat(start))
    assert moved > 0 and np.linalg.norm(flat(a) - flat(b)) <= rtol * moved


def run(eng, batches, params, save=None):
    state, losses = eng.init_from(params, batches[0]), []
    for i, b in enumerate(batches):
        if save is not None and i == len(batches) // 2:
            eng.save(state, save)
            state = eng.restore(save)
        state, m = eng.step(state, b)
        losses.append(float(m["loss"]))
    return np.array(losses), state


def test_a_share_stays_on_the_devices_with_single_device_optaxs_numbers(apart):
    """Half the params on the devices: single-device optax's losses, norms and params over
    20 steps; each master and moment leaf where the engine says it lives (Twin-Flow's on the
    mesh in device memory, the rest on the host mesh); the host's bytes about half of full
    offload's, the rest counted in the device peak."""
    mesh = zj.make_mesh(data=4, devices=apart)
    cfg = dict(stage=3, clip_norm=CLIP, offload="optimizer")
    # the host's share as zerojax.adamw's fused pass (offload/fused.py), the devices' as optax's
    # program
    twin = zj.Engine(tiny_gpt(), fused_adamw(), mesh,
                     zj.ZeroConfig(**cfg, offload_fraction=0.5))
    check_parity(twin)
    assert twin.host_update == "fused" and "zerojax_adamw" in twin.lower_host_update().as_text()
    state = check_parity.state
    device, moments = twin._offload.split()
    assert 0 < len(device) < len(jax.tree.leaves(state.master))
    assert len(moments) == 2 * len(device)  # mu and nu of each of the devices' params
    homes = twin.state_shardings()
    for field in ("master", "opt_state"):
        on = twin._offload.on_devices(field)
        for i, (x, want) in enumerate(zip(jax.tree.leaves(getattr(state, field)),
                                          jax.tree.leaves(getattr(homes, field)))):
            assert x.sharding == want
            assert (x.sharding.mesh == mesh) == (i in on), (field, i)
            assert x.sharding.memory_kind == "device"
    full = zj.Engine(tiny_gpt(), adamw(), mesh, zj.ZeroConfig(**cfg))
    learn_units(full, gpt_batch(tiny_gpt().cfg, 8, 0))
    bytes_full, bytes_twin = state_bytes(full), state_bytes(twin)
    assert 0.3 < bytes_twin["host"] / bytes_full["host"] < 0.7
    assert bytes_twin["total"] == bytes_full["total"]
    assert twin_flow_bytes(twin) == bytes_full["host"] - bytes_twin["host"] > 0
    assert twin_flow_bytes(full) == 0
    # What `train` shows: the state measured on this device and its host twin, Twin-Flow's
    # share with the device's (not left out); the host's share as applied (whole groups of
    # leaves), and the estimate at that share.
    measured, host = report.state_bytes_split(twin, state, mesh.devices.flat[0])
    assert (measured, host) == (bytes_twin["total"], bytes_twin["host"])
    assert measured - host == bytes_full["device"] + twin_flow_bytes(twin)
    sizes = [math.prod(leaf.shape) for leaf in twin.layout.leaves]
    applied = report.host_share(twin)
    assert applied == 1 - sum(sizes[i] for i in device) / sum(sizes)
    assert abs(applied - 0.5) < 0.05 and report.host_share(full) == 1.0
    cfg = options.TrainConfig(model="test", stage=3, offload="optimizer", offload_fraction=0.5)
    est = report.estimate_for(sum(sizes), 4, 3, cfg, 8.0, None, applied).memory
    assert est.host == pytest.approx(bytes_twin["host"], rel=0.02)  # the shards' padding
    assert report.offload_text(cfg, applied) == (
        ", offload optimizer (Twin-Flow: 0.5 of it in host memory, the rest on the devices)")
    assert report.offload_text(cfg, 0.4) == (
        ", offload optimizer (Twin-Flow: 0.4 of it in host memory, the rest on the devices; "
        "0.5 asked, the devices take whole groups of leaves as the update ties them)")


@pytest.mark.slow  # two runs of four steps, a save, two restores (~25 CPU s)
def test_with_the_delayed_update_and_a_restore_twin_flow_is_full_offloads_run(apart, tmp_path):
    """With the delayed update and a save in the delayed phase restored halfway: full
    offload's losses, params, optimizer state and evaluate; the checkpoint restores into full
    offload, which continues the run."""
    mesh = zj.make_mesh(data=4, devices=apart)
    cfg = dict(stage=3, clip_norm=CLIP, offload="optimizer", delayed_update=1)
    full = zj.Engine(tiny_gpt(), adamw(), mesh, zj.ZeroConfig(**cfg))
    # the host's share fused (zerojax.adamw), full offload's optax's program: the same run
    twin = zj.Engine(tiny_gpt(), fused_adamw(), mesh,
                     zj.ZeroConfig(**cfg, offload_fraction=0.5))
    batches = [gpt_batch(tiny_gpt().cfg, 8, s) for s in range(4)]
    params = tiny_gpt().init(jax.random.key(0))
    l0, s0 = run(full, batches, params)
    l1, s1 = run(twin, batches, params, tmp_path / "ckpt")
    assert twin._offload.on_devices("pending")
    # CPU devices of one client: Twin-Flow's delayed update in turn, full offload's beside
    assert (full._offload._apart(s0), twin._offload._apart(s1)) == (True, False)
    # the thread the update runs on beside the devices' programs: made only where it does
    assert (full._offload._thread is None, twin._offload._thread is None) == (False, True)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    close_run(twin.params(s1), full.params(s0), params)
    close_run(twin.optimizer_state(s1)[0].mu, full.optimizer_state(s0)[0].mu,
              jax.tree.map(np.zeros_like, params))
    np.testing.assert_allclose(float(twin.evaluate(s1, batches[0])["loss"]),
                               float(full.evaluate(s0, batches[0])["loss"]), rtol=1e-6)
    back = full.restore(tmp_path / "ckpt")
    for b in batches[2:]:
        back, _ = full.step(back, b)
    close_run(full.params(back), full.params(s0), params)


def test_the_hosts_program_takes_only_its_share():
    """`lower_host_update` with Twin-Flow lowers the host's share as one program: its
    arguments are the host's master and moments (and the scalars, the replicated leaves and
    the gradient), not the devices' leaves."""
    mesh = zj.make_mesh(data=2, devices=jax.devices()[:2])
    eng = zj.Engine(tiny_gpt(), adamw(), mesh, zj.ZeroConfig(
        stage=3, offload="optimizer", offload_fraction=0.5))
    learn_units(eng, gpt_batch(tiny_gpt().cfg, 8, 0))
    low = eng.lower_host_update()
    args = low.args_info[0]
    device, moments = eng._offload.split()
    n = len(eng.layout.leaves)
    assert len(args[2]) == n - len(device)  # the host's master leaves
    assert len(args[4]) == n - len(device)  # and their gradient
    assert len(moments) == 2 * len(device)  # mu and nu of each of the devices' params
    assert len(args[3]) + len(moments) + len(args[1]) == len(
        jax.tree.leaves(eng.abstract_state().opt_state))


@pytest.mark.parametrize("stage", sweep([3, 2], quick=[3]))
def test_the_devices_share_of_the_gradient_never_leaves_them(stage):
    """In the program XLA:GPU receives (StableHLO lowered for CUDA), the backward's loop moves
    to pinned host memory only the host's stacked leaf's gradient shard, once per layer, and
    the gradients program gives Twin-Flow's leaves' gradient in device memory, the rest in
    pinned host memory: the devices' update reads its gradient where the backward made it."""
    eng = zj.Engine(Stack(), optax.adam(1e-2), zj.make_mesh(data=2, devices=jax.devices()[:2]),
                    zj.ZeroConfig(stage=stage, param_dtype="bfloat16", offload="optimizer",
                                  offload_fraction=0.9))  # b, 24 of the 232 params
    eng.init(jax.random.key(0), STACK_BATCH)
    assert per_unit(eng.plan)
    kept = eng._offload.on_devices("master")
    names = ["['blocks']['b']", "['blocks']['w']", "['head']"]  # the leaves' order
    assert [names[i] for i in kept] == ["['blocks']['b']"]
    text = _cuda_step(eng)
    (backward,) = [b for b in _loop_bodies(text) if "stablehlo.reduce_scatter" in b]
    assert re.findall(TO_HOST, backward) == ["32xbf16"]  # w's [3, 8, 8] over 2, per layer
    kinds = dict(re.findall(r'jax\.result_info = "result\[1\]\[0\](\[[^"]*)", '
                            r'mhlo\.memory_kind = "(\w+)"', text))
    assert kinds == {names[0]: "device", names[1]: "pinned_host", names[2]: "pinned_host"}


@pytest.mark.parametrize("optimizer, match", [
    (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
     r"offload_fraction=0.5 splits the update .* ties every leaf to every other .*"
     r"clip_norm=\.\.\.\) instead, or use offload_fraction=1.0"),
])
def test_an_update_that_cannot_split_is_one_config_error(optimizer, match):
    mesh = zj.make_mesh(data=2, devices=jax.devices()[:2])
    eng = zj.Engine(tiny_gpt(), optimizer, mesh, zj.ZeroConfig(
        stage=2, offload="optimizer", offload_fraction=0.5))
    with pytest.raises(zj.ConfigError, match=match):
        eng.init(jax.random.key(0), gpt_batch(tiny_gpt().cfg, 8, 0))


@pytest.mark.parametrize("cfg, match", [
    ({"stage": 2, "offload_fraction": 0.5}, r"offload_fraction=0.5 needs offload='optimizer' "
                                             r"\(got offload=None\)"),
    ({"stage": 2, "offload": "optimizer", "offload_fraction": 0}, r"must be a number in \(0, 1]"),
    ({"stage": 2, "offload": "optimizer", "offload_fraction": 1.5}, r"in \(0, 1\]"),
    ({"stage": 2, "offload": "optimizer", "offload_fraction": "0.5"}, r"'0.5' must be a number"),
    ({"stage": 2, "offload": "optimizer", "offload_fraction": True}, r"True must be a number"),
    ({"stage": 2, "offload": "optimizer", "offload_fraction": float("nan")}, r"nan must be"),
])
def test_bad_offload_fraction_is_one_config_error(cfg, match):
    with pytest.raises(zj.ConfigError, match=match):
        zj.ZeroConfig(**cfg)


@pytest.mark.slow  # two runs of three steps on a hybrid mesh (~15 CPU s)
def test_twin_flow_with_model_state_fp16_and_stage_1_on_a_hybrid_mesh(apart):
    """Where Twin-Flow meets the rest: model state (the devices' program), stage 1's gathered
    compute params, fp16's skip flag (a skipped step skips both shares' updates) on replica
    2 x data 2: full offload's losses, params, model state and compute params."""
    mesh = zj.make_mesh(data=2, replica=2, devices=apart)
    model = Norm(zj.batch_axes(mesh))
    cfg = dict(stage=1, offload="optimizer", param_dtype="float16")
    engines = [zj.Engine(model, optax.adam(1e-2, eps=1e-6), mesh,
                         zj.ZeroConfig(**cfg, offload_fraction=f)) for f in (1.0, 0.3)]
    params = model.init(jax.random.key(0))
    (l0, s0), (l1, s1) = (run(e, BATCHES[:3], params) for e in engines)
    assert engines[1]._offload.split()[0]
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    close_run(engines[1].params(s1), engines[0].params(s0), params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
                 s1.model_state, s0.model_state)
    assert int(s1.model_state["count"]) > 0


@pytest.mark.slow  # two runs of three steps each (~10 CPU s a case)
@pytest.mark.parametrize("case", ["model axis", "muon", "grad accum, hpz", "3 devices, parts"])
def test_twin_flow_meets_the_model_axis_muon_accumulation_and_hpz(apart, monkeypatch, case):
    """Twin-Flow against full offload where it meets the model axis (data 2 x model 2), Muon's
    whole-matrix work on owner devices (the devices' share runs it on the mesh), gradient
    accumulation and hpZ, and padded shards (data 3) with the update in parts of any size and
    the delayed update: the same losses, the params to 1e-5 of how far they moved (Muon:
    1e-4, its Newton-Schulz products round otherwise in a program of their own; measured
    1.4e-5)."""
    from zerojax.app import presets
    from zerojax.update import parts

    if case == "3 devices, parts":
        monkeypatch.setattr(parts, "LEAST", 0)
    mesh, optimizer, kw, rtol = {
        "model axis": (zj.make_mesh(data=2, model=2, devices=apart), adamw(), {"stage": 3},
                       1e-5),
        "muon": (zj.make_mesh(data=4, devices=apart), presets.build("muon", 1e-2),
                 {"stage": 2}, 1e-4),
        "grad accum, hpz": (zj.make_mesh(data=2, replica=2, devices=apart), adamw(),
                            {"stage": 3, "grad_accum": 2, "hpz": True}, 1e-5),
        "3 devices, parts": (zj.make_mesh(data=3, devices=apart[:3]), adamw(),
                             {"stage": 3, "delayed_update": 1}, 1e-5)}[case]
    size = 6 if case == "3 devices, parts" else 8
    batches = [gpt_batch(tiny_gpt().cfg, size, s) for s in range(3)]
    params = tiny_gpt().init(jax.random.key(0))
    engines = [zj.Engine(tiny_gpt(), optimizer, mesh, zj.ZeroConfig(
        offload="optimizer", offload_fraction=f, **kw)) for f in (1.0, 0.5)]
    (l0, s0), (l1, s1) = (run(e, batches, params) for e in engines)
    assert engines[1]._offload.split()[0]
    if case == "3 devices, parts":  # the delayed update's: the devices' part, the host's parts
        gdtypes = [jax.numpy.float32] * len(engines[1].layout.leaves)
        got = [p.on_device for p, _ in engines[1].plan.update.parts(
            True, gdtypes, engines[1]._offload.split()[0])]
        assert got[0] and not any(got[1:]) and len(got) > 2
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    close_run(engines[1].params(s1), engines[0].params(s0), params, rtol)
