"""The analytic memory and communication model against the ZeRO paper and the seeds."""

import dataclasses
import math
import types

import pytest

from zerojax.analysis.accounting import (
    CommEstimate,
    MemoryEstimate,
    comm_estimate,
    estimate,
    format_bytes,
    shares_master,
    state_estimate,
)
from zerojax.analysis.estimate_args import EstimateError
from zerojax.analysis.estimate_table import estimate_table
from zerojax.app.report import estimate_for, memory_rows

GB = 1e9


def totals(num_params, devices, **kw):
    return [estimate(num_params, devices, s, **kw).total for s in range(4)]


def test_zero_paper_figure_1():
    # Ψ = 7.5B, N = 64, K = 12, fp16 params and grads: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB.
    t = totals(7_500_000_000, 64)
    assert t == [120 * GB, 31.40625 * GB, 16.640625 * GB, 1.875 * GB]
    assert [round(x / GB, p) for x, p in zip(t, (0, 1, 1, 2), strict=True)] == [
        120,
        31.4,
        16.6,
        1.88,
    ]
    assert [format_bytes(x) for x in t] == ["120 GB", "31.4 GB", "16.6 GB", "1.88 GB"]


def test_components_by_stage():
    psi, n = 1000, 8
    assert estimate(psi, n, 0) == MemoryEstimate(2000, 2000, 12000, 16000)
    assert estimate(psi, n, 1) == MemoryEstimate(2000, 2000, 1500, 5500)
    assert estimate(psi, n, 2) == MemoryEstimate(2000, 250, 1500, 3750)
    assert estimate(psi, n, 3) == MemoryEstimate(250, 250, 1500, 2000)
    assert estimate(psi, n, 2).as_dict() == {
        "params": 2000,
        "grads": 250,
        "optimizer": 1500,
        "total": 3750,
        "host": 0,
        "transfer": 0,
    }


@pytest.mark.parametrize(
    "n, ratio, saving, printed", [(8, 5.5, 0.65625, 65), (64, 4.1875, 0.73828125, 74)]
)
def test_seed_001_stage_1_saving(n, ratio, saving, printed):
    # Seed 001: 16P vs 4P + 12P/N; "At N=8 ... 5.5P, a 65% drop. At N=64 ... 4.19P, a 74% drop."
    psi = 1_000_000
    s0, s1 = estimate(psi, n, 0).total, estimate(psi, n, 1).total
    assert s0 == 16 * psi
    assert s1 == ratio * psi
    assert 1 - s1 / s0 == saving
    # The seed floors 65.6 % to 65 but rounds 73.8 % to 74; both are within a point.
    assert math.floor(100 * saving) <= printed <= math.ceil(100 * saving)


def test_seed_003_tiny_transformer():
    # Seed 003: 260 parameters on 2 GPUs, bf16 params/grads, fp32 Adam.
    assert totals(260, 2)[:3] == [4160, 2600, 2340]
    assert estimate(260, 2, 2) == MemoryEstimate(520, 260, 1560, 2340)
    rows = estimate_table(260, 2)
    assert [r["saving"] for r in rows[:3]] == ["0.0%", "37.5%", "43.8%"]


def test_seed_003_calculator_7b_on_8():
    # Seed 003's calculator: 7B on 8 GPUs, 112 / 38.5 / 26.25 GB, savings 65.6 % and 76.6 %.
    t = totals(7_000_000_000, 8)
    assert t[:3] == [112 * GB, 38.5 * GB, 26.25 * GB]
    assert [r["saving"] for r in estimate_table(7_000_000_000, 8)[1:3]] == ["65.6%", "76.6%"]


def test_seed_004_simulator_70b_on_8():
    # Seed 004: 70B, N = 8, FP16/BF16 + Adam: 1120.0 / 385.0 / 262.5 / 140.0 GB (decimal GB).
    assert totals(70_000_000_000, 8) == [1120 * GB, 385 * GB, 262.5 * GB, 140 * GB]
    assert format_bytes(1120 * GB) == "1.12 TB"  # the seed's "≈ 1.12 Terabytes"


def test_hybrid_shards_over_devices_per_replica():
    assert estimate(1000, 16, 3, replica=2) == estimate(1000, 8, 3)
    assert estimate(1000, 8, 1, replica=8) == estimate(1000, 1, 0)


def test_custom_byte_sizes():
    m = estimate(100, 4, 3, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert m == MemoryEstimate(100, 100, 200, 400)


@pytest.mark.parametrize("n", [2, 8, 64])
def test_comm_stage_ratios(n):
    psi, b = 1_000_000, 2
    c = [comm_estimate(psi, n, s) for s in range(4)]
    ddp = 2 * (n - 1) / n * psi * b
    assert c[0] == CommEstimate(ddp, 0.0, 0.0, ddp, axes={"data": ddp})
    assert c[1].total == pytest.approx(ddp, rel=1e-12)
    assert c[2] == c[1]
    assert c[3].total == pytest.approx(1.5 * c[0].total, rel=1e-12)
    assert c[3].all_gather == pytest.approx(2 * c[1].all_gather, rel=1e-12)
    assert c[1].all_reduce == c[3].all_reduce == 0


def test_comm_seed_003_two_gpus():
    # Ring on 2 GPUs sends half of each 520-byte buffer per collective; the seed's table lists
    # buffer sizes (520 B + 520 B = 1,040 B), not bytes sent.
    assert comm_estimate(260, 2, 0) == CommEstimate(520, 0, 0, 520, axes={"data": 520})
    assert comm_estimate(260, 2, 1) == CommEstimate(0, 260, 260, 520, axes={"data": 520})
    assert comm_estimate(260, 2, 3) == CommEstimate(0, 260, 520, 780, axes={"data": 780})


def test_comm_reduce_bytes():
    c = comm_estimate(1000, 4, 1, reduce_bytes=4)
    assert (c.reduce_scatter, c.all_gather) == (3000, 1500)
    assert comm_estimate(1000, 4, 0, grad_bytes=4).all_reduce == 6000


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_comm_hybrid_adds_replica_all_reduce(stage):
    psi, n, r = 1_000_000, 4, 2
    flat, hybrid = comm_estimate(psi, n, stage), comm_estimate(psi, n * r, stage, replica=r)
    extra = 2 * (r - 1) / r * psi * 2 / n
    assert hybrid.all_reduce == extra
    assert (hybrid.reduce_scatter, hybrid.all_gather) == (flat.reduce_scatter, flat.all_gather)
    assert hybrid.total == pytest.approx(flat.total + extra, rel=1e-12)


def test_comm_hybrid_stage_0_all_reduces_over_all_devices():
    hybrid, flat = comm_estimate(1000, 8, 0, replica=2), comm_estimate(1000, 8, 0)
    assert dataclasses.replace(hybrid, axes={}) == dataclasses.replace(flat, axes={})
    # The same ring, but across the replica groups' slower link.
    assert (hybrid.axes, flat.axes) == ({"all": 3500.0}, {"data": 3500.0})


def test_single_device_sends_nothing():
    assert all(comm_estimate(1000, 1, s).total == 0 for s in range(4))


@pytest.mark.parametrize(
    "args, kwargs, text",
    [
        ((1000, 8, 4), {}, "stage=4"),
        ((1000, 8, -1), {}, "stage=-1"),
        ((1000, 8, 1.5), {}, "stage=1.5"),
        ((1000, 0, 1), {}, "devices=0"),
        ((1000, 6, 1), {"replica": 4}, "replica=4"),
        ((1000, 8, 1), {"replica": 0}, "replica=0"),
        ((-5, 8, 1), {}, "num_params=-5"),
        ((10.5, 8, 1), {}, "num_params=10.5"),
        ((float("nan"), 8, 1), {}, "num_params=nan"),
        ((float("inf"), 8, 1), {}, "num_params=inf"),
        ((1000, 8, 1), {"param_bytes": -2}, "param_bytes=-2"),
        ((1000, 8, 1), {"optimizer_bytes": -1}, "optimizer_bytes=-1"),
    ],
)
def test_bad_inputs(args, kwargs, text):
    with pytest.raises(EstimateError, match=text):
        estimate(*args, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k != "optimizer_bytes"}
    if "optimizer_bytes" not in text:
        with pytest.raises(EstimateError, match=text):
            comm_estimate(*args, **kwargs)


def test_bad_reduce_bytes():
    with pytest.raises(EstimateError, match="reduce_bytes=-4"):
        comm_estimate(1000, 8, 1, reduce_bytes=-4)
    assert issubclass(EstimateError, ValueError)


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (520, "520 B"), (999.6, "1.00 KB"), (4160, "4.16 KB"), (38.5 * GB, "38.5 GB")],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_estimate_table():
    rows = estimate_table(70_000_000_000, 8)
    assert [r["stage"] for r in rows] == ["0", "1", "2", "3"]
    assert [r["total"] for r in rows] == ["1.12 TB", "385 GB", "262 GB", "140 GB"]
    assert rows[3]["comm"] == format_bytes(1.5 * comm_estimate(70_000_000_000, 8, 0).total)
    with pytest.raises(EstimateError, match="bogus"):
        estimate_table(1000, 8, bogus=1)


# --- the engine's own state: estimate with each compute dtype's byte sizes -------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_state_estimate_is_the_paper_for_half_precision(dtype):
    t = [state_estimate(7_500_000_000, 64, s, dtype) for s in range(4)]
    assert t == [estimate(7_500_000_000, 64, s) for s in range(4)]
    assert [m.total for m in t] == [120 * GB, 31.40625 * GB, 16.640625 * GB, 1.875 * GB]


def test_state_estimate_float32_keeps_no_separate_master_in_stages_0_and_3():
    psi, n = 1000, 8
    # Stages 0 and 3 update the fp32 params in place (K = 8: the moments); stages 1-2 keep
    # replicated fp32 params next to the fp32 master shard (K = 12).
    assert [state_estimate(psi, n, s, "float32") for s in range(4)] == [
        MemoryEstimate(4000, 4000, 8000, 16000),
        MemoryEstimate(4000, 4000, 1500, 9500),
        MemoryEstimate(4000, 500, 1500, 6000),
        MemoryEstimate(500, 500, 1000, 2000),
    ]
    assert [shares_master("float32", s) for s in range(4)] == [True, False, False, True]
    assert not any(shares_master(d, s) for d in ("bfloat16", "float16") for s in range(4))
    assert state_estimate(1000, 16, 3, "float32", replica=2) == state_estimate(1000, 8, 3,
                                                                                "float32")
    with pytest.raises(EstimateError, match="param_dtype='fp8'"):
        state_estimate(1000, 8, 1, "fp8")


def train_cfg(dtype):
    return types.SimpleNamespace(param_dtype=dtype, replica=1)


def test_train_memory_rows_say_what_the_state_holds():
    # The nano preset at stage 3 on 4 devices (the README's run).
    psi, held = 875_264, 12 * 875_264 // 4
    fp32 = estimate_for(psi, 4, 3, train_cfg("float32"))
    assert fp32.state == held and fp32.shared_master
    assert memory_rows(fp32, held + 16) == [
        ("memory/device", "2.63 MB estimated = float32 params 875 KB (the master) + Adam "
                          "moments 1.75 MB"),
        ("", "2.63 MB measured: this device's shards of the state"),
        ("", "+ grads 875 KB (float32) only while a step runs"),
    ]
    bf16 = estimate_for(psi, 4, 3, train_cfg("bfloat16"))
    assert bf16.state == held + 2 * psi // 4 and not bf16.shared_master
    assert memory_rows(bf16, 0)[0] == (
        "memory/device", "3.06 MB estimated = bfloat16 params 438 KB + float32 master 875 KB "
                         "+ Adam moments 1.75 MB")
    assert bf16.as_dict()["state"] == bf16.state


# --- optimizer offload: device and host bytes ----------------------------------------------

def test_offload_splits_device_and_host_bytes_zero_figure_1():
    psi, n = 7_500_000_000, 64
    by_stage = {s: estimate(psi, n, s, offload="optimizer") for s in (1, 2, 3)}
    # The host holds the fp32 master and moments, 12Ψ/N = 1.41 GB, in every stage.
    assert {m.host for m in by_stage.values()} == {12 * psi / n} == {1.40625 * GB}
    # The device: stage 1 replicated params + the full gradient before its reduce-scatter,
    # stage 2 params + a gradient shard, stage 3 a shard of each: 4Ψ/N = 0.47 GB.
    assert [m.total for m in by_stage.values()] == [2 * psi + 2 * psi, 2 * psi + 2 * psi / n,
                                                    4 * psi / n]
    assert by_stage[3].total == 0.46875 * GB and format_bytes(by_stage[3].total) == "469 MB"
    assert all(m.optimizer == 0 for m in by_stage.values())
    # Each step: the bf16 gradient shard down, the bf16 compute shard up.
    assert {m.transfer for m in by_stage.values()} == {4 * psi / n}
    # Offload moves the optimizer bytes and nothing else.
    for s, m in by_stage.items():
        plain = estimate(psi, n, s)
        assert (m.params, m.grads, m.total + m.host) == (plain.params, plain.grads, plain.total)
    assert state_estimate(psi, n, 3, offload="optimizer") == by_stage[3]
    # The host's peak while the update runs in place: the state, the bf16 gradient shard that
    # came down and the bf16 compute shard that goes up, 16Ψ/N = 1.875 GB.
    assert {m.host_peak for m in by_stage.values()} == {16 * psi / n} == {1.875 * GB}
    assert by_stage[3].as_dict()["host_peak"] == 1.875 * GB
    assert "host_peak" not in estimate(psi, n, 3).as_dict() and estimate(psi, n, 3).host_peak == 0


def test_offload_float32_keeps_a_compute_copy_on_the_device():
    psi, n = 1000, 8
    # Stage 3 float32 without offload computes on the master itself (K = 8); with offload the
    # master is on the host, so the device keeps float32 compute params and the host K = 12.
    assert state_estimate(psi, n, 3, "float32") == MemoryEstimate(500, 500, 1000, 2000)
    assert state_estimate(psi, n, 3, "float32", offload="optimizer") == MemoryEstimate(
        500, 500, 0, 1000, host=1500, transfer=1000)
    assert state_estimate(psi, n, 1, "float32", offload="optimizer") == MemoryEstimate(
        4000, 4000, 0, 8000, host=1500, transfer=1000)
    assert shares_master("float32", 3) and not shares_master("float32", 3, "optimizer")
    fp32 = estimate_for(psi, n, 3, types.SimpleNamespace(param_dtype="float32", replica=1,
                                                         offload="optimizer"))
    assert (fp32.state, fp32.memory.host, fp32.shared_master) == (500, 1500, False)


@pytest.mark.parametrize("kw, message", [
    ({"stage": 0, "offload": "optimizer"}, "offload='optimizer' needs stage 1, 2 or 3"),
    ({"stage": 3, "offload": "params"}, "offload='params' is not an offload mode"),
])
def test_offload_bad_arguments(kw, message):
    with pytest.raises(EstimateError, match=message):
        estimate(1000, 8, **kw)


def test_offload_table_and_memory_rows():
    rows = estimate_table(7_500_000_000, 64, offload="optimizer")
    assert [r["stage"] for r in rows] == ["0", "1 + offload", "2 + offload", "3 + offload"]
    assert (rows[0]["host"], rows[3]["host"], rows[3]["total"]) == ("0 B", "1.41 GB", "469 MB")
    assert rows[3]["host<->device"] == "469 MB" and rows[3]["saving"] == "99.6%"
    assert (rows[0]["host peak"], rows[3]["host peak"]) == ("0 B", "1.88 GB")
    est = estimate_for(875_264, 4, 3, types.SimpleNamespace(param_dtype="bfloat16", replica=1,
                                                           offload="optimizer"))
    assert memory_rows(est, 3_063_424 + 16, 2_625_792) == [
        ("memory/device", "438 KB estimated in device memory = bfloat16 params 438 KB"),
        ("memory/host", "2.63 MB estimated in host memory (offload) = float32 master 875 KB + "
                        "Adam moments 1.75 MB"),
        ("", "438 KB device + 2.63 MB host measured: this device's shards of the state"),
        ("", "+ grads 438 KB (bfloat16) only while a step runs; 875 KB host<->device per step"),
    ]
    # With the delayed update the host also holds the pending gradient as it arrived (bf16,
    # 2 B a param); the master and the moments stay what they were.
    est = estimate_for(875_264, 4, 3, types.SimpleNamespace(
        param_dtype="bfloat16", replica=1, offload="optimizer", delayed_update=2))
    assert memory_rows(est, 3_501_056 + 16, 3_063_424)[1] == (
        "memory/host", "3.06 MB estimated in host memory (offload) = float32 master 875 KB + "
                       "Adam moments 1.75 MB + the pending gradient 438 KB (delayed update)")


def test_twin_flow_keeps_its_share_of_the_host_bytes_on_the_devices():
    """`offload_fraction=0.25` on ZeRO figure 1's Ψ over 64 devices, stage 3 bf16: the host
    keeps a quarter of 12Ψ/N (and of the pending gradient, and of what moves each step), the
    devices the rest beside their 4Ψ/N; together the bytes of full offload."""
    psi, n = 7_500_000_000, 64
    for k in (None, 2):
        full = estimate(psi, n, 3, offload="optimizer", delayed_update=k)
        m = estimate(psi, n, 3, offload="optimizer", delayed_update=k, offload_fraction=0.25)
        assert (m.host, m.pending, m.transfer) == (full.host / 4, full.pending / 4,
                                                    full.transfer / 4)
        assert m.optimizer == 0.75 * full.host and m.total == full.total + m.optimizer
        assert m.host + m.optimizer == full.host and m.host_peak == m.host + m.transfer
        assert (m.params, m.grads, m.ahead) == (full.params, full.grads, full.ahead)
    m = estimate(psi, n, 3, offload="optimizer", offload_fraction=0.25)
    assert (m.host, m.optimizer, m.total) == (3 * psi / n, 9 * psi / n, 13 * psi / n)
    assert state_estimate(psi, n, 3, offload="optimizer", offload_fraction=0.25) == m
    assert estimate(psi, n, 3, offload="optimizer", offload_fraction=1.0) == estimate(
        psi, n, 3, offload="optimizer")
    rows = estimate_table(psi, n, offload="optimizer", offload_fraction=0.25)
    assert (rows[0]["host"], rows[3]["host"], rows[3]["optimizer"]) == ("0 B", "352 MB",
                                                                         "1.05 GB")
    est = estimate_for(875_264, 4, 3, types.SimpleNamespace(
        param_dtype="bfloat16", replica=1, offload="optimizer", offload_fraction=0.5))
    assert memory_rows(est, 3_063_424 + 16, 1_312_896)[:2] == [
        ("memory/device", "1.75 MB estimated in device memory = bfloat16 params 438 KB + "
                          "Twin-Flow's share of the master and Adam moments 1.31 MB"),
        ("memory/host", "1.31 MB estimated in host memory (offload) = float32 master 438 KB + "
                        "Adam moments 875 KB")]


@pytest.mark.parametrize("kw, message", [
    ({"offload": "optimizer", "offload_fraction": 0.0}, r"offload_fraction=0.0 must be"),
    ({"offload": "optimizer", "offload_fraction": 1.5}, r"offload_fraction=1.5 must be"),
    ({"offload": "optimizer", "offload_fraction": True}, r"offload_fraction=True must be"),
    ({"offload_fraction": 0.5}, r"offload_fraction=0.5 needs offload='optimizer'"),
])
def test_bad_offload_fraction_estimates(kw, message):
    with pytest.raises(EstimateError, match=message):
        estimate(1000, 8, 3, **kw)
    with pytest.raises(EstimateError, match=message):
        estimate_table(1000, 8, **kw)


def test_delayed_update_adds_the_pending_gradient_shard():
    """ZeRO figure 1's Ψ on 64 devices in bf16 with the delayed update: the host also holds the
    pending gradient shard as it arrived (bf16), 2Ψ/N = 0.23 GB (host 12Ψ/N -> 14Ψ/N, host
    peak 16Ψ/N -> 18Ψ/N), and the device the next step's compute shard, 2Ψ/N, while a step
    runs."""
    psi, n = 7_500_000_000, 64
    for s in (1, 2, 3):
        plain = estimate(psi, n, s, offload="optimizer")
        for k in (0, 40):
            m = estimate(psi, n, s, offload="optimizer", delayed_update=k)
            assert (m.pending, m.ahead) == (2 * psi / n, 2 * psi / n) == (0.234375 * GB,
                                                                          0.234375 * GB)
            assert (m.host, m.host_peak) == (14 * psi / n, 18 * psi / n) == (1.640625 * GB,
                                                                             2.109375 * GB)
            assert m.host - plain.host == m.host_peak - plain.host_peak == m.pending
            assert (m.total - plain.total, m.state) == (m.ahead, plain.state)
            assert (m.params, m.grads, m.optimizer, m.transfer) == (
                plain.params, plain.grads, plain.optimizer, plain.transfer)
            assert state_estimate(psi, n, s, offload="optimizer", delayed_update=k) == m
    # float32 params: the gradient that waits and the compute shard that comes up are 4 bytes.
    f32 = state_estimate(1000, 8, 3, "float32", offload="optimizer", delayed_update=1)
    assert (f32.pending, f32.ahead, f32.host) == (500, 500, 2000)
    # Without the delay nothing changes, and as_dict names the fields only with it.
    assert "pending" not in estimate(psi, n, 3, offload="optimizer").as_dict()
    assert estimate(psi, n, 3, offload="optimizer", delayed_update=2).as_dict()["pending"] == \
        0.234375 * GB
    rows = estimate_table(psi, n, offload="optimizer", delayed_update=2)
    assert (rows[3]["host"], rows[3]["host peak"], rows[3]["of which pending"]) == (
        "1.64 GB", "2.11 GB", "234 MB")
    assert "of which pending" not in estimate_table(psi, n, offload="optimizer")[3]


@pytest.mark.parametrize("kw, message", [
    ({"delayed_update": 2}, r"delayed_update=2 needs offload='optimizer' \(got offload=None"),
    ({"offload": "optimizer", "delayed_update": -1}, "must be an integer K >= 0"),
    ({"offload": "optimizer", "delayed_update": True}, "must be an integer K >= 0"),
])
def test_delayed_update_bad_arguments(kw, message):
    with pytest.raises(EstimateError, match=message):
        estimate(1000, 8, 3, **kw)
    with pytest.raises(EstimateError, match=message):
        estimate_table(1000, 8, **kw)


# --- the optimizer's own state instead of Adam's ------------------------------------------------

def test_state_estimate_takes_the_optimizers_state_bytes():
    psi, n = 1000, 8
    # Default: Adam's 8 bytes + the 4-byte master, the numbers above.
    assert state_estimate(psi, n, 1) == state_estimate(psi, n, 1, optimizer_state_bytes=8)
    # Lion's one momentum (4 bytes): K = 8 with a master, 4 where the fp32 params are it.
    assert state_estimate(psi, n, 1, optimizer_state_bytes=4) == MemoryEstimate(
        2000, 2000, 1000, 5000)
    assert state_estimate(psi, n, 3, "float32", optimizer_state_bytes=4) == MemoryEstimate(
        500, 500, 500, 1500)
    assert state_estimate(psi, n, 3, offload="optimizer", optimizer_state_bytes=0.5) == \
        MemoryEstimate(250, 250, 0, 500, host=562.5, transfer=500)
    with pytest.raises(EstimateError, match="optimizer_state_bytes=-1 must be a non-negative"):
        state_estimate(psi, n, 1, optimizer_state_bytes=-1)


def test_train_memory_rows_name_the_optimizers_state():
    psi = 875_264  # nano at stage 3 on 4 devices, with Lion (4 bytes per param)
    cfg = lambda dtype, **kw: types.SimpleNamespace(param_dtype=dtype, replica=1,
                                                    optimizer="lion", **kw)
    fp32 = estimate_for(psi, 4, 3, cfg("float32"), 4)
    assert fp32.state == 2 * 4 * psi / 4 and fp32.as_dict()["optimizer_state_bytes"] == 4
    assert memory_rows(fp32, 0)[0] == (
        "memory/device", "1.75 MB estimated = float32 params 875 KB (the master) + Lion "
                         "momentum 875 KB")
    bf16 = estimate_for(psi, 4, 3, cfg("bfloat16"), 4)
    assert memory_rows(bf16, 0)[0] == (
        "memory/device", "2.19 MB estimated = bfloat16 params 438 KB + float32 master 875 KB "
                         "+ Lion momentum 875 KB")
    # Offload: the host holds the master and the optimizer's state, split by its K.
    off = estimate_for(psi, 4, 3, cfg("bfloat16", offload="optimizer"), 4)
    assert off.memory.host == 8 * psi / 4
    assert memory_rows(off, 0)[1] == (
        "memory/host", "1.75 MB estimated in host memory (offload) = float32 master 875 KB + "
                       "Lion momentum 875 KB")
    muon = estimate_for(psi, 4, 3, types.SimpleNamespace(param_dtype="float32", replica=1,
                                                         optimizer="muon"), 4.406)
    assert memory_rows(muon, 0)[0][1].endswith("+ Muon momentum + Adam moments 964 KB")
