"""What an optimizer adds to the step, read off the programs: nothing for elementwise ones,
one scalar all-reduce for a global-norm clip, small all-reduces for per-leaf norms, and
Muon's Newton–Schulz split over the owners (FLOPs per device ~ total/N, ⌈M/N⌉ matrices each).
"""

import collections
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import reference_run, sweep
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax.analysis.measurement import lower
from zerojax.models import GPT
from zerojax.units import PlainUnits

N = 4
_COLLECTIVE = re.compile(r"=\s*(\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all)"
                         r"(?:-start)?\(")


@functools.cache
def _lowered(name, stage, dtype="float32"):
    """(engine, its step lowered): one lowering per optimizer, stage and dtype, shared by the
    collective counts and the compiled measurement."""
    engine, batch = gpt_engine(OPTS[name](), stage, dtype=dtype)
    return engine, lower(engine, batch)


@functools.cache
def _collectives(name, stage, dtype="float32") -> collections.Counter:
    return count(_lowered(name, stage, dtype)[1])


OPTS = {"sgd": lambda: optax.sgd(0.1), "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
        "lion": lambda: optax.lion(1e-4), "sgd+momentum": lambda: optax.sgd(0.1, momentum=0.9),
        "clip+adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                          optax.adamw(1e-3, weight_decay=0.1)),
        "lamb": lambda: optax.lamb(1e-3), "lars": lambda: optax.lars(1e-3),
        "fromage": lambda: optax.fromage(1e-3)}


def count(lowered) -> collections.Counter:
    """(kind, result type) of every collective in a lowered step's pre-optimization HLO."""
    hlo = lowered.compiler_ir("hlo").as_hlo_text()
    return collections.Counter((kind, re.sub(r"\{[^}]*\}", "", typ))
                               for typ, kind in _COLLECTIVE.findall(hlo))


def gpt_engine(optimizer, stage, n=N, dtype="float32"):
    model = GPT.from_preset("test")
    b = jax.ShapeDtypeStruct((2 * n, model.cfg.seq_len), jnp.int32)
    cfg = zj.ZeroConfig(stage=stage, param_dtype=dtype)
    return zj.Engine(model, optimizer, zj.make_mesh(data=n), cfg), {"inputs": b, "targets": b}


def added(name, stage, base="sgd", dtype="float32"):
    """The collectives optimizer `name` adds to the step of `base` (and those it drops)."""
    got, ref = _collectives(name, stage, dtype), _collectives(base, stage, dtype)
    return got - ref, ref - got


@pytest.mark.parametrize("stage", sweep([1, 3], quick=[3]))
def test_elementwise_optimizers_add_no_collective(stage):
    for name in ("adamw", "lion", "sgd+momentum"):
        assert added(name, stage) == (collections.Counter(), collections.Counter()), name


@pytest.mark.parametrize("stage", sweep([0, 1, 3], quick=[0, 3]))
def test_global_norm_clip_adds_one_scalar_all_reduce(stage):
    more, fewer = added("clip+adamw", stage, base="adamw")
    assert not fewer
    # Stage 0 holds whole leaves on every device: the norm is local, nothing is added.
    assert more == (collections.Counter() if stage == 0 else
                    collections.Counter({("all-reduce", "f32[]"): 1}))


@pytest.mark.parametrize("dtype", sweep(["float32", "bfloat16", "float16"],
                                        quick=["bfloat16"]))
def test_lamb_adds_small_all_reduces_of_two_norms_per_leaf(dtype):
    """lamb needs each leaf's param norm and update norm: one all-reduce of both for every
    leaf at once; optax's safe_norm then takes each norm again where it is not zero (a second
    read of the same data, so a second all-reduce of the same size). No leaf is gathered, and
    none goes to an owner: in bf16 and fp16 (loss-scaled), `jnp.where` traced under the step's
    mesh adds `reshard` annotations, which move no value (they once sent every update to
    owners, an all-to-all of the whole gradient that doubled LAMB's stage-3 peak)."""
    more, fewer = added("lamb", 3, base="adamw", dtype=dtype)
    leaves = len(jax.tree.leaves(jax.eval_shape(GPT.from_preset("test").init,
                                                jax.random.key(0))))
    assert not fewer and more == collections.Counter({("all-reduce", f"f32[{2 * leaves}]"): 2})


def test_trust_ratio_optimizers_in_bf16_keep_adamws_stage3_peak():
    """LARS and Fromage take per-leaf norms like LAMB: in bf16 at stage 3 they add all-reduces
    only (no all-to-all), and their compiled peak is AdamW's (the state differs by Fromage's
    and LARS's smaller moments only)."""
    from zerojax.analysis.measurement import measure_lowered

    for name in ("lars", "fromage"):
        more, _ = added(name, 3, base="sgd", dtype="bfloat16")
        assert {kind for kind, _ in more} == {"all-reduce"}, (name, more)
    peaks = {}
    for name in ("adamw", "lamb"):  # lowered already where the lamb test counted collectives
        m = measure_lowered(*_lowered(name, 3, "bfloat16"))
        peaks[name] = m.peak_bytes - m.state["total"]
    assert peaks["lamb"] <= 1.01 * peaks["adamw"], peaks


# ---------------------------------------------------------------------------------------------
# Muon: each matrix orthogonalized on one owner


M, D = 8, 48  # eight equal matrices, one per layer of a Python loop (separate leaves)


class Matrices:
    def init(self, rng):
        ks = jax.random.split(rng, M)
        return {f"w{i}": jax.random.normal(k, (D, D)) / np.sqrt(D) for i, k in enumerate(ks)}

    def loss(self, params, batch, units):
        h = batch["x"]
        for i in range(M):
            h = jnp.tanh(h @ units.gather(params[f"w{i}"]))
        return jnp.mean((h - batch["y"]) ** 2)


def muon(ns_steps):
    return optax.contrib.muon(1e-2, ns_steps=ns_steps)


def _flops(lowered) -> float:
    return lowered.cost_analysis()["flops"]  # of the program XLA compiles


@functools.cache  # muon_step(5) is read twice: its FLOPs and its collectives
def muon_step(ns_steps, owners=True):
    model = Matrices()
    b = {"x": jax.ShapeDtypeStruct((2 * N, D), jnp.float32),
         "y": jax.ShapeDtypeStruct((2 * N, D), jnp.float32)}
    engine = zj.Engine(model, muon(ns_steps), zj.make_mesh(data=N), zj.ZeroConfig(stage=1),
                       owners=owners)
    return lower(engine, b)


def single_device_update_flops(ns_steps) -> float:
    params = jax.eval_shape(Matrices().init, jax.random.key(0))
    tx = muon(ns_steps)
    fn = jax.jit(lambda g, s, p: tx.update(g, s, p))
    return _flops(fn.lower(params, jax.eval_shape(tx.init, params), params))


def test_muon_newton_schulz_is_split_over_the_owners():
    total = single_device_update_flops(5) - single_device_update_flops(0)
    per_device = _flops(muon_step(5)) - _flops(muon_step(0))
    replicated = _flops(muon_step(5, owners=False)) - _flops(muon_step(0, owners=False))
    assert total > 0
    assert per_device <= 1.25 * total / N, (per_device, total)
    assert replicated >= 0.9 * total  # the measurement sees the work where it is repeated
    # One exchange in and one out, each holding ⌈M/N⌉ matrices per owner; nothing gathers a
    # matrix whole on every device.
    hlo = muon_step(5).compiler_ir("hlo").as_hlo_text()
    found = collections.Counter((kind, typ) for typ, kind in _COLLECTIVE.findall(hlo))
    k = math.ceil(D * D / N)  # one device's part of one matrix
    a2a = [typ for kind, typ in found.elements() if kind == "all-to-all"]
    sizes = [math.prod(int(d) for d in re.search(r"\[([\d,]*)\]", t).group(1).split(","))
             for t in a2a]
    assert sizes == [N * math.ceil(M / N) * k] * 2, a2a


class Embedded:
    """An embedding [2D, D] and a head [D, 3D/2], shapes no other leaf has (owner groups of
    one), around a scanned stack of 24 [D, D] layers (one instance per layer)."""

    D, L = 16, 24

    def init(self, rng):
        k = jax.random.split(rng, 3)
        D = self.D
        return {"tok": jax.random.normal(k[0], (2 * D, D)),
                "head": jax.random.normal(k[1], (D, 3 * D // 2)),
                "stack": jax.random.normal(k[2], (self.L, D, D)) / np.sqrt(D)}

    def loss(self, params, batch, units):
        p = units.gather({"tok": params["tok"], "head": params["head"]})
        h = units.scan(lambda h, w: jnp.tanh(h @ w), p["tok"][batch["x"]], params["stack"])
        return jnp.mean((h @ p["head"] - batch["y"]) ** 2)


def embedded_muon(ns_steps):
    dims = lambda params: jax.tree.map(
        lambda x: optax.contrib.MuonDimensionNumbers(1, 2) if x.ndim == 3
        else optax.contrib.MuonDimensionNumbers(0, 1), params)
    return optax.contrib.muon(1e-2, ns_steps=ns_steps, muon_weight_dimension_numbers=dims)


def test_muon_with_an_embedding_and_a_head_of_their_own_shapes_is_balanced():
    """At N = 8 the busiest device's Newton–Schulz FLOPs (the compiled per-device program's)
    stay within 1.25x total/N: 1.18x, against 1.77x when every group's ⌈M/N⌉ slots ran on
    every device (the embedding's and the head's groups of one, whole, on all eight). Still
    one all-to-all in and one out."""
    n = 8
    b = {"x": jax.ShapeDtypeStruct((n,), jnp.int32),
         "y": jax.ShapeDtypeStruct((n, 3 * Embedded.D // 2), jnp.float32)}
    params = jax.eval_shape(Embedded().init, jax.random.key(0))
    steps = {}
    for ns in (5, 0):
        tx = embedded_muon(ns)
        update = jax.jit(lambda g, s, p, tx=tx: tx.update(g, s, p))
        single = _flops(update.lower(params, jax.eval_shape(tx.init, params), params))
        engine = zj.Engine(Embedded(), tx, zj.make_mesh(data=n), zj.ZeroConfig(stage=1))
        steps[ns] = (single, lower(engine, b), engine)
    total = steps[5][0] - steps[0][0]
    per_device = _flops(steps[5][1]) - _flops(steps[0][1])
    assert per_device <= 1.25 * total / n, per_device / (total / n)
    # The placement's estimate is what the program runs: the busiest device's instances.
    report = steps[5][2].plan.update.report()
    est = report["owner_flops"]
    assert est["busiest"] == max(est["devices"])
    assert est["busiest"] / (est["total"] / n) == pytest.approx(per_device / (total / n),
                                                                rel=0.02)
    # The embedding and the head on two devices that own fewer layers than the others.
    owned = {g["instances"]: g["owned"] for g in report["owner_groups"]}
    singles = [g["owned"].index(1) for g in report["owner_groups"] if g["instances"] == 1]
    assert len(singles) == 2 and singles[0] != singles[1]
    assert sum(owned[Embedded.L]) == Embedded.L
    assert all(owned[Embedded.L][d] < max(owned[Embedded.L]) for d in singles)
    hlo = steps[5][1].compiler_ir("hlo").as_hlo_text()
    assert [kind for _, kind in _COLLECTIVE.findall(hlo)].count("all-to-all") == 2
    assert [c["kind"] for r in report["rounds"] for c in r].count("all_to_all") == 2


class Unstacked:
    """An embedding, three hidden [6, 6] matrices as separate leaves and a head: at N = 4 the
    hidden group's three instances go to the devices the embedding and head leave free."""

    def init(self, rng):
        k = jax.random.split(rng, 5)
        return {"tok": jax.random.normal(k[0], (12, 6)), "head": jax.random.normal(k[4], (6, 5)),
                "w": [jax.random.normal(k[i + 1], (6, 6)) / 3 for i in range(3)]}

    def loss(self, params, batch, units):
        p = units.gather(params)
        h = p["tok"][batch["x"]]
        for w in p["w"]:
            h = jnp.tanh(h @ w)
        return jnp.mean((h @ p["head"] - batch["y"]) ** 2)


def scaled_cube():
    """Each matrix's update g·gᵀ·g times its own norm: the norm, a whole value per leaf, is
    an input of the owner work (each owner gets its instances' own)."""
    def update(updates, state, params=None):
        one = lambda g: (g @ g.T @ g) * jnp.sqrt(jnp.sum(g * g))
        return jax.tree.map(one, updates), state
    return optax.chain(optax.GradientTransformation(lambda p: optax.EmptyState(), update),
                       optax.sgd(0.1))


@pytest.mark.slow
def test_owner_placement_across_groups_matches_single_device_optax():
    """Instances placed off their order (the hidden matrices on devices 1-3), each owner
    reading its own instances' whole inputs: the numbers of single-device optax."""
    r = np.random.default_rng(0)
    bs = [{"x": r.integers(0, 12, 8).astype(np.int32),
           "y": r.normal(size=(8, 5)).astype(np.float32)} for _ in range(2)]
    model, tx = Unstacked(), scaled_cube()
    params = start = model.init(jax.random.key(0))
    state = tx.init(params)
    for b in bs:
        g = jax.grad(lambda p, b=b: model.loss(p, b, PlainUnits()))(params)
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
    engine = zj.Engine(Unstacked(), scaled_cube(), zj.make_mesh(data=4), zj.ZeroConfig(stage=1))
    st = engine.init(jax.random.key(0), bs[0])
    for b in bs:
        st, _ = engine.step(st, b)
    owned = [g["owned"] for g in engine.plan.update.report()["owner_groups"]]
    assert [0, 1, 1, 1] in owned  # the hidden group: not in instance order
    for (path, got), want, s0 in zip(jax.tree.flatten_with_path(engine.params(st))[0],
                                     jax.tree.leaves(params), jax.tree.leaves(start)):
        moved = np.linalg.norm(want - s0)
        # g·gᵀ·g·|g| is of 4th order in g: reduction-order noise grows 4-fold (2e-4 measured).
        assert np.linalg.norm(np.asarray(got) - want) <= 1e-3 * moved, jax.tree_util.keystr(path)


# ---------------------------------------------------------------------------------------------
# What is refused, and what is accepted as users write it


class Tiny:
    def init(self, rng):
        return {"w": jax.random.normal(rng, (3, 5)), "b": jnp.zeros(5)}

    def loss(self, params, batch, units):
        p = units.gather(params)
        return jnp.mean((batch["x"] @ p["w"] + p["b"][None] - batch["y"]) ** 2)


def tiny_batches(steps=3):
    r = np.random.default_rng(1)
    return [{"x": r.normal(size=(8, 3)).astype(np.float32),
             "y": r.normal(size=(8, 5)).astype(np.float32)} for _ in range(steps)]


@pytest.mark.parametrize("make, name", [(optax.lbfgs, "value_fn"),
                                        (lambda: optax.contrib.sophia(1e-3), "obj_fn")])
def test_an_optimizer_that_needs_the_loss_function_is_refused_by_name(make, name):
    """lbfgs's line search (optax raises a TypeError) and sophia's Hutchinson estimate (a
    ValueError): one ConfigError line, not optax's error from inside the update's trace."""
    engine = zj.Engine(Tiny(), make(), zj.make_mesh(data=2), zj.ZeroConfig(stage=1))
    with pytest.raises(zj.ConfigError, match=rf"needs the loss function itself.*{name}") as e:
        engine.init(jax.random.key(0), tiny_batches(1)[0])
    assert "\n" not in str(e.value) and e.value.__suppress_context__


def test_multisteps_as_users_write_it():
    """optax.MultiSteps itself (not its .gradient_transformation()) is accepted and exact."""
    bs = tiny_batches(4)
    _, params = reference_run(Tiny(), optax.MultiSteps(optax.adam(0.1), 2), bs, clip=None)
    engine = zj.Engine(Tiny(), optax.MultiSteps(optax.adam(0.1), 2), zj.make_mesh(data=2),
                       zj.ZeroConfig(stage=3))
    st = engine.init(jax.random.key(0), bs[0])
    for b in bs:
        st, _ = engine.step(st, b)
    got = engine.params(st)
    for k in params:
        np.testing.assert_allclose(got[k], params[k], rtol=1e-5, atol=1e-6)


class SplitEmbedded(Embedded):
    """`Embedded` with every matrix split over a model axis by its output features."""

    def param_specs(self):
        return {"tok": P(None, "model"), "head": P(None, "model"), "stack": P(None, None, "model")}


def test_muon_owners_cover_data_x_model():
    """On data 4 x model 2 the eight devices own the matrices, each whole on one device (the
    devices of a model group share their data index's instances): the busiest device's
    Newton–Schulz FLOPs are those of data 8 alone, within 1.25x total/8 (measured: 1.18x;
    2.07x when a data index's instances ran whole on both of its model devices)."""
    b = {"x": jax.ShapeDtypeStruct((8,), jnp.int32),
         "y": jax.ShapeDtypeStruct((8, 3 * Embedded.D // 2), jnp.float32)}
    params = jax.eval_shape(Embedded().init, jax.random.key(0))

    def ns_flops(per_device):
        return per_device(5) - per_device(0)

    def single(ns):
        tx = embedded_muon(ns)
        return _flops(jax.jit(lambda g, s, p: tx.update(g, s, p)).lower(
            params, jax.eval_shape(tx.init, params), params))

    def compiled(ns):
        engine = zj.Engine(SplitEmbedded(), embedded_muon(ns), zj.make_mesh(data=4, model=2),
                           zj.ZeroConfig(stage=1))
        return lower(engine, b).compile().cost_analysis()["flops"]

    total = ns_flops(single)
    assert ns_flops(compiled) <= 1.25 * total / 8, ns_flops(compiled) / (total / 8)
