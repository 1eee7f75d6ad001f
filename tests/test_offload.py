"""ZeRO-Offload (`offload="optimizer"`): master and optimizer state in pinned host memory, the
update on the host, the same numbers as without offload."""

import re
import sys
import time
from pathlib import Path

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
    gpt_batch,
    sweep,
    tiny_gpt,
)
from test_precision import BATCH as SEED_BATCH
from test_state import BATCHES, Norm, assert_bitwise

import zerojax as zj
from zerojax.analysis.measurement import state_bytes
from zerojax.mesh import put_batch
from zerojax.models import SeedMLP

HOST, DEVICE = "pinned_host", "device"


def kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def assert_placement(state):
    """Master and optimizer state on the host; everything the device computes with on it."""
    assert kinds(state.master) == {HOST}
    assert kinds(state.opt_state) == {HOST}
    rest = (state.step, state.compute, state.loss_scale, state.rng, state.model_state)
    assert kinds(rest) == {DEVICE}


def learn_units(engine, batch):
    """What `engine.init(rng, batch)` learns (the units, so the state's layout), without
    compiling or running the init program: these tests only read the step's program."""
    state_bytes(engine, batch)


def offload_pair(model, optimizer, mesh, batches, **cfg):
    """The same run without and with offload: [(losses, grad norms, params, state)] * 2."""
    out = []
    for offload in (None, "optimizer"):
        eng = zj.Engine(model, optimizer, mesh, zj.ZeroConfig(offload=offload, **cfg))
        losses, params, state = engine_run(eng, batches)
        out.append((losses, engine_run.norms, params, state))
    return out


@pytest.mark.parametrize("stage", sweep([1, 2, 3], quick=[3]))
@pytest.mark.parametrize("n", sweep([1, 4], quick=[4]))
def test_offload_gives_the_same_numbers(stage, n):
    model = tiny_gpt()
    batches = [gpt_batch(model.cfg, 8, s) for s in range(20)]
    (l0, n0, p0, _), (l1, n1, p1, state) = offload_pair(
        model, adamw(), zj.make_mesh(data=n), batches, stage=stage, clip_norm=CLIP)
    np.testing.assert_array_equal(l1, l0)
    np.testing.assert_array_equal(n1, n0)
    assert_bitwise(p1, p0)
    assert_placement(state)
    assert kinds(p1) == {DEVICE}  # engine.params reads the host master into device memory


def test_offload_matches_single_device_optax():
    cfg = zj.ZeroConfig(stage=2, clip_norm=CLIP, offload="optimizer")
    check_parity(zj.Engine(tiny_gpt(), adamw(), zj.make_mesh(data=4), cfg))


def test_model_state_stays_on_device_and_evaluate_reads_it():
    mesh = zj.make_mesh(data=4)
    (l0, _, p0, s0), (l1, _, p1, s1) = offload_pair(
        Norm(zj.batch_axes(mesh)), optax.adam(1e-2, eps=1e-6), mesh, BATCHES[:5], stage=3)
    np.testing.assert_array_equal(l1, l0)
    assert_bitwise(p1, p0)
    assert_bitwise(s1.model_state, s0.model_state)
    assert int(s1.model_state["count"]) == 5
    assert_placement(s1)
    # float32 stage 3 computes on the master without offload; offloaded, it keeps a device copy.
    assert s0.compute is None and s1.compute is not None
    eng = zj.Engine(Norm(zj.batch_axes(mesh)), optax.adam(1e-2), mesh,
                    zj.ZeroConfig(stage=3, offload="optimizer"))
    learn_units(eng, BATCHES[0])
    assert_placement(eng.abstract_state())  # what AOT compilation and restore target
    ev = eng.evaluate(s1, BATCHES[5])
    ref = zj.Engine(Norm(zj.batch_axes(mesh)), optax.adam(1e-2), mesh, zj.ZeroConfig(stage=3))
    learn_units(ref, BATCHES[0])
    assert float(ev["loss"]) == float(ref.evaluate(s0, BATCHES[5])["loss"])


def test_update_is_compiled_for_the_host():
    eng = zj.Engine(tiny_gpt(), adamw(), zj.make_mesh(data=4),
                    zj.ZeroConfig(stage=3, offload="optimizer"))
    batch = gpt_batch(tiny_gpt().cfg, 8, 0)
    learn_units(eng, batch)
    text = eng.lower(None, put_batch(batch, eng.mesh)).as_text()
    assert '_xla_compute_type = "host"' in text
    assert 'mhlo.memory_kind = "pinned_host"' in text


@pytest.mark.parametrize("stage", sweep([1, 3], quick=[3]))
def test_fp16_skipped_steps_clip_accumulation_and_hybrid_mesh(stage):
    # SeedMLP's gradients overflow fp16 at a scale of 2**17: the first steps are skipped and
    # must leave the host's master and moments untouched, exactly as on the device.
    mesh = zj.make_mesh(data=2, replica=2)
    batch = jax.tree.map(lambda x: np.concatenate([x] * 4), SEED_BATCH)
    out = offload_pair(SeedMLP(), optax.adam(0.1, eps=1e-8), mesh, [batch] * 8, stage=stage,
                       param_dtype="float16", loss_scale_init=2.0**17, clip_norm=5.0,
                       grad_accum=2)
    (l0, n0, p0, s0), (l1, n1, p1, s1) = out
    skipped = int((~np.isfinite(n1)).sum())
    assert 0 < skipped < 8 and np.isfinite(n1[skipped:]).all()  # skipped first, then trains
    np.testing.assert_array_equal(l1, l0)
    np.testing.assert_array_equal(n1, n0)
    assert_bitwise(p1, p0)
    assert_bitwise(jax.device_get(s1.opt_state), jax.device_get(s0.opt_state))
    assert float(s1.loss_scale.scale) == float(s0.loss_scale.scale) < 2.0**17
    assert_placement(s1)


def test_checkpoints_cross_offload_and_device_counts(tmp_path):
    model = tiny_gpt()
    batches = [gpt_batch(model.cfg, 8, s) for s in range(3)]

    def engine(n, stage, offload):
        return zj.Engine(model, adamw(), zj.make_mesh(data=n),
                         zj.ZeroConfig(stage=stage, clip_norm=CLIP, offload=offload))

    on = engine(4, 3, "optimizer")
    _, params, state = engine_run(on, batches[:2])
    on.save(state, tmp_path / "on")

    off = engine(2, 1, None)  # offload on -> off, N 4 -> 2
    restored = off.restore(tmp_path / "on")
    assert kinds((restored.master, restored.opt_state)) == {DEVICE}
    assert_bitwise(off.params(restored), params)
    state, m_on = on.step(state, batches[2])
    restored, m_off = off.step(restored, batches[2])
    np.testing.assert_allclose(float(m_off["loss"]), float(m_on["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m_off["grad_norm"]), float(m_on["grad_norm"]), rtol=1e-5)
    assert_tree_close(off.params(restored), on.params(state), rtol=1e-5, atol=1e-6)
    off.save(restored, tmp_path / "off")

    back = engine(1, 2, "optimizer")  # offload off -> on, N 2 -> 1
    again = back.restore(tmp_path / "off")
    assert_placement(again)
    assert_bitwise(back.params(again), off.params(restored))
    assert int(again.step) == 3
    again, m = back.step(again, batches[0])
    assert np.isfinite(float(m["loss"]))


@pytest.mark.parametrize("cfg, match", [
    ({"stage": 0, "offload": "optimizer"}, "offload='optimizer' needs stage 1, 2 or 3"),
    ({"stage": 2, "offload": "cpu"}, r"offload='cpu' is not an offload mode; use one of "
                                     r"\('optimizer',\) or None"),
])
def test_bad_offload_is_one_config_error(cfg, match):
    with pytest.raises(zj.ConfigError, match=match):
        zj.ZeroConfig(**cfg)


def _transfers(jaxpr, out):
    """The avals of every `device_put` into device memory of a value in host memory, in
    `jaxpr` and the jaxprs inside it (shard_map, jit, scan bodies)."""
    for eqn in jaxpr.eqns:
        if eqn.ctx.compute_type == "device_host":
            continue  # a host computation: its values are typed device memory, not moved
        if eqn.primitive.name == "device_put" and \
                tuple(eqn.params["devices"]) == (jax.memory.Space.Device,):
            out += [v.aval for v in eqn.invars
                    if getattr(v.aval, "memory_space", None) == jax.memory.Space.Host]
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _transfers(inner, out)
    return out


@pytest.mark.parametrize("stage, dtype", [(3, "bfloat16"), (1, "float16")])
def test_the_updated_shard_comes_back_in_the_compute_dtype(stage, dtype):
    """What the host sends back each step is the compute-dtype shard (2 bytes a parameter), not
    the fp32 master cast on the device (twice the traffic, the same numbers)."""
    eng = zj.Engine(tiny_gpt(), adamw(), zj.make_mesh(data=4),
                    zj.ZeroConfig(stage=stage, param_dtype=dtype, offload="optimizer"))
    batch = gpt_batch(tiny_gpt().cfg, 8, 0)
    learn_units(eng, batch)
    jaxpr = jax.make_jaxpr(eng._compiled_step())(eng.abstract_state(), put_batch(batch, eng.mesh))
    back = _transfers(jaxpr.jaxpr, [])
    assert {a.dtype.name for a in back} == {dtype}
    layout = eng.layout  # one shard per leaf: [k] or [L, k] per device
    assert sorted(a.size for a in back) == sorted(
        layout.shard_size(leaf) * (leaf.shape[0] if leaf.stacked else 1)
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
    (path,) = dump.glob("*jit_local_step*after_optimizations-buffer-assignment.txt")
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


@pytest.mark.parametrize("donate", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_the_host_update_runs_in_place(tmp_path, monkeypatch, donate):
    """The master and moments are donated, and the host update writes their new values into
    the same buffers: every host-state argument aliases its output, no copy of one is made,
    and XLA's buffer assignment holds the update's result in the argument's own buffer (so the
    host never holds a second master or moment). Without donation each check fails."""
    if not donate:
        jit = jax.jit
        monkeypatch.setattr(jax, "jit", lambda f, donate_argnums=(), **kw: jit(f, **kw))
    # A learning rate no earlier compile shares: XLA writes the dump only when it compiles the
    # step, not when the step is loaded from a persistent compilation cache.
    lr = 1e-3 * (1 + (time.time_ns() % 997) * 1e-6)
    eng = zj.Engine(Flat(1 << 12), optax.adamw(lr, weight_decay=0.1), zj.make_mesh(data=2),
                    zj.ZeroConfig(stage=3, param_dtype="bfloat16", offload="optimizer"))
    batch = {"x": np.ones((4, 8), np.float32)}
    learn_units(eng, batch)
    low = eng.lower(None, put_batch(batch, eng.mesh))
    compiled = low.compile({"xla_dump_to": str(tmp_path), **DEFAULT_BUFFERS})
    alias, params = _entry(compiled.as_text())
    host = {i for i, p in enumerate(params) if ":S(5)" in p}
    assert len(host) == len(jax.tree.leaves((eng.abstract_state().master,
                                             eng.abstract_state().opt_state)))
    names = re.findall(r"ENTRY %\S+ \((.*?)\) ->", compiled.as_text())[0]
    copied = [n for n in re.findall(r"(\S+): ", names)
              if re.search(rf" copy\(%{re.escape(n)}\)", compiled.as_text())]
    in_place = _allocations(tmp_path)
    big = {i for i in host if "[" in params[i] and "[]" not in params[i]}  # master, mu, nu
    assert len(big) == 3
    if donate:
        assert all(alias.get(i) == i for i in host)  # state output i is argument i's buffer
        assert not copied
        assert all(len(in_place[i]) == 2 for i in big), in_place  # the argument, its update
    else:
        assert not alias and all(len(in_place.get(i, [])) < 2 for i in big)


def test_a_units_gradient_can_go_to_the_host_inside_the_backward():
    """experiments/grads_to_host.py: host-memory stand-ins moved to the device per unit send
    each unit's reduced shard to the host right after its reduce-scatter, inside the backward
    loop, with plain jax's numbers (the mechanism for gradients leaving the device as they
    are produced; not yet the step's, see docs/performance.md)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import grads_to_host

    grads_to_host.main()
