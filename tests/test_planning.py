"""The planner and the estimate / measure / plan commands."""

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import pytest

import zerojax as zj
from zerojax.analysis.commands import measure_main
from zerojax.analysis.console import parse_bytes
from zerojax.analysis.estimate_command import estimate_main
from zerojax.analysis.plan_command import plan_main
from zerojax.analysis.planning import (
    Candidate,
    PlanResult,
    _zeropp,
    link_seconds,
    named_optimizer,
    on_links,
    plan,
)
from zerojax.models import GPT

MB = 1e6


def small8_batch(n):
    shape = (n, GPT.from_preset("small8").cfg.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("inputs", "targets")}


@pytest.fixture(scope="module")
def roomy_run():
    """Every stage of small8 on 8 devices with memory to spare (4 compiles, shared), and the
    progress calls the planner made."""
    calls = []
    result = plan(GPT.from_preset("small8"), 8, 1e12, small8_batch(8), remat=(True,),
                  grad_accum=(1,), progress=lambda c, phase, i, n: calls.append(
                      (c.stage, phase, i, n, c.peak_bytes is not None)))
    return result, calls


@pytest.fixture(scope="module")
def roomy(roomy_run):
    return roomy_run[0]


def test_progress_names_each_candidate_before_it_compiles(roomy_run):
    result, calls = roomy_run
    # Lowered, then compiled (no result yet), then done (measured), in order.
    assert calls == [(s, phase, s + 1, 4, phase == "done") for s in range(4)
                     for phase in ("lowering", "compiling", "done")]
    assert result.num_params == GPT.from_preset("small8").num_params()


def test_everything_fits_picks_stage_0(roomy):
    assert [c.stage for c in roomy.candidates] == [0, 1, 2, 3]
    assert all(c.fits for c in roomy.candidates)
    # Stages 0-2 send the same bytes (2(N-1)/N·Ψ·2); stage 0 does it in the fewest collectives.
    assert roomy.best.stage == 0 and roomy.best.chosen and roomy.best.reason == ""
    assert roomy.config() == zj.ZeroConfig(stage=0, param_dtype="bfloat16", remat=True)
    by_stage = {c.stage: c for c in roomy.candidates}
    assert "same cost" in by_stage[2].reason
    assert by_stage[3].reason.startswith("fits; sends")
    assert by_stage[3].comm_bytes / by_stage[0].comm_bytes == pytest.approx(1.5, rel=0.02)


def test_stage_3_when_nothing_else_fits(roomy):
    peaks = {c.stage: c.peak_bytes for c in roomy.candidates}
    assert peaks[3] < 10 * MB < min(peaks[0], peaks[1], peaks[2])
    tight = roomy.refit(10 * MB, margin=0)
    assert tight.best.stage == 3
    assert [c.fits for c in tight.candidates] == [False, False, False, True]
    for c in tight.candidates[:3]:
        assert c.reason.startswith("peak ") and c.reason.endswith("> 10.0 MB")
    assert roomy.best.stage == 0  # refit leaves the original alone


def test_nothing_fits_and_state_too_big_is_not_compiled():
    result = plan(GPT.from_preset("small8"), 8, 1 * MB, small8_batch(8), stages=(0,),
                  remat=(True,), grad_accum=(1,), model_parallel=(1,))
    (c,) = result.candidates
    assert result.best is None and not c.fits and c.peak_bytes is None
    assert c.state_bytes == pytest.approx(16 * GPT.from_preset("small8").num_params() - 2 *
                                          GPT.from_preset("small8").num_params(), rel=1e-5)
    assert c.reason == ("model state alone is 23.4 MB > 900 KB (1.00 MB less the 10% margin) "
                        "(not compiled)")
    assert c.comm_bytes == pytest.approx(2 * 7 / 8 * 2 * GPT.from_preset("small8").num_params(),
                                         rel=1e-5)
    with pytest.raises(ValueError, match="no configuration fits"):
        result.config()


def test_notes_explain_the_full_size_accumulator_of_stages_0_and_1():
    def result(*cands):
        return PlanResult(64, 80 * 10**9, list(cands), num_params=6_714_695_680)

    stage1 = Candidate(1, True, 2, peak_bytes=89_430_000_000)
    # Every plan says what "fits" means and that CPU compiles gave the peaks.
    always = ["fits: the peak is at most 72.0 GB (80.0 GB less the 10% margin)",
              "peaks and bytes are read from XLA:CPU compiles on simulated devices; a GPU's "
              "peaks differ (on CPU stages 0-2 hold float32 copies of the weights: "
              "docs/memory.md), so keep the margin"]
    *first, note = result(Candidate(1, True, 1, peak_bytes=1), stage1).notes()
    assert first == always
    # 7B on 64 devices: accum 2 costs stage 1 22.1 GB more than accum 1 (67.3 -> 89.4 GB),
    # while it saves stage 2 4.2 GB (55.1 -> 50.9 GB): 26.3 GB apart, 4Ψ(1 - 1/N) = 26.4 GB.
    assert "full-size float32 gradient accumulator (4 B x Ψ = 26.9 GB)" in note
    assert "1/N shard (420 MB)" in note
    assert result(Candidate(2, True, 4, peak_bytes=1)).notes() == always
    assert result(Candidate(1, True, 2)).notes() == always  # not compiled: no peak to explain
    assert result(stage1).as_dict()["notes"] == [*always, note]
    gpu = dataclasses.replace(result(stage1), platform="gpu", margin=0.0)
    assert gpu.notes() == ["fits: the peak is at most 80.0 GB", note]


def test_indivisible_micro_batches_are_rejected_with_the_reason():
    result = plan(GPT.from_preset("small8"), 8, 1e12, small8_batch(8), stages=(1,),
                  remat=(True,), grad_accum=(2,), model_parallel=(1,))
    (c,) = result.candidates
    assert result.best is None and c.reason.startswith("batch: per-device batch 1")


@pytest.mark.parametrize("text, value", [("80GB", 80e9), ("80GiB", 80 * 2**30), ("8e10", 8e10),
                                         ("512MB", 512e6), ("1.5 TB", 1.5e12), ("100", 100)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_parse_bytes_rejects_garbage():
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("eighty gigs")


# --- commands -----------------------------------------------------------------------------

def test_estimate_json_reproduces_zero_figure_1(capsys):
    assert estimate_main(["--params", "7.5e9", "--devices", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    totals = [s["memory"]["total"] for s in out["stages"]]
    assert totals == [120e9, 31.40625e9, 16.640625e9, 1.875e9]
    assert out["stages"][3]["comm"]["total"] == 1.5 * out["stages"][0]["comm"]["total"]


def test_estimate_table(capsys):
    assert estimate_main(["--params", "7.5e9", "--devices", "64"]) == 0
    out = capsys.readouterr().out
    for text in ("120 GB", "31.4 GB", "16.6 GB", "1.88 GB"):
        assert text in out


@pytest.mark.parametrize("main, argv, message", [
    (estimate_main, ["--params", "7.5e9"], "required: --devices"),
    (estimate_main, ["--params", "1.5", "--devices", "8"], "num_params=1.5"),
    (estimate_main, ["--params", "1e9", "--devices", "0"], "'0' must be a positive integer"),
    (measure_main, ["--model", "huge", "--devices", "8"], "invalid choice: 'huge'"),
    (measure_main, ["--model", "test", "--devices", "8", "--stage", "4"], "stages are 0, 1"),
    (plan_main, ["--model", "test", "--devices", "8", "--memory", "lots"], "not a size"),
    (plan_main, ["--model", "test", "--devices", "8"], "required: --memory"),
    (measure_main, ["--model", "test", "--devices", "8", "--offload", "optimizer"],
     "--offload optimizer needs stages 1-3; drop stage 0"),
    (estimate_main, ["--params", "1e9", "--devices", "8", "--offload", "params"],
     "invalid choice: 'params'"),
    (measure_main, ["--model", "test", "--devices", "8", "--stage", "3", "--hpz"],
     "--hpz needs --stage 3 and --replica R > 1 (got --stage 3, --replica 1)"),
    (measure_main, ["--model", "test", "--devices", "8", "--replica", "3"],
     "do not split into --replica 3 groups"),
    *[(plan_main, ["--model", "test", "--devices", "8", "--memory", "1GB", *more], message)
      for more, message in [
          (["--replica", "2"], "--replica 2 weighs the link between replicas"),
          (["--quantize", "int8"], "--quantize int8 needs --bandwidth"),
          (["--bandwidth", "replica=25GB/s,data=1TB/s"], "names a replica link but --replica"),
          (["--bandwidth", "nvlink=400GB/s"], "'nvlink' is not a mesh axis"),
          (["--bandwidth", "0GB/s"], "'0GB/s' must be more than 0 bytes per second"),
          (["--bandwidth", "0"], "'0' must be more than 0 bytes per second"),
          (["--bandwidth=-5GB/s"], "'-5GB/s' must be more than 0 bytes per second"),
          (["--bandwidth", "nan"], "'nan' is not a size"),
          (["--bandwidth", "inf"], "'inf' is not a size"),
          (["--replica", "2", "--bandwidth", "data=400GB/s,replica=0"],
           "'0' must be more than 0 bytes per second"),
          (["--bandwidth", "fast"], "'fast' is not a size"),
          (["--replica", "3", "--bandwidth", "25GB/s"], "do not split into --replica 3 groups"),
          (["--replica", "2", "--bandwidth", "data=400GB/s"],
           "with --replica 2 name data and replica"),
          (["--largest", "--bandwidth", "25GB/s"], "--largest compiles nothing")]],
])
def test_bad_options_exit_2_with_one_line(main, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


@pytest.fixture
def keep_xla_flags(monkeypatch):
    # The commands set XLA_FLAGS for the device count; keep that from leaking to other tests.
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))


def test_plan_command_when_nothing_fits(capsys, keep_xla_flags):
    argv = ["--model", "small8", "--devices", "8", "--memory", "1MB", "--stages", "0",
            "--remat", "on", "--grad-accum", "1", "--model-parallel", "1"]
    assert plan_main([*argv, "--json"]) == 1
    captured = capsys.readouterr()
    out = json.loads(captured.out)  # the assumptions and the progress go to stderr
    assert out["best"] is None and out["device_memory"] == 1_000_000
    assert out["candidates"][0]["reason"].startswith("model state alone")
    facts = out["assumptions"]
    assert facts["global batch"] == ("8 sequences x 128 tokens (1 per device); per-device "
                                     "micro-batch 1 for grad_accum 1")
    assert facts["sequence length"] == "128"
    assert facts["params and grads"] == "bfloat16 (gradients reduced in bfloat16)"
    assert (facts["master params"], facts["optimizer"]) == ("float32",
                                                            "AdamW (lr 0.0003), moments in float32")
    assert facts["memory budget"].startswith("1.00 MB per device")
    assert facts["searched"].startswith("stages 0 x remat on x grad_accum 1 = 1 candidate;")
    for key, value in facts.items():
        assert f"{key}:" in captured.err and value in captured.err
    assert "stage 0, remat on, accum 1: lowering 1/1" in captured.err
    assert "searched 1 candidate in " in captured.err
    assert plan_main(argv) == 1
    captured = capsys.readouterr()
    assert "model state alone" in captured.out and "nothing fits" in captured.err


@pytest.mark.parametrize("main", [estimate_main, measure_main, plan_main])
def test_help_shows_the_defaults(main, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # help text is wrapped
    expected = {estimate_main: ["K: fp32 master + Adam moments per param (default: 12)",
                                "replica groups (hybrid) (default: 1)"],
                measure_main: ["or e.g. 0,3 (default: all)", "per step (default: 1)",
                               "(default: bfloat16)", "in backward (default: True)"],
                plan_main: ["or e.g. 0,3 (default: all)", "(default: 1,2,4)",
                            "(default: both)", "(default: bfloat16)"]}[main]
    for text in expected:
        assert text in out
    assert "(default: None)" not in out and "(default: False)" not in out


def test_measure_command_float32_state_formula_is_exact(capsys, keep_xla_flags):
    assert measure_main(["--model", "test", "--devices", "8", "--stage", "0,3",
                         "--param-dtype", "float32", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["assumptions"]["master params"].startswith("the float32 params themselves")
    for m in out["measurements"]:
        mem = m["estimate"]["memory"]
        # 24 bytes of scalars: step, Adam's count, loss scale, its good-step count, base key.
        assert m["state"]["total"] == mem["total"] - mem["grads"] + 24
        assert m["state"]["params"] == 0  # the fp32 master is the compute copy
    assert [m["state"]["total"] for m in out["measurements"]] == [261_144, 32_664]
    assert "stage 3, remat on, accum 1: compiling 2/2" in captured.err


def test_measure_command_needs_a_fresh_process_for_more_devices(capsys, keep_xla_flags):
    with pytest.raises(SystemExit) as exc:
        measure_main(["--model", "test", "--devices", "16"])
    assert exc.value.code == 2
    assert "run it in a fresh process" in capsys.readouterr().err


# --- plan --largest -----------------------------------------------------------------------

def test_activation_estimate_is_the_stated_formula():
    from zerojax.analysis.largest import activation_bytes

    c = GPT.from_preset("1b").cfg  # T = 2048, d = 2048, 16 heads, 18 layers, V = 32000
    layer = 2 * 2048 * 2048 * (34 + 5 * 16 * 2048 / 2048)  # b = 2, bf16: 2 bytes a value
    logits = 2 * 2048 * 32000 * (2 + 8)
    on = activation_bytes(c, 2, "bfloat16", remat=True)
    assert on == {"layers": 18 * 2 * 2048 * 2048 * 2 + layer, "logits": logits,
                  "total": 18 * 2 * 2048 * 2048 * 2 + layer + logits}
    off = activation_bytes(c, 2, "float32", remat=False)
    assert off["layers"] == 18 * 2 * layer and off["logits"] == 2 * 2048 * 32000 * 12


def test_largest_is_the_biggest_shape_whose_estimate_fits():
    from zerojax.analysis.accounting import state_estimate
    from zerojax.analysis.largest import activation_bytes, estimate_fit, gpt_family, largest

    family = gpt_family()
    sizes = [GPT(c).num_params() for c in family.values()]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)  # no shape twice
    assert family["7b"] == GPT.from_preset("7b").cfg and "gpt3-175b" in family
    rows = largest(1, 80e9)
    assert [(r["stage"], r["remat"]) for r in rows] == [(s, r) for s in range(4)
                                                        for r in (True, False)]
    for r in rows:
        f, nx = r["fits"], r["next"]
        cfg = family[f.name]
        psi = GPT(cfg).num_params()
        # On one device every stage keeps the whole state: 16 bytes a param, grads included.
        assert f.state == state_estimate(psi, 1, r["stage"]).total == 16 * psi
        assert f.activations == activation_bytes(cfg, 1, "bfloat16", r["remat"])["total"]
        assert f.gathered == 0 and f.peak == f.state + f.activations <= 80e9 < nx.peak
        names = list(family)
        assert names.index(nx.name) == names.index(f.name) + 1  # the very next shape
    assert {r["fits"].name for r in rows if r["remat"]} == {"gpt-4b"}
    assert {r["fits"].name for r in rows if not r["remat"]} == {"gpt3-2.7b"}
    # Eight devices: sharding lets stage 3 reach further than stage 0; it adds one gathered
    # unit (here the 32000 x 6144 table) and its gradient.
    by_stage = {r["stage"]: r["fits"] for r in largest(8, 80e9, remat=(True,))}
    assert by_stage[0].name == "gpt-4b" and by_stage[3].num_params > 4 * by_stage[0].num_params
    f3 = by_stage[3]
    assert f3 == estimate_fit(f3.name, family[f3.name], 8, 3, 1)
    assert f3.gathered == 2 * 2 * max(family[f3.name].layer_params,
                                      family[f3.name].vocab_size * family[f3.name].d_model)
    assert largest(1, 1e9, stages=(0,), remat=(True,))[0]["fits"] is None  # nothing fits


def test_plan_largest_command(capsys):
    argv = ["--devices", "1", "--memory", "80GB", "--largest"]
    assert plan_main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert (out["devices"], out["device_memory"], out["batch"]) == (1, 80_000_000_000, 1)
    rows = {(r["stage"], r["remat"]): r for r in out["largest"]}
    assert rows[3, True]["fits"]["name"] == "gpt-4b" and rows[3, True]["next"]["name"] == "7b"
    assert rows[0, False]["fits"]["name"] == "gpt3-2.7b"
    for key in ("global batch", "sequence length", "params and grads", "master params",
                "optimizer", "activations", "remat"):
        assert f"{key}:" in captured.err and out["assumptions"][key] in captured.err
    assert out["assumptions"]["global batch"] == "1 sequence (1 per device), no grad_accum"
    assert plan_main([*argv, "--stages", "3", "--remat", "on"]) == 0
    table = capsys.readouterr().out
    assert "gpt-4b" in table and "4.28B" in table and "7b (6.71B)" in table
    # one row: stage 3, remat on, whose offload column goes on to gpt3-13b: host memory is
    # not limited, and XLA:GPU's default pinned-host pool (64 GiB) holds gpt3-13b's gradient
    # shard on its way to the host (2Ψ = 25.8 GB); the state is in the CPU backend's memory
    assert table.count("gpt-4b") == 1 and "gpt3-13b" in table
    assert "pinned-host limit" not in table
    assert plan_main(["--devices", "1", "--memory", "1GB", "--largest", "--stages", "0"]) == 1
    captured = capsys.readouterr()
    assert "nothing fits: the smallest shape, gpt3-125m, needs more than 1.00 GB" in captured.err


@pytest.mark.parametrize("argv, message", [
    (["--devices", "2", "--memory", "80GB", "--largest", "--batch", "3"],
     "--batch 3 is not divisible by --devices 2"),
    (["--devices", "1", "--memory", "80GB", "--largest", "--model", "1b"], "drop --model 1b"),
    (["--devices", "1", "--memory", "80GB"], "required: --model (or --largest)"),
])
def test_plan_largest_bad_options_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        plan_main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


# --- optimizer offload ------------------------------------------------------------------------

def test_largest_with_offload_is_the_estimate():
    from zerojax.analysis.accounting import state_estimate
    from zerojax.analysis.largest import activation_bytes, gpt_family, largest

    family = gpt_family()
    rows = largest(1, 80e9, offload="optimizer")
    # Stage 0 cannot offload; on one device the device keeps 2Ψ params + 2Ψ grads (stage 3:
    # 4Ψ/N, N = 1) and the host the master and moments, 12Ψ.
    assert [(r["stage"], r["remat"], r["offload"]) for r in rows] == [
        (s, rm, "optimizer") for s in (1, 2, 3) for rm in (True, False)]
    for r in rows:
        f, nx = r["fits"], r["next"]
        psi = GPT(family[f.name]).num_params()
        mem = state_estimate(psi, 1, r["stage"], offload="optimizer")
        assert (f.state, f.host, f.transfer) == (mem.total, mem.host, mem.transfer)
        assert (f.state, f.host, f.transfer) == (4 * psi, 12 * psi, 4 * psi)
        assert f.activations == activation_bytes(family[f.name], 1, "bfloat16", r["remat"])[
            "total"]
        assert f.peak == f.state + f.activations <= 80e9 < nx.peak
    assert {r["fits"].name for r in rows if r["remat"]} == {"gpt3-13b"}  # 2.7B-4B without
    assert {r["fits"].name for r in rows if not r["remat"]} == {"7b"}
    # The host peak adds the gradient shard down and the compute shard up to the state:
    # 12Ψ + 2Ψ + 2Ψ. 100 GB of host memory holds gpt-4b's (68.5 GB), not 7b's (107 GB).
    capped = largest(1, 80e9, offload="optimizer", host_memory=100e9, remat=(True,))
    assert {r["fits"].name for r in capped} == {"gpt-4b"}
    assert {r["next"].name for r in capped} == {"7b"}
    assert {tuple(r["binds"]) for r in capped} == {("host",)}
    for r in capped:
        assert (r["fits"].host_peak, r["next"].host_peak) == (16 * 4_281_206_784,
                                                              16 * 6_714_695_680)
    # XLA:GPU's pinned-host pool holds the gradient shard on its way to the host, 2Ψ (7b:
    # 13.4 GB, gpt3-13b: 25.8 GB); both bind: both named.
    both = largest(1, 80e9, offload="optimizer", host_memory=100e9, pinned=10e9,
                   stages=(3,), remat=(True,))
    assert (both[0]["fits"].name, both[0]["binds"]) == ("gpt-4b", ["host", "pinned-host limit"])
    assert both[0]["next"].pinned == 2 * 6_714_695_680
    pinned = largest(1, 80e9, offload="optimizer", pinned=20e9, stages=(3,), remat=(True,))
    assert (pinned[0]["fits"].name, pinned[0]["binds"]) == ("7b", ["pinned-host limit"])


def test_plan_largest_command_adds_offload_columns(capsys):
    argv = ["--devices", "1", "--memory", "80GB", "--largest", "--pinned-limit", "none"]
    assert plan_main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    rows = {(r["stage"], r["remat"]): r for r in out["largest"]}
    assert rows[0, True]["offload"] is None
    assert rows[3, True]["offload"]["fits"]["name"] == "gpt3-13b"
    assert rows[3, True]["offload"]["next"]["name"] == "neox-20b"
    assert rows[3, True]["offload"]["fits"]["host"] == 12 * rows[3, True]["offload"]["fits"][
        "num_params"]
    assert "12 bytes x Ψ/N per device; host peak" in out["assumptions"]["offload"]
    assert "host memory, not limited, and XLA:GPU's pinned-host pool, not limited (--pinned" \
        in out["assumptions"]["offload"]
    assert out["assumptions"]["offload"] in captured.err
    assert plan_main([*argv, "--stages", "3", "--remat", "on"]) == 0
    table = capsys.readouterr().out
    assert "+ offload" in table and "gpt3-13b" in table and "12.92B" in table
    assert "155 GB" in table and "51.7 GB" in table  # host 12Ψ, host<->device 4Ψ
    assert plan_main([*argv, "--offload", "off", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert "offload" not in out["assumptions"]
    assert all(r["offload"] is None for r in out["largest"])


def test_plan_tries_offload_only_when_nothing_fits():
    from test_measure import engine_offloads

    model = GPT.from_preset("test")
    shape = (8, model.cfg.seq_len)
    b = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("inputs", "targets")}
    kw = dict(stages=(3,), remat=(True,), grad_accum=(1,), model_parallel=(1,), margin=0)
    roomy = plan(model, 8, 1e12, b, **kw)
    (c,) = roomy.candidates
    assert not roomy.offload_searched and c.offload is None and roomy.best is c
    budget = c.peak_bytes - 1
    never = plan(model, 8, budget, b, **kw, offload=False)
    assert never.best is None and len(never.candidates) == 1
    tight = plan(model, 8, budget, b, **kw)
    assert tight.offload_searched and [c.offload for c in tight.candidates] == [None,
                                                                                "optimizer"]
    assert tight.as_dict()["offload_searched"] is True
    assert any(n.startswith("nothing fits without offload") for n in tight.notes())
    plain, off = tight.candidates
    assert not plain.fits and plain.reason.startswith("peak ")
    if not engine_offloads():  # the state stays on the device: offload cannot help
        assert tight.best is None
        return
    psi = model.num_params()
    assert off.host_bytes == pytest.approx(12 * psi / 8, abs=8)
    assert off.state_bytes < plain.state_bytes
    assert tight.best is off and off.peak_bytes <= budget
    assert tight.config() == zj.ZeroConfig(stage=3, param_dtype="bfloat16", offload="optimizer")


def test_estimate_command_with_offload(capsys):
    argv = ["--params", "7.5e9", "--devices", "64", "--offload", "optimizer"]
    assert estimate_main([*argv, "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert [s["offload"] for s in stages] == [None, "optimizer", "optimizer", "optimizer"]
    assert [s["memory"]["total"] for s in stages] == [120e9, 30e9, 15.234375e9, 0.46875e9]
    assert [s["memory"]["host"] for s in stages] == [0, 1.40625e9, 1.40625e9, 1.40625e9]
    assert estimate_main(argv) == 0
    out = capsys.readouterr().out
    assert "3 + offload" in out and "1.41 GB" in out and "host<->device" in out


def test_delayed_update_host_bytes_are_the_engines_state():
    """The pending update's host bytes against an engine's state (the test preset on 8 devices,
    where no leaf is padded): its gradient shard as it arrived, bf16 and laid out as the
    master, is 2Ψ/N, and
    the rest of the host's bytes are plain offload's. Stage 3 reads the arrays an init placed,
    stages 1 and 2 the abstract state's shardings."""
    from test_measure import engine_offloads, tiny

    from zerojax.analysis.accounting import state_estimate
    from zerojax.analysis.measurement import state_bytes
    from zerojax.app.report import state_bytes_per_device, state_bytes_split

    if not engine_offloads():
        return
    dev, psi = jax.devices()[0], GPT.from_preset("test").num_params()

    def host_bytes(tree) -> int:  # a device's shards of the arrays of `tree`
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                   for x in jax.tree.leaves(tree))

    for stage in (1, 2, 3):
        host = {}
        for k in (None, 0):
            eng, batch = tiny(stage, "bfloat16", offload="optimizer", delayed_update=k)
            state_bytes(eng, batch)  # learns the units
            state = eng.abstract_state()
            host[k] = host_bytes(eng.host_part(state))
            est = state_estimate(psi, 8, stage, "bfloat16", offload="optimizer",
                                 delayed_update=k)
            # + the optimizer's step count (4 bytes) and the pending update's scalars (13)
            assert host[k] == pytest.approx(est.host, abs=17)
            if k is not None:
                assert host_bytes(state.pending.grads) == est.pending == 2 * psi / 8
            if stage == 3 and k is not None:
                real = eng.init(jax.random.key(0), batch)
                assert state_bytes_split(eng, real, dev)[1] == host[k]
                assert state_bytes_per_device(real.pending.grads, dev) == est.pending
        assert host[0] - host[None] == 2 * psi / 8 + 13  # the pending gradient and scalars


def test_estimate_with_twin_flow(capsys):
    """`estimate --offload-fraction 0.25`: the host keeps a quarter of 12Ψ/N, the devices the
    rest beside their 4Ψ/N (stage 3), in the JSON and the table's title; bad fractions are one
    line each."""
    argv = ["--params", "7.5e9", "--devices", "64", "--offload", "optimizer"]
    assert estimate_main([*argv, "--offload-fraction", "0.25", "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert [s["memory"]["host"] for s in stages] == [0, 0.3515625e9, 0.3515625e9, 0.3515625e9]
    assert stages[3]["memory"]["total"] == 0.46875e9 + 1.0546875e9
    assert estimate_main([*argv, "--offload-fraction", "0.25"]) == 0
    assert "--offload-fraction 0.25: the host keeps" in capsys.readouterr().out
    for bad in (argv[:4] + ["--offload-fraction", "0.5"], [*argv, "--offload-fraction", "0"]):
        with pytest.raises(SystemExit) as exc:
            estimate_main(bad)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and "in (0, 1]" in err


def test_estimate_and_plan_largest_with_the_delayed_update(capsys):
    argv = ["--params", "7.5e9", "--devices", "64", "--offload", "optimizer"]
    assert estimate_main([*argv, "--delayed-update", "2", "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    # the pending bf16 gradient, 2Ψ/N, beside the 12Ψ/N of master and moments
    assert [s["memory"]["host"] for s in stages] == [0, 1.640625e9, 1.640625e9, 1.640625e9]
    assert [s["memory"].get("pending", 0) for s in stages] == [0] + [0.234375e9] * 3
    assert [s["memory"]["host_peak"] for s in stages[1:]] == [2.109375e9] * 3  # 18Ψ/N
    assert stages[3]["memory"]["total"] == 0.46875e9 + 0.234375e9  # 4Ψ/N + the next 2Ψ/N
    assert estimate_main([*argv, "--delayed-update", "0"]) == 0
    assert "of which pending" in capsys.readouterr().out
    for bad, message in ((argv[:4] + ["--delayed-update", "1"], "needs --offload optimizer"),
                         ([*argv, "--delayed-update", "-1"], "must be a non-negative integer")):
        with pytest.raises(SystemExit) as exc:
            estimate_main(bad)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and message in err

    # One 80 GB device on a 125 GB host less its 10 % margin (112.5 GB), the pinned-host pool
    # at 110 GiB: offload reaches 7b without the delay (host peak 16Ψ = 107 GB), not with it
    # (18Ψ = 121 GB: the pending bf16 gradient is 2Ψ; the pool holds only the gradient shard on
    # its way), which reaches gpt-4b, its device peak with its 2Ψ compute copy; with no host
    # margin 7b fits both (4 GB left for everything else), and gpt3-13b fits neither memory.
    plan = ["--devices", "1", "--memory", "80GB", "--largest", "--stages", "3", "--remat", "on",
            "--host-memory", "125GB", "--pinned-limit", "110GiB", "--json"]
    out = {}
    for k, margin in ((None, []), ("2", []), ("2", ["--host-margin", "0"])):
        assert plan_main(plan + (["--delayed-update", k] if k else []) + margin) == 0
        out[k, bool(margin)] = json.loads(capsys.readouterr().out)
    (plain,), (delayed,) = out[None, False]["largest"], out["2", False]["largest"]
    (unkept,) = out["2", True]["largest"]
    assert (out[None, False]["host_margin"], out["2", True]["host_margin"]) == (0.1, 0)
    assert (plain["offload"]["fits"]["name"], delayed["offload"]["fits"]["name"],
            unkept["offload"]["fits"]["name"]) == ("7b", "gpt-4b", "7b")
    f, nx = unkept["offload"]["fits"], unkept["offload"]["next"]
    psi = f["num_params"]
    assert (f["host"], f["host_peak"], f["pending"]) == (14 * psi, 18 * psi, 2 * psi)
    assert f["host_peak"] - plain["offload"]["fits"]["host_peak"] == 2 * psi
    assert nx["name"] == "gpt3-13b" and nx["host_peak"] == 18 * nx["num_params"]
    assert unkept["offload"]["binds"] == ["device", "host"]
    assert delayed["offload"]["next"] == f and delayed["offload"]["binds"] == ["host"]
    assert 112.5e9 < f["host_peak"] <= 125e9
    g = delayed["offload"]["fits"]
    assert g["host_peak"] == 18 * g["num_params"] and g["peak"] < plain["offload"]["fits"]["peak"]
    assert "--delayed-update 2: + the pending gradient shard" in \
        out["2", False]["assumptions"]["offload"]
    assert delayed["fits"] == plain["fits"]  # the columns without offload do not change
    for bad, message in (([*plan[:4], "--model", "1b", "--delayed-update", "1"],
                          "add --largest"),
                         ([*plan, "--offload", "off", "--delayed-update", "1"],
                          "which --offload off drops")):
        with pytest.raises(SystemExit) as exc:
            plan_main(bad)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and message in err


def test_measure_command_splits_device_and_host(capsys, keep_xla_flags):
    from test_measure import engine_offloads

    assert measure_main(["--model", "test", "--devices", "8", "--stage", "3", "--offload",
                         "optimizer", "--json"]) == 0
    (m,) = json.loads(capsys.readouterr().out)["measurements"]
    psi, mem = m["num_params"], m["estimate"]["memory"]
    assert (m["offload"], mem["host"], mem["total"]) == ("optimizer", 12 * psi / 8, 4 * psi / 8)
    assert m["state"]["device"] + m["state"]["host"] == m["state"]["total"]
    if engine_offloads():
        assert m["state"]["host"] == pytest.approx(mem["host"], abs=8)
        # The device's program and the host's update are programs of their own: each peak is
        # its compiled program's. The host's holds its state once (updated in place) beside the
        # gradient, whose buffer takes the compute shards (measured: 1.19x the state, the
        # bf16 gradient being 1/6 of it); ZeRO-Offload's budget is 1.25x.
        assert m["split"] == "measured" and m["device_peak_bytes"] == m["peak_bytes"]
        assert m["state"]["host"] < m["host_peak_bytes"] < 1.25 * m["state"]["host"]
    assert measure_main(["--model", "test", "--devices", "8", "--stage", "3", "--offload",
                         "optimizer", "--memory", "1GB"]) == 0
    table = capsys.readouterr().out
    assert "host state" in table and "device peak" in table and "split" in table


@pytest.mark.slow  # the library's search: test_plan_tries_offload_only_when_nothing_fits
def test_plan_command_says_when_it_tried_offload(capsys, keep_xla_flags):
    from test_measure import engine_offloads

    argv = ["--model", "test", "--devices", "8", "--stages", "3", "--remat", "on",
            "--grad-accum", "1", "--model-parallel", "1", "--margin", "0", "--json"]
    assert plan_main([*argv, "--memory", "1GB"]) == 0
    (c,) = json.loads(capsys.readouterr().out)["candidates"]
    tight = [*argv, "--memory", str(c["peak_bytes"] - 1)]
    code = plan_main(tight)
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["offload_searched"] and out["notes"][2].startswith("nothing fits without offload")
    assert [c["offload"] for c in out["candidates"]] == [None, "optimizer"]
    assert "searched 1 candidate + 1 with offload (nothing fit without it)" in captured.err
    assert "stage 3 + offload, remat on, accum 1: lowering 2/2" in captured.err
    assert code == (0 if engine_offloads() else 1)
    assert plan_main([*tight, "--offload", "off"]) == 1
    assert not json.loads(capsys.readouterr().out)["offload_searched"]


# --- --optimizer: the named optimizer's state instead of Adam's ------------------------------

def test_measure_counts_the_named_optimizers_state(capsys, keep_xla_flags):
    assert measure_main(["--model", "test", "--devices", "8", "--stage", "3", "--optimizer",
                         "lion", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["optimizer"] == "lion"
    assert out["assumptions"]["optimizer"] == ("Lion (lr 0.0003), Lion momentum in float32: 4 "
                                               "bytes per param (read from its init; AdamW: 8)")
    (m,) = out["measurements"]
    psi = GPT.from_preset("test").num_params()
    assert m["optimizer_state_bytes"] == 4  # AdamW's would be 8
    # The compiled state's shards: one momentum shard, its step count and the master shard.
    assert m["state"]["optimizer"] == 4 * psi / 8 + 4
    mem = m["estimate"]["memory"]
    assert m["state"]["master"] + m["state"]["optimizer"] == mem["optimizer"] + 4
    # 24 bytes of scalars: step, Lion's count, loss scale, its good-step count, base key.
    assert m["state"]["total"] == mem["total"] - mem["grads"] + 24


def test_estimate_reads_k_from_the_named_optimizer(capsys):
    argv = ["--params", "7.5e9", "--devices", "64", "--json"]
    assert estimate_main([*argv, "--optimizer", "lion"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["optimizer_bytes"] == 8 and "on 7b (6.71B params)" in out["optimizer_bytes_from"]
    assert [s["memory"]["total"] for s in out["stages"]] == [90e9, 30.9375e9, 16.171875e9,
                                                            1.40625e9]
    assert estimate_main([*argv, "--optimizer", "muon"]) == 0
    k = json.loads(capsys.readouterr().out)["optimizer_bytes"]
    assert k == pytest.approx(8.162, abs=1e-3)  # Adam's 8 on 7b's embeddings, head, norms
    assert estimate_main([*argv, "--optimizer", "lion", "--optimizer-bytes", "10"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["optimizer_bytes"], out["optimizer_bytes_from"]) == (10, "--optimizer-bytes")
    assert estimate_main(argv[:4] + ["--optimizer", "sgd"]) == 0
    assert ("note: K = 8 bytes per param: fp32 master 4 + sgd state 4 read from its init on 7b "
            "(6.71B params), the GPT shape nearest Ψ") in capsys.readouterr().out


def test_plan_counts_the_named_optimizers_state(capsys, keep_xla_flags):
    assert plan_main(["--model", "test", "--devices", "8", "--memory", "1KB", "--stages", "3",
                      "--remat", "on", "--grad-accum", "1", "--offload", "off", "--optimizer",
                      "sgd", "--model-parallel", "1", "--json"]) == 1  # nothing fits in 1 KB
    (c,) = json.loads(capsys.readouterr().out)["candidates"]
    # bf16 params, fp32 master, SGD's one momentum (Adam: two and a count), 1/8 each; 20 bytes
    # of scalars: step, loss scale, its good-step count, base key.
    assert c["state_bytes"] == (2 + 4 + 4) * GPT.from_preset("test").num_params() / 8 + 20


def test_plan_largest_reads_k_per_shape(capsys, monkeypatch):
    from zerojax.analysis import largest as lg
    from zerojax.analysis import largest_command
    from zerojax.analysis.accounting import state_estimate

    family = {k: v for k, v in lg.gpt_family().items() if k in ("gpt3-760m", "1b", "gpt3-1.3b",
                                                               "gpt3-2.7b", "gpt-4b")}
    monkeypatch.setattr(largest_command, "gpt_family", lambda: family)
    argv = ["--devices", "1", "--memory", "40GB", "--largest", "--stages", "0", "--remat", "on",
            "--json"]
    fits = {}
    for name in ("adamw", "adafactor"):
        assert plan_main([*argv, "--optimizer", name]) == 0
        out = json.loads(capsys.readouterr().out)
        fits[name] = out["largest"][0]["fits"]
    # Adam's 16 bytes per param reach 1.3B params in 40 GB; Adafactor's factored moments
    # (about 0.01 bytes per param, so 8 in all) reach 4.3B.
    assert (fits["adamw"]["name"], fits["adafactor"]["name"]) == ("gpt3-1.3b", "gpt-4b")
    f = fits["adafactor"]
    k = lg.state_per_param(named_optimizer("adafactor"), family["gpt-4b"])
    assert f["optimizer_state_bytes"] == k < 0.02
    assert f["state"] == state_estimate(f["num_params"], 1, 0, optimizer_state_bytes=k).total
    assert "Adafactor, Adafactor factored moments in float32: K = " in out["assumptions"][
        "optimizer"]


# --- plan --largest where its options meet ------------------------------------------------------

def test_plan_largest_on_several_devices_splits_the_global_batch(capsys):
    from zerojax.analysis.accounting import state_estimate
    from zerojax.analysis.largest import activation_bytes, gpt_family

    family = gpt_family()
    argv = ["--devices", "8", "--memory", "80GB", "--largest", "--batch", "16", "--json",
            "--remat", "on", "--offload", "off"]
    assert plan_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["devices"], out["batch"]) == (8, 16)
    assert out["assumptions"]["global batch"] == "16 sequences (2 per device), no grad_accum"
    for r in out["largest"]:
        f = r["fits"]
        cfg = family[f["name"]]
        # Activations of 2 sequences (16 over 8 devices), not 16 nor 1; the state over 8.
        assert f["activations"] == activation_bytes(cfg, 2, "bfloat16", True)["total"]
        assert f["state"] == state_estimate(f["num_params"], 8, r["stage"]).total
    fits = {r["stage"]: r["fits"]["num_params"] for r in out["largest"]}
    assert fits[3] > 4 * fits[0]  # sharding over 8 devices reaches further


def test_plan_largest_host_memory_caps_offload(capsys):
    argv = ["--devices", "1", "--memory", "80GB", "--largest", "--stages", "3", "--remat", "on",
            "--json"]
    assert plan_main([*argv, "--host-memory", "100GB", "--pinned-limit", "none"]) == 0
    out = json.loads(capsys.readouterr().out)
    (row,) = out["largest"]
    # The host peak, 16Ψ, of 7b (107 GB) does not fit 100 GB of host memory; gpt-4b's does.
    assert (row["offload"]["fits"]["name"], row["offload"]["next"]["name"]) == ("gpt-4b", "7b")
    assert row["offload"]["binds"] == ["host"]
    assert "at most 90.0 GB (100 GB less a 10% margin for the operating system" in \
        out["assumptions"]["offload"]
    # The host's limit is the table's: 0 bytes is refused (it said "not limited" while no
    # shape fitted); without --host-memory nothing caps the host, and the header says so.
    with pytest.raises(SystemExit) as exc:
        plan_main([*argv, "--host-memory", "0"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "--host-memory 0: give" in err
    assert plan_main([*argv, "--pinned-limit", "none"]) == 0  # without the caps: gpt3-13b
    out = json.loads(capsys.readouterr().out)
    assert out["largest"][0]["offload"]["fits"]["name"] == "gpt3-13b"
    assert "must fit the host memory, not limited" in out["assumptions"]["offload"]


@pytest.mark.parametrize("env, limit, fits, binds", [
    ({}, 64 << 30, "7b", ["host"]),  # XLA:GPU's default pool
    ({"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "110"}, 110 << 30, "7b", ["host"]),
    ({"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "10"}, 10 << 30, "gpt-4b", ["pinned-host limit"]),
])
def test_plan_largest_offload_on_one_h100(capsys, monkeypatch, env, limit, fits, binds):
    """One H100 (80 GB) on a 125 GB host: the host binds at 7b (host peak 16Ψ = 107 GB;
    gpt3-13b's 207 GB does not fit) with XLA's pinned-host pool at its default or raised, since
    the pool holds only the gradient shard on its way to the host (2Ψ: 13.4 GB at 7b). A pool
    of 10 GiB binds at gpt-4b (8.6 GB of gradient shard)."""
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = ["--devices", "1", "--memory", "80GB", "--largest", "--stages", "3", "--remat", "on",
            "--host-memory", "125GB", "--json"]
    assert plan_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    (row,) = out["largest"]
    assert out["pinned_limit"] == limit
    assert row["fits"]["name"] == "gpt-4b"  # plain optax's stage 3 on the device alone
    assert (row["offload"]["fits"]["name"], row["offload"]["binds"]) == (fits, binds)
    assert row["offload"]["fits"]["peak"] < 80e9


def test_plan_largest_json_succeeds_when_only_offload_fits(capsys):
    from zerojax.analysis.largest import largest

    # 2 GB on one device: no stage holds 16Ψ of the smallest shape, offload's 4Ψ fits.
    assert all(r["fits"] is None for r in largest(1, 2e9))
    assert any(r["fits"] for r in largest(1, 2e9, offload="optimizer"))
    argv = ["--devices", "1", "--memory", "2GB", "--largest", "--json"]
    assert plan_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(r["fits"] is None for r in out["largest"])
    assert {r["offload"]["fits"]["name"] for r in out["largest"]
            if r["offload"] and r["offload"]["fits"]} == {"gpt2-small"}
    assert plan_main([*argv, "--offload", "off"]) == 1  # then nothing fits
    assert plan_main(argv[:-1]) == 0  # the table says the same
    assert "gpt2-small" in capsys.readouterr().out


# --- --bandwidth: the least time on the links, and ZeRO++ ------------------------------------

LINKS = {"data": 400e9, "replica": 25e9}  # e.g. NVLink within a node, 200 Gb/s between nodes


def test_link_seconds_weigh_each_axis_and_what_spans_both_goes_at_the_slower_link():
    found = {"data": 4e6, "replica": 1e6, "all": 2e6}
    assert link_seconds(found, LINKS) == pytest.approx(4e6 / 400e9 + 1e6 / 25e9 + 2e6 / 25e9)
    assert link_seconds({"data": 4e6}, {"data": 1e9}) == pytest.approx(4e-3)
    # A flat mesh on a machine of two groups sends every byte across them.
    assert on_links({"data": 3e6}, 1, 2) == {"all": 3e6}
    assert on_links({"data": 3e6}, 1, 1) == {"data": 3e6}
    assert on_links({"data": 2e6, "replica": 1e6}, 2, 2) == {"data": 2e6, "replica": 1e6}


def test_zeropp_variants_keep_the_base_and_try_exact_hpz_first():
    def names(cands):
        return [c.zeropp() for c in cands]

    full = "qwZ int8 + qgZ int4"
    assert names(_zeropp(Candidate(3, True, 1, replica=2), "int4")) == ["hpZ", full,
                                                                         f"{full} + hpZ"]
    assert names(_zeropp(Candidate(3, True, 1), "int4")) == [full]
    assert names(_zeropp(Candidate(3, True, 1, replica=2), None)) == ["hpZ"]  # exact only
    assert names(_zeropp(Candidate(3, True, 1), None)) == []
    assert names(_zeropp(Candidate(0, False, 2), "int8")) == ["qgZ int8"]  # no params gathered
    assert names(_zeropp(Candidate(2, True, 1), "int4", alone=True)) == ["qwZ int8", "qgZ int4"]
    assert names(_zeropp(Candidate(0, True, 1), "int4", alone=True)) == []
    v = _zeropp(Candidate(2, False, 4, offload="optimizer", replica=2), "int4")[0]
    assert (v.stage, v.remat, v.grad_accum, v.offload, v.replica) == (2, False, 4, "optimizer", 2)


def linked_candidates():
    """The test GPT's stage-3 candidates at N = 8 on 2 groups of 4 as `plan` measured them."""
    kw = dict(stage=3, remat=True, grad_accum=1)
    q = dict(quantize_weights="int8", quantize_grads="int4")
    return {
        "flat": Candidate(**kw, peak_bytes=140_452, comm_bytes=106_078, launches=12,
                          axis_bytes={"all": 106_078}),
        "hybrid": Candidate(**kw, replica=2, peak_bytes=187_876, comm_bytes=101_805,
                            launches=29, axis_bytes={"data": 90_918, "replica": 10_880,
                                                     "all": 7}),
        "hpz": Candidate(**kw, replica=2, hpz=True, peak_bytes=159_052, comm_bytes=101_806,
                         launches=19, axis_bytes={"data": 90_912, "replica": 10_880,
                                                  "all": 14}),
        "flat q": Candidate(**kw, **q, peak_bytes=383_012, comm_bytes=45_990, launches=22,
                            axis_bytes={"all": 45_990}),
        "hpz q": Candidate(**kw, **q, replica=2, hpz=True, peak_bytes=350_932,
                           comm_bytes=43_750, launches=36,
                           axis_bytes={"data": 39_408, "replica": 4_328, "all": 14}),
    }


def choose(cands, memory=1e9, bandwidth=LINKS):
    """`cands` chosen among on 8 devices in 2 groups; bandwidth None: by bytes."""
    result = PlanResult(8, int(memory), list(cands), param_dtype="bfloat16", replica=2,
                        margin=0.0, latency=0.0)
    return result.refit(bandwidth=bandwidth) if bandwidth else result.refit()


def test_a_slow_link_between_groups_chooses_hpz_and_quantization():
    c = linked_candidates()
    r = choose(c.values())
    assert r.best.zeropp() == "qwZ int8 + qgZ int4 + hpZ" and r.best.replica == 2
    for cand in r.candidates:
        assert cand.comm_seconds == pytest.approx(link_seconds(cand.axis_bytes, LINKS))
    # No FLOPs known and no latency: the step is the time on the links.
    assert r.candidates[0].reason == "fits; step 4.24 us vs 0.272 us"
    assert [c.step_seconds for c in r.candidates] == [c.comm_seconds for c in r.candidates]
    assert r.config() == zj.ZeroConfig(stage=3, param_dtype="bfloat16", quantize_weights="int8",
                                       quantize_grads="int4", hpz=True)
    assert dict(r.mesh().shape) == {"replica": 2, "data": 4}
    assert r.notes()[2].startswith("step: compute (not counted (no FLOPs or peak)) + the link")
    assert "sends quantized values" in r.notes()[3]
    assert r.as_dict()["bandwidth"] == LINKS and r.as_dict()["replica"] == 2
    # Where the quantized ones do not fit: hpZ ties the hybrid mesh's time (the same bytes
    # cross the slow link) and wins on fewer launches and less memory; exact, so no note.
    tight = choose(c.values(), memory=200_000)
    assert tight.candidates[2].chosen and tight.best.zeropp() == "hpZ"
    assert tight.candidates[1].reason.startswith("fits; same cost")
    assert [x.fits for x in tight.candidates] == [True, True, True, False, False]
    assert not any("sends quantized values" in note for note in tight.notes())
    assert tight.mesh().shape == r.mesh().shape
    flat = choose(c.values(), memory=150_000)
    assert flat.best.replica == 1 and not flat.best.zeropp() and flat.mesh().shape == {"data": 8}


def test_time_and_bytes_disagree_where_the_fewer_bytes_cross_the_slow_link():
    c = linked_candidates()
    both = [c["flat q"], c["hybrid"]]  # refit chooses among copies: compare by position
    assert choose(both, bandwidth=None).candidates[0].chosen  # 46.0 KB < 102 KB
    assert choose(both).candidates[1].chosen  # 0.663 us < 1.84 us: flat q sends all across
    assert choose(both, bandwidth={"data": 25e9, "replica": 25e9}).candidates[0].chosen


@pytest.mark.parametrize("bandwidth", [0, -25e9, float("nan"), {"data": 0.0},
                                       {"data": float("nan")}, True])
def test_plan_refuses_a_bandwidth_that_is_not_positive_in_one_line(bandwidth):
    """plan(bandwidth=) and refit(bandwidth=) refuse 0, negative and NaN link speeds (a NaN
    would rank every candidate as NaN seconds) before anything compiles."""
    calls = [lambda: plan(GPT.from_preset("small8"), 8, 1e9, small8_batch(8),
                          bandwidth=bandwidth),
             lambda: PlanResult(8, 10**9, list(linked_candidates().values())).refit(
                 bandwidth=bandwidth)]
    for call in calls:
        with pytest.raises(zj.ConfigError, match=r"bandwidth for 'data' is .*: give bytes per "
                                                 r"second > 0$") as e:
            call()
        assert "\n" not in str(e.value)


def test_quantized_must_shorten_the_step_by_five_percent():
    exact = Candidate(3, True, 1, replica=2, hpz=True, peak_bytes=1, launches=9,
                      comm_bytes=1e6, axis_bytes={"data": 1e6})
    quant = Candidate(3, True, 1, replica=2, quantize_grads="int4", peak_bytes=1, launches=9,
                      comm_bytes=0.995e6, axis_bytes={"data": 0.995e6})
    r = choose([quant, exact])
    assert r.candidates[1].chosen and not r.best.quantized
    assert r.candidates[0].reason == ("fits; same cost, but more recompute, collectives or "
                                      "memory, or quantized")
    quant.axis_bytes = {"data": 0.96e6}  # 4% shorter: not enough
    r = choose([quant, exact])
    assert r.candidates[1].chosen and r.candidates[0].reason == (
        "fits; quantized, step 2.4 us is 4.0% shorter than the exact 2.5 us, less than the 5% "
        "it must gain")
    quant.axis_bytes = {"data": 0.94e6}  # 6% shorter
    assert choose([quant, exact]).best.quantized
    # Where no exact option fits, a quantized one is chosen whatever it gains.
    assert choose([quant, dataclasses.replace(exact, peak_bytes=2)], memory=1).best.quantized


@pytest.mark.slow
def test_plan_command_with_bandwidth_searches_zeropp_and_says_why(capsys, keep_xla_flags):
    argv = ["--model", "test", "--devices", "8", "--memory", "1GB", "--stages", "3",
            "--remat", "on", "--grad-accum", "1", "--replica", "2", "--bandwidth",
            "data=400GB/s,replica=1GB/s"]
    slow = {"data": 400e9, "replica": 1e9}
    assert plan_main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    # The test GPT allows a model axis of 2: its link is the data link's.
    assert out["bandwidth"] == {**slow, "model": 400e9} and out["replica"] == 2
    cands = out["candidates"]
    assert [(c["replica"], Candidate(**c).zeropp()) for c in cands] == [
        (1, ""), (2, ""), (1, "qwZ int8 + qgZ int4"), (2, "hpZ"), (2, "qwZ int8 + qgZ int4"),
        (2, "qwZ int8 + qgZ int4 + hpZ")]
    # The flat mesh sends all 106 KB across the 1 GB/s link; hpZ only 10.9 KB, in 19 launches
    # (10 us each) where the quantized variants need 36 and more to save 6.6 us.
    assert all(c["fits"] for c in cands) and [c["chosen"] for c in cands].index(True) == 3
    assert [c["launches"] for c in cands][3] < min(c["launches"] for c in cands[4:])
    for c in cands:
        assert sum(c["axis_bytes"].values()) == pytest.approx(c["comm_bytes"])
        assert c["comm_seconds"] == pytest.approx(link_seconds(c["axis_bytes"], slow))
    assert set(cands[0]["axis_bytes"]) == {"all"}  # the flat mesh crosses the slow link
    # hpZ keeps ZeRO-3's state over all 8 devices; the 2 x 4 mesh without it, over 4.
    assert cands[3]["state_bytes"] == cands[0]["state_bytes"] < cands[1]["state_bytes"]
    assert "searched 2 candidates + 4 ZeRO++ variants of the best that fit" in captured.err
    assert "stage 3, remat on, accum 1 on 2x4 + qwZ int8 + qgZ int4 + hpZ: lowering 6/6" \
        in captured.err
    facts = out["assumptions"]
    assert facts["links"] == ("data 400 GB/s, replica 1.00 GB/s, model 400 GB/s (data's); 2 "
                              "groups of 4 devices")
    assert facts["searched"].startswith("stages 3 x remat on x grad_accum 1 x mesh 8/2x4 = 2")
    # Exact options only: the same programs (from the compilation cache), hpZ chosen.
    assert plan_main([*argv, "--quantize", "off"]) == 0
    captured = capsys.readouterr()
    assert "searched 2 candidates + 1 ZeRO++ variants" in captured.err
    assert ("chosen: stage 3 + hpZ, remat on, grad_accum 1 on make_mesh(replica=2, data=4)"
            in captured.out)
    assert "on the links)" in captured.out and "sends quantized" not in captured.out


@pytest.mark.slow
def test_plan_with_bandwidth_tries_zeropp_on_offloaded_candidates_too():
    from test_measure import engine_offloads

    model = GPT.from_preset("test")
    b = {k: jax.ShapeDtypeStruct((8, model.cfg.seq_len), jnp.int32)
         for k in ("inputs", "targets")}
    kw = dict(stages=(3,), remat=(True,), grad_accum=(1,), bandwidth=25e9,
              model_parallel=(1,), margin=0)
    (plain,) = plan(model, 8, 1e12, b, **kw, quantize=None).candidates
    tight = plan(model, 8, plain.peak_bytes - 1, b, **kw)
    assert tight.offload_searched and tight.bandwidth == {"data": 25e9}
    if not engine_offloads():
        assert tight.best is None and len(tight.candidates) == 2
        return
    offloaded = tight.candidates[1:]
    assert all(c.offload == "optimizer" for c in offloaded)
    names = [c.zeropp() for c in offloaded]
    assert names[:2] == ["", "qwZ int8 + qgZ int4"]
    # qwZ and qgZ alone are tried exactly when both together do not fit.
    assert (names[2:] == ["qwZ int8", "qgZ int4"]) == (not offloaded[1].fits)
    best = tight.best
    assert best.offload == "optimizer" and best.peak_bytes <= plain.peak_bytes - 1
    exact = min(c.step_seconds for c in offloaded if c.fits and not c.quantized)
    assert best.step_seconds < 0.95 * exact if best.quantized else best.step_seconds == exact
    assert tight.config().offload == "optimizer"


def test_plan_largest_chooses_twin_flows_fraction(capsys):
    """`plan --largest`'s Twin-Flow column: the least --offload-fraction, a multiple of 0.05,
    whose devices' share of the host state fits beside the offloaded shape's device peak in
    the device memory less `--margin` (10 %, the room the estimate leaves out; one step less
    would not fit; at least 0.05); on one 80 GB device 7b's 80.6 GB of host state leaves the
    devices room for 50 % of it in 72 GB (60 % in all 80 GB, with --margin 0)."""
    from zerojax.analysis.largest import TWIN_STEP, largest, twin_flow_fraction

    argv = ["--devices", "1", "--memory", "80GB", "--largest", "--stages", "3", "--remat", "on",
            "--host-memory", "125GB", "--json"]
    for margin, want, budget in ((None, 0.5, 72e9), ("0", 0.4, 80e9)):
        assert plan_main(argv + (["--margin", margin] if margin else [])) == 0
        (row,) = json.loads(capsys.readouterr().out)["largest"]
        fits, f = row["offload"]["fits"], row["offload"]["twin_flow_fraction"]
        assert (fits["name"], f) == ("7b", want)
        assert fits["peak"] + (1 - f) * fits["host"] <= budget < fits["peak"] + (
            1 - f + TWIN_STEP) * fits["host"]
    for r in largest(8, 80e9, offload="optimizer", remat=(True,)):
        g = twin_flow_fraction(r["fits"], 80e9)
        assert 0 < g <= 1 and abs(g / TWIN_STEP - round(g / TWIN_STEP)) < 1e-9
        assert r["fits"].peak + (1 - g) * r["fits"].host <= 72e9 or g == 1.0
        if g > TWIN_STEP:
            assert r["fits"].peak + (1 - g + TWIN_STEP) * r["fits"].host > 72e9
