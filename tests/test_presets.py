"""The command line's named optimizers and the optimizer state any optax optimizer allocates.

Byte counts are computed here from the GPT's logical shapes, independently of the optimizers'
`init`, which `state_size` reads. Nothing is compiled.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

from zerojax.analysis.measurement import state_size
from zerojax.app import presets
from zerojax.models import GPT


@functools.cache
def abstract(preset: str):
    return jax.eval_shape(GPT.from_preset(preset).init, jax.random.key(0))


def small():
    """A few leaves named as GPT names them (cheap to trace): an embedding, a stacked block
    kernel and its bias, a LayerNorm scale and the head."""
    shapes = {"embed": {"tok": (6, 4)},
              "blocks": {"mlp": {"fc": {"kernel": (2, 4, 5), "bias": (2, 5)}}},
              "final": {"ln": {"scale": (4,)}, "head": {"kernel": (4, 6)}}}
    return jax.tree.map(lambda s: jnp.ones(s, jnp.float32), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


def leaves(params) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    return [(tuple(k.key for k in path), x.shape)
            for path, x in jax.tree.flatten_with_path(params)[0]]


def expected_bytes(name: str, params) -> int:
    """What `name`'s state holds for `params` (float32 master), by the optimizer's maths,
    with a constant learning rate (a schedule adds one int32 step count where none is)."""
    shapes = leaves(params)
    psi = sum(math.prod(s) for _, s in shapes)
    if name in ("adamw", "lamb"):
        return 8 * psi + 4  # mu, nu; their step count
    if name == "lion":
        return 4 * psi + 4  # one momentum; its step count
    if name == "sgd":
        return 4 * psi  # the momentum trace; a constant rate keeps no count
    if name == "adafactor":
        # Factored where the two largest dims are >= 128: a row and a column statistic (the
        # shape less its largest / second largest dim) and a (1,) placeholder for the full
        # one; else the full second moment and two (1,) placeholders. One step count.
        elems = 0
        for _, s in shapes:
            top = sorted(s)[-2:]
            if len(s) >= 2 and top[0] >= 128:
                elems += math.prod(s) // top[1] + math.prod(s) // top[0] + 1
            else:
                elems += math.prod(s) + 2
        return 4 * elems + 4
    assert name == "muon"
    # Momentum on the block kernels [L, in, out]; Adam's mu and nu on everything else (the
    # embeddings, the head, biases, norms); two step counts; Newton–Schulz's 3 coefficients.
    matrices = sum(math.prod(s) for p, s in shapes if p[0] == "blocks" and p[-1] == "kernel")
    return 4 * matrices + 8 * (psi - matrices) + 4 + 4 + 3 * 4


@pytest.mark.parametrize("preset", ["test", "nano"])
@pytest.mark.parametrize("name", presets.OPTIMIZERS)
def test_state_size_is_what_each_optimizer_keeps(name, preset):
    params = abstract(preset)
    size = state_size(presets.build(name, 1e-3, weight_decay=0.1), params)
    psi = GPT.from_preset(preset).num_params()
    assert size.num_params == psi
    assert size.total == expected_bytes(name, params)
    assert size.scalars == {"sgd": 0, "muon": 8}.get(name, 4)  # the step counts
    assert size.per_param == (size.total - size.scalars) / psi


def test_state_per_param_differs_from_adam_as_the_maths_says():
    k = {name: state_size(presets.build(name, 1e-3), abstract("nano")).per_param
         for name in presets.OPTIMIZERS}
    assert (k["adamw"], k["lamb"], k["lion"], k["sgd"]) == (8, 8, 4, 4)
    # nano (d 128, d_ff 512): every matrix and embedding factored, 0.07 bytes per param.
    assert k["adafactor"] == pytest.approx(0.0738, abs=1e-4)
    # Muon: 4 bytes on the 786,432 block-kernel params, Adam's 8 on the other 88,832.
    assert k["muon"] == (4 * 786_432 + 8 * 88_832 + 12) / 875_264
    assert k["muon"] == pytest.approx(4.406, abs=1e-3)


def test_muon_treats_block_kernels_as_matrices_and_the_rest_as_adam():
    dims = presets.by_leaf(presets.gpt_matrix)(abstract("test"))
    by_path = {jax.tree_util.keystr(p): d for p, d in jax.tree.flatten_with_path(
        dims, is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))[0]}
    stacked = MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    assert {k for k, d in by_path.items() if d is not None} == {
        f"['blocks']{m}['kernel']" for m in ("['attn']['qkv']", "['attn']['out']",
                                              "['mlp']['fc']", "['mlp']['out']")}
    assert all(d == stacked for d in by_path.values() if d is not None)
    assert by_path["['final']['head']['kernel']"] is None  # Adam, as Muon's authors advise
    assert presets.gpt_matrix(("proj", "kernel"), (8, 4)) == MuonDimensionNumbers(0, 1)
    assert presets.gpt_matrix(("blocks", "ln1", "scale"), (2, 32)) is None


def test_a_custom_matrix_rule_changes_muons_state():
    params = abstract("test")
    head = lambda path, shape: (presets.gpt_matrix(path, shape)
                                or (MuonDimensionNumbers(0, 1) if "head" in path else None))
    default = state_size(presets.build("muon", 1e-3), params).total
    with_head = state_size(presets.build("muon", 1e-3, matrices=head), params).total
    assert default - with_head == 4 * 32 * 64  # the head's nu moves out; its mu stays


def test_adamw_preset_is_the_adamw_train_always_used():
    """Bitwise one update of the optax.adamw that `train` built before `--optimizer`."""
    params = jax.tree.map(lambda x: 0.5 * x, small())
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.25), params)
    sched = optax.linear_schedule(1e-4, 1e-3, 10)
    names = lambda p: jax.tree_util.tree_map_with_path(
        lambda path, _: str(path[-1].key) in ("kernel", "tok", "pos"), p)
    old = optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1, mask=names)
    new = presets.build("adamw", sched, weight_decay=0.1)

    @jax.jit
    def two_steps(params, grads):
        results = []
        for opt in (old, new):
            state = opt.init(params)
            for _ in range(2):
                updates, state = opt.update(grads, state, params)
            results.append(updates)
        return results

    results = two_steps(params, grads)
    for a, b in zip(*map(jax.tree.leaves, results), strict=True):
        np.testing.assert_array_equal(a, b)
    # decay on the embedding, not on the LayerNorm scale
    assert results[1]["embed"]["tok"][0, 0] != results[1]["final"]["ln"]["scale"][0]


# The decay rule (docs/training.md): matrices and the embedding tables, positions included,
# decay; biases and LayerNorm do not. Every leaf name of the GPT, classified here by hand.
DECAYED = {
    ("embed", "tok"): True, ("embed", "pos"): True,
    ("blocks", "attn", "qkv", "kernel"): True, ("blocks", "attn", "qkv", "bias"): False,
    ("blocks", "attn", "out", "kernel"): True, ("blocks", "attn", "out", "bias"): False,
    ("blocks", "mlp", "fc", "kernel"): True, ("blocks", "mlp", "fc", "bias"): False,
    ("blocks", "mlp", "out", "kernel"): True, ("blocks", "mlp", "out", "bias"): False,
    ("blocks", "ln1", "scale"): False, ("blocks", "ln1", "bias"): False,
    ("blocks", "ln2", "scale"): False, ("blocks", "ln2", "bias"): False,
    ("final", "ln", "scale"): False, ("final", "ln", "bias"): False,
    ("final", "head", "kernel"): True,
}


def test_the_decay_mask_of_every_gpt_preset_by_name():
    """The mask every `train --optimizer` gets (`build`'s default `decay`), on each GPT
    preset's params: a leaf the table does not name fails too."""
    from zerojax.models.gpt import PRESETS

    mask = presets.by_leaf(presets.gpt_decay)
    for preset in PRESETS:
        got = {presets._names(p): m for p, m in jax.tree.flatten_with_path(
            mask(abstract(preset)))[0]}
        assert got == DECAYED, preset


@pytest.mark.parametrize("name", presets.OPTIMIZERS)
def test_every_preset_descends_on_logical_params(name):
    """One step of each preset lowers a quadratic on GPT-named leaves, decays only the masked
    leaves' share, and the adafactor decay is decoupled (scaled by the rate)."""
    loss = lambda p: sum(jnp.sum(x**2) for x in jax.tree.leaves(p))

    @jax.jit  # one compile instead of hundreds of small dispatches
    def steps(params):
        opt = presets.build(name, 1e-2, weight_decay=0.0)
        updates, _ = opt.update(jax.grad(loss)(params), opt.init(params), params)
        # With zero gradients only the weight decay moves params: matrices and embeddings
        # shrink by rate × decay (sgd: its L2 term through the rate), biases and norms stay.
        opt = presets.build(name, 1e-2, weight_decay=0.5)
        zeros = jax.tree.map(jnp.zeros_like, params)
        decayed, _ = opt.update(zeros, opt.init(params), params)
        return loss(params), loss(optax.apply_updates(params, updates)), decayed

    before, after, decayed = steps(small())
    assert after < before
    u = {presets._names(p): x for p, x in jax.tree.flatten_with_path(decayed)[0]}
    assert np.all(u[("final", "ln", "scale")] == 0)
    if name == "muon":  # decay on the Newton–Schulz matrices only; Adam's leaves none
        assert np.all(u[("embed", "tok")] == 0)
        np.testing.assert_allclose(u[("blocks", "mlp", "fc", "kernel")], -5e-3, rtol=1e-6)
    elif name == "lion":  # sign(0) = 0: the decay alone
        np.testing.assert_allclose(u[("embed", "tok")], -5e-3, rtol=1e-6)
    else:
        assert np.all(u[("embed", "tok")] < 0)
        if name in ("adamw", "adafactor", "sgd"):
            np.testing.assert_allclose(u[("embed", "tok")], -5e-3, rtol=1e-6)


def test_unknown_name_is_refused():
    with pytest.raises(ValueError, match="unknown optimizer 'adam'; choose one of adamw, lion"):
        presets.build("adam", 1e-3)
    assert set(presets.HELP) == set(presets.STATE) == set(presets.TITLE) == set(
        presets.OPTIMIZERS)
