"""The optimizer table shared by test_optimizers*.py: optax optimizers and idioms, bundled by
`optax.partition` into a few engines (one group of params per optimizer, labelled by a
function of the logical params, so one compile covers a bundle), and the single-device optax
reference on the same global batches.

Tolerances: per-step loss within 1e-5 relative; each optimizer's params within 1e-4 of how far
the reference moved them (the distance from the reference over the reference's own movement:
an absolute bound would hide a wrong update when updates are small).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import moved_error
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as MDN

import zerojax as zj
from zerojax.units import PlainUnits

STEPS, BATCH = 3, 24
LOSS_RTOL, MOVE_RTOL = 1e-5, 1e-4


def _muon_dims(params):
    return jax.tree.map(lambda x: MDN(1, 2) if x.ndim == 3 else MDN(0, 1) if x.ndim == 2
                        else None, params)


def _no_decay_on_vectors(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


def _whole_matrix():
    """A custom transform that needs whole tensors: scales each matrix update by the
    Frobenius norm of its Gram matrix g.T @ g, and transposes a square one twice."""
    def update(updates, state, params=None):
        def one(g):
            if g.ndim < 2:
                return g
            gram = jnp.swapaxes(g, -1, -2) @ g
            out = g / (1.0 + jnp.sqrt(jnp.sum(gram * gram)))
            return jnp.swapaxes(jnp.swapaxes(out, -1, -2), -1, -2)
        return jax.tree.map(one, updates), state
    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


c = optax.contrib
OPTIMIZERS = {
    # global and per-leaf norms
    "clip+adamw": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2)),
    "clip+adamw(mask fn)": lambda: optax.chain(
        optax.clip_by_global_norm(0.05),
        optax.adamw(1e-2, weight_decay=0.1, mask=_no_decay_on_vectors)),
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1.0, trust_coefficient=0.02),
    "fromage": lambda: optax.fromage(1e-2),
    "clip_by_block_rms": lambda: optax.chain(optax.clip_by_block_rms(0.01), optax.sgd(0.1)),
    "scale_by_param_block_rms": lambda: optax.chain(optax.scale_by_param_block_rms(),
                                                    optax.sgd(1e-2)),
    "normalize_by_update_norm": lambda: optax.chain(optax.normalize_by_update_norm(),
                                                    optax.sgd(1e-2)),
    # shapes, means and factored statistics
    "centralize": lambda: optax.chain(optax.centralize(), optax.sgd(0.1)),
    "adaptive_grad_clip": lambda: optax.chain(optax.adaptive_grad_clip(0.05), optax.sgd(0.1)),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
    "sm3": lambda: optax.sm3(0.1),
    "novograd": lambda: optax.novograd(1e-2),
    "flatten(adam)": lambda: optax.flatten(optax.adam(1e-2)),
    # whole matrices
    "muon": lambda: c.muon(1e-2, muon_weight_dimension_numbers=_muon_dims),
    "whole-matrix custom": lambda: optax.chain(_whole_matrix(), optax.sgd(0.1)),
    # global scalars in the state
    "prodigy": lambda: c.prodigy(1.0, estim_lr0=1e-2),
    "dadapt_adamw": lambda: c.dadapt_adamw(1.0, estim_lr0=1e-2),
    "dog": lambda: c.dog(1.0, init_step=("distance", 1e-2)),
    "mechanize": lambda: c.mechanize(optax.adam(1e-2), s_init=1e-2),
    "schedule_free_adamw": lambda: c.schedule_free_adamw(1e-2),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), 3),
    "MultiSteps": lambda: optax.MultiSteps(optax.adam(1e-2), 2).gradient_transformation(),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
    "noisy_sgd": lambda: optax.noisy_sgd(1e-2, key=0),
    "polyak_sgd": lambda: optax.polyak_sgd(0.1),
    # elementwise
    "adabelief": lambda: optax.adabelief(1e-2),
    "adagrad": lambda: optax.adagrad(0.1),
    "amsgrad": lambda: optax.amsgrad(1e-2),
    "nadamw": lambda: optax.nadamw(1e-2),
    "radam": lambda: optax.radam(1e-2),
    "rmsprop": lambda: optax.rmsprop(1e-2),
    "yogi": lambda: optax.yogi(1e-2),
    "sgd+momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "lion": lambda: optax.lion(1e-3),
}
# Four bundles of about nine; the first holds the states a checkpoint test restores (factored
# statistics, Muon's momentum, a noise key, injected hyperparameters, MultiSteps' accumulators,
# copies of the initial params).
BUNDLES = [
    ["adafactor", "muon", "noisy_sgd", "inject_hyperparams", "MultiSteps", "prodigy",
     "schedule_free_adamw", "sm3", "adagrad"],
    ["clip+adamw", "lamb", "clip_by_block_rms", "centralize", "flatten(adam)", "dog",
     "apply_if_finite", "adabelief", "lion"],
    ["clip+adamw(mask fn)", "lars", "scale_by_param_block_rms", "adaptive_grad_clip",
     "whole-matrix custom", "dadapt_adamw", "polyak_sgd", "amsgrad", "rmsprop"],
    ["fromage", "normalize_by_update_norm", "novograd", "mechanize", "nadamw", "radam", "yogi",
     "sgd+momentum"],
]
assert sorted(n for b in BUNDLES for n in b) == sorted(OPTIMIZERS)
NO_SCALARS = {"sm3"}  # optax's sm3 keeps one accumulator per axis: a scalar has none ((1,))
# Elementwise updates see no shapes: one matrix is enough (the others also get a scanned stack).
ELEMENTWISE = {"adagrad", "adabelief", "amsgrad", "rmsprop", "nadamw", "radam", "yogi",
               "sgd+momentum", "lion", "inject_hyperparams", "schedule_free_adamw"}


class Bundle:
    """One small model per optimizer: a matrix, a scalar temperature and (unless the optimizer
    is elementwise) a 2-layer scanned stack, of sizes that no N here divides (every leaf is
    padded). `split`: width 6 instead of 7, the matrix and each layer split over the `model`
    axis by their output features (the pieces still padded over "data")."""

    def __init__(self, names, split: bool = False):
        self.names, self.split = tuple(names), split
        self.width = 6 if split else 7

    def init(self, rng):
        """Every matrix from one normal draw (one random program to compile, not two a
        group)."""
        w = self.width
        shapes = [(name, key, shape, scale) for name in self.names
                  for key, shape, scale in (("w", (5, w), 0.4), ("stack", (2, w, w), 0.3))
                  if key == "w" or name not in ELEMENTWISE]
        sizes = [math.prod(shape) for _, _, shape, _ in shapes]
        z = jnp.split(jax.random.normal(rng, (sum(sizes),)), np.cumsum(sizes)[:-1])
        out = {name: {"t": jnp.ones(() if name not in NO_SCALARS else (1,))}
               for name in self.names}
        for (name, key, shape, scale), x in zip(shapes, z):
            out[name][key] = scale * x.reshape(shape)
        return out

    def param_specs(self):
        if not self.split:
            return None
        specs = {"w": P(None, "model"), "t": None, "stack": P(None, None, "model")}
        return {n: {k: v for k, v in specs.items() if k != "stack" or n not in ELEMENTWISE}
                for n in self.names}

    def loss(self, params, batch, units):
        total = 0.0
        for name in self.names:
            p = units.gather({k: v for k, v in params[name].items() if k != "stack"})
            h = jnp.tanh(batch["x"] @ p["w"])
            if "stack" in params[name]:
                h = units.scan(lambda h, s: jnp.tanh(h @ s) + h, h, params[name]["stack"])
            total = total + jnp.mean((jnp.sum(h, -1) * p["t"] - batch["y"]) ** 2)
        return total


def bundled(names):
    """One optimizer per group, labelled by a function of the logical params."""
    labels = lambda params: {k: jax.tree.map(lambda _, k=k: k, v) for k, v in params.items()}
    return optax.partition({n: OPTIMIZERS[n]() for n in names}, labels)


def batches():
    r = np.random.default_rng(0)
    return [{"x": r.normal(size=(BATCH, 5)).astype(np.float32),
             "y": r.normal(size=(BATCH,)).astype(np.float32)} for _ in range(STEPS)]


def reference(bundle, split=False):
    """(per-step losses, final params, initial params) of single-device optax on the bundle."""
    return _reference(bundle, bool(split))  # one cache entry whether `split` is given or not


@functools.cache
def _reference(bundle, split):
    model, tx = Bundle(BUNDLES[bundle], split), bundled(BUNDLES[bundle])
    params = jax.jit(model.init)(jax.random.key(0))  # as Engine.init: one program
    start, state = params, tx.init(params)

    @jax.jit
    def step(params, state, b):
        loss, g = jax.value_and_grad(lambda p: model.loss(p, b, PlainUnits()))(params)
        u, state = tx.update(g, state, params, value=loss)
        return optax.apply_updates(params, u), state, loss

    losses = []
    for b in batches():
        params, state, loss = step(params, state, b)
        losses.append(float(loss))
    reference.opt_state[bundle, split] = state
    return np.array(losses), params, start


reference.opt_state = {}  # the reference's final optimizer state, per (bundle, split)


def assert_matches(bundle, losses, params, split=False):
    """`losses` (None: not checked) and each optimizer's `params` against the reference's."""
    ref_losses, ref, start = reference(bundle, split)
    if losses is not None:
        np.testing.assert_allclose(losses, ref_losses[:len(losses)], rtol=LOSS_RTOL)
    off = {n: moved_error(params[n], ref[n], start[n]) for n in BUNDLES[bundle]}
    assert max(off.values()) <= MOVE_RTOL, {n: f"{v:.2g}" for n, v in off.items()}


CONFIGS = {
    "stage0-n4": ({"data": 4}, {"stage": 0}),
    "stage1-n3": ({"data": 3}, {"stage": 1}),
    "stage2-n4": ({"data": 4}, {"stage": 2}),
    "stage3-hybrid2x2-accum2-offload": ({"replica": 2, "data": 2},
                                        {"stage": 3, "grad_accum": 2, "offload": "optimizer"}),
    # the model axis: the bundle's matrices split over it (Bundle(split=True))
    "stage3-data4-model2": ({"data": 4, "model": 2}, {"stage": 3}),
    "stage1-hybrid2x2-model2": ({"replica": 2, "data": 2, "model": 2}, {"stage": 1}),
}


def split(config) -> bool:
    """Whether `config`'s mesh has a model axis (the bundle then splits its matrices)."""
    return CONFIGS[config][0].get("model", 1) > 1


@functools.cache
def engine(bundle, config):
    """The bundle's engine for `config` (one per test process: its compiled step is reused)."""
    mesh_kw, cfg = CONFIGS[config]
    return zj.Engine(Bundle(BUNDLES[bundle], split(config)), bundled(BUNDLES[bundle]),
                     zj.make_mesh(**mesh_kw), zj.ZeroConfig(**cfg))


def run(bundle, config, steps=STEPS):
    """(per-step losses, final params, state) of the bundle's engine on the table's batches."""
    eng = engine(bundle, config)
    bs = batches()[:steps]
    state = eng.init(jax.random.key(0), bs[0])
    losses = []
    for b in bs:
        state, m = eng.step(state, b)
        losses.append(float(m["loss"]))
    return np.array(losses), eng.params(state), state
