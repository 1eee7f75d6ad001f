"""experiments/bench.py end to end on the tiny preset, its HLO accounting, and app/overlap.py."""

import gc
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_state import assert_bitwise

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
           "--repeats", "5", "--steps-per-repeat", "1", "--update-params", "1e5",
           "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_every_variant_reports_positive_ratios(run):
    result, _ = run
    variants = result["variants"]
    assert result["baseline"] == "gspmd_fsdp"
    assert set(ZERO + ["gspmd_fsdp", "gspmd_fsdp_hinted", "floor"]) <= {
        n for n, v in variants.items() if v["status"] == "ok"}
    assert "stage3_prefetch" in variants  # measured, or n/a with the reason
    assert "stage3_offload" in variants
    update = result["offload_update"]  # with stage3_offload: its update alone, and a copy
    assert update["params"] == 100_000 and update["bytes_per_update"] == 28 * 100_000 + 8
    assert all(r["bytes_per_s"] > 0 for r in update["update"].values())
    off = variants["stage3_offload"]
    if off["status"] == "ok" and off["host_state_bytes"]:  # the engine offloads: peak apart
        # the devices' program holds no host state; the host's update is a program of its own
        assert off["device_peak_bytes"] == off["peak_bytes"]
        assert off["device_peak_bytes"] < variants["stage3"]["device_peak_bytes"]
        assert off["host_state_bytes"] < off["host_peak_bytes"] < 1.25 * off["host_state_bytes"]
        assert off["host_update"] == "fused"  # zerojax.adamw's pass (g++ is here)
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


@pytest.mark.slow
def test_every_variant_trains_the_same_model(run):
    # Same init, batch and number of steps: final losses agree up to bf16/reduction order.
    # (The floor trains on one device's share of the batch.)
    variants = run[0]["variants"]
    ref = variants["gspmd_fsdp"]["loss"]
    assert 3.0 < ref < 5.0  # ~ln(64) after a few small steps
    for name, v in variants.items():
        if v["status"] == "ok" and name != "floor":
            assert v["loss"] == pytest.approx(ref, rel=1e-2), name


@pytest.mark.slow
def test_config_targets_and_table(run):
    result, stdout = run
    cfg = result["config"]
    assert (cfg["preset"], cfg["devices"], cfg["batch"], cfg["param_dtype"]) == (
        "test", 2, 4, "bfloat16")
    assert "--xla_force_host_platform_device_count=2" in cfg["xla_flags"]
    assert result["machine"]["platform"] == "cpu"
    t = dict(result["targets"])
    offload = {k: t.pop(k) for k in list(t) if k.startswith("stage3_offload")}
    v = result["variants"]
    if all(v[n]["status"] == "ok" for n in ("stage3_offload", "stage3_offload_dpu")):
        dpu, off = v["stage3_offload_dpu"], v["stage3_offload"]
        assert offload["stage3_offload_dpu_over_gspmd_fsdp"] == dpu["ratio"]
        assert offload["stage3_offload_over_gspmd_fsdp"] == off["ratio"]
        assert offload["stage3_offload_dpu_over_stage3_offload"] == pytest.approx(
            dpu["median_s"] / off["median_s"])
        assert offload["stage3_offload_dpu_over_stage3_offload_paired"] > 0
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


def test_timing_freezes_the_heap_it_starts_from_and_unfreezes_it_after():
    """Each block's collection skips the programs built before the timing (frozen), and the
    freeze ends with the timing: a `--sequential` run's collection must free the variant it
    drops. Also when a block fails (an out-of-memory variant is reported, not fatal)."""
    frozen = []

    def step(state, batch):
        frozen.append(gc.get_freeze_count())
        return state + 1, {"loss": 0.0}

    v = bench.Variant("v", step, 0, None, lower=None)
    bench.time_interleaved({"v": v}, repeats=2, steps=2)
    assert len(frozen) == 4 and min(frozen) > 0 and len(v.times) == 2
    assert gc.get_freeze_count() == 0

    def fails(state, batch):
        raise MemoryError("out of memory")

    with pytest.raises(MemoryError):
        bench.time_interleaved({"v": bench.Variant("v", fails, 0, None, lower=None)}, 1, 1)
    assert gc.get_freeze_count() == 0


def test_fsdp_spec_shards_the_largest_divisible_dimension():
    P = bench.P
    assert bench.fsdp_spec((8, 128, 384), 8, first=1) == P(None, None, "data")
    assert bench.fsdp_spec((256, 128), 8) == P("data", None)
    assert bench.fsdp_spec((8, 128), 8, first=1) == P(None, "data")  # never the layer axis
    assert bench.fsdp_spec((3, 5), 2) == P()
    assert bench.fsdp_spec((64, 64), 8) == P("data", None)  # ties: the first


def test_tp_spec_puts_the_split_dimension_on_tensor_and_another_on_fsdp():
    P = bench.P
    assert bench.tp_spec((8, 128, 384), 2, 4, first=1) == P(None, "fsdp", "tensor")
    assert bench.tp_spec((8, 512, 128), 1, 4, first=1) == P(None, "tensor", "fsdp")
    assert bench.tp_spec((8, 384), 1, 4, first=1) == P(None, "tensor")  # never the layer axis
    assert bench.tp_spec((256, 128), None, 4) == P("fsdp", None)
    assert bench.tp_spec((256, 6), 0, 4) == P("tensor", None)  # nothing else divisible


def test_tp_shardings_follow_the_models_plan_and_shard_adam_like_the_params():
    import jax

    from zerojax.models import GPT

    model = GPT.from_preset("test")  # d 32, d_ff 64, V 64, T 16, 2 layers
    mesh = bench.tp_mesh(jax.devices()[:8], 2)
    assert dict(mesh.shape) == {"fsdp": 4, "tensor": 2}
    assert mesh.devices[0, 1] == jax.devices()[1]  # tensor innermost, as zerojax's model
    p_sh, o_sh = bench.tp_shardings(model, mesh, bench.plain_tx(bench.parse_args([])))
    spec = lambda sh: tuple(sh.spec)
    blocks, P = p_sh["blocks"], bench.P
    want = {"qkv": (None, "fsdp", "tensor"), "out": (None, "tensor", "fsdp")}
    assert {k: spec(blocks["attn"][k]["kernel"]) for k in want} == want
    assert spec(blocks["mlp"]["fc"]["kernel"]) == (None, "fsdp", "tensor")
    assert spec(blocks["mlp"]["out"]["kernel"]) == (None, "tensor", "fsdp")
    assert spec(blocks["attn"]["qkv"]["bias"]) == (None, "tensor")
    assert spec(blocks["attn"]["out"]["bias"]) == (None, "fsdp")
    assert spec(p_sh["embed"]["tok"]) == ("tensor", "fsdp")
    assert spec(p_sh["embed"]["pos"]) == (None, "fsdp")  # [16, 32]: replicated over tensor
    assert spec(p_sh["final"]["head"]["kernel"]) == ("fsdp", "tensor")
    adam = o_sh[1][0]  # chain(clip, adamw): adamw's ScaleByAdamState
    assert jax.tree.map(spec, adam.mu) == jax.tree.map(spec, p_sh)
    assert jax.tree.map(spec, adam.nu) == jax.tree.map(spec, p_sh)
    assert adam.count.spec == P()


def test_tensor_parallel_variants_run_only_when_named():
    import jax

    from zerojax.models import GPT

    args = bench.parse_args([])
    makers = bench.variant_makers(GPT.from_preset("test"), bench.zj.make_mesh(data=8), args,
                                  None)
    assert set(bench.TP_VARIANTS) <= set(makers)
    assert not set(bench.TP_VARIANTS) & set(bench.selected(makers, args))
    args = bench.parse_args(["--variants", "stage3_tp", "--baseline", "gspmd_fsdp_tp"])
    assert bench.selected(makers, args) == ["stage3_tp", "gspmd_fsdp_tp"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--tp", "1"])
    with pytest.raises(ValueError, match="--tp 3 does not divide the 8 devices"):
        bench.tp_mesh(jax.devices()[:8], 3)


@pytest.mark.slow
def test_tensor_parallel_variants_train_the_same_model_and_report_their_ratio(tmp_path):
    # data 2 × model 2 against GSPMD fsdp 2 × tensor 2, on 4 simulated devices.
    out = tmp_path / "tp.json"
    fast = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": fast}
    cmd = [sys.executable, str(BENCH), "--preset", "test", "--devices", "4", "--batch", "8",
           "--repeats", "5", "--steps-per-repeat", "1", "--baseline", "gspmd_fsdp_tp",
           "--variants", "stage3_tp", "gspmd_fsdp_tp_hinted", "--hlo", "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    v = result["variants"]
    assert list(v) == ["stage3_tp", "gspmd_fsdp_tp", "gspmd_fsdp_tp_hinted"]
    ref = v["gspmd_fsdp_tp"]["loss"]
    assert 3.0 < ref < 5.0
    for name, r in v.items():
        assert r["status"] == "ok", (name, r.get("reason"))
        assert r["loss"] == pytest.approx(ref, rel=1e-2), name
        assert 0 < r["temp_bytes"] < r["peak_bytes"]
    # zerojax: ZeRO's collectives and Megatron's activation all-reduces over model
    assert set(v["stage3_tp"]["hlo"]["collectives"]) == {"all-gather", "reduce-scatter",
                                                         "all-reduce"}
    t = result["targets"]
    for base in ("gspmd_fsdp_tp", "gspmd_fsdp_tp_hinted"):
        key = f"stage3_tp_over_{base}"
        assert t[key] == pytest.approx(v["stage3_tp"]["median_s"] / v[base]["median_s"])
        assert t[key + "_paired"] > 0 and t[key + "_cpu"] > 0
        assert t[f"stage3_tp_le_1.0x_{base}"] == (t[key] <= 1.0)


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


# --- scripts/gpu_bench.sh -------------------------------------------------------------------

GPU_BENCH = ROOT / "experiments" / "gpu_bench.py"


def _load_gpu_bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", GPU_BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_gpu_bench_script_runs_every_part_on_cpu(tmp_path):
    # The GPU command on 2 simulated CPU devices: plain optax (GSPMD at N = 2) and stage 3,
    # without and with the overlap flags, and the largest-shape search over one tiny shape.
    # The probes take the bench parts' batch (4, not the default one sequence per device):
    # the same programs, loaded from the compilation cache instead of compiled again.
    fast = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": fast,
           "PYTHON": sys.executable}
    cmd = [str(ROOT / "scripts" / "gpu_bench.sh"), "--out", str(tmp_path), "--preset", "test",
           "--devices", "2", "--batch", "4", "--repeats", "5", "--steps-per-repeat", "1",
           "--variants", "stage3", "stage3_offload", "--largest-variants", "stage3",
           "stage3_offload", "--largest-shapes", "test", "--largest-batch", "4",
           "--update-params", "1e5", "--pinned-limit-gb", "7"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "gpu_bench.json").read_text())
    md = (tmp_path / "gpu_bench.md").read_text()
    assert proc.stdout.strip() == md.strip()
    parts = result["parts"]
    assert set(parts) == {"bench", "overlap", "largest"}
    for part, overlap in (("bench", "off"), ("overlap", "flags")):
        run = parts[part]
        assert run["config"]["overlap"] == overlap and run["config"]["sequential"]
        assert run["config"]["overlap_flags"] == []  # CPU: the GPU flags are not added
        assert run["baseline"] == "gspmd_fsdp"
        assert "6·Ψ + 12·L·T·d" in run["config"]["flops_formula"]
        for name in ("gspmd_fsdp", "stage3"):
            v = run["variants"][name]
            assert v["status"] == "ok" and v["mfu"] is None  # no peak FLOP/s for a CPU
            assert v["tokens_per_s"] == pytest.approx(4 * 16 / v["median_s"])
            assert 0 < v["temp_bytes"] < v["peak_bytes"]
            assert f"| {name} | {'on (no effect' if overlap == 'flags' else 'off |'}" in md
    lg = parts["largest"]["variants"]["stage3"]
    assert (lg["largest"], lg["first_failing"], lg["top_of_search"]) == ("test", None, True)
    probe = lg["probes"]["test"]
    assert probe["ok"] and probe["variant"] == "stage3" and probe["num_params"] == 21760
    assert probe["peak_bytes"] > 0 and 3.0 < probe["loss"] < 5.0
    off = parts["largest"]["variants"]["stage3_offload"]
    assert off["largest"] == "test" and off["probes"]["test"]["host_rss_peak_bytes"] > 0
    # the probe's resident memory as each phase ended, and its peak so far: never falling
    phases = off["probes"]["test"]["host_rss_phases"]
    assert [p[0] for p in phases] == ["state made", "compiled", "step 1", "step 2"]
    assert all(0 < rss <= peak for _, rss, peak in phases)
    assert [p[2] for p in phases] == sorted(p[2] for p in phases)
    assert phases[-1][2] <= off["probes"]["test"]["host_rss_peak_bytes"]
    assert "stage 3 + offload, test: the probe's resident host memory (its peak so far) as " \
           "each phase ended: state made " in md
    assert parts["largest"]["pinned_limit"] == 7 << 30  # passed to the probes
    assert "XLA:GPU's pinned-host pool 7.52 GB" in md and "| host RSS peak |" in md
    # The offloaded update alone, in the bench part only (the overlap part does not repeat it)
    assert parts["bench"]["offload_update"]["params"] == 100_000
    assert parts["overlap"]["offload_update"] is None
    assert "## The offloaded update alone" in md and "| update, donated |" in md
    assert "not_measured" not in result and "Not measured" not in md
    # Offload's targets: the step measured (stage 3 + offload against GSPMD here), the delayed
    # step not run, the 7b shape not searched
    assert "## Offload's targets" in md
    assert re.search(r"\| offload's step ≤ 2\.5× gspmd_fsdp's \| \d+\.\d\d× \| (yes|no) \|", md)
    assert "| offload's delayed step ≤ 1.5× gspmd_fsdp's | not measured | - |" in md
    assert "| test (7b not searched) | - |" in md
    # Stage 3 + offload: its device peak is the devices' program's, which holds no host state;
    # its host peak the host update's, in place (the state and the bf16 gradient).
    from test_measure import engine_offloads

    for part in ("bench", "overlap"):
        off, plain = parts[part]["variants"]["stage3_offload"], parts[part]["variants"]["stage3"]
        if not engine_offloads():
            assert off["status"] == "n/a" or off["host_state_bytes"] == 0
            continue
        assert off["status"] == "ok" and off["split"] == "measured"
        # fp32 master + moments (12Ψ/N) and Adam's int32 step count
        assert off["host_state_bytes"] == 12 * 21760 // 2 + 4
        assert off["device_peak_bytes"] == off["peak_bytes"]
        assert off["host_state_bytes"] < off["host_peak_bytes"] < 1.25 * off["host_state_bytes"]
        assert plain["device_peak_bytes"] == plain["peak_bytes"] and plain["split"] == "measured"
        peak = f"{gb_size(off['device_peak_bytes'])} (+ {gb_size(off['host_state_bytes'])} host"
        assert f"| stage 3 + offload | {'on (no effect' if part == 'overlap' else 'off |'}" in md
        assert peak in md


def gb_size(nbytes):
    from zerojax.analysis.accounting import format_bytes

    return format_bytes(nbytes)


def test_gpu_bench_says_which_of_offloads_targets_the_parts_met():
    """Each target against the parts' figures, its limit included; a largest shape counts only
    at 7b or above and as the planner predicted it; nothing measured, no section."""
    gb = _load_gpu_bench()
    ok = lambda ratio, **k: {"status": "ok", "ratio": ratio, **k}
    bench = {"baseline": "optax_single", "variants": {
        "optax_single": ok(1.0),
        "stage3_offload": ok(2.5, host_peak_bytes=125, host_state_bytes=100),
        "stage3_offload_dpu": ok(1.51, host_peak_bytes=117, host_state_bytes=100),
        "stage3_twin": {"status": "n/a", "reason": "out of memory", "host_peak_bytes": 300,
                        "host_state_bytes": 100}}}
    shapes = ["1b", "gpt-4b", "7b", "gpt3-13b"]
    offload = {"largest": "7b", "predicted": "7b"}
    parts = {"bench": bench, "largest": {"shapes": shapes, "variants": {"stage3_offload": offload}}}
    rows = gb.targets(parts)
    assert rows[0][0] == "offload's step ≤ 2.5× optax_single's"
    assert [(m, met) for _, m, met in rows] == [
        ("2.50×", True), ("1.51×", False), ("1.25× (stage 3 + offload)", True),
        ("7b (predicted 7b)", True)]
    bench["variants"]["stage3_offload_dpu"]["host_peak_bytes"] = 126
    assert gb.targets(parts)[2][1:] == ("1.26× (stage 3 + offload, delayed update)", False)
    for largest, predicted in (("gpt-4b", "gpt-4b"), ("gpt3-13b", "7b"), (None, "7b")):
        offload.update(largest=largest, predicted=predicted)
        assert gb.targets(parts)[3][2] is False
    del bench["variants"]["stage3_offload_dpu"]
    assert gb.targets(parts)[1][1:] == ("not measured", None)
    parts["largest"]["shapes"] = ["test"]
    assert gb.targets(parts)[3][2] is None
    assert all(met is None for _, _, met in gb.targets({}))
    assert "## Offload's targets" not in gb.markdown({})


def test_gpu_bench_largest_search_walks_from_the_estimate(tmp_path, monkeypatch):
    gb = _load_gpu_bench()
    sizes = {n: gb.GPT(c).num_params() for n, c in gb.gpt_family().items()}
    limit = sizes["gpt3-13b"]  # pretend: every shape up to 13B steps, nothing larger
    calls = []

    def fake(args, out, shape, variant):
        calls.append(shape)
        ok = sizes[shape] <= limit
        return {"shape": shape, "num_params": sizes[shape], "ok": ok,
                **({"peak_bytes": 1} if ok else {"reason": "RESOURCE_EXHAUSTED"})}

    monkeypatch.setattr(gb, "_probe", fake)
    names = list(sizes)
    # 80 GB: the planner guesses 33B (too big: down); 20 GB: 7B (up); unknown: the smallest.
    for memory, start in ((80e9, "gpt-33b"), (20e9, "7b"), (None, "gpt3-125m")):
        calls.clear()
        args = gb.parse_args(["--devices", "8", "--largest-variants", "stage3"])
        args.largest_batch, args.memory = 8, memory
        gb.run_largest(args, tmp_path)
        r = json.loads((tmp_path / "largest.json").read_text())["variants"]["stage3"]
        assert r["estimate_start"] == start
        assert (r["largest"], r["first_failing"]) == ("gpt3-13b", "neox-20b")
        assert r["probes"]["neox-20b"]["reason"] == "RESOURCE_EXHAUSTED"
        i, j = names.index(start), names.index("gpt3-13b")
        # up from the estimate while it steps, or down while it does not: no shape twice
        expected = names[i:j + 2] if i <= j else names[j:i + 1][::-1]
        assert calls == expected


@pytest.mark.parametrize("pinned_gb, start", [(10, "gpt-4b"), (110, "7b")])
def test_gpu_bench_offload_search_starts_at_the_plans_prediction(tmp_path, monkeypatch,
                                                                 pinned_gb, start):
    """One 80 GB device on a 125 GB host: the offload probes start where `plan --largest`
    predicts with XLA's pinned-host pool too small for 7b's gradient shard (10 GiB: gpt-4b) or
    not binding (110 GiB: 7b, where the host binds), and the report holds the prediction and
    the compiled host peak against the state."""
    gb = _load_gpu_bench()
    monkeypatch.setattr(gb, "_probe", lambda args, out, shape, variant: {
        "shape": shape, "num_params": 1, "ok": shape == start, "peak_bytes": 1,
        "host_state_bytes": 100, "host_peak_bytes": 110, "split": "measured",
        "host_update": "fused", "host_rss_peak_bytes": 2e9, "reason": "RESOURCE_EXHAUSTED"})
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(pinned_gb))
    args = gb.parse_args(["--devices", "1", "--largest-variants", "stage3_offload",
                          "--host-memory", "125e9"])
    args.largest_batch, args.memory = 1, 80e9
    gb.run_largest(args, tmp_path)
    lg = json.loads((tmp_path / "largest.json").read_text())
    r = lg["variants"]["stage3_offload"]
    assert (r["estimate_start"], r["predicted"], r["largest"]) == (start, start, start)
    assert (lg["host_memory_for_estimate"], lg["pinned_limit"]) == (125e9, pinned_gb << 30)
    md = gb.markdown({"largest": lg})
    assert f"| stage 3 + offload | {start} | {start} | 1 | 1 B (+ 100 B host; host peak 110 B, " \
           f"1.10× the state; host update fused) | 2.00 GB |" in md


def test_gpu_bench_script_finds_the_project_venv(tmp_path):
    # A copy of the script beside a fake .venv/bin/python that logs its arguments.
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "gpu_bench.sh"
    script.write_text((ROOT / "scripts" / "gpu_bench.sh").read_text())
    venv_python = tmp_path / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    log = tmp_path / "calls.log"
    venv_python.write_text(f'#!/bin/sh\necho "$0 $*" >> {log}\n')
    venv_python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    proc = subprocess.run(["bash", str(script), "--out", "x y"], env=env, capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    python, args = log.read_text().strip().split(" ", 1)
    assert Path(python).resolve() == venv_python
    assert args == f"{tmp_path / 'experiments' / 'gpu_bench.py'} --out x y"


def test_gpu_bench_failed_part_is_reported_not_stale(tmp_path, monkeypatch, capsys):
    gb = _load_gpu_bench()
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # main sets these if unset:
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "64")  # not left to later tests
    (tmp_path / "bench.json").write_text("{}")  # from an earlier run
    monkeypatch.setattr(gb, "child", lambda cmd, timeout, log_path: subprocess.CompletedProcess(
        cmd, 1, "", "RESOURCE_EXHAUSTED: out of memory"))
    assert gb.main(["--out", str(tmp_path), "--parts", "bench"]) == 1
    err = capsys.readouterr().err
    assert "bench: experiments/bench.py failed (rc 1)" in err and "out of memory" in err
    assert "failed: bench" in err
    assert not (tmp_path / "bench.json").exists()
    assert json.loads((tmp_path / "gpu_bench.json").read_text())["parts"] == {}


def test_update_bench_counts_the_bytes_and_times_every_form():
    """The offloaded update alone: bf16 gradient in (2 bytes a param), fp32 master and Adam
    moments read and written (2 x 12) and the step count (2 x 4 bytes), the bf16 compute
    shard out (2): 28 bytes a param + 8; each form timed against the same copy."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import update_bench

    res = update_bench.measure(4096, repeats=1, host_devices=(2,))
    assert res["bytes_per_update"] == 28 * 4096 + 8
    fused = update_bench.FUSED  # g++ is here
    assert set(res["update"]) == {"donated", "not donated", "CPU-backend program",
                                  "over 2 CPU devices", fused}
    # the engine's fused pass gives its XLA program's update bitwise on the bench's state (a
    # random one, with every scalar: test_fused.py)
    assert res["fused_check"] == {fused: {"differ": 0.0, "max_ulps": 0}}
    best = max(res["copy_bytes_per_s"].values())
    for name, r in res["update"].items():
        if name != "over 2 CPU devices":
            assert r["bytes_per_s"] == pytest.approx(res["bytes_per_update"] / r["median_s"])
        assert r["ratio_to_copy"] == pytest.approx(r["bytes_per_s"] / best)
        assert 0 < r["returned_s"] <= r["median_s"]  # dispatched, then done
    # what the compiled program moves: four fusions, one per output (two moments, the master,
    # the compute shard), each reading what the one before wrote: 42 bytes a param
    for name in ("donated", "over 2 CPU devices"):
        assert res["update"][name]["traffic_bytes"] == pytest.approx(42 * 4096, abs=200)
        assert res["update"][name]["traffic_per_s"] == pytest.approx(
            res["update"][name]["traffic_bytes"] / res["update"][name]["median_s"])
    assert "traffic_bytes" not in res["update"][fused]  # a custom call: XLA counts no bytes
    text = update_bench.table(res)
    assert "offloaded AdamW update of 4,096 params" in text
    assert f"({fused} gives the XLA program's numbers: bitwise)" in text


def test_gpu_bench_largest_alone_reads_the_device_memory_from_nvidia_smi(tmp_path,
                                                                          monkeypatch):
    """`--parts largest` without a bench part in the directory: the planner's device memory
    is nvidia-smi's total times the probes' memory fraction; without nvidia-smi, unknown."""
    gb = _load_gpu_bench()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 81559\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    assert gb._device_memory(tmp_path) == pytest.approx(81559 * 2**20 * 0.95)
    (tmp_path / "bench.json").write_text(json.dumps({"machine": {"device_memory_bytes": 7.0}}))
    assert gb._device_memory(tmp_path) == 7.0  # the bench part's figure first
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert gb._device_memory(tmp_path / "elsewhere") is None


@pytest.mark.slow
def test_offload_phases_times_the_engines_own_step(tmp_path):
    """experiments/offload_phases.py runs the offloaded step's programs and moves one by one:
    two of its ordinary steps and two of its update as a step runs it (in parts, in one part)
    leave the params the engine's four steps give, bitwise, and its
    report has every phase, both steps, both forms of each move and offload's distance from
    the run without it."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import offload_phases

    from zerojax.offload.side_by_side import RUNS

    eng, state, batch = offload_phases.engine("test", 2, None)
    _, kinds, state = offload_phases.phases(eng, state, batch, 2)
    assert kinds == ["device"]  # where the shards came up: the devices' own memory
    _, state = offload_phases.sent(eng, state, batch, 1)  # the update as the step runs it
    assert eng._offload.runs == RUNS  # (as it was: the one-part form's runs undone)
    ref, ref_state, _ = offload_phases.engine("test", 2, None)
    for _ in range(4):
        ref_state, _ = ref.step(ref_state, batch)
    assert_bitwise(eng.params(state), ref.params(ref_state))
    res = offload_phases.main(["--preset", "test", "--batch", "2", "--steps", "1",
                               "--move-gb", "0.001", "--out", str(tmp_path / "p.json")])
    assert set(res["phases_s"]) == {"gradients program", "gradient to the host mesh",
                                    "host update", "shards to the devices", "compute params"}
    assert all(v > 0 for v in res["phases_s"].values())
    assert set(res["together_s"]) == {"gradients, beside the update",
                                      "update, beside the gradients"}
    assert all(v > 0 for v in res["together_s"].values())
    cores = os.cpu_count()
    assert set(res["under_load_s"]) == {f"gradients, beside {cores} threads computing",
                                        f"gradients, beside {cores} threads copying"}
    assert all(v > 0 for v in res["under_load_s"].values())
    assert res["step_s"] > 0 and res["delayed_step_s"] > 0
    assert set(res["sent_s"]) == {"in parts", "in one part"} and min(res["sent_s"].values()) > 0
    assert res["update_parts"] == 1  # the fused pass, its host mesh the mesh: one program
    # the engine's own delayed step, in the order it dispatches: the update of the last
    # gradient first, then the gradients program the update overlaps
    line = res["delayed_timeline_ms"]
    assert [r[0] for r in line] == ["host update", "gradients program",
                                    "gradient to the host mesh", "shards to the devices",
                                    "compute params", "step returned", "step ready"]
    # each call returns in that order, before the step does, and before its result is seen
    # ready (by a watcher thread, whose wake-up may come after the step's own wait)
    calls = [at for _, at, _ in line]
    assert calls == sorted(calls) and calls[0] > 0
    assert all(at <= ready for _, at, ready in line)
    assert len(res["moves"]["seconds"]) == 4 and res["moves"]["bytes"] == 4 * 250_000
    assert json.loads((tmp_path / "p.json").read_text())["preset"] == "test"
    # one backend here: rounding (measured 0 as a script, 1.9e-5 under the suite's compile
    # flags, Adam magnifying last-bit gradient differences where one crosses zero); a wrong
    # or misplaced shard moves it by O(1)
    assert 0 <= res["parity"] < 1e-3


@pytest.mark.slow
def test_offload_checkpoint_memory_reports_each_phase(tmp_path):
    """experiments/offload_checkpoint_memory.py measures a step, two saves, a restore and the
    step after it, each over the host state's bytes, and writes them as JSON, the two
    checkpoints where it was told."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import offload_checkpoint_memory

    res = offload_checkpoint_memory.main(["--preset", "test", "--dir", str(tmp_path / "c"),
                                          "--out", str(tmp_path / "m.json")])
    assert list(res["over_host_state"]) == ["step", "save (first: compiles)", "save",
                                            "restore (nothing else held)",
                                            "first step after it"]
    assert all(v["host"] >= 0 and v["device"] >= 0 for v in res["over_host_state"].values())
    assert res["host_state_bytes"] > 0 and res["params"] > 0
    assert json.loads((tmp_path / "m.json").read_text())["preset"] == "test"
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["a", "b"]
    # A resume: the second step restored in a fresh process, glibc's mmap threshold fixed.
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    script = ROOT / "experiments" / "offload_checkpoint_memory.py"
    proc = subprocess.run([sys.executable, str(script),
                           "--preset", "test", "--restore-only", str(tmp_path / "c" / "b"),
                           "--mmap-threshold", str(16 << 20), "--out", str(tmp_path / "r.json")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["mmap_threshold"] == 16 << 20 and res["params"] == 21_760
    row = res["restore_fresh_process"]
    assert row["host"] >= row["host_at_end"] > 0 and row["device"] >= 0
    # the state (master, two moments: 12 bytes a param) and the compute params (2 or 4 bytes)
    assert row["host_arrays"] == pytest.approx(1 + 2 / 12, rel=0.02)
    assert "restore, fresh process: host peak" in proc.stdout


def test_gpu_offload_check_commands_parse(tmp_path):
    """scripts/gpu_offload_check.sh's commands (printed by --dry-run, nothing run) are what
    each experiment's own parser accepts, in priority order, with the preset passed on."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import gpu_bench
    import offload_checkpoint_memory
    import offload_phases
    import update_bench

    env = {**os.environ, "PYTHON": sys.executable, "HOST_MEMORY": "125e9"}
    out = subprocess.run([str(ROOT / "scripts" / "gpu_offload_check.sh"), "--dry-run", "--out",
                          str(tmp_path / "o"), "--preset", "test"], env=env, check=True,
                         capture_output=True, text=True).stdout.splitlines()
    assert [line.split(":")[0] for line in out] == ["bench", "largest", "phases", "update",
                                                    "ckpt", "resume", "resume-mmap"]
    parsers = {"gpu_bench.py": gpu_bench.parse_args, "offload_phases.py": offload_phases.parse_args,
               "offload_checkpoint_memory.py": offload_checkpoint_memory.parse_args,
               "update_bench.py": update_bench.parse_args}
    parsed = {}
    for line in out:
        part, cmd = line.split(": ", 1)
        words = cmd.split()
        assert words[0] == sys.executable
        parsed[part] = parsers[Path(words[1]).name](words[2:])
        assert part == "update" or parsed[part].preset == "test"
    assert parsed["bench"].variants == ["stage3_offload", "stage3_offload_dpu", "stage3_twin",
                                        "stage3_twin_dpu"] and parsed["bench"].parts == ["bench"]
    assert parsed["largest"].largest_variants == ["stage3_offload"]
    assert parsed["update"].host_devices == [1, 2, 4, 8] and parsed["update"].params == 302e6
    assert parsed["largest"].host_memory == 125e9 and parsed["largest"].pinned_limit_gb == 110
    # the resumes read the second step the ckpt part writes, outside OUT (which is packed)
    assert parsed["resume"].restore_only == parsed["ckpt"].dir / "b" \
        == parsed["resume-mmap"].restore_only
    assert tmp_path / "o" not in parsed["ckpt"].dir.parents
    assert (parsed["resume"].mmap_threshold, parsed["resume-mmap"].mmap_threshold) == (
        None, 16 << 20)
    assert not (tmp_path / "o").exists()  # a dry run writes nothing
    bad = subprocess.run([str(ROOT / "scripts" / "gpu_offload_check.sh"), "--bogus"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown argument '--bogus'" in bad.stderr
