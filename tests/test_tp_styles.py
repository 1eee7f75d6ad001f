"""Tensor parallelism for every way a model writes its plan (docs/tensor-parallel.md).

Each style's small model (tests/tp_models.py) trains on `data 4 × model 2` to single-device
optax's numbers (losses 1e-5 relative, params within 1e-5 of how far the reference moved them,
adamw at eps 1e-6: `helpers.adamw`); the explicit-sharding model's file also on `data=8`, where
its hints are the identity. Every hint or annotation naming an axis that nothing maps is one
ModelError line, raised while tracing (no compile).
"""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import ATOL, RTOL, assert_tree_close, sweep
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from test_model_axis import check_against_plain, clipped
from tp_models import (
    EXPLICIT_RULES,
    HD,
    HEADS,
    ZOO_RULES,
    DenseGeneralLast,
    DenseGeneralNet,
    ExplicitLM,
    LinenZoo,
    NNXZoo,
    T,
    V,
    shard,
)

import zerojax as zj

MESHES = {"4x2": dict(data=4, model=2), "2x4": dict(data=2, model=4),
          "2x2x2": dict(replica=2, data=2, model=2), "8": dict(data=8)}
STEPS = 4
EXPLICIT = (AxisType.Explicit, AxisType.Explicit)


def token_batches(n=STEPS):
    r = np.random.default_rng(0)
    return [{"x": r.integers(0, V, (16, T)).astype(np.int32),
             "y": r.integers(0, V, (16, T)).astype(np.int32)} for _ in range(n)]


def xent(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def nnx_plain(net):
    """(the module's own params, the loss of the module as built with params p)."""
    graph, template, rest = nnx.split(net, nnx.Param, ...)

    def loss(p, b):
        ps = jax.tree.map(lambda x: x, template)
        nnx.replace_by_pure_dict(ps, p)
        return xent(nnx.merge(graph, ps, rest)(b["x"]), b)

    return jax.device_get(nnx.to_pure_dict(template)), loss


# ---------------------------------------------------------------------------------------------
# JAX's explicit-sharding style: the model's own axis names, out_sharding= and reshard


def explicit_lm():
    """Built as its authors build it: under `jax.set_mesh` of a mesh in its own axis names."""
    with jax.set_mesh(jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=EXPLICIT)):
        return ExplicitLM(rngs=nnx.Rngs(0))


@functools.cache
def explicit_reference():
    """(initial params, losses, final params) of single-device optax on the explicit-sharding
    model, the model under a one-device mesh of its own names (the whole step one program:
    eager updates on an explicit mesh compile op by op). Computed once: every mesh and stage
    trains to it."""
    params, loss = nnx_plain(explicit_lm())
    batches = token_batches()
    one = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=EXPLICIT, devices=jax.devices()[:1])
    tx = clipped()

    @jax.jit
    def step(p, s, b):
        loss_value, g = jax.value_and_grad(loss)(p, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss_value

    with jax.set_mesh(one):
        want = jax.device_put(params, jax.devices()[0])
        opt, want_losses = tx.init(want), []
        for b in batches:
            want, opt, loss_value = step(want, opt, b)
            want_losses.append(float(loss_value))
    return params, want_losses, jax.device_get(want)


@pytest.mark.parametrize(("mesh", "stage"), sweep(
    [("4x2", 3), ("4x2", 1), ("8", 3), ("8", 1)], quick=[]))
def test_explicit_sharding_model_trains_unmodified(mesh, stage):
    net = explicit_lm()
    params, _ = nnx_plain(net)
    batches = token_batches()
    start, want_losses, want = explicit_reference()
    assert_tree_close(start, params, rtol=0)  # the reference started from these params
    model = zj.from_nnx(net, lambda m, b: xent(m(b["x"]), b), logical_axis_rules=EXPLICIT_RULES)
    engine = zj.Engine(model, clipped(), zj.make_mesh(**MESHES[mesh]), zj.ZeroConfig(stage=stage))
    state = engine.init(jax.random.key(0), batches[0])
    assert_tree_close(engine.params(state), params, rtol=0)  # the module's own params
    losses = []
    for b in batches:
        state, m = engine.step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
    assert_tree_close(engine.params(state), want, rtol=RTOL, atol=ATOL)
    split = {leaf.path for leaf in engine.layout.leaves if leaf.is_split}
    if "model" in MESHES[mesh]:  # every "tp" param: q, kv, o, up (+ bias), down; the embedding
        assert len(split) == 13 and "['embed']['embedding']" in split
    else:
        assert not split


def abstract(build):
    """An NNX module's shapes and metadata, nothing computed (for the checks of its plan)."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(build)


@pytest.mark.parametrize("mesh", ["4x2", "8"])
def test_explicit_sharding_model_steps_through_its_hints(mesh):
    """The quick tier's check of the style (training: the test above, slow): the step's program
    traces through every hint (lowered, not compiled), from the module's own params."""
    with nnx.use_eager_sharding(False):
        net = ExplicitLM(rngs=nnx.Rngs(0))
    params, _ = nnx_plain(net)
    model = zj.from_nnx(net, lambda m, b: xent(m(b["x"]), b), logical_axis_rules=EXPLICIT_RULES)
    engine = zj.Engine(model, clipped(), zj.make_mesh(**MESHES[mesh]), zj.ZeroConfig(stage=3))
    batch = token_batches(1)[0]
    state = engine.init(jax.random.key(0), batch)
    assert_tree_close(engine.params(state), params, rtol=0)
    text = engine.lower(state, batch).as_text()
    # The MLP's reshard to P("fsdp", None, "tp"): its model part, a constraint in each of the
    # 2 layers (again where backward recomputes them); the identity without a model axis.
    kept = re.findall(r'sharding_constraint %\S+ <@mesh, \[\{\}, \{\}, \{"model"\}\]> : '
                      r'tensor<4x8x32xf32>', text)
    assert len(kept) >= 2 if mesh == "4x2" else '"model"' not in text, len(kept)
    assert sum(leaf.is_split for leaf in engine.layout.leaves) == (13 if mesh == "4x2" else 0)


def test_explicit_sharding_metadata_is_read_on_every_layer():
    net = abstract(lambda: ExplicitLM(rngs=nnx.Rngs(0)))
    specs = zj.from_nnx(net, lambda m, b: 0.0, logical_axis_rules=EXPLICIT_RULES).param_specs()
    block = specs["blocks"][0]
    assert block["attn"]["q"]["kernel"] == P("data", "model", None)  # Einsum
    assert block["attn"]["kv"]["kernel"] == P("data", "model", None)  # LinearGeneral
    assert block["attn"]["o"] == P("model", None, "data")  # a bare nnx.Param
    assert block["up"]["kernel"] == P("data", "model") and block["up"]["bias"] == P("model")
    assert block["norm1"]["scale"] == P(None) and block["norm2"]["scale"] == P(None)
    assert specs["embed"]["embedding"] == P("model", "data")
    assert specs["pos"] == P(None, "data")


# ---------------------------------------------------------------------------------------------
# linen's DenseGeneral: a flat kernel boxed with the names of the reshaped one


DENSE_GENERAL = {  # split name in the middle of three, and last (the flat kernel's 2-D box
    # cannot place a third name: only the final 3-D box says which dimension is split)
    "middle": (DenseGeneralNet, {"['DenseGeneral_0']['kernel']": 1,
                                 "['DenseGeneral_1']['kernel']": 0}),
    "last": (DenseGeneralLast, {"['DenseGeneral_0']['kernel']": 2,
                                "['DenseGeneral_1']['kernel']": 1}),
}


@pytest.mark.parametrize(("mesh", "stage", "where"), sweep(
    [(m, s, w) for m in ("4x2", "2x4", "2x2x2") for s in (0, 1, 2, 3)
     for w in ("middle", "last")], quick=[]))
def test_dense_general_with_three_logical_names(mesh, stage, where):
    cls, want = DENSE_GENERAL[where]
    net = cls()
    model = zj.from_linen(net, lambda apply, b: jnp.mean((apply(b["x"]) - b["y"]) ** 2),
                          (jnp.zeros((1, 16)),), logical_axis_rules=ZOO_RULES)
    kernel = model.param_specs()["DenseGeneral_0"]["kernel"]
    assert kernel.index("model") == want["['DenseGeneral_0']['kernel']"], kernel
    r = np.random.default_rng(0)
    batches = [{"x": r.normal(size=(16, 16)).astype(np.float32),
                "y": r.normal(size=(16,)).astype(np.float32)} for _ in range(STEPS)]
    params = model.init(jax.random.key(0))
    loss = lambda p, b: jnp.mean((net.apply({"params": p}, b["x"]) - b["y"]) ** 2)  # noqa: E731
    engine = check_against_plain(model, params, loss, batches, MESHES[mesh], stage)
    split = {leaf.path: leaf.split for leaf in engine.layout.leaves if leaf.is_split}
    assert split == want


@pytest.mark.parametrize("where", ["middle", "last"])
def test_dense_general_boxes_are_read_from_their_final_shape(where):
    """The quick tier's check (training: the sweep above, slow): the plan from the final 3-D
    boxes, and the step's program traced (flax unboxes the flat kernel's box inside it)."""
    cls, want = DENSE_GENERAL[where]
    model = zj.from_linen(cls(), lambda apply, b: jnp.mean(apply(b["x"])),
                          (jnp.zeros((1, 16)),), logical_axis_rules=ZOO_RULES)
    specs = model.param_specs()
    for name, dim in want.items():
        spec = specs[name[2:-12]]["kernel"]
        assert spec == P(*("model" if d == dim else None for d in range(3))), (name, spec)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    assert shapes["DenseGeneral_0"]["kernel"].shape == (
        (16, HEADS, HD) if where == "middle" else (16, HD, HEADS))
    engine = zj.Engine(model, optax.sgd(0.1), zj.make_mesh(**MESHES["4x2"]),
                       zj.ZeroConfig(stage=3))
    batch = {"x": np.zeros((8, 16), np.float32)}
    engine.lower(engine.init(jax.random.key(0), batch), batch)


# ---------------------------------------------------------------------------------------------
# The layer zoo: every flax layer that takes partitioned initializers


def zoo(name, shapes_only=False):
    """(zerojax model, a function of the module's own params, the plain loss) for a zoo
    model; `shapes_only`: an NNX module's shapes and metadata, nothing computed."""
    if name == "linen":
        net = LinenZoo()
        model = zj.from_linen(net, lambda apply, b: xent(apply(b["x"]), b),
                              (jnp.zeros((1, T), jnp.int32),), logical_axis_rules=ZOO_RULES)
        # jitted: one program, not flax's init op by op
        return model, lambda: jax.jit(model.init)(jax.random.key(0)), \
            lambda p, b: xent(net.apply({"params": p}, b["x"]), b)
    if shapes_only:
        net = abstract(lambda: NNXZoo(nnx.Rngs(0)))
        return zj.from_nnx(net, lambda m, b: 0.0, logical_axis_rules=ZOO_RULES), None, None
    with nnx.use_eager_sharding(False):
        net = NNXZoo(nnx.Rngs(0))
    params, loss = nnx_plain(net)
    return zj.from_nnx(net, lambda m, b: xent(m(b["x"]), b), logical_axis_rules=ZOO_RULES), \
        lambda: params, loss


ZOO_SPLITS = {
    "linen": {"['Conv_0']['kernel']": 1, "['DenseGeneral_0']['bias']": 0,
              "['DenseGeneral_0']['kernel']": 1, "['DenseGeneral_1']['kernel']": 0,
              "['Dense_0']['kernel']": 0, "['Einsum_0']['bias']": 0, "['Einsum_0']['kernel']": 1,
              "['Embed_0']['embedding']": 0,
              **{f"['MultiHeadDotProductAttention_0']['{k}']['kernel']": 1
                 for k in ("query", "key", "value")},
              "['MultiHeadDotProductAttention_0']['out']['kernel']": 0},
    "nnx": {"['attn']['key']['kernel']": 1, "['attn']['out']['kernel']": 0,
            "['attn']['query']['kernel']": 1, "['attn']['value']['kernel']": 1,
            "['down']['kernel']": 0, "['ein']['kernel']": 1, "['emb']['embedding']": 0,
            "['out']['kernel']": 0, "['up']['bias']": 0, "['up']['kernel']": 1},
}


@pytest.mark.parametrize("name", sweep(["linen", "nnx"], quick=[]))
def test_layer_zoo_trains_exactly_on_data_x_model(name):
    model, params, loss = zoo(name)
    engine = check_against_plain(model, params(), loss, token_batches(), MESHES["4x2"], 3)
    split = {leaf.path: leaf.split for leaf in engine.layout.leaves if leaf.is_split}
    assert split == ZOO_SPLITS[name]


@pytest.mark.parametrize("name", ["linen", "nnx"])
def test_layer_zoo_plans_are_read_from_every_layer(name):
    """The zoo's plan, read without compiling: every layer's partitioned param, the norms'
    scales replicated ("embed" maps to None)."""
    model, _, _ = zoo(name, shapes_only=True)
    specs = jax.tree_util.tree_flatten_with_path(
        model.param_specs(), is_leaf=lambda x: x is None or isinstance(x, P))[0]
    split = {jax.tree_util.keystr(p): s.index("model") for p, s in specs
             if s is not None and "model" in s}
    assert split == ZOO_SPLITS[name]


# ---------------------------------------------------------------------------------------------
# A name with two rules: the first wins, as in flax's own lookup


def test_the_first_of_two_rules_for_a_name_wins():
    from zerojax.adapters.axes import mesh_spec
    from zerojax.adapters.hints import Hints, translate

    rules = (("tp", "model"), ("tp", None))
    with nn.logical_axis_rules(rules):  # flax: the first rule for a name is its axis
        assert nn.logical_to_mesh_axes(("tp", None)) == P("model", None)
    for first, split in ((rules, True), (rules[::-1], False)):
        hint = translate(P("data", None, "tp"), "reshard", Hints(first, None, "from_nnx"))
        assert hint == (P(None, None, "model") if split else P()), (first, hint)
        assert mesh_spec(("tp", None), first) == P("model" if split else None, None)
    # A model's hints and params through those rules: split and constrained, or neither.
    with nnx.use_eager_sharding(False):
        net = ExplicitLM(rngs=nnx.Rngs(0))
    model = zj.from_nnx(net, lambda m, b: xent(m(b["x"]), b),
                        logical_axis_rules=(*rules, ("fsdp", "data")))
    engine = zj.Engine(model, clipped(), zj.make_mesh(**MESHES["4x2"]), zj.ZeroConfig(stage=3))
    batch = token_batches(1)[0]
    text = engine.lower(engine.init(jax.random.key(0), batch), batch).as_text()
    assert sum(leaf.is_split for leaf in engine.layout.leaves) == 13
    assert re.search(r'sharding_constraint %\S+ <@mesh, \[\{\}, \{\}, \{"model"\}\]>', text)


# ---------------------------------------------------------------------------------------------
# One line for every name nothing maps, and for a mesh that would split nothing


class Hinted(nnx.Module):
    """A linear layer placing its output with `how` in the axis name "tp"."""

    def __init__(self, how, rngs):
        self.how = how
        self.lin = nnx.Linear(6, 4, kernel_metadata={"out_sharding": P(None, "model")},
                              rngs=rngs)

    def __call__(self, x):
        spec = P(None, "tp")
        if self.how == "with_sharding_constraint":
            return jax.lax.with_sharding_constraint(self.lin(x), spec)
        if self.how == "reshard":
            return shard(self.lin(x), spec)
        if self.how == "nnx out_sharding":
            return self.lin(x, out_sharding=spec)
        if self.how == "jnp out_sharding":
            return jnp.einsum("bi,io->bo", x, self.lin.kernel[...], out_sharding=spec)
        if self.how == "auto_axes":  # the form nnx.Embed(...)(x, out_sharding=) takes
            return jax.sharding.auto_axes(lambda y: self.lin(y), out_sharding=spec)(x)
        return self.lin(x).at[:, :2].get(out_sharding=spec)


def engine_init(model, mesh):
    engine = zj.Engine(model, optax.sgd(0.1), zj.make_mesh(**mesh))
    return engine.init(jax.random.key(0), {"x": np.zeros((8, 6), np.float32)})


@pytest.mark.parametrize("how", ["with_sharding_constraint", "reshard", "nnx out_sharding",
                                 "jnp out_sharding", ".at[].get", "auto_axes"])
def test_a_hint_naming_an_unmapped_axis_is_one_line(how):
    with nnx.use_eager_sharding(False):
        net = Hinted(how, nnx.Rngs(0))
    model = zj.from_nnx(net, lambda m, b: jnp.mean(m(b["x"])))
    with pytest.raises(zj.ModelError) as e:
        engine_init(model, MESHES["4x2"])
    msg = str(e.value)
    where = "tp_models.py" if how == "reshard" else "test_tp_styles.py"  # where the hint is
    assert "\n" not in msg and "'tp'" in msg and where in msg, msg
    assert "('tp', 'model')" in msg and "from_nnx(logical_axis_rules=" in msg, msg
    assert "('tp', 'data') if it shards over the batch devices" in msg, msg


_own_constraint = jax.lax.with_sharding_constraint  # as `from jax.lax import ...` binds it


def test_a_constraint_imported_by_name_is_one_line():
    class ByName(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(6, 4, kernel_metadata={"out_sharding": P(None, "model")},
                                  rngs=rngs)

        def __call__(self, x):
            return _own_constraint(self.lin(x), P(None, "tp"))

    with nnx.use_eager_sharding(False):
        model = zj.from_nnx(ByName(nnx.Rngs(0)), lambda m, b: jnp.mean(m(b["x"])),
                            logical_axis_rules=EXPLICIT_RULES)
    with pytest.raises(zj.ModelError, match=r"P\(None, 'tp'\) \(with_sharding_constraint at "
                                            r"test_tp_styles.py:\d+ \(__call__\)\).*'tp'.*call it "
                                            r"as jax.lax.with_sharding_constraint"):
        engine_init(model, MESHES["4x2"])


def test_a_hint_that_names_no_axes_is_one_line():
    class Placed(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(6, 4, kernel_metadata={"out_sharding": P(None, "model")},
                                  rngs=rngs)

        def __call__(self, x):
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            return jax.lax.with_sharding_constraint(self.lin(x), device)

    with nnx.use_eager_sharding(False):
        model = zj.from_nnx(Placed(nnx.Rngs(0)), lambda m, b: jnp.mean(m(b["x"])))
    with pytest.raises(zj.ModelError, match=r"SingleDeviceSharding.*test_tp_styles.py.*no "
                                            r"PartitionSpec or NamedSharding"):
        engine_init(model, MESHES["4x2"])


def test_a_param_naming_an_unmapped_axis_is_one_line():
    net = abstract(lambda: ExplicitLM(rngs=nnx.Rngs(0)))
    model = zj.from_nnx(net, lambda m, b: xent(m(b["x"]), b),
                        logical_axis_rules=(("tp", "model"),))  # "fsdp" has no rule
    with pytest.raises(zj.ModelError, match=r"^parameter \['blocks'\]\[0\].*'fsdp'.*"
                                            r"\('fsdp', None\)") as e:
        model.param_specs()
    assert "\n" not in str(e.value)
    # An FSDP-style name goes to ZeRO's "data" (docs/tensor-parallel.md), not to "model".
    assert "('fsdp', 'data') if it shards over the batch devices" in str(e.value)


def test_a_linen_constraint_naming_an_unmapped_axis_is_one_line():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(4, kernel_init=nn.with_partitioning(nn.initializers.ones,
                                                             (None, "model")))(x)
            return jax.lax.with_sharding_constraint(h, P(None, "heads"))

    with pytest.raises(zj.ModelError, match=r"'heads'.*from_linen\(logical_axis_rules="):
        zj.from_linen(Net(), lambda apply, b: apply(b["x"]).mean(), (jnp.zeros((1, 6)),))


def test_a_mesh_that_would_split_nothing_is_refused_before_any_trace():
    traced = []

    def loss(m, b):
        traced.append(1)
        return jnp.mean(m(b["x"]))

    with nnx.use_eager_sharding(False):
        net = nnx.Linear(6, 4, rngs=nnx.Rngs(0))
    with pytest.raises(zj.ConfigError, match="splits none of its parameters"):
        engine_init(zj.from_nnx(net, loss), MESHES["4x2"])
    assert not traced
