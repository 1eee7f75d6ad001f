"""Model FLOPs per step (the GPT's formula, any model's compiled program), device peaks, MFU."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import gpt_batch

import zerojax as zj
from zerojax.analysis import flops
from zerojax.analysis.hlo import matmul_flops
from zerojax.analysis.measurement import lower
from zerojax.models import GPT


def test_peaks_by_device_kind_specific_names_first():
    expected = {
        "NVIDIA H100 80GB HBM3": 989.0,  # the SXM part, as jax names it on an H100 node
        "NVIDIA H100 PCIe": 756.0,
        "NVIDIA H100 NVL": 835.0,
        "NVIDIA H200": 989.0,
        "NVIDIA GH200 480GB": 989.0,
        "NVIDIA B200": 2250.0,
        "NVIDIA GB200": 2500.0,
        "NVIDIA A100-SXM4-80GB": 312.0,
        "NVIDIA A100 80GB PCIe": 312.0,
        "NVIDIA A10G": None,  # not the A10: whole words only
        "NVIDIA L40S": 362.0,
        "NVIDIA L4": 121.0,
        "TPU v5 lite": 197.0,
        "TPU v5": 459.0,
        "cpu": None,
    }
    assert {k: zj.peak_tflops(k) for k in expected} == expected
    assert zj.peak_tflops(jax.devices()[0]) is None
    cpu = jax.devices()[0]
    assert flops.run_peak(cpu, "bfloat16") == (None, "cpu is not in the peak table (give "
                                                     "--peak-tflops)")
    assert flops.run_peak(cpu, "float32", 50.0) == (50.0, "--peak-tflops")
    assert flops.run_peak(cpu, "float32")[0] is None
    assert zj.throughput(2e12, 0.5, 4, peak=8.0) == {"tflops_per_device": 1.0, "mfu": 0.125}
    assert zj.throughput(2e12, 0.5, 4) == {"tflops_per_device": 1.0}


HLO = textwrap.dedent("""\
    HloModule m

    %inner_cond (p: (s32[], f32[4,8])) -> pred[] {
      %p = (s32[], f32[4,8]{1,0}) parameter(0)
      %i = s32[] get-tuple-element(%p), index=0
      %n = s32[] constant(3)
      ROOT %lt = pred[] compare(%i, %n), direction=LT
    }

    %inner_body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
      %p = (s32[], f32[4,8]{1,0}) parameter(0)
      %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
      %w = f32[8,8]{1,0} constant({...})
      %d = f32[4,8]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
      ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %d)
    }

    %outer_body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
      %p = (s32[], f32[4,8]{1,0}) parameter(0)
      %w2 = (s32[], f32[4,8]{1,0}) while(%p), condition=%inner_cond, body=%inner_body
      %y = f32[4,8]{1,0} get-tuple-element(%w2), index=1
      %b = f32[2,4,8]{2,1,0} broadcast(%y), dimensions={1,2}
      %c = f32[2,4,4]{2,1,0} dot(f32[2,4,8]{2,1,0} %b, f32[2,4,8]{2,1,0} %b), BATCH_DIMS
      ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %y)
    }

    ENTRY %main (a: f32[1,6,6,3]) -> f32[1,4,4,5] {
      %a = f32[1,6,6,3]{3,2,1,0} parameter(0)
      %k = f32[3,3,3,5]{3,2,1,0} parameter(1)
      %w = (s32[], f32[4,8]{1,0}) while(%t0), condition=%c, body=%outer_body, KNOWN_TRIP
      ROOT %conv = f32[1,4,4,5]{3,2,1,0} convolution(%a, %k), window={size=3x3}, LABELS
    }
    """).replace("KNOWN_TRIP", 'backend_config={"known_trip_count":{"n":"5"}}').replace(
    "BATCH_DIMS", "lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, "
    "rhs_contracting_dims={2}").replace("LABELS", "dim_labels=b01f_01io->b01f")


def test_matmul_flops_count_each_loop_trip():
    got, unknown = matmul_flops(HLO)
    inner = 2 * 4 * 8 * 8  # [4,8] @ [8,8], operand types looked up by name
    batched = 2 * (2 * 4 * 4) * 8  # [2,4,8] x [2,4,8] over 8, operand types inline
    conv = 2 * (4 * 4 * 5) * (3 * 3 * 3)  # each output: a 3x3x3 window
    assert (got, unknown) == (5 * (3 * inner + batched) + conv, 0)


def _engine(model, stage, remat=True, grad_accum=1):
    mesh = zj.make_mesh(data=4, devices=jax.devices()[:4])
    return zj.Engine(model, optax.adamw(1e-3), mesh,
                     zj.ZeroConfig(stage=stage, remat=remat, grad_accum=grad_accum))


def _gpt_model_flops(model, batch) -> float:
    """6·N + 12·L·T·d per token, N counted from the params without the embedding tables."""
    c = model.cfg
    params = jax.eval_shape(model.init, jax.random.key(0))
    n = sum(x.size for x in jax.tree.leaves(params)) - (c.vocab_size + c.seq_len) * c.d_model
    b, t = batch["inputs"].shape
    return (6 * n + 12 * c.n_layers * t * c.d_model) * b * t


def test_gpt_model_flops_per_step_on_the_batch_length():
    model = GPT.from_preset("test")
    batch = gpt_batch(model.cfg, 8, 0)
    for b in (batch, {k: v[:, :12] for k, v in batch.items()}):
        np.testing.assert_allclose(zj.step_flops(_engine(model, 3), b),
                                   _gpt_model_flops(model, b), rtol=0.01)
    with pytest.raises(zj.BatchError, match=r"needs 'inputs' of shape \[batch, seq_len\]"):
        zj.step_flops(_engine(model, 3), {"tokens": batch["inputs"]})


@pytest.mark.slow
def test_gpt_compiled_program_agrees_within_the_remat_factor():
    model = GPT.from_preset("test")
    batch = gpt_batch(model.cfg, 8, 0)
    model_flops = _gpt_model_flops(model, batch)
    # The program runs the matmuls only (no biases, LayerNorms): a little under 6·N; remat
    # recomputes each layer's forward (2·N of the 6·N), the head and embeddings not.
    lowered = lower(_engine(model, 0, remat=False), batch)  # 4 devices, one program each
    plain = 4 * matmul_flops(lowered.compiler_ir("hlo").as_hlo_text())[0] / model_flops
    remat = flops.program_flops(_engine(model, 3), batch) / model_flops
    assert 0.95 < plain <= 1.0 and 1.1 < remat < 4 / 3, (plain, remat)
    # XLA's own count sees one trip of the scan over the layers.
    xla = 4 * lowered.cost_analysis()["flops"] / model_flops
    assert xla < 0.75 * plain, (xla, plain)


class MLP:
    """relu(x @ w1) @ w2, squared error: its matmul FLOPs are known exactly."""

    def init(self, rng):
        k1, k2 = jax.random.split(rng)
        return {"l1": {"w": jax.random.normal(k1, (6, 16))},
                "l2": {"w": jax.random.normal(k2, (16, 3))}}

    def loss(self, params, batch, units):
        h = jax.nn.relu(batch["x"] @ units.gather(params["l1"])["w"])
        return jnp.mean((h @ units.gather(params["l2"])["w"] - batch["y"]) ** 2)


@pytest.mark.parametrize("stage, grad_accum", [(3, 2), (0, 1)])
def test_any_model_is_counted_from_its_step_program(stage, grad_accum):
    b = 8
    batch = {"x": np.ones((b, 6), np.float32), "y": np.zeros((b, 3), np.float32)}
    # forward 2·B·(6·16 + 16·3); backward: both weight gradients and the hidden activation's
    # gradient, not the input's (data, not a param)
    expected = 2 * b * (6 * 16 + 16 * 3) + 2 * b * (6 * 16 + 16 * 3) + 2 * b * 16 * 3
    assert zj.step_flops(_engine(MLP(), stage, grad_accum=grad_accum), batch) == expected


def test_the_flop_figures_say_which_n_and_which_flops(tmp_path, monkeypatch):
    """The banner's formula shows the N of its 6·N; a model without a formula is counted from
    its compiled program, and its records say so: hardware FLOPs and HFU, never MFU."""
    from types import SimpleNamespace

    nano = GPT.from_preset("nano")
    c = nano.cfg
    assert nano.flops_params() == nano.num_params() - (c.vocab_size + c.seq_len) * c.d_model
    assert flops.formula(nano) == ("6·N + 12·L·T·d per token (PaLM app. B), N = 826,112 params "
                                   "without the embedding tables")
    assert nano.flops_per_token(64) == 6 * 826_112 + 12 * c.n_layers * 64 * c.d_model
    assert flops.formula(object()).startswith("the compiled step's matrix products")
    engine = SimpleNamespace(model=object(), mesh=zj.make_mesh(data=2),
                             config=zj.ZeroConfig(param_dtype="bfloat16"))
    monkeypatch.setattr(flops, "step_flops", lambda engine, batch: 4e12)
    one = {"loss": 2.0, "grad_norm": 1.0}
    batch = {"x": np.zeros((4, 3), np.float32)}
    # No sinks but metrics.jsonl, and no plot (matplotlib): nothing to close.
    log = zj.RunLog(tmp_path, engine, tensorboard=False, plot_every=1e9, peak_tflops=4.0)
    rec = log.step(1, one, batch, seconds=1.0)
    assert (rec["program_tflops_per_device"], rec["hfu"]) == (2.0, 0.5)
    assert "tflops_per_device" not in rec and "mfu" not in rec
    from zerojax.app.sinks import tag

    assert (tag("program_tflops_per_device"), tag("hfu")) == (
        "perf/per_device_program_tflops_per_sec", "perf/hfu")
    log = zj.RunLog(tmp_path / "b", engine, tensorboard=False, plot_every=1e9, peak_tflops=4.0,
                    flops_per_step=2e12)  # the user's own count: model FLOPs
    rec = log.step(1, one, batch, seconds=1.0)
    assert (rec["tflops_per_device"], rec["mfu"]) == (1.0, 0.25)
