"""experiments/bench.py end to end on the tiny preset, its HLO accounting, and app/overlap.py."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "experiments" / "bench.py"
ZERO = ["stage0", "stage1", "stage2", "stage3"]
RATIOS = ["ratio", "paired_ratio", "paired_ratio_min", "paired_ratio_max"]


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


bench = _load_bench()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    # LLVM -O0 and the legacy CPU emitters compile ~4x faster; this test checks the pipeline,
    # not the figures.
    fast = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": fast}
    cmd = [sys.executable, str(BENCH), "--preset", "test", "--devices", "2", "--batch", "4",
           "--repeats", "5", "--steps-per-repeat", "1", "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def test_every_variant_reports_positive_ratios(run):
    result, _ = run
    variants = result["variants"]
    assert result["baseline"] == "gspmd_fsdp"
    assert set(ZERO + ["gspmd_fsdp", "gspmd_fsdp_hinted", "floor"]) <= {
        n for n, v in variants.items() if v["status"] == "ok"}
    assert "stage3_prefetch" in variants  # measured, or n/a with the reason
    for name, v in variants.items():
        if v["status"] != "ok":
            assert v["status"] == "n/a" and v["reason"], name
            continue
        for key in RATIOS + ["median_s", "min_s", "max_s", "tokens_per_s", "compile_s"]:
            assert v[key] > 0, (name, key)
        assert len(v["times_s"]) == 5
        assert v["min_s"] <= v["q25_s"] <= v["median_s"] <= v["q75_s"] <= v["max_s"]
        assert v["paired_ratio_min"] <= v["paired_ratio"] <= v["paired_ratio_max"]
        assert v["tokens_per_s"] == pytest.approx(4 * 16 / v["median_s"])
        assert v["mfu"] is None  # CPU: no peak known
    assert variants["gspmd_fsdp"]["ratio"] == 1.0


def test_every_variant_trains_the_same_model(run):
    # Same init, batch and number of steps: final losses agree up to bf16/reduction order.
    # (The floor trains on one device's share of the batch.)
    variants = run[0]["variants"]
    ref = variants["gspmd_fsdp"]["loss"]
    assert 3.0 < ref < 5.0  # ~ln(64) after a few small steps
    for name, v in variants.items():
        if v["status"] == "ok" and name != "floor":
            assert v["loss"] == pytest.approx(ref, rel=1e-2), name


def test_config_targets_and_table(run):
    result, stdout = run
    cfg = result["config"]
    assert (cfg["preset"], cfg["devices"], cfg["batch"], cfg["param_dtype"]) == (
        "test", 2, 4, "bfloat16")
    assert "--xla_force_host_platform_device_count=2" in cfg["xla_flags"]
    assert result["machine"]["platform"] == "cpu"
    t = result["targets"]
    assert set(t) == {"stage3_over_fsdp", "stage3_over_fsdp_paired", "stage3_over_fsdp_cpu",
                      "stage3_le_0.8x_fsdp", "stages_123_spread", "stages_123_spread_paired",
                      "stages_123_spread_cpu", "stages_123_within_10pct", "floor_over_fsdp",
                      "floor_over_fsdp_cpu"}
    assert t["stage3_over_fsdp"] == result["variants"]["stage3"]["ratio"]
    assert t["stages_123_spread"] >= 0 and t["stages_123_spread_cpu"] >= 0
    assert "stage3" in stdout and "× fsdp" in stdout


def test_repeats_below_five_are_refused():
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeats", "4"])


def test_fsdp_spec_shards_the_largest_divisible_dimension():
    P = bench.P
    assert bench.fsdp_spec((8, 128, 384), 8, first=1) == P(None, None, "data")
    assert bench.fsdp_spec((256, 128), 8) == P("data", None)
    assert bench.fsdp_spec((8, 128), 8, first=1) == P(None, "data")  # never the layer axis
    assert bench.fsdp_spec((3, 5), 2) == P()
    assert bench.fsdp_spec((64, 64), 8) == P("data", None)  # ties: the first


HLO = textwrap.dedent("""\
    %body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
      %p = (s32[], f32[8]{0}) parameter(0)
      %ag = bf16[4,8]{1,0} all-gather(%x), replica_groups=mesh['axis_0'=4] {'axis_0'}
      %rs = f32[2]{0} reduce-scatter(%y), replica_groups={{0,1,2,3}}, to_apply=%add
      ROOT %t = (s32[], f32[8]{0}) tuple(%i, %y)
    }

    ENTRY %main (a: f32[8]) -> f32[8] {
      %a = f32[8]{0} parameter(0)
      %w = (s32[], f32[8]{0}) while(%t0), body=%body, backend_config={"known_trip_count":{"n":"3"}}
      %ar = (f32[8]{0}, bf16[4]{0}) all-reduce(%a, %b), replica_groups=[1,4]<=[4], to_apply=%add
      ROOT %f = f32[8]{0} fusion(%ar), kind=kLoop, calls=%fused
    }
    """)


def test_hlo_stats_weights_loop_bodies_by_trip_count():
    s = bench.hlo_stats(HLO)
    assert s["collectives"] == {"all-gather": {"count": 3, "bytes": 3 * 64},
                                "reduce-scatter": {"count": 3, "bytes": 3 * 8},
                                "all-reduce": {"count": 1, "bytes": 40}}
    # ring bytes per device: AG out·(g-1)/g, RS out·(g-1), AR 2·out·(g-1)/g with g = 4
    assert s["comm_bytes"] == int(3 * 64 * 0.75) + 3 * 8 * 3 + int(40 * 1.5)
    assert (s["while_loops"], s["fusions"]) == (1, 1)
    assert s["ops"] == 2 * 3 + 3  # body: ag, rs (the tuple is trivial); entry: while, ar, fusion


OVERLAP = textwrap.dedent("""\
    import os
    from zerojax.app.overlap import apply_overlap_flags, xla_overlap_flags
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    assert apply_overlap_flags(platform="cpu") == []
    added = apply_overlap_flags(platform="gpu", combine_threshold_bytes=2**20)
    assert added == xla_overlap_flags(2**20), added
    assert apply_overlap_flags(platform="gpu") == []  # already set: nothing twice
    import jax, jax.numpy as jnp
    assert float(jax.jit(lambda x: x + 1)(jnp.ones(()))) == 2.0  # XLA accepted every flag
    try:
        apply_overlap_flags(platform="gpu")
    except RuntimeError:
        print("ok", os.environ["XLA_FLAGS"])
    """)


def test_overlap_flags_are_accepted_by_xla_and_only_set_before_the_backend():
    from zerojax.app.overlap import xla_overlap_flags

    flags = xla_overlap_flags()
    assert [f.split("=")[0] for f in flags] == [
        "--xla_gpu_enable_latency_hiding_scheduler", "--xla_gpu_enable_pipelined_all_gather",
        "--xla_gpu_enable_pipelined_reduce_scatter",
        "--xla_gpu_all_gather_combine_threshold_bytes"]
    with pytest.raises(ValueError, match="combine_threshold_bytes"):
        xla_overlap_flags(0)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", OVERLAP], env={**env, "JAX_PLATFORMS": "cpu"},
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok ")
    assert all(f in proc.stdout for f in xla_overlap_flags(2**20))
