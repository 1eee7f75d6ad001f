"""The NVMe tier in the engine (`offload_device="nvme"`, zerojax/offload/disk.py): the host
tier's numbers bitwise, single-device optax's within the usual tolerance, its state on disk,
its checkpoints ordinary ones, and what it refuses."""

import json
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from helpers import (
    CLIP,
    LR,
    WD,
    assert_tree_close,
    engine_run,
    fused_adamw,
    gpt_batch,
    moved_error,
    reference_run,
    sweep,
    tiny_gpt,
)
from test_nvme_store import tmpfs
from test_precision import BATCH as SEED_BATCH
from test_state import assert_bitwise

import zerojax as zj
from zerojax.errors import StoreError
from zerojax.models import SeedMLP
from zerojax.offload.store import META

BATCHES = [gpt_batch(tiny_gpt().cfg, 8, s) for s in range(4)]


def nvme(path, **cfg):
    return dict(cfg, offload="optimizer", offload_device="nvme", nvme_path=str(path))


def pair(model, optimizer, mesh, path, **cfg):
    """The host tier's engine and the NVMe tier's, alike but for where the state lives."""
    return (zj.Engine(model, optimizer(), mesh, zj.ZeroConfig(offload="optimizer", **cfg)),
            zj.Engine(model, optimizer(), mesh, zj.ZeroConfig(**nvme(path, **cfg))))


def placeholders(engine, state) -> bool:
    """Whether the state's master and moments are the tier's empty placeholders (but for
    Twin-Flow's share, arrays on the devices)."""
    mu, nu, counts = engine._offload.moments()
    mine = engine._offload.mine()
    opt, master = jax.tree.leaves(state.opt_state), jax.tree.leaves(state.master)
    return (all(master[i].size == 0 for i in mine)
            and all(opt[j].size == 0 for i in mine for j in (mu[i], nu[i]))
            and all(opt[j].size == 1 for j in counts))


def assert_same_run(host, disk, batches):
    """The two engines' runs on `batches`: losses, norms, params and optimizer state bitwise;
    (the NVMe engine's final state)."""
    (l0, p0, s0), n0 = engine_run(host, batches), engine_run.norms
    (l1, p1, s1), n1 = engine_run(disk, batches), engine_run.norms
    np.testing.assert_array_equal(l1, l0)
    np.testing.assert_array_equal(n1, n0)
    assert_bitwise(p1, p0)
    assert_bitwise(disk.optimizer_state(s1), host.optimizer_state(s0))
    assert placeholders(disk, s1)
    return s1


# replica 2 x data 2 is the float16 test's mesh (bitwise the host tier, grad_accum 2 and
# clipping): the test GPT's case there differed from the host tier in its first loss (before
# any NVMe update) in 1 of 4 clean-clone CI runs, XLA:CPU's collectives (docs/testing.md).
@pytest.mark.parametrize("case", sweep(["stage3", "stage1", "stage2",
                                        "grad_accum2", "data4xmodel2", "twin_flow"],
                                       quick=["stage3"]))
def test_the_nvme_tier_is_the_host_tier_bitwise(tmp_path, case):
    """3 steps of the test GPT with zerojax.adamw and clipping: the same losses, norms,
    params and optimizer state to the last bit (the two tiers run one arithmetic,
    adamw_math.h). Each step reads and writes exactly the store's bytes once."""
    mesh = {"replica2xdata2": zj.make_mesh(replica=2, data=2),
            "data4xmodel2": zj.make_mesh(data=4, model=2)}.get(
        case, zj.make_mesh(data=4, devices=jax.devices()[:4]))
    stage = {"stage1": 1, "stage2": 2, "grad_accum2": 2}.get(case, 3)
    accum = 2 if case == "grad_accum2" else 1
    fraction = 0.5 if case == "twin_flow" else 1.0  # the devices keep and update the rest
    host, disk = pair(tiny_gpt(), fused_adamw, mesh, tmp_path / "s", stage=stage,
                      clip_norm=CLIP, grad_accum=accum, offload_fraction=fraction)
    state = assert_same_run(host, disk, BATCHES[:3])
    assert disk.host_update == "nvme"
    store = disk._offload.store
    store.counters(reset=True)
    state, _ = disk.step(state, BATCHES[3])
    disk._offload._wait()
    io = store.counters()
    assert io["read"] == io["written"] == store.bytes > 0
    assert io["passes"] == len(disk._offload.mine()) * len(store.shards)
    if fraction < 1:  # Twin-Flow's leaves on the devices, none of their bytes on disk
        device = disk._offload.split()[0]
        assert device and all(store.shards[0][i] == 0 for i in device)
        assert all(jax.tree.leaves(state.master)[i].size > 0 for i in device)
    assert store.direct or store.io  # O_DIRECT where the file system takes it
    disk._offload.close()


def test_init_writes_the_state_to_the_store_a_part_at_a_time(tmp_path, monkeypatch):
    """init builds the hosted state in parts (`_by_parts`) and writes each master and moment
    leaf to the store as its part is done: the float32 arrays alive while it writes stay well
    under the store's bytes (built whole and then written, they were all of them), and the
    store holds the host tier's state bitwise. (From given params: the random draw, compiled
    per part, may round otherwise in its last bits than the host tier's one-program build on
    CPU devices, as the host tier's own build by parts does on a GPU's host; so on CPU
    devices a state under RESTORE_LEAST is built whole, as the host tier's.)"""
    from zerojax.offload import disk as tier

    live = []
    call = tier._ToStore.__call__

    def counting(self, k, x):
        live.append(sum(a.nbytes for a in jax.live_arrays() if a.dtype == np.float32))
        return call(self, k, x)

    monkeypatch.setattr(tier._ToStore, "__call__", counting)
    monkeypatch.setattr(tier, "RESTORE_LEAST", 0)  # by parts however small the state
    mesh = zj.make_mesh(data=4, devices=jax.devices()[:4])
    host, disk = pair(tiny_gpt(), fused_adamw, mesh, tmp_path / "s", stage=3,
                      param_dtype="bfloat16")
    params = jax.jit(tiny_gpt().init)(jax.random.key(0))
    given = sum(a.nbytes for a in jax.live_arrays() if a.dtype == np.float32)
    s1 = disk.init_from(params, BATCHES[0])
    store = disk._offload.store
    assert live and store.clean
    assert max(live) - given < 0.5 * store.bytes, (max(live) - given, store.bytes)
    s0 = host.init_from(params, BATCHES[0])
    assert placeholders(disk, s1)
    assert_bitwise(disk.params(s1), host.params(s0))
    assert_bitwise(disk.optimizer_state(s1), host.optimizer_state(s0))
    assert_bitwise(s1.compute, s0.compute)
    disk._offload.close()


def test_on_a_host_mesh_apart_init_by_parts_is_the_host_tiers_bitwise(tmp_path, monkeypatch):
    """With the host mesh apart from the devices' (a GPU's host; CPU devices 4-7 here) both
    tiers build by parts, the NVMe tier writing each part to the store as it is done: the
    same state from a key to the last bit, and the same first step."""
    from jax.sharding import Mesh

    import zerojax.offload.host as host_module

    devices = jax.devices()
    monkeypatch.setattr(host_module, "host_mesh", lambda m: Mesh(np.array(devices[4:8]).reshape(
        m.devices.shape), m.axis_names, axis_types=m.axis_types))
    mesh = zj.make_mesh(data=4, devices=devices[:4])
    host, disk = pair(tiny_gpt(), fused_adamw, mesh, tmp_path / "s", stage=3,
                      param_dtype="bfloat16")
    s0 = host.init(jax.random.key(0), BATCHES[0])
    s1 = disk.init(jax.random.key(0), BATCHES[0])
    assert placeholders(disk, s1) and disk._offload.store.clean
    assert_bitwise(disk.params(s1), host.params(s0))
    assert_bitwise(disk.optimizer_state(s1), host.optimizer_state(s0))
    assert_bitwise(s1.compute, s0.compute)
    (s0, m0), (s1, m1) = host.step(s0, BATCHES[1]), disk.step(s1, BATCHES[1])
    assert float(m0["loss"]) == float(m1["loss"])
    assert_bitwise(disk.params(s1), host.params(s0))
    disk._offload.close()


def test_a_float16_run_skips_its_overflowing_steps_as_the_host_tier(tmp_path):
    """SeedMLP's gradients overflow float16 at a scale of 2**17: the first steps are skipped
    (the store's master and moments read, not written) and the run goes on bitwise the host
    tier's, on replica 2 x data 2 with grad_accum 2 and clipping."""
    mesh = zj.make_mesh(replica=2, data=2)
    batch = jax.tree.map(lambda x: np.concatenate([x] * 4), SEED_BATCH)
    host, disk = pair(SeedMLP(), lambda: zj.adamw(0.1, eps=1e-8), mesh, tmp_path / "s",
                      stage=3, param_dtype="float16", loss_scale_init=2.0**17, clip_norm=5.0,
                      grad_accum=2)
    state = assert_same_run(host, disk, [batch] * 6)
    skipped = int((~np.isfinite(engine_run.norms)).sum())
    assert 0 < skipped < 6 and np.isfinite(engine_run.norms[skipped:]).all()
    assert disk._offload.store.clean is False  # stepped since init
    assert float(state.loss_scale.scale) < 2.0**17
    disk._offload.close()


@pytest.mark.parametrize("stage", sweep([3, 1], quick=[3]))
def test_the_nvme_tier_matches_single_device_optax(tmp_path, stage):
    """Against optax.adamw after clipping on one device, over 6 steps: the losses within 1e-5
    and the params by their distance relative to how far the reference moved (2e-4; a wrong
    update is off by 1e-2 or more)."""
    model, batches = tiny_gpt(), [gpt_batch(tiny_gpt().cfg, 8, s) for s in range(6)]
    eng = zj.Engine(model, fused_adamw(), zj.make_mesh(data=4, devices=jax.devices()[:4]),
                    zj.ZeroConfig(**nvme(tmp_path / "s", stage=stage, clip_norm=CLIP)))
    losses, params, _ = engine_run(eng, batches)
    ref_losses, ref = reference_run(model, optax.adamw(LR, weight_decay=WD, eps=1e-6), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    start = jax.jit(model.init)(jax.random.key(0))
    assert moved_error(params, ref, start) <= 2e-4
    assert_tree_close(params, ref, rtol=1e-4, atol=1e-5)
    eng._offload.close()


@pytest.mark.parametrize("k, model", sweep([(1, 1), (0, 1), (1, 2)], quick=[(1, 1)]))
def test_the_delayed_update_is_the_host_tiers(tmp_path, k, model):
    """`delayed_update=K`: the pending update applied by the next step's streamed pass, and
    read with it applied by dry passes that write nothing (params, optimizer state, evaluate,
    a save), all bitwise the host tier's; the NVMe run's checkpoint (which holds the params
    the next step runs on) resumes in either tier as the uninterrupted run."""
    mesh = zj.make_mesh(replica=2, data=2, model=model, devices=jax.devices()[:4 * model])
    host, disk = pair(tiny_gpt(), fused_adamw, mesh, tmp_path / "s", stage=3, clip_norm=CLIP,
                      delayed_update=k, grad_accum=2)
    s0 = host.init(jax.random.key(0), BATCHES[0])
    s1 = disk.init(jax.random.key(0), BATCHES[0])
    for b in BATCHES[:3]:
        (s0, m0), (s1, m1) = host.step(s0, b), disk.step(s1, b)
        assert float(m0["loss"]) == float(m1["loss"])
    assert_bitwise(disk.params(s1), host.params(s0))
    assert_bitwise(disk.optimizer_state(s1), host.optimizer_state(s0))
    assert float(disk.evaluate(s1, BATCHES[3])["loss"]) == \
        float(host.evaluate(s0, BATCHES[3])["loss"])
    store = disk._offload.store
    disk._offload._wait()
    before = store.read_leaf(0, 0, "master")
    disk.save(s1, tmp_path / "ck")  # dry passes: the pending update still pending
    assert_bitwise(store.read_leaf(0, 0, "master"), before)
    (s0, m0), (s1, m1) = host.step(s0, BATCHES[3]), disk.step(s1, BATCHES[3])
    assert float(m0["loss"]) == float(m1["loss"])
    for eng in (host, disk):  # resumed from the NVMe run's step 3: step 4 as uninterrupted
        if eng is disk:
            disk._offload.close()
            eng = zj.Engine(tiny_gpt(), fused_adamw(), mesh, disk.config)
        r, m = eng.step(eng.restore(tmp_path / "ck"), BATCHES[3])
        assert float(m["loss"]) == float(m0["loss"])
        assert_bitwise(eng.params(r), host.params(s0))
    eng._offload.close()


def test_checkpoints_are_ordinary_and_restore_into_any_tier(tmp_path):
    """An NVMe run's checkpoint restores exactly with the host tier and without offload, on
    another device count and stage; restored into an NVMe engine (another N and stage), the
    store is written and the run goes on bitwise the host tier's. A store left dirty by a
    crash (a run stopped after an update) is rebuilt from the checkpoint by the resume."""
    four = zj.make_mesh(data=4, devices=jax.devices()[:4])
    two = zj.make_mesh(data=2, devices=jax.devices()[:2])
    disk = zj.Engine(tiny_gpt(), fused_adamw(), four,
                     zj.ZeroConfig(**nvme(tmp_path / "s", stage=3, clip_norm=CLIP)))
    _, params, state = engine_run(disk, BATCHES[:2])
    opt = disk.optimizer_state(state)
    disk.save(state, tmp_path / "ck")
    store = disk._offload.store
    assert store.clean and store.record == {"step": 2}
    state, _ = disk.step(state, BATCHES[2])  # the store now holds step 3, dirty
    disk._offload._wait()
    assert json.loads((tmp_path / "s" / META).read_text())["state"] == "dirty"
    disk._offload.close()  # the process "dies" here: the store stays dirty on disk

    for offload in ("optimizer", None):  # another N and stage, host tier and no offload
        other = zj.Engine(tiny_gpt(), fused_adamw(), two,
                          zj.ZeroConfig(stage=1, clip_norm=CLIP, offload=offload))
        restored = other.restore(tmp_path / "ck")
        assert_bitwise(other.params(restored), params)
        assert_bitwise(other.optimizer_state(restored), opt)
        assert int(restored.step) == 2
    host = other  # without offload, N 2, stage 1: the reference of the runs below
    ref, m_ref = host.step(restored, BATCHES[2])

    # The resume: the same engine's config and path find the store dirty and rebuild it.
    again = zj.Engine(tiny_gpt(), fused_adamw(), four,
                      zj.ZeroConfig(**nvme(tmp_path / "s", stage=3, clip_norm=CLIP)))
    back = again.restore(tmp_path / "ck")
    assert again._offload.store.clean and again._offload.store.record == {"step": 2}
    assert placeholders(again, back)
    assert_bitwise(again.params(back), params)
    assert_bitwise(again.optimizer_state(back), opt)
    back, m = again.step(back, BATCHES[2])
    assert_tree_close(again.params(back), host.params(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(m["loss"]), float(m_ref["loss"]), rtol=1e-6)
    again._offload.close()

    # Into an NVMe engine of another N and stage, beside the host tier's of the same.
    tier = zj.Engine(tiny_gpt(), fused_adamw(), two,
                     zj.ZeroConfig(stage=2, clip_norm=CLIP, offload="optimizer"))
    moved = zj.Engine(tiny_gpt(), fused_adamw(), two,
                      zj.ZeroConfig(**nvme(tmp_path / "s2", stage=2, clip_norm=CLIP)))
    a, b = tier.restore(tmp_path / "ck"), moved.restore(tmp_path / "ck")
    assert_bitwise(moved.params(b), params)
    for batch in BATCHES[2:4]:
        (a, ma), (b, mb) = tier.step(a, batch), moved.step(b, batch)
        assert float(ma["loss"]) == float(mb["loss"])
    assert_bitwise(moved.params(b), tier.params(a))
    assert_bitwise(moved.optimizer_state(b), tier.optimizer_state(a))
    moved._offload.close()


def test_what_the_tier_refuses(tmp_path):
    """Each refusal one line naming the option and what runs: another optimizer, and
    Twin-Flow with the delayed update (not composed yet); a store of another run or shape by
    name; a state the store no longer holds."""
    mesh = zj.make_mesh(data=4, devices=jax.devices()[:4])
    cases = [(optax.adamw(1e-3), {}, "streams a zerojax.adamw's update"),
             (fused_adamw(), {"offload_fraction": 0.5, "delayed_update": 2},
              r"does not run Twin-Flow \(offload_fraction=0.5\) with delayed_update=2 yet"),
             ]
    for tx, extra, says in cases:
        with pytest.raises(zj.ConfigError, match=f"offload_device='nvme' {says}"):
            zj.Engine(tiny_gpt(), tx, mesh, zj.ZeroConfig(**nvme(tmp_path / "x", stage=3,
                                                                 **extra)))

    first = zj.Engine(tiny_gpt(), fused_adamw(), mesh,
                      zj.ZeroConfig(**nvme(tmp_path / "s", stage=3)))
    old = first.init(jax.random.key(0), BATCHES[0])
    new = first.init(jax.random.key(1), BATCHES[0])  # the store now holds this state
    with pytest.raises(zj.StateError, match="no longer on the NVMe store"):
        first.step(old, BATCHES[0])
    with pytest.raises(zj.StateError, match="takes an NVMe-tier state as engine.saveable"):
        first.logical(new)
    tree = first.logical(first.saveable(new))
    assert_bitwise(tree["params"], first.params(new))
    first.step(new, BATCHES[0])
    first._offload.close()
    init_refused(mesh, tmp_path / "s", f"the NVMe store at {tmp_path / 's'} belongs to another "
                 f"run or shape \\(its stage 3, this run's 2\\); give this run another "
                 f"nvme_path", stage=2)


def init_refused(mesh, path, says, stage=3):
    """`init` of an NVMe engine at `path` raises one StoreError matching `says`."""
    eng = zj.Engine(tiny_gpt(), fused_adamw(), mesh, zj.ZeroConfig(**nvme(path, stage=stage)))
    with pytest.raises(StoreError, match=says):
        eng.init(jax.random.key(0), BATCHES[0])


def test_a_read_only_path_and_a_full_disk_are_one_error_each(tmp_path):
    """At init, before anything is written: one line each, naming the path, the bytes and
    the fix."""
    mesh = zj.make_mesh(data=2, devices=jax.devices()[:2])
    with tmpfs(tmp_path / "ro", "ro,size=1M") as ro:
        init_refused(mesh, ro / "s", f"^nvme_path {ro / 's'} is not writable \\(Read-only "
                                     f"file system.*give nvme_path a writable directory$")
    with tmpfs(tmp_path / "small", "size=64K") as small:
        init_refused(mesh, small / "s", f"^nvme_path {small / 's'} has [0-9,]+ bytes free; the "
                                        f"store needs [0-9,]+: free space there or give "
                                        f"nvme_path on a larger disk$")


@pytest.mark.slow  # two runs of the command line (~15 CPU s); CI runs it
def test_the_command_line_trains_on_the_nvme_tier(tmp_path, capsys, monkeypatch):
    """`train --offload optimizer --offload-device nvme --nvme-path DIR`: the banner's disk
    row, summary.json's I/O record (each step read and wrote the store's bytes once), and the
    host tier's losses bitwise; the options' misuse one line each."""
    from zerojax.app import options, train
    from zerojax.app.data import embedded_corpus

    parse = lambda *a: options.validate(options.parse_args(list(a)))
    cfg = parse("--offload", "optimizer", "--offload-device", "nvme", "--nvme-path", "d")
    assert (cfg.offload_device, cfg.nvme_path, options.TrainConfig().offload_device) == (
        "nvme", "d", "cpu")
    for argv, says in [(["--offload-device", "nvme", "--nvme-path", "d"], "needs --offload"),
                       (["--offload", "optimizer", "--offload-device", "nvme"],
                        "needs --offload optimizer and --nvme-path DIR"),
                       (["--offload", "optimizer", "--nvme-path", "d"],
                        "--nvme-path d needs --offload-device nvme")]:
        with pytest.raises(options.UsageError, match=says):
            parse(*argv)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XLA_FLAGS", __import__("os").environ.get("XLA_FLAGS", ""))
    np.save(tmp_path / "tokens.npy", (embedded_corpus(2**18) % 64).astype(np.uint16))
    argv = ["--model", "test", "--batch", "8", "--eval-every", "0", "--data", "tokens.npy",
            "--devices", "4", "--steps", "3", "--stage", "3", "--param-dtype", "bfloat16",
            "--offload", "optimizer"]
    assert train.main([*argv, "--out", "host", "--quiet"]) == 0
    capsys.readouterr()
    assert train.main([*argv, "--offload-device", "nvme", "--nvme-path", "store", "--out",
                       "disk"]) == 0
    out = capsys.readouterr().out
    assert "memory/disk" in out and "streamed from and to the NVMe store" in out
    s = json.loads((tmp_path / "disk" / "summary.json").read_text())
    nv, io = s["nvme"], s["nvme"]["update"]
    assert s["host_update"] == "nvme" and s["config"]["offload_device"] == "nvme"
    assert nv["path"] == "store" and nv["store_bytes"] > 0
    assert io["read_bytes"] == io["written_bytes"] == 3 * nv["store_bytes"]
    assert io["read_gb_per_s"] > 0 and io["write_gb_per_s"] > 0
    assert nv["bulk"]["written_bytes"] == nv["store_bytes"]  # init wrote it once
    loss = lambda run: [json.loads(x)["loss"] for x in (tmp_path / run / "metrics.jsonl")
                        .read_text().splitlines() if "loss" in json.loads(x)]
    assert loss("disk") == loss("host") and len(loss("disk")) == 3


@pytest.mark.slow  # four processes of the command line, two of them killed (~60 CPU s)
def test_sigkill_in_the_update_and_in_a_save_then_resume_is_the_uninterrupted_run(tmp_path):
    """`train` on the NVMe tier killed with SIGKILL while it steps (the store dirty, its lock
    held) and while it saves, each time resumed with `--resume` (the store rebuilt from the
    last checkpoint): every step's loss is the uninterrupted run's, bitwise."""
    import os
    import subprocess
    import sys

    from conftest import FAST_COMPILE
    from test_kills import _kill_when, _saved, _saving, _steps

    from zerojax.app.data import embedded_corpus

    data = tmp_path / "tokens.npy"
    np.save(data, (embedded_corpus(2**18) % 64).astype(np.uint16))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE,
               PYTHONPATH=str(__import__("pathlib").Path(__file__).resolve().parents[1]))

    def run(out, resume=False):
        args = ["--model", "test", "--batch", "4", "--seq-len", "16", "--devices", "2",
                "--eval-every", "0", "--save-every", "3", "--steps", "12", "--data", str(data),
                "--offload", "optimizer", "--offload-device", "nvme", "--nvme-path",
                str(out) + "-store", "--out", str(out), "--quiet", "--no-tensorboard",
                *(["--resume"] if resume else [])]
        return subprocess.Popen([sys.executable, "-m", "zerojax", "train", *args],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def losses(out):
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    ref = tmp_path / "ref"
    assert run(ref).wait() == 0
    out = tmp_path / "killed"
    proc = run(out)
    # stepping past the save at 3, once it is complete
    _kill_when(proc, lambda: 3 in _saved(out) and max(_steps(out), default=0) >= 4)
    proc.kill()
    proc.wait()
    meta = json.loads((tmp_path / "killed-store" / META).read_text())
    assert meta["state"] == "dirty"
    proc = run(out, resume=True)
    _kill_when(proc, lambda: max(_steps(out), default=0) >= 6 and bool(_saving(out)))
    proc.kill()
    proc.wait()
    proc = run(out, resume=True)
    assert proc.wait() == 0, proc.communicate()[1]
    assert losses(out) == losses(ref) and sorted(losses(ref)) == list(range(1, 13))


@pytest.mark.slow  # two runs of two processes of the command line (~40 CPU s)
def test_two_processes_keep_a_store_each_and_train_as_the_host_tier(tmp_path):
    """A run of 2 processes × 1 device given one --nvme-path: each process's store in its own
    `process-NNNNN` directory, and the losses of the host tier's 2-process run, bitwise."""
    import os
    import socket
    import subprocess
    import sys

    from conftest import FAST_COMPILE

    from zerojax.app.data import embedded_corpus

    data = tmp_path / "tokens.npy"
    np.save(data, (embedded_corpus(2**18) % 64).astype(np.uint16))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE,
               PYTHONPATH=str(__import__("pathlib").Path(__file__).resolve().parents[1]))

    def run(out, *extra):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen(
            [sys.executable, "-m", "zerojax", "train", "--model", "test", "--batch", "4",
             "--seq-len", "16", "--devices", "1", "--steps", "3", "--eval-every", "0",
             "--data", str(data), "--offload", "optimizer", "--out", str(out), "--quiet",
             "--no-tensorboard", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(i), *extra], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True) for i in range(2)]
        for p in procs:
            assert p.wait(timeout=300) == 0, p.communicate()[1]
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r]

    host = run(tmp_path / "host")
    disk = run(tmp_path / "disk", "--offload-device", "nvme", "--nvme-path", str(tmp_path / "s"))
    assert disk == host and len(disk) == 3
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["process-00000",
                                                                  "process-00001"]
    for p in (tmp_path / "s").iterdir():
        meta = json.loads((p / META).read_text())
        assert meta["state"] == "clean" and list(meta["shards"]) == [p.name[-1]]


@pytest.mark.slow
def test_a_gpt_trains_on_the_nvme_tier_under_a_cap_that_kills_the_host_tier():
    """experiments/nvme_gpt_memcap.py at the 1b preset's width, 4 layers (0.21B params, one
    CPU device, bf16, stage 3): under a cap the NVMe run inits and trains 3 steps, its
    cgroup's peak under the cap, where the host tier's run is killed by it. (On CPU the
    devices' memory is the host's too: the cap holds the gradients program, about 13 bytes a
    param, beside the tier's memory; docs/nvme.md has the 18-layer run.)"""
    sys.path[:0] = [str(Path(__file__).parents[1] / d) for d in ("experiments", "scripts")]
    import memcap
    import nvme_gpt_memcap

    why = memcap.available()
    if why:
        pytest.skip(why)
    res = nvme_gpt_memcap.main(["--cap", CAP_4_LAYERS, "--layers", "4", "--steps", "3"])
    disk, host = res["nvme"], res["cpu"]
    assert disk["rc"] == 0 and not disk["oom_killed"] and disk["peak"] < res["cap"], disk
    steps = [x for x in disk["phases"] if x["phase"] == "step"]
    assert len(steps) == 3 and all(np.isfinite(x["loss"]) for x in steps)
    assert host["oom_killed"] and host["rc"] == -9, host
    assert res["holds"]


CAP_4_LAYERS = "4.5e9"  # the NVMe run's peak measured 2.87 GB; the host tier's killed in its init
