"""The offloaded AdamW update as one fused pass (zerojax/offload/fused.py): optax.adamw's numbers,
in place, with every feature of the offloaded step; and optax's own program where it cannot
run."""

import math
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    CLIP,
    DEFAULT_BUFFERS,
    LR,
    WD,
    assert_tree_close,
    check_parity,
    gpt_batch,
    tiny_gpt,
)
from test_offload import Flat, _allocations, _entry, learn_units, runs
from test_precision import BATCH as SEED_BATCH
from test_state import assert_bitwise
from test_twin_flow import run as run_saving

import zerojax as zj
from zerojax.models import SeedMLP
from zerojax.offload import fused as fused_mod
from zerojax.offload.fused import FusedAdamW, spec_of
from zerojax.update import StepUpdate, step_update


def _ulps(a, b):
    """Per element, how many representable values apart two float arrays of one dtype are."""
    a, b = np.asarray(a), np.asarray(b)
    bits = {4: np.int32, 2: np.int16}[a.dtype.itemsize]
    order = lambda x: (lambda i: np.where(i < 0, np.iinfo(bits).min - i, i))(
        x.view(bits).astype(np.int64))
    return np.abs(order(a) - order(b))


# "w" is several of the pass's blocks (16 k elements at least), which the pool's threads claim
PARAMS = {"w": (600, 100), "b": (100,), "e": (50, 13)}


def _state(optimizer, gdtype, count=3):
    """Random master, moments of a few steps and a gradient of `gdtype`, as logical trees."""
    keys = iter(jax.random.split(jax.random.key(0), 16))
    rand = lambda shape, scale=1.0, dtype=jnp.float32: (
        jax.random.normal(next(keys), shape) * scale).astype(dtype)
    master = {k: rand(s) for k, s in PARAMS.items()}
    adam, *rest = optimizer.init(master)
    adam = adam._replace(count=jnp.int32(count),
                         mu={k: rand(s, 1e-2) for k, s in PARAMS.items()},
                         nu={k: jnp.abs(rand(s, 1e-4)) for k, s in PARAMS.items()})
    rest = [r._replace(count=jnp.int32(count)) if isinstance(r, optax.ScaleByScheduleState)
            else r for r in rest]
    grads = {k: rand(s, 1e-2, gdtype) for k, s in PARAMS.items()}
    return master, (adam, *rest), grads


def _fused(optimizer, how):
    """The fused update of a zerojax.adamw over `PARAMS`, as the host program runs it."""
    assert fused_mod.kernel() == (True, "")  # g++ is on this machine
    logical = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in PARAMS.items()}
    update = types.SimpleNamespace(how=how, logical_params=logical, state_def=jax.tree.structure(
        jax.eval_shape(optimizer.init, logical)))
    return FusedAdamW(spec_of(optimizer), update)


@pytest.mark.parametrize("gdtype, out", [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32),
                                         (jnp.float32, jnp.bfloat16), (jnp.float16, jnp.float16)])
def test_the_fused_pass_gives_optax_adamws_update(gdtype, out):
    """Against the step's update of the same optax.adamw (`update.step_update`, a program
    XLA compiles) on a random state at count 3, with a clipped gradient (its scale), a
    schedule, a weight-decay mask and eps_root: moments within one unit in the last place on
    under 1 % of the elements (bitwise today), the master within one unit in the last place
    plus 1e-6 of how far it moved (the pass multiplies by the bias corrections' reciprocals,
    as XLA rewrites the engine's program; this program XLA left dividing: a rounding of the
    step apart), and the compute shard exactly the new master in the compute dtype (as XLA
    converts). A skipped step (a flag of 0) changes nothing and still writes the compute
    shard. Negative control: a weight decay off by half."""
    schedule = optax.linear_schedule(1e-3, 1e-4, 10)
    mask = lambda p: {"w": True, "b": False, "e": True}
    how = StepUpdate(clip_norm=0.5, out_dtype=out, extra=False)

    def both(optimizer, finite):
        master, opt, grads = _state(optimizer, gdtype)
        reduced = (grads, jnp.float32(3.0), jnp.float32(2.0), finite, jnp.float32(0))
        ref = jax.jit(lambda r, o, m: step_update(optimizer, how, r, o, m))(reduced, opt, master)
        run = _fused(optimizer, how)
        mine = jax.jit(lambda r, o, m: run(r, o, m))(reduced, opt, master)
        return ref, mine, (master, opt)

    tx = zj.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, eps_root=1e-12, weight_decay=0.1,
                  mask=mask)
    (ref_m, ref_o, ref_s), (m, o, s), (before, _) = both(tx, None)
    d = [_ulps(a, b) for a, b in zip(jax.tree.leaves((ref_o[0].mu, ref_o[0].nu)),
                                      jax.tree.leaves((o[0].mu, o[0].nu)))]
    assert max(int(x.max()) for x in d) <= 1
    assert sum(int(np.count_nonzero(x)) for x in d) / sum(x.size for x in d) < 0.01
    for k in PARAMS:
        ref, mine = np.asarray(ref_m[k]), np.asarray(m[k])
        moved = np.abs(ref - np.asarray(before[k])).max()
        assert moved > 1e-5, k  # it moved
        assert (np.abs(mine - ref) <= np.spacing(np.abs(ref)) + 1e-6 * moved).all(), k
    for k, shard in zip(sorted(PARAMS), s):
        np.testing.assert_array_equal(np.asarray(shard), np.asarray(m[k].astype(out)))
    assert [x.dtype for x in s] == [jnp.dtype(out)] * 3
    assert int(o[0].count) == int(ref_o[0].count) == 4
    assert int(o[2].count) == int(ref_o[2].count) == 4  # the schedule's

    # a skipped step: nothing moves, the counts stay, the shard is the master's
    (_, _, ref_s), (m, o, s), (master, opt) = both(tx, jnp.bool_(False))
    for a, b in zip(jax.tree.leaves((m, o)), jax.tree.leaves((master, opt))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(s, ref_s):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # negative control: the fused pass of a decay off by half, against the right one
    half = zj.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, eps_root=1e-12, weight_decay=0.05,
                    mask=mask)
    master, opt, grads = _state(half, gdtype)
    reduced = (grads, jnp.float32(3.0), jnp.float32(2.0), None, jnp.float32(0))
    wrong = jax.jit(lambda r, o, p: _fused(half, how)(r, o, p))(reduced, opt, master)[0]
    ref, moved = np.asarray(ref_m["w"]), np.abs(np.asarray(ref_m["w"]) - master["w"]).max()
    off = np.abs(np.asarray(wrong["w"]) - ref) > np.spacing(np.abs(ref)) + 1e-6 * moved
    assert off.mean() > 0.5  # the bound the right pass meets, missed on most elements


def test_only_zerojax_adamw_is_fused():
    """zerojax.adamw is optax.adamw (the same state, the same update without offload); an
    optimizer wrapped around it, or optax.adamw itself, is not recognized."""
    tx = zj.adamw(1e-3, weight_decay=0.1)
    assert spec_of(tx).weight_decay == 0.1
    assert spec_of(optax.adamw(1e-3)) is None and spec_of(optax.MultiSteps(tx, 2)) is None
    assert spec_of(optax.chain(tx)) is None and spec_of(None) is None
    params = {"w": jnp.arange(6.0).reshape(2, 3)}
    g = {"w": jnp.ones((2, 3))}
    a = tx.update(g, tx.init(params), params)[0]
    b = optax.adamw(1e-3, weight_decay=0.1).update(g, tx.init(params), params)[0]
    np.testing.assert_array_equal(a["w"], b["w"])
    with pytest.raises(TypeError, match="b1 must be a float"):
        zj.adamw(1e-3, b1=jnp.asarray(0.9))
    # values optax takes as given and turns into NaN params: one line each
    for args, kw, match in (((1e-3,), {"weight_decay": float("nan")},
                             r"weight_decay=nan must be a finite number"),
                            ((1e-3,), {"eps": float("inf")}, r"eps=inf must be a finite"),
                            ((1e-3,), {"b2": 1.0}, r"b2=1.0 must be in \[0, 1\)"),
                            ((float("nan"),), {}, r"learning_rate=nan must be a finite")):
        with pytest.raises(zj.ConfigError, match=match) as e:
            zj.adamw(*args, **kw)
        assert "\n" not in str(e.value)
    assert spec_of(zj.adamw(1e-3, b1=np.float32(0.9))).b1 == float(np.float32(0.9))


def test_offload_with_the_fused_update_matches_single_device_optax():
    """The test GPT at stage 3 on 4 devices with clipping, each unit's gradient sent to the host
    in the backward: single-device optax.adamw's numbers (`check_parity`'s tolerances)."""
    eng = zj.Engine(tiny_gpt(), zj.adamw(LR, weight_decay=WD, eps=1e-6), zj.make_mesh(data=4),
                    zj.ZeroConfig(stage=3, clip_norm=CLIP, offload="optimizer"))
    check_parity(eng)
    assert eng.host_update == "fused" and "zerojax_adamw" in eng.lower_host_update().as_text()


@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_fused_fp16_skipped_steps_clip_accumulation_and_hybrid_mesh(stage):
    """fp16 loss scaling skips the first steps (their update leaves the host's master and
    moments untouched, its counts too), clipping, grad_accum=2, replica 2 × data 2: the fused
    run against the same run with optax.adamw's program on the host, to the last bits (as
    offload against no offload, test_offload.py)."""
    mesh = zj.make_mesh(data=2, replica=2)
    batch = jax.tree.map(lambda x: np.concatenate([x] * 4), SEED_BATCH)
    cfg = dict(stage=stage, param_dtype="float16", loss_scale_init=2.0**17, clip_norm=5.0,
               grad_accum=2, offload="optimizer")
    (l0, n0, p0, s0), (l1, n1, p1, s1) = runs(
        [zj.Engine(SeedMLP(), tx, mesh, zj.ZeroConfig(**cfg))
         for tx in (optax.adamw(0.1, weight_decay=0.01), zj.adamw(0.1, weight_decay=0.01))],
        [batch] * 8)
    assert [e.host_update for e in runs.engines] == [
        "xla: the optimizer is not zerojax.adamw", "fused"]
    skipped = int((~np.isfinite(n1)).sum())
    assert 0 < skipped < 8 and np.array_equal(np.isfinite(n1), np.isfinite(n0))
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    assert_tree_close(p1, p0, rtol=1e-6, atol=1e-7)
    assert_tree_close(jax.device_get(s1.opt_state), jax.device_get(s0.opt_state), rtol=1e-6,
                      atol=1e-7)
    assert int(s1.opt_state[0].count) == int(s0.opt_state[0].count) == 8 - skipped


@pytest.mark.slow
def test_fused_delayed_update_with_a_schedule_and_a_mask():
    """delayed_update=2 at stage 2 on 4 devices with a warm-up schedule and the GPT's decay
    mask (the CLI's adamw): the fused run gives the run with optax.adamw's program."""
    from zerojax.app.presets import by_leaf, gpt_decay

    schedule = optax.linear_schedule(0.0, 3e-3, 4)
    batches = [gpt_batch(tiny_gpt().cfg, 8, s) for s in range(8)]
    (l0, _, p0, _), (l1, _, p1, _) = offload_pair_of(
        lambda mk: mk(schedule, eps=1e-6, weight_decay=0.1, mask=by_leaf(gpt_decay)), batches,
        stage=2, delayed_update=2)  # eps: helpers.adamw says why
    assert runs.engines[1].host_update == "fused"
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    assert_tree_close(p1, p0, rtol=1e-6, atol=1e-7)


def offload_pair_of(make, batches, **cfg):
    """Offloaded runs of the test GPT on 4 devices with `make(optax.adamw)` and
    `make(zerojax.adamw)`."""
    return runs([zj.Engine(tiny_gpt(), make(mk), zj.make_mesh(data=4),
                           zj.ZeroConfig(offload="optimizer", **cfg))
                 for mk in (optax.adamw, zj.adamw)], batches)


def test_the_fused_update_runs_in_place(tmp_path):
    """The host's compiled update aliases every host-state argument and the gradient to its
    outputs (the gradient to the compute shards), copies none of master, moments and gradient,
    and each of their buffers holds the argument and the custom call's result: the pass
    reads and writes them in place."""
    eng = zj.Engine(Flat(1 << 12), zj.adamw(1.3e-3, weight_decay=0.1), zj.make_mesh(data=2),
                    zj.ZeroConfig(stage=3, param_dtype="bfloat16", offload="optimizer",
                                  delayed_update=1))
    learn_units(eng, {"x": np.ones((4, 8), np.float32)})
    assert eng.host_update == "fused"
    low = eng.lower_host_update()
    compiled = low.compile({"xla_dump_to": str(tmp_path), **DEFAULT_BUFFERS})
    text = compiled.as_text()
    alias, params = _entry(text)
    scalars = len(jax.tree.leaves(low.args_info[0][0]))
    host, grads = set(range(scalars, len(params) - 1)), len(params) - 1
    assert set(alias.values()) == host | {grads} and alias[max(alias)] == grads
    big = {i for i in host | {grads} if "[" in params[i] and "[]" not in params[i]}
    assert len(big) == 4  # master, mu, nu, gradient
    names = re.findall(r"(\S+): ", re.findall(r"ENTRY %\S+ \((.*?)\) ->", text)[0])
    assert not [n for i, n in enumerate(names) if i in big and f" copy(%{n})" in text]
    in_place = _allocations(tmp_path)
    assert all(len(in_place[i]) == 2 and in_place[i][1].startswith("ffi_call") for i in big)
    assert "custom_call_target=\"zerojax_adamw\"" in text


def test_where_the_pass_cannot_run_the_update_is_optaxs_program(monkeypatch, tmp_path):
    """No compiler (or a failed build): the engine runs optax's program and says why, with
    Twin-Flow too. A build with a missing or failing compiler reports it and leaves nothing
    behind in the cache."""
    assert fused_mod.build("zerojax-no-such-cxx")[1].startswith("no C++ compiler")
    monkeypatch.setenv("ZEROJAX_CACHE", str(tmp_path))
    lib, why = fused_mod.build("false")
    assert lib is None and why.startswith("false could not build")
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(fused_mod, "kernel", lambda: (False, "no C++ compiler (g++) on PATH"))
    for cfg in ({}, {"offload_fraction": 0.5}):
        eng = zj.Engine(SeedMLP(), zj.adamw(1e-3), zj.make_mesh(data=2),
                        zj.ZeroConfig(stage=3, offload="optimizer", **cfg))
        learn_units(eng, SEED_BATCH)
        assert eng.host_update == "xla: no C++ compiler (g++) on PATH"
        text = eng.lower_host_update().as_text()
        assert "zerojax_adamw" not in text and "stablehlo.sqrt" in text
    assert zj.Engine(SeedMLP(), zj.adamw(1e-3), zj.make_mesh(data=2)).host_update is None
    monkeypatch.undo()  # the compiler back


def test_the_mask_is_read_as_optax_reads_it():
    """A mask function gets traced params, as optax.masked gives it (not ShapeDtypeStructs,
    which have no methods): one that reshapes them is read, leaf by leaf."""
    def by_size(params):
        return jax.tree.map(lambda p: p.reshape(-1).shape[0] > 1, params)

    eng = zj.Engine(SeedMLP(), zj.adamw(1e-3, mask=by_size), zj.make_mesh(data=2),
                    zj.ZeroConfig(stage=3, offload="optimizer"))
    learn_units(eng, SEED_BATCH)
    assert eng.host_update == "fused"
    sizes = [math.prod(leaf.shape) for leaf in eng.layout.leaves]
    assert eng._offload.fused()[0].decay == [n > 1 for n in sizes] and min(sizes) <= 1 < max(sizes)


def test_sending_runs_in_turn_and_sends_each_ones_results_as_it_ends():
    """`side_by_side.Sending`: each call's results go to `send` on a thread of its own while the
    next call runs. A handshake proves it: call k + 1 starts only once send k has started, and send
    k returns only once call k + 1 has started; in turn on one thread, it would wait for
    ever (10 s here). The results come back in order."""
    import threading

    from zerojax.offload.side_by_side import Sending

    n = 3
    ran, sending = [threading.Event() for _ in range(n)], [threading.Event() for _ in range(n)]
    main = threading.current_thread()

    def call(k):
        if k:
            assert sending[k - 1].wait(10), f"call {k} ran before send {k - 1} began"
        ran[k].set()
        return ("out", k)

    def send(k, out):
        sending[k].set()
        assert threading.current_thread() is not main and out == ("out", k)
        if k + 1 < n:
            assert ran[k + 1].wait(10), f"send {k} held call {k + 1} back"
        return ("sent", k)

    out, sent = Sending()([(call, (k,), k) for k in range(n)], send)
    assert out == [("out", k) for k in range(n)] and sent == [("sent", k) for k in range(n)]


@pytest.mark.parametrize("gpt, stage, fraction", [
    (False, 3, 1.0), pytest.param(True, 1, 1.0, marks=pytest.mark.slow),
    pytest.param(True, 3, 0.5, marks=pytest.mark.slow)])
def test_on_a_host_mesh_apart_the_fused_update_sends_its_runs_shards_as_each_ends(
        monkeypatch, tmp_path, gpt, stage, fraction):
    """As on a GPU's host (CPU devices 4-7 stand in for its CPU beside a mesh on 0-3), with
    `runs` 4 (`side_by_side.RUNS`, 1 by default): a step's fused update runs in parts, the largest
    first, and each part's compute shards are put on the devices' mesh on the sending thread
    as it ends; the step's own move up then moves none. With an ordinary step, delayed ones
    (the update on a thread of its own beside the devices' program), clipping and a save in
    the delayed phase restored halfway: the numbers of the one fused program on the mesh
    itself, bitwise. The seed's MLP (its three leaves in two parts), the test GPT (stacked
    leaves, stage 1's gathers) and Twin-Flow (the devices' share updated first, on the
    devices, and never sent)."""
    import threading

    from jax.sharding import Mesh

    import zerojax.offload.host as host
    from zerojax.offload import moves, side_by_side
    from zerojax.update import parts

    devices = jax.devices()
    mesh = zj.make_mesh(data=4, devices=devices[:4])
    cfg = zj.ZeroConfig(stage=stage, clip_norm=CLIP, offload="optimizer", delayed_update=2,
                        offload_fraction=fraction)
    model = tiny_gpt() if gpt else SeedMLP()
    batches = [gpt_batch(model.cfg, 8, s) if gpt else jax.tree.map(
        lambda x, s=s: np.concatenate([x * (1 + s / 4)] * 4), SEED_BATCH) for s in range(4)]
    params = model.init(jax.random.key(0))
    same = zj.Engine(model, zj.adamw(LR, weight_decay=WD, eps=1e-6), mesh, cfg)
    l0, s0 = run_saving(same, batches, params)
    monkeypatch.setattr(parts, "LEAST", 0)  # the test GPT's 0.1 M params in several parts
    monkeypatch.setattr(host, "host_mesh", lambda m: Mesh(np.array(devices[4:8]).reshape(
        m.devices.shape), m.axis_names, axis_types=m.axis_types))
    eng = zj.Engine(model, zj.adamw(LR, weight_decay=WD, eps=1e-6), mesh, cfg)
    assert eng._offload.runs == side_by_side.RUNS == 1  # off by default: in one part, sent after
    eng._offload.runs = 4
    ups, runs_of, real, stepping, step = [], [], moves.across, [False], eng._offload.step

    def stepped(state, batch):
        stepping[0] = True
        try:
            return step(state, batch)
        finally:
            stepping[0] = False

    def across(xs, shardings, twin, by_shard):  # a step's moves up: on which thread, how many
        if stepping[0] and twin is eng._offload._twins[1]:
            ups.append((threading.current_thread().name.startswith("zerojax-send"), len(xs)))
        return real(xs, shardings, twin, by_shard)

    monkeypatch.setattr(moves, "across", across)
    sending = type(eng._offload._sending).__call__

    def spied(self, calls, send):
        runs_of.append([sum(math.prod(x.shape) for x in args[2]) for _, args, _ in calls])
        return sending(self, calls, send)

    monkeypatch.setattr(type(eng._offload._sending), "__call__", spied)
    monkeypatch.setattr(eng._offload, "step", stepped)
    l1, s1 = run_saving(eng, batches, params, tmp_path / "ckpt")
    assert eng.host_update == "fused" and len(runs_of) == 4  # a step's update each
    # in parts, the largest first
    assert all(len(r) > 1 and r == sorted(r, reverse=True) for r in runs_of), runs_of
    leaves = len(jax.tree.leaves(params)) - len(eng._offload.on_devices("master"))
    assert leaves > 0 and (fraction == 1) == (leaves == len(jax.tree.leaves(params)))
    sent = [n for on_send, n in ups if on_send]
    assert len(sent) == 4 * len(runs_of[0]) and sum(sent) == 4 * leaves
    assert not [n for on_send, n in ups if not on_send and n]  # the step's own: nothing left
    p1 = eng.params(s1)
    assert {x.sharding.mesh for x in jax.tree.leaves(p1)} == {mesh}
    np.testing.assert_array_equal(l1, l0)
    assert_bitwise(p1, same.params(s0))
    assert_bitwise(jax.device_get(eng.optimizer_state(s1)),
                   jax.device_get(same.optimizer_state(s0)))
