"""The model axis in the analysis: the estimator's split of state and traffic over data ×
model, Megatron's all-reduces, the HLO reader's model groups, and all of it against compiled
steps of the GPT on data × model meshes."""

import json

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import sweep

import zerojax as zj
from zerojax.analysis.accounting import comm_estimate, estimate, state_estimate
from zerojax.analysis.estimate_args import EstimateError
from zerojax.analysis.hlo import as_requested, axis_bytes, collective_sites, mesh_axis
from zerojax.analysis.largest import activation_bytes
from zerojax.analysis.tensor import (
    Activations,
    allowed_model_sizes,
    megatron_bytes,
    split_count,
    split_sizes,
)
from zerojax.models import GPT, SeedMLP

# The test GPT (V 64, T 16, d 32, 2 layers, d_ff 64): what Megatron's plan splits.
TEST_SPLIT = 2 * 64 * 32 + 2 * (32 * 96 + 96 + 32 * 32 + 32 * 64 + 64 + 64 * 32)  # 20,800
TEST_PARAMS = 21_760


# --- what a model splits --------------------------------------------------------------------

def test_split_params_are_megatrons_plan():
    gpt = GPT.from_preset("test")
    assert gpt.num_params() == TEST_PARAMS and split_count(gpt) == TEST_SPLIT
    sizes = split_sizes(gpt)
    # qkv by its 3·d output columns, attention-out by its d inputs, the MLP by d_ff, the
    # tables by the vocabulary.
    assert sizes["['blocks']['attn']['qkv']['kernel']"] == (96, 2 * 32 * 96)
    assert sizes["['blocks']['attn']['out']['kernel']"] == (32, 2 * 32 * 32)
    assert sizes["['embed']['tok']"] == (64, 64 * 32)
    assert "['embed']['pos']" not in sizes and "['blocks']['ln1']['scale']" not in sizes
    assert split_count(SeedMLP()) == 0 and allowed_model_sizes(SeedMLP(), 4) == [1]


def test_allowed_model_sizes_divide_every_split_dimension_and_the_heads():
    test, nano = GPT.from_preset("test"), GPT.from_preset("nano")
    assert allowed_model_sizes(test, 8, heads=2) == [1, 2]
    assert allowed_model_sizes(test, 8) == [1, 2, 4, 8]  # 3d 96, d 32, d_ff 64, V 64
    assert allowed_model_sizes(test, 12) == [1, 2, 4]  # 3 and 6 do not divide 32
    assert allowed_model_sizes(nano, 8, heads=4) == [1, 2, 4]
    # gpt2-small's 50257-row vocabulary splits over no M > 1.
    assert allowed_model_sizes(GPT.from_preset("gpt2-small"), 8, heads=12) == [1]


# --- the estimator over data x model ---------------------------------------------------------

def test_state_divides_split_params_over_data_x_model_and_the_rest_over_data():
    psi, split = 1000, 800  # 8 devices: data 4 x model 2; a model piece: 400 + 200 = 600
    for stage, (params, grads, opt) in {0: (1200, 1200, 7200), 1: (1200, 1200, 1800),
                                        2: (1200, 300, 1800), 3: (300, 300, 1800)}.items():
        e = estimate(psi, 8, stage, model=2, split_params=split)
        assert (e.params, e.grads, e.optimizer, e.total) == (params, grads, opt,
                                                             params + grads + opt)
    # Stage 3: split / (D·M) + replicated / D, 16 bytes a param.
    assert estimate(psi, 8, 3, model=2, split_params=split).total == 16 * (800 / 8 + 200 / 4)
    # Every param split: ZeRO-3 over all 8 devices; none split: over the 4 of data only.
    assert estimate(psi, 8, 3, model=2).total == estimate(psi, 8, 3).total
    assert estimate(psi, 8, 3, model=2, split_params=0).total == estimate(psi, 4, 3).total
    assert estimate(psi, 8, 3, model=1, split_params=800) == estimate(psi, 8, 3)
    # hpZ: the primary shard over data x replica, the secondary within a replica.
    h = estimate(psi, 16, 3, replica=2, model=2, split_params=split, hpz=True)
    assert (h.params, h.secondary) == (2 * 600 / 8, 2 * 600 / 4)
    mem = state_estimate(psi, 8, 3, "float32", model=2, split_params=split)
    assert mem.total == (4 + 8 + 4) * 600 / 4  # fp32: no separate master in stage 3


def test_comm_moves_each_devices_model_piece_over_data_and_activations_over_model():
    acts = Activations(n_layers=2, d_model=32, tokens=32, remat=True)
    for stage in range(4):
        c = comm_estimate(TEST_PARAMS, 8, stage, model=2, split_params=TEST_SPLIT,
                          activations=acts)
        piece = comm_estimate(TEST_SPLIT // 2 + TEST_PARAMS - TEST_SPLIT, 4, stage)
        assert c.axes["data"] == piece.total and c.axes["model"] == acts.bytes(2)
        assert c.total == piece.total + acts.bytes(2)
        assert c.all_reduce == piece.all_reduce + acts.bytes(2)
    # Without the activations the model axis is not counted; without a model axis, nothing.
    assert "model" not in comm_estimate(TEST_PARAMS, 8, 3, model=2).axes
    assert "model" not in comm_estimate(TEST_PARAMS, 8, 3, activations=acts).axes
    # Hybrid: the replica axis's share of the traffic is its own.
    h = comm_estimate(1000, 16, 3, replica=2, model=2, split_params=800)
    assert h.axes == {"data": 3 * 3 / 4 * 600 * 2, "replica": 2 * 1 / 2 * 600 * 2 / 4}
    assert comm_estimate(1000, 8, 0, replica=2).axes == {"all": 2 * 7 / 8 * 2000}


def test_megatrons_all_reduces_per_layer_and_at_the_ends():
    # 2 layers x (2 forward + 2 backward + 1 recomputed) + embedding + head = 12 all-reduces of
    # tokens x d, plus 3 float32 [tokens] reductions of the vocabulary-split cross-entropy;
    # a ring all-reduce over M = 2 sends 2·(M-1)/M = 1x the buffer.
    assert megatron_bytes(2, 32, 32, 2, act_bytes=4) == 12 * 32 * 32 * 4 + 3 * 32 * 4
    assert megatron_bytes(2, 32, 32, 2, act_bytes=4, remat=False) == 10 * 4096 + 384
    assert megatron_bytes(2, 32, 32, 4, act_bytes=2) == 1.5 * (12 * 32 * 32 * 2 + 384)
    assert megatron_bytes(2, 32, 32, 1) == 0
    assert Activations.of(GPT.from_preset("test").cfg, 8 * 16, 4).tokens == 32


def test_activations_split_as_korthikanti_says():
    c = GPT.from_preset("1b").cfg  # T = 2048, d = 2048, 16 heads, 18 layers, V = 32000
    one, two = (activation_bytes(c, 2, "bfloat16", remat=False, model=m) for m in (1, 2))
    layer = lambda m: 2 * 2048 * 2048 * (10 + 24 / m + 5 * 16 * 2048 / (2048 * m))
    assert one["layers"] == 18 * layer(1) and two["layers"] == 18 * layer(2)
    assert two["logits"] == one["logits"] / 2
    # remat: every layer's input (not split) and one layer recomputed.
    on = activation_bytes(c, 2, "bfloat16", remat=True, model=4)
    assert on["layers"] == 18 * 2 * 2048 * 2048 * 2 + layer(4)
    with pytest.raises(EstimateError, match="model=0"):
        activation_bytes(c, 2, model=0)


@pytest.mark.parametrize("kw, text", [
    ({"model": 3}, "devices=8 do not split into replica=1 x data x model=3"),
    ({"model": 0}, "model=0 must be an integer >= 1"),
    ({"model": 2, "split_params": 2000}, "split_params=2000 must be a number of params between"),
    ({"model": 2, "split_params": -1}, "split_params=-1"),
])
def test_bad_model_axis_arguments(kw, text):
    for f in (estimate, comm_estimate):
        with pytest.raises(EstimateError, match=text):
            f(1000, 8, 3, **kw)


# --- reading the model axis from compiled programs -------------------------------------------

def test_mesh_axis_tells_data_model_and_replica_groups_apart():
    # replica x data x model, model innermost: model groups are neighbours.
    assert mesh_axis([[0, 1], [2, 3], [4, 5], [6, 7]], 1, 4, 2) == "model"
    assert mesh_axis([[0, 2, 4, 6], [1, 3, 5, 7]], 1, 4, 2) == "data"
    assert mesh_axis([[0, 4], [1, 5], [2, 6], [3, 7]], 2, 2, 2) == "replica"
    assert mesh_axis([[0, 2], [1, 3], [4, 6], [5, 7]], 2, 2, 2) == "data"
    assert mesh_axis([list(range(8))], 1, 4, 2) == "all"
    assert mesh_axis([[0, 1, 2, 3], [4, 5, 6, 7]], 1, 4, 2) == "other"  # data and model
    assert mesh_axis([[0], [1]], 1, 2, 1) == "none"
    assert mesh_axis([list(range(8))], 1, 8) == "data"  # as before: one flat data axis


def test_groups_on_a_named_mesh_are_read_by_axis():
    """XLA writes a collective the partitioner placed on a named mesh as the mesh and the axes
    it runs over (`mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}`: the
    devices of data 4 x model 2 in model-major order); read as one group of all 8 devices,
    a model-axis gather counted over "all" at 7/8 of its bytes instead of 1/2."""
    mesh = "mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0))"

    def one(line):
        sites, _ = collective_sites(f"ENTRY %main (x: f32[8]) -> f32[16] {{\n  %x = f32[8]{{0}} "
                                    f"parameter(0)\n  ROOT %g = f32[16]{{0}} all-gather(%x), "
                                    f"channel_id=1, {line}, dimensions={{0}}, "
                                    f"use_global_device_ids=true\n}}\n", 8)
        return sites[0]

    model, data = one(f"replica_groups={mesh} {{'axis_0'}}"), one(
        f"replica_groups={mesh} {{'axis_1'}}")
    assert model["groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and model["sent"] == 32
    assert data["groups"] == [[0, 2, 4, 6], [1, 3, 5, 7]] and data["sent"] == 48
    assert axis_bytes([model, data], 1, 4, 2) == {"model": 32, "data": 48}
    # Row-major ids when none are written; a sub-axis `(pre)size`; an explicit id list.
    assert one("replica_groups=mesh['a'=4,'b'=2] {'b'}")["groups"] == \
        [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert one("replica_groups=mesh['a'=8] {'a':(2)2}")["groups"] == \
        [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert one("replica_groups=mesh['a'=8] {'a':(1)2,'a':(4)2}")["groups"] == \
        [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert one("replica_groups=mesh['a'=4,'b'=2], device_ids=(0,2,4,6,1,3,5,7) {'b'}"
               )["groups"] == [[0, 2], [4, 6], [1, 3], [5, 7]]


# A compiled XLA:CPU step on data 4 x model 2: a bf16 all-reduce over model computed in f32
# (its reducer marked promoted) inside a 3-trip loop of matrix products, a float32 one over
# model outside, and a 2-trip loop of data gathers with nothing to compute (as the gathers of
# updated params after the optimizer); what runs beside compute and the widths asked for are
# what `measure` reports.
COMPILED = """HloModule step

%add.clone_promoted (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %a = f32[] add(f32[] %x, f32[] %y)
}

%max.clone (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %m = f32[] maximum(f32[] %x, f32[] %y)
}

%body (p: (s32[], f32[2,16,32])) -> (s32[], f32[2,16,32]) {
  %p = (s32[], f32[2,16,32]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[2,16,32]{2,1,0} get-tuple-element(%p), index=1
  %d = f32[2,16,16]{2,1,0} dot(f32[2,16,32]{2,1,0} %v, f32[2,16,32]{2,1,0} %v), \
lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={2}
  %ar = f32[2,16,32]{2,1,0} all-reduce(%v), channel_id=2, replica_groups=[4,2]<=[8], \
use_global_device_ids=true, to_apply=%add.clone_promoted
  ROOT %t = (s32[], f32[2,16,32]) tuple(%i, %ar)
}

%gathers (q: (s32[], f32[64])) -> (s32[], f32[64]) {
  %q = (s32[], f32[64]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %u = f32[64]{0} get-tuple-element(%q), index=1
  %ag = f32[256]{0} all-gather(%u), channel_id=4, replica_groups={{0,2,4,6},{1,3,5,7}}, \
dimensions={0}, use_global_device_ids=true
  ROOT %t2 = (s32[], f32[64]) tuple(%j, %u)
}

%cond2 (q: (s32[], f32[64])) -> pred[] {
  %q = (s32[], f32[64]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %k = s32[] constant(2)
  ROOT %lt = pred[] compare(s32[] %j, s32[] %k), direction=LT
}

%cond (p: (s32[], f32[2,16,32])) -> pred[] {
  %p = (s32[], f32[2,16,32]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %k = s32[] constant(3)
  ROOT %lt = pred[] compare(s32[] %i, s32[] %k), direction=LT
}

ENTRY %main (a: f32[2,16,32], b: f32[2,16], c: f32[64]) -> f32[2,16] {
  %a = f32[2,16,32]{2,1,0} parameter(0)
  %b = f32[2,16]{1,0} parameter(1)
  %c = f32[64]{0} parameter(2)
  %z = s32[] constant(0)
  %init = (s32[], f32[2,16,32]) tuple(%z, %a)
  %w = (s32[], f32[2,16,32]) while(%init), condition=%cond, body=%body
  %init2 = (s32[], f32[64]) tuple(%z, %c)
  %w2 = (s32[], f32[64]) while(%init2), condition=%cond2, body=%gathers
  %g = f32[256]{0} all-gather(%c), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}, \
dimensions={0}, use_global_device_ids=true
  ROOT %mx = f32[2,16]{1,0} all-reduce(%b), channel_id=3, replica_groups=[4,2]<=[8], \
use_global_device_ids=true, to_apply=%max.clone
}
"""


def test_model_axis_bytes_at_the_width_the_program_asked_for():
    sites, unknown = collective_sites(COMPILED, 8)
    assert unknown == 0
    # Ring over 2: an all-reduce sends 2·1/2 = 1x its buffer, 3 trips of the loop; a gather
    # over 4 sends 3/4 of its 1 KB, once and in 2 trips.
    assert axis_bytes(sites, 1, 4, 2) == {"model": 3 * 4096 + 128, "data": 3 * 768}
    assert sorted(s["promoted"] for s in sites) == [False, False, False, True]
    asked = as_requested(sites, 2, "bf16")
    # The bf16 reduction XLA:CPU widened counts at 2 bytes; the float32 max stays 4.
    assert axis_bytes(asked, 1, 4, 2) == {"model": 3 * 2048 + 128, "data": 3 * 768}
    # Both loops are loops; only the one that computes has compute to hide its collectives.
    assert axis_bytes([s for s in asked if s["in_loop"]], 1, 4, 2) == {"model": 3 * 2048,
                                                                      "data": 2 * 768}
    beside = [s for s in asked if s["beside_compute"]]
    assert axis_bytes(beside, 1, 4, 2) == {"model": 3 * 2048}
    assert {d for s in asked for d in s["by_dtype"]} == {"bf16", "f32"}
    assert as_requested(sites, 4, "f32") == sites  # a float32 program asked for float32


# --- measured against the formulas (compiles) -----------------------------------------------

def engine(stage, model, dtype="float32", remat=True):
    cfg = zj.ZeroConfig(stage=stage, param_dtype=dtype, remat=remat)
    mesh = zj.make_mesh(data=8 // model, model=model)
    return zj.Engine(GPT.from_preset("test"), optax.adamw(3e-4), mesh, cfg)


def batch(n=8):
    return {k: jax.ShapeDtypeStruct((n, 16), jnp.int32) for k in ("inputs", "targets")}


# Compiled on 8 devices: the slow tier (test_model_axis_memory.py reads a data x model step's
# state and collectives in the quick one).
@pytest.mark.parametrize("stage, dtype, remat", sweep(
    [(3, "float32", True), (0, "float32", False), (3, "bfloat16", True)], quick=[]))
def test_measured_bytes_per_axis_and_state_match_the_formulas(stage, dtype, remat):
    from zerojax.analysis.measurement import measure

    m = measure(engine(stage, 2, dtype, remat), batch())
    mem, comm = m.estimates()
    assert (m.model, m.devices, m.split_params) == (2, 4, TEST_SPLIT)
    assert m.activations == Activations(2, 32, 32, remat)
    # The state to the byte: each device's piece, 10,400 split + 960 replicated params, over 4
    # (plus the scalars: step, Adam's count, loss scale, its counter, base key).
    assert m.state["total"] == mem.total - mem.grads + 24
    # Megatron's all-reduces as the compiled program sends them, in the dtype asked for, and
    # a few loss and norm scalars more.
    assert m.collective_axis_bytes["model"] == pytest.approx(comm.axes["model"], rel=0.01)
    assert m.collective_axis_bytes["model"] > comm.axes["model"]
    # ZeRO over data moves the pieces; stage 3 gathers the embedding and head once (8% less).
    rel = 0.001 if stage == 0 else 0.08
    assert m.collective_axis_bytes["data"] == pytest.approx(comm.axes["data"], rel=rel)
    assert set(m.collective_axis_bytes) == {"data", "model"}
    # Beside the layers' compute: the model axis's per-layer reductions, 2 layers of 4 (+1
    # remat), and at stage 3 ZeRO's per-layer gathers and reduce-scatters; at stage 0 nothing
    # over data (the gradient's all-reduce follows the backward pass).
    layers = 2 * (4 + remat) * 32 * 32 * (2 if dtype == "bfloat16" else 4)
    assert m.collective_overlap_bytes["model"] == layers
    assert (m.collective_overlap_bytes.get("data", 0) > 0.5 * m.collective_axis_bytes["data"]) \
        == (stage == 3)
    text = str(m)
    assert "over model" in text and "model formula" in text


# --- the estimate command: any shape, a model axis, its assumptions ---------------------------

def test_estimate_command_with_a_shape_and_a_model_axis(capsys):
    from zerojax.analysis.estimate_command import estimate_main

    argv = ["--devices", "8", "--model-parallel", "2", "--json"]
    assert estimate_main(["--model", "test", *argv]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert (out["params"], out["split_params"], out["model_parallel"]) == (TEST_PARAMS,
                                                                         TEST_SPLIT, 2)
    stage3 = out["stages"][3]
    assert stage3["memory"]["total"] == 16 * (TEST_SPLIT / 8 + (TEST_PARAMS - TEST_SPLIT) / 4)
    # One sequence per data-parallel device by default: 16 tokens, bf16 activations.
    assert stage3["comm"]["axes"]["model"] == megatron_bytes(2, 32, 16, 2, act_bytes=2)
    facts = out["assumptions"]
    assert facts["mesh"] == "8 devices: data 4 x model 2"
    assert facts["model axis"].startswith("20,800 params split over model")
    assert "Megatron's all-reduces over model" in facts["comm"]
    assert facts["K"] == "12 bytes per param: fp32 master + Adam moments"
    for key, value in facts.items():
        assert f"{key}:" in captured.err and value in captured.err
    # The same shape by its dimensions.
    dims = ["--layers", "2", "--d-model", "32", "--heads", "2", "--vocab", "64", "--seq-len",
            "16", "--d-ff", "64"]
    assert estimate_main([*dims, *argv]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["stages"] == out["stages"] and again["model"].startswith("GPT (2 layers")


def test_estimate_table_and_str_of_a_memory_estimate_agree(capsys):
    from zerojax.analysis.estimate_command import estimate_main

    assert estimate_main(["--params", "7.5e9", "--devices", "64"]) == 0
    table = capsys.readouterr().out
    text = str(estimate(7_500_000_000, 64, 3))
    assert text.splitlines()[0].strip() == "per-device model state (estimated)"
    row = text.splitlines()[-2]  # the one data row, above the bottom border
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells == ["234 MB", "234 MB", "1.41 GB", "1.88 GB"]
    assert all(c in table for c in cells)  # the CLI's stage-3 row
    assert "host" in str(estimate(7_500_000_000, 64, 3, offload="optimizer"))


@pytest.mark.parametrize("argv, message", [
    (["--params", "1e9", "--model", "test"], "--params and a GPT shape both give Ψ; drop one"),
    (["--devices", "8"], "required: --params (or a GPT shape"),
    (["--params", "1e9", "--batch", "8"], "--batch and --no-remat size the activations"),
    (["--params", "1e9", "--model-parallel", "3"],
     "--devices 8 do not split into --replica 1 x data x --model-parallel 3"),
    (["--model", "test", "--batch", "6", "--model-parallel", "2"],
     "--batch 6 is not divisible by the 4 data-parallel devices"),
    (["--d-model", "64"], "a GPT shape needs --layers and --d-model"),
])
def test_estimate_bad_shape_options_exit_2(argv, message, capsys):
    from zerojax.analysis.estimate_command import estimate_main

    with pytest.raises(SystemExit) as exc:
        estimate_main(["--devices", "8", *argv] if "--devices" not in argv else argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
