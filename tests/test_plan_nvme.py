"""Planning with the NVMe tier (ZeRO-Infinity, docs/nvme.md): `estimate --offload-device nvme`
and `plan --largest --offload-device nvme` count the master and optimizer state on disk and the
ring of I/O buffers in host memory instead."""

import json
import math
import shutil

import jax
import pytest

from zerojax.analysis.accounting import estimate, nvme_ring_bytes, state_estimate
from zerojax.analysis.estimate_args import EstimateError
from zerojax.analysis.estimate_command import estimate_main
from zerojax.analysis.plan_command import plan_main
from zerojax.models import GPT

PSI, N = 7_500_000_000, 64  # ZeRO's Figure 1: 7.5B params on 64 devices
RING = 4 * 3 * 4 * 2**20  # the default ring: 4 buffers of 1Mi elements of master, mu, nu (fp32)


def test_the_disk_tier_is_the_formula():
    """Derived by hand: the disk holds the host tier's 12Ψ/N, the host the ring (and a pending
    gradient), the device what it holds with the host tier."""
    assert nvme_ring_bytes() == RING == 50_331_648
    assert nvme_ring_bytes(1 << 18, 2) == 2 * 3 * 4 * (1 << 18)
    for stage in (1, 2, 3):
        cpu = estimate(PSI, N, stage, offload="optimizer")
        nvme = estimate(PSI, N, stage, offload="optimizer", offload_device="nvme")
        assert nvme.on_disk == 12 * PSI / N == 1.40625e9
        assert (nvme.host, nvme.ring) == (RING, RING)
        assert nvme.host_peak == RING + 4 * PSI / N  # + the bf16 gradient down, shard up
        assert (nvme.params, nvme.grads, nvme.optimizer, nvme.total, nvme.transfer) == (
            cpu.params, cpu.grads, cpu.optimizer, cpu.total, cpu.transfer)
        # The host drops the master and moments and takes the ring instead.
        assert cpu.host - nvme.host == 12 * PSI / N - RING
        assert cpu.host_peak - nvme.host_peak == 12 * PSI / N - RING
        assert nvme.as_dict()["on_disk"] == nvme.on_disk and "on_disk" not in cpu.as_dict()
    # The delayed update's pending bf16 gradient shard stays in host memory, 2Ψ/N.
    d = estimate(PSI, N, 3, offload="optimizer", offload_device="nvme", delayed_update=1)
    assert (d.host, d.pending, d.on_disk, d.ahead) == (2 * PSI / N + RING, 2 * PSI / N,
                                                       12 * PSI / N, 2 * PSI / N)
    assert d.host_peak == RING + 6 * PSI / N
    # Twin-Flow: the devices keep 3/4 of the state, the disk a quarter.
    t = estimate(PSI, N, 3, offload="optimizer", offload_device="nvme", offload_fraction=0.25)
    assert (t.on_disk, t.optimizer, t.host) == (3 * PSI / N, 9 * PSI / N, RING)
    assert t.total == 4 * PSI / N + 9 * PSI / N and t.transfer == PSI / N
    # Another ring; float32 (the device keeps a float32 compute copy, the disk master + moments).
    r = estimate(PSI, N, 3, offload="optimizer", offload_device="nvme", ring_bytes=1000)
    assert (r.host, r.host_peak) == (1000, 1000 + 4 * PSI / N)
    f32 = state_estimate(1000, 1, 3, "float32", offload="optimizer", offload_device="nvme")
    assert (f32.params, f32.on_disk, f32.host, f32.transfer) == (4000, 12000, RING, 8000)


@pytest.mark.parametrize("kw, message", [
    (dict(offload_device="nvme"), "needs offload='optimizer'"),
    (dict(offload="optimizer", offload_device="disk"), "is not an offload device"),
    (dict(offload="optimizer", ring_bytes=10), "give offload_device='nvme'"),
    (dict(offload="optimizer", offload_device="nvme", ring_bytes=0), "positive number"),
    (dict(offload="optimizer", offload_device="nvme", ring_bytes=-1.0), "positive number"),
])
def test_bad_disk_tier_estimates(kw, message):
    with pytest.raises(EstimateError, match=message):
        estimate(PSI, N, 3, **kw)


def test_the_disk_tier_is_the_host_tiers_engine_less_its_state():
    """Against an engine of the host tier (the test preset on 8 devices, no leaf padded): the
    arrays the NVMe store would hold (master and moments: every float array of the host's
    master and optimizer state) are `on_disk` to the byte; the host's other bytes (the
    optimizer's count, a pending gradient) plus the ring are the NVMe tier's `host`; and the
    host update's compiled program holds, beside that state, no more than the gradient and
    compute shards the NVMe tier's host peak counts."""
    from helpers import DEFAULT_BUFFERS
    from test_measure import engine_offloads, tiny

    from zerojax.analysis.measurement import peaks, state_bytes

    if not engine_offloads():
        pytest.skip("the engine keeps the optimizer state on the device")
    psi = GPT.from_preset("test").num_params()

    def nbytes(leaves) -> int:  # a device's shards
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                   for x in leaves)

    for stage, k in ((1, None), (2, None), (3, None), (3, 0)):
        eng, batch = tiny(stage, "bfloat16", offload="optimizer", delayed_update=k)
        state_bytes(eng, batch)  # learns the units
        state = eng.abstract_state()
        host = nbytes(jax.tree.leaves(eng.host_part(state)))
        store = nbytes([x for x in jax.tree.leaves((state.master, state.opt_state))
                        if x.ndim and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)])
        nvme = state_estimate(psi, 8, stage, "bfloat16", offload="optimizer",
                              delayed_update=k, offload_device="nvme")
        assert store == nvme.on_disk == 12 * psi / 8
        # the optimizer's count (4 bytes) and the pending update's scalars (13)
        assert host - store + RING == pytest.approx(nvme.host, abs=17)
        assert host - store + RING > nvme.host - 1
        if k is None:
            peak = peaks(eng.lower_host_update().compile(
                compiler_options=DEFAULT_BUFFERS).memory_analysis())[0]
            # The update holds the bf16 gradient shard (2Ψ/N) beside the state, its compute
            # shard in the gradient's buffer: within the 4Ψ/N the NVMe host peak adds to the ring.
            assert 2 * psi / 8 <= peak - store <= nvme.host_peak - RING == 4 * psi / 8


def test_estimate_command_with_the_disk_tier(capsys):
    argv = ["--params", "7.5e9", "--devices", "64", "--offload", "optimizer"]
    assert estimate_main([*argv, "--offload-device", "nvme", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    stages = out["stages"]
    assert out["offload_device"] == "nvme"
    assert [s["memory"].get("on_disk", 0) for s in stages] == [0] + [1.40625e9] * 3
    assert [s["memory"]["host"] for s in stages] == [0] + [RING] * 3
    assert [s["memory"]["host_peak"] for s in stages[1:]] == [RING + 0.46875e9] * 3
    assert estimate_main([*argv, "--offload-device", "nvme"]) == 0
    table = capsys.readouterr().out
    assert "3 + offload (nvme)" in table and "disk" in table and "1.41 GB" in table
    assert "50.3 MB" in table  # the ring
    assert estimate_main([*argv, "--json"]) == 0  # the host tier: no disk
    cpu = json.loads(capsys.readouterr().out)["stages"]
    assert "on_disk" not in cpu[3]["memory"] and cpu[3]["memory"]["host"] == 1.40625e9


def largest_json(capsys, *extra) -> dict:
    argv = ["--devices", "1", "--memory", "80GB", "--largest", "--stages", "3", "--remat", "on",
            "--host-memory", "125GB", "--pinned-limit", "64GiB", "--json", *extra]
    assert plan_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    (row,) = out["largest"]
    return out, row["offload"]


def test_plan_largest_with_the_disk_tier_reaches_past_the_host(capsys):
    """One H100 (80 GB) on a 125 GB host: the host tier stops at 7b (its 16Ψ host peak, 107 GB,
    fits 112.5 GB; gpt3-13b's 207 GB does not); with the state on a 2 TB disk the device's own
    bf16 params and gradients and activations bind, at gpt3-13b (neox-20b's 4Ψ alone is 82 GB)."""
    _, cpu = largest_json(capsys)
    out, nvme = largest_json(capsys, "--offload-device", "nvme", "--nvme-bytes", "2TB")
    assert (cpu["fits"]["name"], cpu["binds"]) == ("7b", ["host"])
    f, nx = nvme["fits"], nvme["next"]
    assert (f["name"], nx["name"], nvme["binds"]) == ("gpt3-13b", "neox-20b", ["device"])
    assert f["num_params"] > 1.9 * cpu["fits"]["num_params"]
    psi = f["num_params"]
    assert (f["on_disk"], f["host"], f["ring"]) == (12 * psi, RING, RING)
    assert f["host_peak"] == RING + 4 * psi and f["state"] == 4 * psi
    assert f["peak"] <= 80e9 < nx["peak"] and 4 * nx["num_params"] > 80e9
    assert nx["host_peak"] <= 112.5e9 and nx["on_disk"] <= 2e12  # only the device binds
    assert (out["offload_device"], out["disk"]) == ("nvme", 2e12)
    assert "12 bytes x Ψ/N per device (each device's shard of its process's store)" in out[
        "assumptions"]["offload"] and "at most 2.00 TB per device (--nvme-bytes)" in out[
        "assumptions"]["offload"]
    assert plan_main(["--devices", "1", "--memory", "80GB", "--largest", "--host-memory",
                      "125GB", "--pinned-limit", "64GiB", "--offload-device", "nvme",
                      "--nvme-bytes", "2TB"]) == 0
    table = capsys.readouterr().out
    assert "+ offload (nvme)" in table and "gpt3-13b" in table and "155 GB" in table, table


def test_plan_largest_with_a_small_disk_binds_at_the_disk(capsys, tmp_path, monkeypatch):
    # 100 GB of disk holds 7b's 12Ψ = 80.6 GB, not gpt3-13b's 155 GB.
    _, small = largest_json(capsys, "--offload-device", "nvme", "--nvme-bytes", "100GB")
    assert (small["fits"]["name"], small["binds"]) == ("7b", ["disk"])
    assert small["next"]["on_disk"] > 100e9 >= small["fits"]["on_disk"]
    # --nvme-path: its file system's free space, shared by the devices of the process.
    free = shutil.disk_usage(tmp_path).free
    out, _ = largest_json(capsys, "--offload-device", "nvme", "--nvme-path", str(tmp_path))
    assert out["disk"] == pytest.approx(free, rel=1e-3) and out["nvme_path"] == str(tmp_path)
    usage = shutil.disk_usage(tmp_path)._replace(free=200e9)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    argv = ["--devices", "2", "--memory", "80GB", "--largest", "--stages", "3", "--remat", "on",
            "--offload-device", "nvme", "--nvme-path", str(tmp_path), "--json"]
    assert plan_main(argv) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    (row,) = out["largest"]
    assert out["disk"] == 100e9 and "disk" in row["offload"]["binds"]
    assert row["offload"]["fits"]["on_disk"] <= 100e9 < row["offload"]["next"]["on_disk"]
    assert "free space, 200 GB / 2 devices" in captured.err


@pytest.mark.parametrize("main, argv, message", [
    (estimate_main, ["--params", "1e9", "--devices", "8", "--offload-device", "nvme"],
     "--offload-device nvme needs --offload optimizer"),
    (plan_main, ["--devices", "1", "--memory", "80GB", "--largest", "--offload", "off",
                 "--offload-device", "nvme"], "which --offload off drops"),
    (plan_main, ["--devices", "1", "--memory", "80GB", "--largest", "--offload-device", "nvme",
                 "--nvme-bytes", "-1"], "'-1': give the disk space per device, more than 0"),
    (plan_main, ["--devices", "1", "--memory", "80GB", "--largest", "--offload-device", "nvme",
                 "--nvme-bytes=-1TB"], "'-1TB': give the disk space per device"),
    (plan_main, ["--devices", "1", "--memory", "80GB", "--largest", "--offload-device", "nvme",
                 "--nvme-bytes", "0"], "more than 0 bytes"),
    (plan_main, ["--devices", "1", "--memory", "80GB", "--largest", "--nvme-bytes", "1TB"],
     "add --offload-device nvme"),
    (plan_main, ["--devices", "1", "--memory", "80GB", "--largest", "--offload-device", "nvme",
                 "--nvme-path", "/no/such/dir"], "no such directory"),
    (plan_main, ["--devices", "1", "--memory", "80GB", "--largest", "--offload-device", "nvme",
                 "--nvme-path", "/", "--nvme-bytes", "1TB"], "drop one of them"),
    (plan_main, ["--devices", "1", "--memory", "80GB", "--model", "1b", "--offload-device",
                 "nvme"], "add --largest"),
])
def test_bad_disk_tier_options_exit_2_with_one_line(main, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err, err
