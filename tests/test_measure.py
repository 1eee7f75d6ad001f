"""Measured memory and collective bytes of compiled steps against the analytic ZeRO model.

The engine keeps no gradients between steps (they live in the step's temp buffers), so the
measured model state is compared with `estimate(...).total - grads`. Collective bytes are
compared in the dtype the program asks for (bf16); XLA:CPU's compiled program sends f32.
The GPT preset is small8: its untied embedding and head, which stage 3 gathers once instead
of twice (they are not rematerialized), are 5% of the parameters, so stage 3 sends 1.6% less
than 3(N-1)/N·Ψ·b. ("test", at 21%, would be 7% off.)
"""

import functools
import json
import resource
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import sweep

import zerojax as zj
from zerojax.analysis.accounting import estimate, state_estimate
from zerojax.analysis.hlo import collective_bytes
from zerojax.analysis.measurement import lower, measure, state_bytes, twin_flow_bytes
from zerojax.models import GPT

PRESET = "small8"


@functools.cache  # one engine per stage and N: the traffic tests and `measured` lower it once
def engine(stage, n, **kw):
    cfg = zj.ZeroConfig(stage=stage, param_dtype="bfloat16", **kw)
    return zj.Engine(GPT.from_preset(PRESET), optax.adamw(3e-4), zj.make_mesh(data=n), cfg)


def batch(n):
    shape = (n, GPT.from_preset(PRESET).cfg.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("inputs", "targets")}


@pytest.fixture(scope="module")
def measured():
    """Compiled measurements of every stage at N = 8 (the expensive part: 4 compiles)."""
    return {s: measure(engine(s, 8), batch(8)) for s in range(4)}


# --- state and traffic at N = 2, 4, 8 (lowering only: these checks need no compile) --------

@pytest.mark.parametrize("n", sweep([2, 4, 8], quick=[8]))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_and_traffic_match_the_formulas(stage, n):
    e = engine(stage, n)
    text = lower(e, batch(n)).compiler_ir("hlo").as_hlo_text()
    psi = GPT.from_preset(PRESET).num_params()
    est = estimate(psi, n, stage)  # bf16 params and grads, K = 12 (master + Adam moments)
    state = state_bytes(e)
    assert state["total"] == pytest.approx(est.total - est.grads, rel=0.02)
    assert state["params"] == pytest.approx(est.params, rel=0.02)
    assert state["master"] + state["optimizer"] == pytest.approx(est.optimizer, rel=0.02)
    sent = collective_bytes(text, n)
    comm = zj.comm_estimate(psi, n, stage)
    assert sent["total"] == pytest.approx(comm.total, rel=0.05)
    assert sent["total"] == pytest.approx(2 * (n - 1) / n * psi * 2 * (1.5 if stage == 3 else 1),
                                          rel=0.05)
    if stage == 0:
        assert sent["all_gather"] == sent["reduce_scatter"] == 0
    else:  # the gradient reduce-scatter is exact; only scalar all-reduces remain
        assert sent["reduce_scatter"] == pytest.approx(comm.reduce_scatter, rel=1e-6)
        assert sent["all_reduce"] < 100


# --- the state formula, to the byte, for every compute dtype (nothing compiled) -------------

SCALARS = 4 + 4 + 4 + 4 + 8  # step, Adam's count, loss scale, its good-step count, base key


def tiny(stage, dtype, n=8, **kw):
    model = GPT.from_preset("test")  # no leaf needs padding at N = 8: the formula is exact
    cfg = zj.ZeroConfig(stage=stage, param_dtype=dtype, **kw)
    batch = {k: jnp.zeros((n, model.cfg.seq_len), jnp.int32) for k in ("inputs", "targets")}
    return zj.Engine(model, optax.adamw(3e-4), zj.make_mesh(data=n), cfg), batch


@pytest.mark.parametrize("dtype", sweep(["float32", "bfloat16", "float16"],
                                        quick=["float16"]))  # fp16: half params + loss scale
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_live_state_is_the_formula_for_every_dtype(stage, dtype):
    """The arrays `init` allocates on each device, the shapes `state_bytes` reads and
    `state_estimate`, by component."""
    e, b = tiny(stage, dtype)
    live_state = e.init(jax.random.key(0), b)
    live = {sum(s.data.nbytes for x in jax.tree.leaves(live_state) for s in x.addressable_shards
                if s.device == d) for d in e.mesh.devices.flat}
    state, psi = state_bytes(e), e.layout.num_params
    assert e.layout.padded_params == psi
    est = state_estimate(psi, 8, stage, dtype)
    assert live == {state["total"]} == {est.total - est.grads + SCALARS}
    # float32 in stages 0 and 3: the compute params are the fp32 master, not a second copy.
    shared = dtype == "float32" and stage in (0, 3)
    assert state["params"] == (0 if shared else est.params)
    assert state["master"] == 4 * psi / (1 if stage == 0 else 8)
    assert state["optimizer"] == 8 * psi / (1 if stage == 0 else 8) + 4
    assert est.optimizer == (8 if shared else 12) * psi / (1 if stage == 0 else 8)


def test_state_bytes_learns_the_units_without_compiling():
    e, b = tiny(2, "bfloat16")
    assert e.plan is None
    assert state_bytes(e, b) == state_bytes(e)
    assert e.plan is not None


# --- compiled measurements at N = 8 -------------------------------------------------------

def test_measurement_fields(measured):
    for stage, m in measured.items():
        assert (m.stage, m.devices, m.replica) == (stage, 8, 1)
        assert m.num_params == GPT.from_preset(PRESET).num_params()
        assert m.peak_bytes == m.argument_bytes + m.output_bytes - m.alias_bytes + m.temp_bytes
        # The state is donated: arguments are the state plus the batch, all aliased but batch.
        assert m.state["total"] <= m.argument_bytes < m.state["total"] + 8 * 128 * 4 * 2
        assert m.alias_bytes == m.state["total"]
        assert m.temp_bytes > 0 and m.unknown_loops == 0
        # XLA:CPU upcasts every bf16 collective to f32: exactly twice the requested bytes.
        sent, compiled = m.collective_bytes, m.collective_bytes_compiled
        for kind in ("all_gather", "reduce_scatter"):
            assert compiled[kind] == 2 * sent[kind]
        assert compiled["total"] == pytest.approx(2 * sent["total"], rel=1e-5)
        # One flat data axis: every byte goes over it.
        assert m.collective_axis_bytes == {"data": pytest.approx(sent["total"])}
        mem, comm = m.estimates()
        assert m.state["total"] == pytest.approx(mem.total - mem.grads, rel=0.02)
        assert sent["total"] == pytest.approx(comm.total, rel=0.05)


def test_stages_share_traffic_and_shrink_memory(measured):
    sent = {s: m.collective_bytes["total"] for s, m in measured.items()}
    assert sent[1] == pytest.approx(sent[0], rel=1e-5)
    assert sent[2] == sent[1]
    assert sent[3] / sent[0] == pytest.approx(1.5, rel=0.02)
    peak = [measured[s].peak_bytes for s in range(4)]
    assert peak[0] > peak[1] > peak[2] > peak[3]
    # A layer's leaves travel as one collective: stage 3 gathers each layer twice (forward,
    # rematerialized backward) and reduce-scatters it once; stage 2 reduce-scatters it in the
    # backward and gathers it in the refresh. A few launches more serve the unscanned leaves
    # and the scalars. One collective per leaf would be 12 times as many per layer.
    launches = [measured[s].collective_launches for s in range(4)]
    layers = GPT.from_preset(PRESET).cfg.n_layers
    assert 3 * layers <= launches[3] < 4 * layers, launches
    assert 2 * layers <= launches[2] < 3 * layers, launches
    assert launches[0] < launches[1], launches  # stage 1 adds the refresh's gathers


def test_json_round_trip(measured):
    d = json.loads(json.dumps(measured[3].as_dict()))
    assert d["state"]["total"] == measured[3].state["total"]
    assert set(d["collective_bytes"]) == {"all_gather", "reduce_scatter", "all_reduce",
                                          "all_to_all", "other", "total"}


# --- the HLO reader on a hand-written module ------------------------------------------------

HLO = """HloModule m, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%inner_body (p: (s32[], bf16[8])) -> (s32[], bf16[8]) {
  %p = (s32[], bf16[8]{0}) parameter(0)
  %g = bf16[8]{0} get-tuple-element(%p), index=1
  %ag = bf16[32]{0} all-gather(%g), replica_groups={{0,1,2,3}}, dimensions={0}
  %rs = bf16[2]{0} reduce-scatter(%g), replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
  ROOT %t = (s32[], bf16[8]{0}) tuple(%i, %g)
}

%inner_cond (p: (s32[], bf16[8])) -> pred[] {
  %p = (s32[], bf16[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%outer_body (p: (s32[], bf16[8])) -> (s32[], bf16[8]) {
  %p = (s32[], bf16[8]{0}) parameter(0)
  ROOT %w = (s32[], bf16[8]{0}) while(%p), condition=%inner_cond, body=%inner_body
}

%outer_cond (p: (s32[], bf16[8])) -> pred[] {
  %p = (s32[], bf16[8]{0}) parameter(0)
  ROOT %b = pred[] constant(true)
}

ENTRY %main (a: bf16[8], b: f32[16]) -> f32[16] {
  %a = bf16[8]{0} parameter(0)
  %b = f32[16]{0} parameter(1)
  %w = (s32[], bf16[8]{0}) while(%t0), condition=%outer_cond, body=%outer_body, KNOWN_TRIP
  %ars = f32[16]{0} all-reduce-start(%b), replica_groups={{0,1},{2,3}}, to_apply=%add
  %ard = f32[16]{0} all-reduce-done(%ars)
  %ags = (f32[4]{0}, f32[16]{0}) all-gather-start(%b), replica_groups={}, dimensions={0}
  %agd = f32[16]{0} all-gather-done(%ags)
  ROOT %cp = f32[16]{0} collective-permute(%agd), source_target_pairs={{0,1},{1,0}}
}
""".replace("KNOWN_TRIP", 'backend_config={"known_trip_count":{"n":"5"}}')


def test_collective_bytes_of_nested_loops_and_async_pairs():
    out = collective_bytes(HLO, 4)
    trips = 5 * 3  # outer: known_trip_count; inner: `i < 3` in its condition
    assert out["all_gather"] == trips * 3 / 4 * 64 + 3 / 4 * 64  # + the async f32[16]
    assert out["reduce_scatter"] == trips * 3 * 4  # (n-1) x the bf16[2] output
    assert out["all_reduce"] == 2 * 1 / 2 * 64  # groups of 2
    assert out["other"] == 64
    assert out["total"] == sum(out[k] for k in ("all_gather", "reduce_scatter", "all_reduce",
                                                "all_to_all", "other"))


# --- the command line on a 7B model and 64 simulated devices -------------------------------

@pytest.mark.slow
def test_measure_cli_7b_on_64_devices():
    # Stages 0 and 3 only (the two that answer "does it fit in 80 GB"); stages 1-2 add ~15 s.
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "zerojax", "measure", "--model", "7b",
                           "--devices", "64", "--stage", "0,3", "--memory", "80GB", "--json"],
                          capture_output=True, text=True, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    peak = {m["stage"]: m["peak_bytes"] for m in out["measurements"]}
    assert peak[0] > 80e9 > peak[3]
    # CPU seconds, not wall time: other processes on a shared machine must not fail this.
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 60, f"measure took {cpu:.0f} CPU s ({time.monotonic() - start:.0f} s wall)"


# --- optimizer offload: the state split by memory kind ---------------------------------------

@functools.cache
def engine_offloads() -> bool:
    """Whether the engine places an offloaded optimizer state in host memory (a shape check of
    the "test" preset; nothing compiled). Tests of offloaded runs switch on with it."""
    if "offload" not in zj.ZeroConfig.__dataclass_fields__:
        return False
    e, b = tiny(3, "bfloat16", offload="optimizer")
    state_bytes(e, b)  # learns the units
    # Read the placement directly, not through measurement.state_bytes, which the tests check.
    return e.host_mesh is not None and {x.sharding.mesh for x in jax.tree.leaves(
        e.abstract_state().master)} == {e.host_mesh}


needs_offload = pytest.mark.skipif("not engine_offloads()",
                                   reason="the engine keeps the optimizer state on the device")


@pytest.mark.parametrize("stage", [0, 3])
def test_state_without_offload_is_all_in_device_memory(stage):
    e, b = tiny(stage, "bfloat16")
    state = state_bytes(e, b)
    assert state["host"] == 0 and state["device"] == state["total"] > 0


@needs_offload
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_state_by_memory_kind_is_the_formula(stage, dtype):
    e, b = tiny(stage, dtype, offload="optimizer")
    state, psi = state_bytes(e, b), e.layout.num_params
    est = state_estimate(psi, 8, stage, dtype, offload="optimizer")
    # The master and Adam's moments (12Ψ/N) on the host; compute params and scalars stay.
    assert state["host"] == pytest.approx(est.host, abs=SCALARS) and est.host == 12 * psi / 8
    assert state["device"] == pytest.approx(est.total - est.grads, abs=SCALARS)
    assert state["params"] == est.params  # float32 stage 3 too: the device keeps a copy


@needs_offload
def test_offloaded_measurement_reads_each_peak_from_its_own_program():
    """The devices' program holds no host state, and the host's update holds its state once
    (in place) beside the bf16 gradient."""
    e, b = tiny(3, "bfloat16", offload="optimizer")
    m = measure(e, b)
    assert m.offload == "optimizer" and m.state["host"] > 0
    assert m.split == "measured" and m.device_peak_bytes == m.peak_bytes
    assert m.state["host"] < m.host_peak_bytes < 1.25 * m.state["host"]
    mem, _ = m.estimates()
    assert mem.host == 12 * m.num_params / 8


@pytest.mark.slow  # two engines' programs compiled (~7 CPU s)
@needs_offload
def test_twin_flows_share_moves_from_the_host_peak_to_the_devices():
    """Twin-Flow (half of the params on the devices): the host's update program holds only the
    host's share (its compiled peak below full offload's, still in place: under 1.25x its
    state), and the device peak is the devices' program's plus the share they keep (master,
    moments), which the program does not take."""
    full, b = tiny(3, "bfloat16", offload="optimizer")
    twin, _ = tiny(3, "bfloat16", offload="optimizer", offload_fraction=0.5)
    m0, m1 = measure(full, b), measure(twin, b)
    share = twin_flow_bytes(twin)
    assert share > 0 and m1.state["host"] + share == m0.state["host"]
    assert m1.device_peak_bytes == m0.device_peak_bytes + share
    assert m1.host_peak_bytes < m0.host_peak_bytes
    assert m1.state["host"] < m1.host_peak_bytes < 1.25 * m1.state["host"]
    # the formula's host bytes: half of full offload's (the engine's split is by leaves)
    assert m1.estimates()[0].host == m0.estimates()[0].host / 2


# --- the state of any optimizer, as its init allocates it ------------------------------------

@pytest.mark.parametrize("name", ["adamw", "lion", "adafactor", "muon", "lamb", "sgd"])
def test_engine_state_is_what_the_optimizers_init_allocates(name):
    """Per device at N = 8: the state leaves stored like the params are 1/8, the others (step
    counts, adafactor's unfactored placeholders, Muon's Newton–Schulz coefficients) whole."""
    from test_presets import expected_bytes

    from zerojax.analysis.measurement import optimizer_state_size
    from zerojax.app.presets import build

    model = GPT.from_preset("test")  # no leaf needs padding at N = 8
    e = zj.Engine(model, build(name, 1e-3, weight_decay=0.1), zj.make_mesh(data=8),
                  zj.ZeroConfig(stage=3, param_dtype="bfloat16"))
    state = state_bytes(e, {k: jax.ShapeDtypeStruct((8, model.cfg.seq_len), jnp.int32)
                            for k in ("inputs", "targets")})
    size = optimizer_state_size(e)
    params = jax.eval_shape(model.init, jax.random.key(0))
    assert size.total == expected_bytes(name, params)
    whole = size.scalars + {"adafactor": 2 * 4 * 17, "muon": 3 * 4}.get(name, 0)
    assert state["optimizer"] == (size.total - whole) / 8 + whole
    assert state["master"] == 4 * size.num_params / 8
