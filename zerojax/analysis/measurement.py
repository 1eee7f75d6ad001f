"""Memory and traffic of compiled training steps, per device: XLA's buffer assignment gives
the memory; hlo.py reads the collectives from the program text (accounting.py: the analytic
model these are checked against).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zerojax.analysis.accounting import (
    ADAM_BYTES,
    CommEstimate,
    MemoryEstimate,
    comm_estimate,
    state_estimate,
)
from zerojax.analysis.hlo import (
    as_requested,
    axis_bytes,
    by_dtype,
    by_kind,
    collective_bytes,
    collective_sites,
    mesh_axis,
)
from zerojax.analysis.tensor import Activations
from zerojax.config import QUANT_BLOCK
from zerojax.mesh import batch_sharding
from zerojax.precision import DTYPES


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Per-device memory and traffic of one compiled training step.

    `state` is the model state the engine keeps between steps, by component: `params`
    (compute copy; 0 where it is the fp32 master itself), `master` (fp32), `optimizer`
    (optax state), `other` (step counter, loss scale) and `total`. There are no `grads`:
    gradients live only inside the step, in `temp_bytes`. `collective_bytes` is in the
    dtype the program asks for; `collective_bytes_compiled` is what the compiled program
    sends on this backend (XLA:CPU upcasts bf16 collectives to f32).

    With offload, `state` also splits into `device` and `host` (the master, optimizer state
    and pending update, on the engine's host mesh). The step's program is the device's
    (`device_peak_bytes` = `peak_bytes`) and `host_peak_bytes` is the peak of the host's
    update, a program of its own. `split` is always "measured" (each peak is its own compiled
    program's); reports made before the host mesh also say "derived".
    """

    stage: int
    devices: int  # data-parallel size N the state is sharded over
    replica: int
    num_params: int
    param_dtype: str  # compute dtype of params and gradients
    param_bytes: int  # bytes per compute param
    reduce_bytes: int  # bytes per reduced gradient element
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int  # argument + output - alias + temp
    state: dict[str, int]
    collective_bytes: dict[str, float]
    collective_bytes_compiled: dict[str, float]
    collective_launches: int  # collectives the program starts per step (loops unrolled)
    unknown_loops: int  # while loops whose trip count was not found (counted once)
    offload: str | None = None
    offload_fraction: float = 1.0  # Twin-Flow: the host's share of the offloaded state
    host_peak_bytes: int = 0  # the host update's peak per host device (offload), else 0
    device_peak_bytes: int = 0  # peak_bytes less what lives in host memory
    split: str = "measured"  # how device/host were told apart: "measured" or "derived"
    # The engine's optimizer state per param, master excluded, from its init (Adam: 8).
    optimizer_state_bytes: float = ADAM_BYTES
    # ZeRO++ (ZeroConfig's fields of the same names), and the requested bytes by kind and
    # element type: a quantized collective's values ("s8", int4 packed in "u8") and scales
    # ("f32") apart.
    quantize_weights: str | None = None
    quantize_grads: str | None = None
    quant_block: int = QUANT_BLOCK
    hpz: bool = False
    collective_dtype_bytes: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    # The requested bytes by the mesh axes a collective spans ("data", "replica", "model",
    # "all"): what `plan` weighs by each link's bandwidth.
    collective_axis_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    # The tensor-parallel `model` axis: its devices M, and the params split over it.
    model: int = 1
    split_params: int = 0
    # The part of `collective_axis_bytes` sent inside loops that also compute (the layer
    # scans): collectives that can run while the loop's other iterations compute.
    collective_overlap_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    # What Megatron's all-reduces move (a GPT's layers and width, the tokens of a data group),
    # for the model axis's formula; None where `measure` could not tell.
    activations: Activations | None = None

    def estimates(self, activations: Activations | None = None
                  ) -> tuple[MemoryEstimate, CommEstimate]:
        """The analytic `state_estimate` (with the engine's optimizer state) and
        `comm_estimate` for this configuration; the model axis's bytes from `activations`
        (default: the measurement's own)."""
        activations = activations or self.activations
        kw = {"replica": self.replica, "hpz": self.hpz, "quant_block": self.quant_block,
              "quantize_weights": self.quantize_weights, "model": self.model,
              "split_params": self.split_params}
        devices = self.devices * self.replica * self.model
        mem = state_estimate(self.num_params, devices, self.stage, self.param_dtype,
                             offload=self.offload, offload_fraction=self.offload_fraction,
                             quantize_grads=self.quantize_grads,
                             optimizer_state_bytes=self.optimizer_state_bytes, **kw)
        comm = comm_estimate(self.num_params, devices, self.stage, param_bytes=self.param_bytes,
                             grad_bytes=self.param_bytes, reduce_bytes=self.reduce_bytes,
                             quantize_grads=self.quantize_grads, activations=activations, **kw)
        return mem, comm

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        """The `zerojax measure` table with this measurement's row."""
        from zerojax.analysis.measure_report import report

        return report(self)


def state_bytes(engine, batch=None) -> dict[str, int]:
    """Per-device bytes of the engine's state by component (from shapes and shardings).

    `batch` (arrays or `jax.ShapeDtypeStruct`s) is needed only if the engine has not learned
    its units yet; nothing is compiled.
    """
    if batch is not None:
        _abstract_batch(engine, batch)
    state = engine.abstract_state()

    def nbytes(tree, where=lambda x: True) -> int:
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                   for x in jax.tree.leaves(tree) if where(x))

    out = {"params": nbytes(state.compute), "master": nbytes(state.master),
           "optimizer": nbytes(state.opt_state),
           "other": nbytes((state.step, state.loss_scale, state.rng, state.model_state))}
    out["total"] = sum(out.values())
    out["host"] = nbytes(engine.host_part(state))
    out["device"] = out["total"] - out["host"]
    return out




def measure(engine, batch) -> Measurement:
    """Compiles `engine`'s step for abstract inputs (allocating nothing) and measures it.

    `batch`: the global batch as arrays or `jax.ShapeDtypeStruct`s. The engine learns its
    units from it if it has not been initialized.
    """
    m = measure_lowered(engine, lower(engine, batch))
    return dataclasses.replace(m, activations=activations_of(engine, batch))


def activations_of(engine, batch) -> Activations | None:
    """What Megatron's all-reduces move in `engine`'s step on `batch`, for a model with a
    GPT-like `cfg` (`n_layers`, `d_model`) and a batch of `inputs` [B, T]; else None."""
    cfg = getattr(engine.model, "cfg", None)
    inputs = batch.get("inputs") if isinstance(batch, dict) else None
    if not hasattr(cfg, "n_layers") or not hasattr(cfg, "d_model") or inputs is None \
            or len(jnp.shape(inputs)) != 2:
        return None
    b, t = jnp.shape(inputs)
    return Activations.of(cfg, b * t, engine.replica * engine.data, engine.config.remat)


def measure_lowered(engine, lowered) -> Measurement:
    """`measure` for a step already lowered with `lower(engine, batch)`."""
    compiled = lowered.compile()
    mem = compiled.memory_analysis()
    r, d, m = engine.replica, engine.data, engine.model_parallel
    cfg = engine.config
    text, compiled_text = lowered.compiler_ir("hlo").as_hlo_text(), compiled.as_text()
    sites, unknown = collective_sites(text, r * d * m)  # the program read once
    sites += model_sites(compiled_text, engine)
    requested, launches = by_kind(sites)
    state = state_bytes(engine)
    peak, host_peak = peaks(mem)
    if engine.host_mesh is not None:
        # Offload: the device's program holds no host state; the host's update is a program
        # of the CPU backend, whose own peak is the host's. Twin-Flow's share of the master
        # and optimizer state stays in device memory beside the devices' program.
        host_peak = host_update_peak(engine)
        peak += twin_flow_bytes(engine)
    return Measurement(
        stage=cfg.stage,
        devices=engine.data,
        replica=engine.replica,
        num_params=engine.layout.num_params,
        param_dtype=cfg.param_dtype,
        param_bytes=jnp.dtype(DTYPES[cfg.param_dtype]).itemsize,
        reduce_bytes=jnp.dtype(DTYPES[cfg.grad_dtype]).itemsize,
        argument_bytes=mem.argument_size_in_bytes,
        output_bytes=mem.output_size_in_bytes,
        alias_bytes=mem.alias_size_in_bytes,
        temp_bytes=mem.temp_size_in_bytes,
        peak_bytes=peak,
        state=state,
        collective_bytes=requested,
        collective_bytes_compiled=collective_bytes(compiled_text, r * d * m),
        collective_launches=launches,
        unknown_loops=unknown,
        offload=cfg.offload,
        offload_fraction=cfg.offload_fraction,
        host_peak_bytes=host_peak,
        device_peak_bytes=peak,
        split="measured",
        optimizer_state_bytes=optimizer_state_size(engine).per_param,
        quantize_weights=cfg.quantize_weights,
        quantize_grads=cfg.quantize_grads,
        quant_block=cfg.quant_block,
        hpz=cfg.hpz,
        collective_dtype_bytes=by_dtype(sites),
        collective_axis_bytes=axis_bytes(sites, r, d, m),
        model=m,
        split_params=sum(leaf.size * (leaf.shape[0] if leaf.stacked else 1)
                         for leaf in engine.layout.leaves if leaf.is_split),
        collective_overlap_bytes=axis_bytes([s for s in sites if s["beside_compute"]], r, d,
                                            m),
    )


def model_sites(compiled_text: str, engine) -> list[dict]:
    """The collectives over the `model` axis of a compiled step, in the dtype the program asks
    for (`hlo.as_requested`): XLA partitions the layers over `model` when it compiles, so
    Megatron's all-reduces are in the compiled program only (the lowered one holds ZeRO's)."""
    r, d, m = engine.replica, engine.data, engine.model_parallel
    if m == 1:
        return []
    dtype = jnp.dtype(DTYPES[engine.config.param_dtype])
    name = {"bfloat16": "bf16", "float16": "f16"}.get(dtype.name, "f32")
    sites, _ = collective_sites(compiled_text, r * d * m)
    return [s for s in as_requested(sites, dtype.itemsize, name)
            if mesh_axis(s["groups"], r, d, m) == "model"]


@dataclasses.dataclass(frozen=True)
class StateSize:
    """The optimizer state `init` allocates for some params, in bytes (master copy excluded)."""

    total: int  # every leaf
    scalars: int  # 0-d leaves: step counts, hyperparameters; they do not grow with the model
    num_params: int

    @property
    def per_param(self) -> float:
        """Bytes per parameter of the state that grows with the model (scalars left out):
        the K of the ZeRO paper's accounting without the fp32 master (Adam: 8)."""
        return (self.total - self.scalars) / self.num_params if self.num_params else 0.0


def state_size(optimizer: optax.GradientTransformation, params) -> StateSize:
    """The bytes of `optimizer.init(params)` for `params` (arrays or `ShapeDtypeStruct`s),
    from shapes alone: nothing is allocated."""
    state = jax.eval_shape(optimizer.init, params)
    leaves = jax.tree.leaves(state)
    nbytes = lambda x: math.prod(x.shape) * jax.numpy.dtype(x.dtype).itemsize
    return StateSize(total=sum(nbytes(x) for x in leaves),
                     scalars=sum(nbytes(x) for x in leaves if not x.shape),
                     num_params=sum(math.prod(x.shape) for x in jax.tree.leaves(params)))


def optimizer_state_size(engine) -> StateSize:
    """What the engine's optimizer allocates for its logical fp32 params (from `init` on
    shapes; the engine must know its units)."""
    layout = engine.layout
    params = layout.unflatten(jax.ShapeDtypeStruct(leaf.shape, jnp.float32)
                              for leaf in layout.leaves)
    return state_size(engine.optimizer, params)


def twin_flow_bytes(engine) -> int:
    """Per device: the master, optimizer state and pending update that Twin-Flow
    (`offload_fraction` < 1) keeps in device memory; 0 without it."""
    state = engine.abstract_state()
    fields = (state.master, state.opt_state, state.pending)
    per_device = lambda t: sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                               for x in jax.tree.leaves(t))
    return per_device(fields) - per_device(engine.host_part(state))


def host_update_peak(engine) -> int:
    """Per host device: the peak bytes of an offloading engine's host update, from its
    compiled program (a CPU program: all of it is host memory)."""
    return peaks(engine.lower_host_update().compile().memory_analysis())[0]


def peaks(mem) -> tuple[int, int]:
    """`(peak, host_peak)` per device from a compiled program's `memory_analysis()`: its
    arguments, outputs not aliased to them and temporaries, in device and in host memory."""
    peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes)
    host_peak = (mem.host_argument_size_in_bytes + mem.host_output_size_in_bytes
                 - mem.host_alias_size_in_bytes + mem.host_temp_size_in_bytes)
    return peak, host_peak


def lower(engine, batch):
    """`engine`'s step lowered for abstract, sharded inputs (learning the units if needed)."""
    batch = _abstract_batch(engine, batch)  # first: the state's layout needs the units
    return engine.lower(engine.abstract_state(), batch)


def _abstract_batch(engine, batch):
    """`batch` as sharded `ShapeDtypeStruct`s; the engine learns its units from it if needed."""
    sharding = batch_sharding(engine.mesh)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x),
                                                        sharding=sharding), batch)
    if engine.plan is None:
        engine._discover(jax.eval_shape(engine.model.init, jax.random.key(0)), batch)
    return batch
