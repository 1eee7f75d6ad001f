"""`plan`'s step time: compute at a fraction of the target's peak plus the link time it does
not hide, the 5% a quantized option must gain, the memory margin, the model axis among the
candidates, and the plan command's options for them. Everything here chooses among
candidates measured once (nothing compiles) except the slow search over model axes."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import pytest

import zerojax as zj
from zerojax.analysis.plan_command import plan_main
from zerojax.analysis.planning import Candidate, PlanResult, plan
from zerojax.analysis.steptime import compute_seconds, step_seconds, target_peak
from zerojax.models import GPT

GB = 1e9

# The 1b preset on 8 devices, batch 8 x 2048, bf16, remat, AdamW, grad_accum 1, as `zerojax plan
# --model 1b --devices 8 --memory 80GB --batch 8 --remat on --grad-accum 1 --bandwidth 450GB/s`
# measured them from XLA:CPU compiles (384 s): stages 0-3 and ZeRO++'s variants of each.
# (stage, qwZ, qgZ, peak, state, sent, launches, sent beside the layers' compute)
ONE_B = [
    (0, None, None, 22_211_126_556, 14_584_070_168, 3_646_017_543, 18, 0),
    (1, None, None, 11_049_620_956, 3_646_017_560, 3_646_017_550, 38, 0),
    (2, None, None, 9_656_478_172, 3_646_017_560, 3_646_017_550, 41, 1_586_285_568),
    (3, None, None, 4_425_856_228, 1_823_008_792, 5_232_303_118, 60, 4_758_856_704),
    (0, None, "int4", 24_164_501_212, 14_584_070_168, 2_293_003_223, 52, 0),
    (1, "int8", "int4", 15_088_910_556, 3_646_017_560, 1_395_741_102, 74, 0),
    (2, "int8", "int4", 9_962_839_964, 3_646_017_560, 1_395_741_102, 80, 408_964_248),
    (3, "int8", "int4", 4_971_531_876, 1_823_008_792, 2_201_276_742, 118, 2_020_035_528),
]
ONE_B_FLOPS = 110_393_812_844_544  # 6·N + 12·L·T·d per token x 16,384 tokens


def one_b(bandwidth, **kw):
    cands = [Candidate(s, True, 1, quantize_weights=qw, quantize_grads=qg, peak_bytes=peak,
                       state_bytes=state, comm_bytes=sent, launches=n, axis_bytes={"data": sent},
                       overlap_bytes={"data": beside} if beside else {})
             for s, qw, qg, peak, state, sent, n, beside in ONE_B]
    result = PlanResult(8, 80 * 10**9, cands, num_params=1_041_719_296,
                        flops=kw.pop("flops", ONE_B_FLOPS), peak_tflops=989.0,
                        peak_from="H100")
    return result.refit(bandwidth=bandwidth, **kw)


def test_one_node_plans_exact_and_a_slow_link_quantized():
    fast = one_b(450 * GB)  # NVLink-class, one node
    # Stage 3's per-layer gathers and reduce-scatters hide behind 31 ms of compute.
    assert not fast.best.quantized and fast.best.stage == 3
    exposed = (5_232_303_118 - 4_758_856_704) / 450e9 + 60 * 10e-6  # + 10 us a launch
    assert fast.best.step_seconds == pytest.approx(fast.compute_seconds + exposed)
    assert fast.compute_seconds == pytest.approx(ONE_B_FLOPS / 8 / (989e12 * 0.45))
    # Quantized stage 3 is 0.2% shorter on a ~33 ms step: a tie, which exact wins.
    q3 = fast.candidates[-1]
    assert q3.step_seconds < fast.best.step_seconds and q3.reason.endswith(", or quantized")
    slow = one_b(10 * GB)
    assert slow.best.zeropp() == "qwZ int8 + qgZ int4" and slow.best.stage == 2
    best_exact = min(c.step_seconds for c in slow.candidates if not c.quantized)
    assert slow.best.step_seconds < 0.95 * best_exact
    # Counting link time alone (no compute, nothing hidden), any bandwidth quantizes: the
    # planner's old answer for one node.
    assert one_b(450 * GB, flops=0).best.quantized


def test_step_is_compute_plus_the_link_time_it_does_not_hide():
    assert compute_seconds(1e15, 8, 1000, 0.5) == pytest.approx(0.25)
    links = {"data": 1e9, "model": 1e9}
    sent, beside = {"data": 4e9, "model": 1e9}, {"data": 3e9, "model": 1e9}
    # 3 s over data beside compute hides behind 2 s of compute but for 1 s; the model axis's
    # 1 s and the 1 s of data outside the loops are exposed.
    assert step_seconds(sent, beside, links, 2.0) == pytest.approx(2 + 2 + 1)
    assert step_seconds(sent, beside, links, 4.0) == pytest.approx(4 + 2)
    assert step_seconds(sent, {}, links, 4.0) == pytest.approx(4 + 5)
    # The stage-2 1b candidate at 450 GB/s: 1.59 GB of its 3.65 GB hidden behind 31 ms.
    r = one_b(450 * GB)
    c2 = next(c for c in r.candidates if c.stage == 2 and not c.quantized)
    assert c2.step_seconds == pytest.approx(r.compute_seconds + (3_646_017_550 - 1_586_285_568)
                                            / 450e9 + 41 * 10e-6)


def test_a_small_model_on_fast_links_is_made_of_latency():
    """The small8 preset at 450 GB/s (batch 8, from its compiles): microseconds of compute and
    of bytes, hundreds of microseconds of collective launches, twice as many quantized."""
    kw = dict(stage=2, remat=True, grad_accum=1, peak_bytes=1)
    exact = Candidate(**kw, comm_bytes=5_839_246, launches=21, axis_bytes={"data": 5_839_246},
                      overlap_bytes={"data": 2_919_618})
    quant = Candidate(**kw, quantize_weights="int8", quantize_grads="int4",
                      comm_bytes=2_238_670, launches=40, axis_bytes={"data": 2_238_670},
                      overlap_bytes={"data": 718_750})
    r = PlanResult(8, 10**9, [exact, quant], flops=11_554_258_944, peak_tflops=989.0)
    fast = r.refit(bandwidth=450e9)
    assert fast.candidates[0].chosen
    # The exact one's traffic beside compute outlasts the 3.2 us of compute: all of its link
    # time counts; the quantized one's hides but for what runs outside the layers.
    compute = 11_554_258_944 / 8 / (989e12 * 0.45)
    assert fast.candidates[0].step_seconds == pytest.approx(5_839_246 / 450e9 + 21 * 10e-6)
    assert fast.candidates[1].step_seconds == pytest.approx(
        compute + (2_238_670 - 718_750) / 450e9 + 40 * 10e-6)
    # Without latency, the bytes alone would quantize it; on a slow link they still do.
    assert r.refit(bandwidth=450e9, latency=0).best.quantized
    assert r.refit(bandwidth=1e9).best.quantized
    with pytest.raises(zj.ConfigError, match="latency=-1"):
        r.refit(latency=-1)


def test_target_peak_of_the_device_planned_for():
    assert target_peak(500.0) == (500.0, "given")
    assert target_peak(device="a100")[0] == 312.0 and target_peak(device="B200")[0] == 2250.0
    cpu = jax.devices()[0]
    assert target_peak(local=cpu) == (989.0, "NVIDIA H100 80GB HBM3, dense bf16 (the default "
                                             "when planning on CPU)")
    for bad in ({"device": "tpu v9"}, {"peak": 0}, {"peak": -1.0}):
        with pytest.raises(zj.ConfigError) as e:
            target_peak(**bad)
        assert "\n" not in str(e.value)
    # A slower device makes compute longer, and so hides more of the links.
    a100 = one_b(450 * GB, peak_tflops=312.0)
    assert a100.compute_seconds == pytest.approx(ONE_B_FLOPS / 8 / (312e12 * 0.45))
    assert not a100.best.quantized


def test_fits_leaves_the_margin_free():
    r = one_b(450 * GB, margin=0.0)
    assert r.budget == 80e9 and all(c.fits for c in r.candidates)
    # 10 GB per device less 10%: stage 2's 9.66 GB peak does not fit, stage 3's 4.43 GB does.
    tight = r.refit(10 * 10**9, margin=0.1)
    by = {(c.stage, c.quantized): c for c in tight.candidates}
    assert not by[2, False].fits and by[3, False].fits
    assert by[2, False].reason == "peak 9.66 GB > 9.00 GB (10.0 GB less the 10% margin)"
    assert tight.best.stage == 3
    assert tight.notes()[0] == "fits: the peak is at most 9.00 GB (10.0 GB less the 10% margin)"
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(zj.ConfigError, match="margin="):
            r.refit(margin=bad)


def test_a_model_axis_is_chosen_when_it_is_the_one_that_fits():
    kw = dict(stage=3, remat=True, grad_accum=1, launches=10)
    flat = Candidate(**kw, peak_bytes=9 * 10**9, comm_bytes=5e9, axis_bytes={"data": 5e9},
                     overlap_bytes={"data": 4.8e9})
    tp = Candidate(**kw, model=2, peak_bytes=6 * 10**9, comm_bytes=4e9,
                   axis_bytes={"data": 2.5e9, "model": 1.5e9},
                   overlap_bytes={"data": 2.4e9, "model": 1.5e9})
    r = PlanResult(8, 10**10, [flat, tp], flops=ONE_B_FLOPS, peak_tflops=989.0, margin=0.0)
    links = {"data": 450e9, "model": 450e9}
    roomy = r.refit(bandwidth=links)
    # The model axis's all-reduces are exposed: 3.1 ms more than the flat mesh's step (whose
    # 0.2 GB outside the layers' compute is, too).
    assert roomy.candidates[0].chosen
    assert roomy.candidates[1].step_seconds - roomy.candidates[0].step_seconds == \
        pytest.approx((1.5e9 + 0.1e9 - 0.2e9) / 450e9)
    tight = r.refit(7 * 10**9, bandwidth=links)
    assert tight.candidates[1].chosen and dict(tight.mesh().shape) == {"data": 4, "model": 2}
    assert "on make_mesh(data=4, model=2)" in str(tight)
    # A model link given apart from data's is the one the model axis's bytes cross.
    slow_model = r.refit(bandwidth={"data": 450e9, "model": 45e9})
    assert slow_model.candidates[1].comm_seconds == pytest.approx(2.5e9 / 450e9 + 1.5e9 / 45e9)


def test_str_of_a_plan_is_what_the_command_prints(capsys, keep_xla_flags):
    argv = ["--model", "test", "--devices", "8", "--memory", "10KB", "--stages", "3",
            "--remat", "on", "--grad-accum", "1", "--model-parallel", "1", "--offload", "off"]
    assert plan_main(argv) == 1
    printed = capsys.readouterr()
    model = GPT.from_preset("test")
    batch = {k: jax.ShapeDtypeStruct((8, 16), jnp.int32) for k in ("inputs", "targets")}
    result = plan(model, 8, 10_000, batch, stages=(3,), remat=(True,), grad_accum=(1,),
                  model_parallel=(1,), offload=False, name="test")
    text = str(result).splitlines()
    # The table and notes on stdout, and the verdict on stderr (nothing fits: exit 1).
    assert printed.out.splitlines() == text[:-1]
    assert printed.err.splitlines()[-1] == text[-1] == (
        "nothing fits: more devices, a smaller batch, or a smaller model")
    assert "model state alone is 38.1 KB > 9.00 KB (10.0 KB less the 10% margin)" in text[4]
    assert text[-3] == "note: fits: the peak is at most 9.00 KB (10.0 KB less the 10% margin)"


@pytest.fixture
def keep_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))


@pytest.mark.parametrize("more, message", [
    (["--model-parallel", "3"], "--model-parallel 3 does not divide the 8 devices of a replica"),
    (["--model-parallel", "0"], "every model-axis size must be >= 1"),
    (["--model-parallel", "two"], "'two': give auto or sizes, e.g. 1,2,4"),
    (["--margin", "100%"], "'100%' must be at least 0% and below 100%"),
    (["--margin", "lots"], "'lots': give a share, e.g. 10% or 0.1"),
    (["--device", "h100"], "--device time the compute of a step, which only --bandwidth"),
    (["--peak-tflops", "500"], "--peak-tflops time the compute"),
    (["--bandwidth", "25GB/s", "--device", "tpu v9"], "device='tpu v9' is not in the peak "
                                                      "table"),
    (["--bandwidth", "25GB/s", "--efficiency", "1.5"], "--efficiency 1.5: give the fraction"),
    (["--bandwidth", "25GB/s", "--peak-tflops", "-3"], "--peak-tflops -3.0: give the device's"),
    (["--bandwidth", "model=400GB/s"], "--bandwidth model: with --replica 1 name data"),
    (["--bandwidth", "nvlink=1TB/s"], "'nvlink' is not a mesh axis; name data, replica and "
                                      "model"),
    (["--params", "1e9"], "--params chooses the nearest GPT shape itself; drop --model"),
    (["--heads", "3"], "d_model=32 must be divisible by n_heads=3; choose --heads that"),
])
def test_plan_options_exit_2_with_one_line(more, message, capsys, keep_xla_flags):
    with pytest.raises(SystemExit) as exc:
        plan_main(["--model", "test", "--devices", "8", "--memory", "1GB", *more])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["--layers", "2"], "a GPT shape needs --layers and --d-model"),
    (["--largest", "--layers", "2"], "--largest searches GPT shapes itself; drop the shape"),
    (["--largest", "--model-parallel", "2"], "--largest compiles nothing"),
])
def test_plan_shape_options_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        plan_main(["--devices", "8", "--memory", "1GB", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.slow
def test_plan_tries_model_axes_when_nothing_fits_on_one(keep_xla_flags):
    model, batch = GPT.from_preset("test"), {
        k: jax.ShapeDtypeStruct((8, 16), jnp.int32) for k in ("inputs", "targets")}
    kw = dict(stages=(3,), remat=(True,), grad_accum=(1,), margin=0.0, offload=False)
    roomy = plan(model, 8, 1e12, batch, model_parallel=(1, 2), **kw)
    flat, tp = roomy.candidates
    assert (flat.model, tp.model) == (1, 2) and tp.peak_bytes < flat.peak_bytes
    assert "model" in tp.axis_bytes and "model" not in flat.axis_bytes
    # Between the two peaks: model = 1 does not fit, so auto tries the model axes the test GPT
    # allows (its 2 heads: M = 2) and chooses data 4 x model 2.
    tight = plan(model, 8, (tp.peak_bytes + flat.peak_bytes) // 2, batch, **kw)
    assert tight.model_searched and [c.model for c in tight.candidates] == [1, 2]
    assert tight.best.model == 2 and dict(tight.mesh().shape) == {"data": 4, "model": 2}
    assert any("the model axes [2] were tried" in n for n in tight.notes())
    assert json.loads(json.dumps(tight.as_dict()))["best"]["model"] == 2
    assert dataclasses.replace(tight.best).mesh_text(8) == "4 x model 2"
