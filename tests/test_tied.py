"""Weights used twice, and published model shapes whose placeholders once read NaN.

A unit's params outside its own call (a tied head through `attend`, a weight read by another
module or by the loss) compute on the right values; a stack's, which only its scan may take,
are refused in one line (docs/models.md, "Design notes"). The zoo (tied_models.py: flax
gemma's `ScaledEmbed` + `attend`, linen's `nn.Embed.attend`, a layer shared by two blocks)
trains as single-device optax at every stage with and without a model axis, with the units
chosen and named: losses within 1e-5 relative, params within 3e-5 of how far the reference
moved them (`helpers.moved_error`; adamw at eps 1e-6; see MOVED). The bonsai shapes
(bonsai_models.py) train with default `from_nnx` arguments from the plan their arrays carry,
and without `units=` zerojax picks their block class.
"""

import functools
import logging

import bonsai_models as bm
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tied_models as tm
from flax import nnx
from helpers import RTOL, moved_error, sweep
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from test_model_axis import clipped
from tp_models import shard

import zerojax as zj
from zerojax.analysis.measurement import state_bytes
from zerojax.units import PlainUnits

MESHES = {"4x2": dict(data=4, model=2), "4": dict(data=4), "8": dict(data=8),
          "2x2": dict(data=2, model=2)}
STEPS = 3
# Params within 3e-5 of how far the reference moved them. Adam (eps 1e-6) magnifies the
# rounding of elements whose gradient is near zero: the LLaDA shape's reference against itself
# with its batch mean taken in two halves differs by 6.4e-6 of the movement, zerojax on
# data 2 x model 2 by 1.1e-5 (1.7e-5 under the suite's XLA flags); a lost or doubled
# reduction is ~1e-1 off.
MOVED = 3e-5
NAMES = ("fsdp", "tp")
EXPLICIT = (AxisType.Explicit, AxisType.Explicit)


def batches(n=STEPS, batch=16, seed=0):
    r = np.random.default_rng(seed)
    return [{"x": r.integers(0, tm.V, (batch, tm.T)).astype(np.int32),
             "y": r.integers(0, tm.V, (batch, tm.T)).astype(np.int32)} for _ in range(n)]


def xent(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def authors(build):
    """The module as its authors build it: under a mesh in its own axis names."""
    with jax.set_mesh(jax.make_mesh((4, 2), NAMES, axis_types=EXPLICIT)):
        return build()


def plain_run(net, loss, names=NAMES):
    """(initial params, losses, final params) of single-device optax on the NNX module `net`
    (`loss(module, batch)`), under a one-device mesh of its axis `names` (its hints need them;
    None: no mesh), the whole step one program."""
    graph, template, rest = nnx.split(net, nnx.Param, ...)
    params = jax.device_get(nnx.to_pure_dict(template))
    rest = jax.tree.map(lambda x: np.asarray(jax.device_get(x)) if isinstance(x, jax.Array)
                        else x, rest)
    tx = clipped()

    def f(p, b):
        ps = jax.tree.map(lambda x: x, template)
        nnx.replace_by_pure_dict(ps, p)
        return loss(nnx.merge(graph, ps, jax.tree.map(lambda x: x, rest)), b)

    @jax.jit
    def step(p, s, b):
        value, g = jax.value_and_grad(f)(p, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    one = jax.make_mesh((1, 1), names, axis_types=EXPLICIT, devices=jax.devices()[:1]) \
        if names else None
    with jax.set_mesh(one) if one is not None else _nothing():
        want, losses = jax.device_put(params, jax.devices()[0]), []
        opt = tx.init(want)
        for b in batches():
            want, opt, value = step(want, opt, b)
            losses.append(float(value))
    return params, np.array(losses), jax.device_get(want)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def train(zm, mesh, stage, params=None):
    """`zm` trained on `mesh` at `stage`: (engine, losses, final params)."""
    engine = zj.Engine(zm, clipped(), zj.make_mesh(**MESHES[mesh]), zj.ZeroConfig(stage=stage))
    bs = batches()
    state = engine.init(jax.random.key(0), bs[0]) if params is None else \
        engine.init_from(params, bs[0])
    losses = []
    for b in bs:
        state, m = engine.step(state, b)
        losses.append(float(m["loss"]))
    return engine, np.array(losses), engine.params(state)


def check(zm, reference, mesh, stage, params=None):
    start, want_losses, want = reference
    engine, losses, got = train(zm, mesh, stage, params)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
    assert moved_error(got, want, start) <= MOVED, moved_error(got, want, start)
    return engine


# ---------------------------------------------------------------------------------------------
# The zoo: weights used twice, units chosen and named, every stage, with and without `model`


def gemma():
    return authors(lambda: tm.GemmaLM(rngs=nnx.Rngs(0)))


def shared():
    with nnx.use_eager_sharding(False):
        return tm.SharedLM(rngs=nnx.Rngs(0))


def nnx_loss(m, b):
    return xent(m(b["x"]), b)


ZOO = {"gemma": (gemma, dict(logical_axis_rules=tm.RULES), (tm.ScaledEmbed, tm.Block), tm.Block),
       "shared": (shared, {}, (nnx.Linear,), tm.SharedBlock),
       "linen": (tm.LinenTiedLM, dict(logical_axis_rules=tm.LOGICAL), (nn.Embed, tm.LinenBlock),
                 tm.LinenBlock)}


@functools.cache
def zoo_reference(name):
    build = ZOO[name][0]
    if name == "linen":
        net = build()
        params = jax.jit(net.init)(jax.random.key(0), batches()[0]["x"][:1])["params"]
        return linen_run(net, nn.unbox(params))
    return plain_run(build(), nnx_loss, NAMES if name == "gemma" else None)


def linen_run(net, params):
    tx, opt = clipped(), None

    @jax.jit
    def step(p, s, b):
        value, g = jax.value_and_grad(lambda p: xent(net.apply({"params": p}, b["x"]), b))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    want, opt, losses = params, tx.init(params), []
    for b in batches():
        want, opt, value = step(want, opt, b)
        losses.append(float(value))
    return params, np.array(losses), want


def zoo_model(name, named):
    build, kw, units, _ = ZOO[name]
    kw = dict(kw, units=units) if named else kw
    if name == "linen":
        with nn.logical_axis_rules(tm.LOGICAL):
            return zj.from_linen(build(), lambda apply, b: xent(apply(b["x"]), b),
                                 batches()[0]["x"][:1], **kw)
    return zj.from_nnx(build(), nnx_loss, **kw)


ZOO_CASES = [(n, u, m, s) for n in ZOO for u in ("chosen", "named") for m in ("4x2", "4")
             for s in (0, 1, 2, 3)]


@pytest.mark.parametrize(("name", "units", "mesh", "stage"), sweep(ZOO_CASES, quick=[
    ("gemma", "chosen", "4x2", 3), ("shared", "chosen", "4x2", 2),
    ("linen", "named", "4", 3)]))
def test_tied_and_shared_weights_train_exactly(name, units, mesh, stage):
    zm = zoo_model(name, units == "named")
    if units == "chosen":
        assert zm.classes == (ZOO[name][3],)
    start = zoo_reference(name)[0] if name == "linen" else None
    engine = check(zm, zoo_reference(name), mesh, stage, start)
    split = {leaf.path for leaf in engine.layout.leaves if leaf.is_split}
    tied = {"gemma": "['embedder']['embedding']", "shared": "['blocks'][0]['shared']['kernel']",
            "linen": "['Embed_0']['embedding']"}[name]
    assert (tied in split) == ("model" in MESHES[mesh])


def test_a_tied_head_on_a_unit_reads_the_root_gather(caplog):
    """`units=(ScaledEmbed, Block)`: the embedder's own call gathers it as a unit; its
    `attend` (the head) computes on the root's gather of the same table, logged once."""
    with caplog.at_level(logging.INFO, logger="zerojax"):
        zm = zoo_model("gemma", named=True)
        engine = zj.Engine(zm, clipped(), zj.make_mesh(**MESHES["4"]), zj.ZeroConfig(stage=3))
        engine.init(jax.random.key(0), batches()[0])
    assert zm.unit_paths[0] == ("embedder",)
    assert ("parameter ['embedder']['embedding'] of unit ScaledEmbed is read outside the "
            "unit's call by ScaledEmbed.attend at tied_models.py") in caplog.text


# ---------------------------------------------------------------------------------------------
# No placeholder computes: every read outside a unit is served or refused in one line


class Reader(nnx.Module):
    """Unit `Layer`s' params read outside their calls: by another module's method, by the
    root through `jnp.take` on the Variable (a jitted jax function), and by the loss over
    `nnx.state` (a regularizer)."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(tm.V, tm.D, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(tm.D, tm.D, rngs=rngs) for _ in range(2)])

    def __call__(self, tokens):
        x = jnp.take(self.embed.embedding, tokens, axis=0)
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        x = x + x @ self.layers[0].kernel[...].T  # layer 0's kernel, read by the root
        return self.embed.attend(x)


def reader_loss(m, b):
    l2 = optax.tree.norm(nnx.state(m, nnx.Param), squared=True)
    return xent(m(b["x"]), b) + 1e-3 * l2


@pytest.mark.parametrize("units", [(nnx.Embed, nnx.Linear), (nnx.Linear,)])
def test_reads_outside_a_unit_compute_on_its_values(units):
    """A NaN placeholder made this model's loss NaN; now it is the plain model's loss, and
    its training single-device optax's."""
    net = Reader(nnx.Rngs(0))
    zm = zj.from_nnx(net, reader_loss, units=units)
    b = batches(1)[0]
    got = jax.jit(lambda p: zm.loss(p, b, PlainUnits()))(zm.init(None))
    want = jax.jit(reader_loss)(net, b)
    assert np.isfinite(float(got)) and float(got) == pytest.approx(float(want), rel=1e-6)
    check(zm, plain_run(net, reader_loss, None), "4", 3)


class Stacked(nnx.Module):
    """Layers stacked by nnx.vmap, scanned by nnx.scan; `peek` reads the stack whole."""

    def __init__(self, rngs, peek=False):
        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs):
            return tm.SharedBlock(nnx.Linear(tm.F, tm.D, rngs=rngs),
                                  nnx.Param(jnp.zeros((tm.T, tm.D))), rngs=rngs)

        with nnx.use_eager_sharding(False):
            self.embed = nnx.Embed(tm.V, tm.D, rngs=rngs)
            self.blocks = stack(rngs)
        self.peek = peek

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        x = self.embed(tokens)
        if self.peek:
            x = x + jnp.sum(self.blocks.up.kernel[...])
        return self.embed.attend(body(x, self.blocks))


@pytest.mark.parametrize("units", [None, (tm.SharedBlock,)])
def test_a_stack_read_outside_its_scan_is_one_line(units):
    zm = zj.from_nnx(Stacked(nnx.Rngs(0), peek=True), nnx_loss, units=units)
    assert zm.classes == (tm.SharedBlock,) and zm.unit_paths == [("blocks",)]
    with pytest.raises(zj.ModelError) as e:
        jax.eval_shape(lambda p: zm.loss(p, batches(1)[0], PlainUnits()), zm.init(None))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(
        "parameter ['blocks']['up']['kernel'] of the stack of SharedBlock layers at /blocks")
    assert "read whole by Stacked.__call__ at test_tied.py" in msg, msg
    assert "leave SharedBlock out of units" in msg
    assert ("from_nnx chose units=(SharedBlock) itself" in msg) == (units is None)
    # Read only inside its scan, the same stack is one unit per layer, and exact.
    zm = zj.from_nnx(Stacked(nnx.Rngs(0)), nnx_loss)
    got = jax.jit(lambda p: zm.loss(p, batches(1)[0], PlainUnits()))(zm.init(None))
    assert float(got) == pytest.approx(float(jax.jit(nnx_loss)(Stacked(nnx.Rngs(0)),
                                                                batches(1)[0])), rel=1e-6)


def test_a_standin_holds_no_values():
    """What zerojax puts in place of a stack's params refuses every read of its values."""
    from zerojax.adapters.placeholders import Stand

    stand = Stand(PlainUnits(), "from_nnx")
    x = stand.standins({"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}, {"w": "handle"},
                       ("blocks",), tm.Block, True)["w"]
    assert (x.shape, x.ndim, x.size, x.dtype) == ((2, 3), 2, 6, jnp.float32)
    for use in (lambda: x[0], lambda: x + 1, lambda: 2 * x, lambda: x.T, lambda: np.asarray(x),
                lambda: jnp.asarray(x), lambda: jnp.dot(jnp.ones(2), x),
                lambda: jnp.ones((4, 2)) @ x, lambda: jax.jit(jnp.sin)(x)):
        with pytest.raises(zj.ModelError, match=r"^parameter \['blocks'\]\['w'\] of the stack"):
            use()


# ---------------------------------------------------------------------------------------------
# Discovery picks the block class (bonsai's shapes, flax gemma's)


def abstract(build):
    with jax.set_mesh(jax.make_mesh((4, 2), NAMES, axis_types=EXPLICIT)):
        return nnx.eval_shape(build)


DISCOVERED = {
    "gemma": (lambda: abstract(lambda: tm.GemmaLM(rngs=nnx.Rngs(0))), tm.Block),
    "gemma3": (lambda: abstract(lambda: bm.Gemma3(rngs=nnx.Rngs(0))), bm.Gemma3DecoderLayer),
    "llada": (lambda: abstract(lambda: bm.LLaDA(rngs=nnx.Rngs(0))), bm.LLaDALlamaBlock),
    "mamba2": (lambda: bm.Mamba2(rngs=nnx.Rngs(0)), bm.Mamba2Block),
    "qwen3_vl": (lambda: bm.Qwen3VLForConditionalGeneration(rngs=nnx.Rngs(0)),
                 bm.Qwen3VLDecoderLayer),
}


@pytest.mark.parametrize("name", list(DISCOVERED))
def test_discovery_picks_the_block_class(name, caplog):
    build, block = DISCOVERED[name]
    with caplog.at_level(logging.INFO, logger="zerojax"):
        zm = zj.from_nnx(build(), nnx_loss, logical_axis_rules=tm.RULES)
    assert zm.classes == (block,)
    assert f"units=({block.__name__}) chosen: the model's block, 2 instances" in caplog.text
    assert not zm._stacks  # no embedding table, no bias-free projection taken for a stack


def qwen3_loss(m, b):
    return xent(m(b["x"], b["patches"]), b)


@pytest.mark.parametrize("units", [None, (bm.ShardedEmbedding,)])
def test_qwen3_vl_reads_its_tied_table_from_the_root(units):
    """The root reads `embed_tokens.embedding[...]` for its logits: with the embedding a
    unit, that read computes on the root's gather of it."""
    net = bm.Qwen3VLForConditionalGeneration(rngs=nnx.Rngs(0))
    b = dict(batches(1)[0], patches=np.random.default_rng(1).normal(
        size=(16, 2, 4)).astype(np.float32))
    zm = zj.from_nnx(net, qwen3_loss, units=units)  # its bias-free projections' zeros: state
    got = jax.jit(lambda p: zm.loss(p, b, PlainUnits(state=zm.init_state(None))))(zm.init(None))
    assert float(got) == pytest.approx(float(jax.jit(qwen3_loss)(net, b)), rel=1e-6)


@pytest.mark.slow  # quick: the zoo's NNX blocks as units
def test_mamba2_trains_with_its_blocks_as_units():
    net = bm.Mamba2(rngs=nnx.Rngs(0))
    zm = zj.from_nnx(net, nnx_loss)
    assert zm.classes == (bm.Mamba2Block,)
    check(zm, plain_run(net, nnx_loss, None), "4", 3)


# ---------------------------------------------------------------------------------------------
# Plans on the arrays: bonsai's Gemma3 and LLaDA with default arguments


def planned(net) -> dict[str, int]:
    """The model's own plan, read off its live arrays (NNX metadata shards them the same):
    param path -> its elements, for the params split over "tp", and None for the others."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(net, nnx.Param)))[0]
    return {jax.tree_util.keystr(p): ("tp" in jax.tree.leaves(tuple(x.sharding.spec)), x.size)
            for p, x in flat}


def assert_split_follows_the_plan(engine, net):
    plan = planned(net)
    split = {leaf.path for leaf in engine.layout.leaves if leaf.is_split}
    assert split == {p for p, (s, _) in plan.items() if s}
    d, m = engine.data, engine.model_parallel
    want = 12 * sum(n / (d * m) if s else n / d for s, n in plan.values())  # fp32 master + Adam
    got = state_bytes(engine)
    assert abs(got["master"] + got["optimizer"] - want) <= 0.01 * want, (got, want)


@functools.cache
def gemma3_reference():
    return plain_run(authors(lambda: bm.Gemma3(rngs=nnx.Rngs(0))), nnx_loss)


@pytest.mark.parametrize(("name", "mesh", "stage"), sweep(
    [(n, m, s) for n in ("gemma3", "gemma") for m in ("4x2", "8") for s in (1, 3)],
    quick=[("gemma3", "4x2", 3)]))
def test_default_arguments_train_from_the_arrays_plan(name, mesh, stage):
    """bonsai's Gemma3 (the plan on its arrays) and flax's gemma (in its metadata), with
    default `from_nnx` arguments besides the rules: exact, split as the arrays are."""
    build = (lambda: bm.Gemma3(rngs=nnx.Rngs(0))) if name == "gemma3" else \
        (lambda: tm.GemmaLM(rngs=nnx.Rngs(0)))
    net = authors(build)
    reference = gemma3_reference() if name == "gemma3" else zoo_reference("gemma")
    engine = check(zj.from_nnx(net, nnx_loss, logical_axis_rules=tm.RULES), reference, mesh,
                   stage)
    if "model" in MESHES[mesh]:
        assert_split_follows_the_plan(engine, net)
    else:
        assert not any(leaf.is_split for leaf in engine.layout.leaves)


def llada_loss(m, b):
    logits, _ = m(b["x"], jax.random.key(0))
    return xent(shard(logits, P()), b)  # the vocabulary whole for the labels' gather


@functools.cache
def llada_reference():
    return plain_run(authors(lambda: bm.LLaDA(rngs=nnx.Rngs(0))), llada_loss)


@pytest.mark.parametrize("stage", sweep([1, 3], quick=[]))  # quick: Gemma3's arrays
def test_llada_trains_from_the_plan_on_its_arrays(stage):
    net = authors(lambda: bm.LLaDA(rngs=nnx.Rngs(0)))
    zm = zj.from_nnx(net, llada_loss, logical_axis_rules=tm.RULES)
    assert zm.classes == (bm.LLaDALlamaBlock,)
    engine = check(zm, llada_reference(), "2x2", stage)
    assert_split_follows_the_plan(engine, net)


def test_an_array_split_nothing_maps_is_one_line():
    net = authors(lambda: bm.Gemma3(rngs=nnx.Rngs(0)))
    zm = zj.from_nnx(net, nnx_loss, logical_axis_rules=(("fsdp", "data"),))  # no "tp" rule
    with pytest.raises(zj.ModelError) as e:
        zm.param_specs()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(
        "parameter ['embed_tokens']['weight']['embedding']'s array, sharded as (None, 'tp') "
        "names the axis 'tp'"), msg
    assert "('tp', 'model') if it is a tensor-parallel dimension" in msg
