"""The NVMe tier's core (zerojax/offload/): the streamed AdamW pass over a store on disk gives
the in-memory fused pass's numbers bitwise; the store's bulk transfers, its identity, its
dirty flag and its errors (a foreign store, a read-only path, a full disk, a truncated file)."""

import contextlib
import ctypes
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax.errors import StoreError
from zerojax.offload import fused, nvme
from zerojax.offload.fused import FusedAdamW, spec_of
from zerojax.offload.store import LOCK, META, Store, layout, shard_file

ROOT = Path(__file__).parents[1]
sys.path[:0] = [str(ROOT / "experiments"), str(ROOT / "scripts")]
BLOCK = 2048  # the ring's buffers in these tests: a leaf of 5000 elements is 3 of them
ROW = dict(a1=0.1, b1=0.9, a2=0.05, b2=0.95, eps=1e-8, eps_root=1e-12, r1=1 / (1 - 0.9**3),
           r2=1 / (1 - 0.95**3), wd=0.05, decay=1.0, lr=-3e-3, scale=0.7, ok=1.0)


def _row(**change) -> np.ndarray:
    return np.asarray(list({**ROW, **change}.values()), np.float32)


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({4: np.uint32, 2: np.uint16}[x.dtype.itemsize])


def assert_bitwise(a, b):
    np.testing.assert_array_equal(_bits(a), _bits(b))


@jax.jit
def _fused_pass(row, p, m, v, g):
    """The host tier's fused pass (zerojax_adamw) over in-memory state: (p, m, v, compute)."""
    f32 = jax.ShapeDtypeStruct(p.shape, jnp.float32)
    call = jax.ffi.ffi_call(fused.TARGET, (f32, f32, f32, jax.ShapeDtypeStruct(p.shape, g.dtype)),
                            input_output_aliases={1: 0, 2: 1, 3: 2})
    return call(row, p, m, v, g)


def _fused_pass_to(out):
    return jax.jit(lambda row, p, m, v, g: jax.ffi.ffi_call(
        fused.TARGET, (*[jax.ShapeDtypeStruct(p.shape, jnp.float32)] * 3,
                       jax.ShapeDtypeStruct(p.shape, out)),
        input_output_aliases={1: 0, 2: 1, 3: 2})(row, p, m, v, g))


def _state(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n).astype(np.float32),
             (rng.standard_normal(n) * 1e-2).astype(np.float32),
             np.abs(rng.standard_normal(n) * 1e-4).astype(np.float32)) for n in sizes]


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert nvme.library()[1] == "" and fused.kernel() == (True, "")  # g++ is on this machine


# sizes: under a 4 KiB unit, 3 blocks with a partial last one, whole blocks, one element
SIZES = [1000, 5000, 2 * BLOCK, 1]


@pytest.mark.parametrize("gdtype, out, count", [
    (jnp.bfloat16, jnp.bfloat16, 3), (jnp.float32, jnp.float32, 2),
    (jnp.float32, jnp.bfloat16, 4), (jnp.float16, jnp.float16, 3)])
def test_the_streamed_pass_is_the_fused_pass_bitwise(tmp_path, gdtype, out, count):
    """Four consecutive steps of each leaf, streamed through a ring of `count` buffers of
    2048 elements, against the in-memory fused pass on the same state: the compute shard and
    the store's master and moments after each step, bitwise. Leaves of one element to several
    blocks with a partial last one; decay on and off; a skipped step (ok 0) in between, which
    reads only the master and writes nothing."""
    state = _state(SIZES)
    store = Store(tmp_path / "s", {"run": "t"}, {3: SIZES}, block=BLOCK, count=count)
    store.begin()
    for k, (p, m, v) in enumerate(state):
        store.write_leaf(3, k, p, m, v)
    store.commit(step=0)
    rng = np.random.default_rng(1)
    step = jax.jit(lambda row, g, k: nvme.update_leaf(store.handle, k, row, jnp.int32(3), g, out),
                   static_argnums=2)
    ref_pass = _fused_pass_to(out)
    for t, change in enumerate([{}, {"decay": 0.0}, {"ok": 0.0}, {"scale": 0.25, "lr": -1e-2}]):
        skip = change.get("ok") == 0.0
        for k, n in enumerate(SIZES):
            g = jnp.asarray((rng.standard_normal(n) * 1e-2).astype(gdtype))
            row = _row(r1=1 / (1 - 0.9 ** (t + 1)), **change)
            p, m, v, c = ref_pass(row, *map(jnp.asarray, state[k]), g)
            state[k] = (np.asarray(p), np.asarray(m), np.asarray(v))
            store.counters(reset=True)
            mine = step(row, g, k)
            assert_bitwise(mine, c)
            assert mine.dtype == jnp.dtype(out)
            # each byte of the leaf's state read once and written once (a skipped step: the
            # master read, nothing written); a block's last 4 KiB unit whole
            got, padded = store.counters(), sum(-(-4 * min(BLOCK, n - lo) // 4096) * 4096
                                                for lo in range(0, n, BLOCK))
            assert (got["read"], got["written"], got["passes"]) == (
                (padded, 0, 1) if skip else (3 * padded, 3 * padded, 1))
            for part, ref in zip(("master", "mu", "nu"), state[k]):
                assert_bitwise(store.read_leaf(3, k, part), ref)
    first = _state(SIZES)
    assert np.abs(state[1][0] - first[1][0]).max() > 1e-4  # the steps moved the master


@pytest.mark.parametrize("ok", [1.0, 0.0])
def test_a_dry_pass_gives_the_updated_state_and_writes_nothing(tmp_path, ok):
    """`dry=` "master", "mu", "nu" (a pending update applied for a read, still pending): the
    fused pass's new master (in f32 and bf16) and moments, bitwise, with the store unchanged
    and nothing written; a skipped step's gives the state as it is. A leaf of no elements
    (Twin-Flow's leaves that stay on the devices) passes through."""
    (p, m, v), = _state([5000])
    store = Store(tmp_path / "s", "run", {0: [0, 5000]}, block=BLOCK, count=3)
    store.write_leaf(0, 1, p, m, v)
    g = jnp.asarray(np.random.default_rng(4).standard_normal(5000).astype(np.float32))
    row = _row(ok=ok)
    ref = _fused_pass(row, *map(jnp.asarray, (p, m, v)), g)
    store.counters(reset=True)
    dry = jax.jit(lambda g, part, out: nvme.update_leaf(store.handle, 1, row, jnp.int32(0), g,
                                                        out, dry=part), static_argnums=(1, 2))
    for j, part in enumerate(("master", "mu", "nu")):
        assert_bitwise(dry(g, part, jnp.float32), ref[j])
    assert_bitwise(dry(g, "master", jnp.bfloat16), ref[0].astype(jnp.bfloat16))
    got = store.counters()
    assert got["written"] == 0 and got["read"] == (12 if ok else 4) * 20480
    for part, x in zip(("master", "mu", "nu"), (p, m, v)):
        assert_bitwise(store.read_leaf(0, 1, part), x)
    if ok:
        assert np.abs(np.asarray(ref[0]) - p).max() > 1e-4
    empty = nvme.update_leaf(store.handle, 0, row, jnp.int32(0), jnp.ones(0), jnp.float32)
    assert empty.shape == (0,)


def test_streamed_adamw_on_a_host_mesh_is_fused_adamw(tmp_path):
    """`StreamedAdamW` (the tier's update as the host program will run it: in a shard_map
    over CPU devices, the shard index from `axis_index`) against `FusedAdamW` over in-memory
    state, with a schedule, a decay mask, clipping's scale and eps_root: three steps, two
    devices' shards in one store, compute shards, master, moments and counts bitwise."""
    sizes = {"w": 6000, "b": 300}  # per device
    logical = {k: jax.ShapeDtypeStruct((2 * n,), jnp.float32) for k, n in sizes.items()}
    tx = zj.adamw(optax.linear_schedule(1e-3, 3e-3, 4), b1=0.9, b2=0.95, eps_root=1e-12,
                  weight_decay=0.1, mask={"w": True, "b": False})
    how = types.SimpleNamespace(clip_norm=0.5, out_dtype=jnp.bfloat16)
    update = types.SimpleNamespace(how=how, logical_params=logical, state_def=jax.tree.structure(
        jax.eval_shape(tx.init, logical)))
    spec = spec_of(tx)
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    names = sorted(sizes)  # the leaves' order: b, w
    store = Store(tmp_path / "s", {"run": "mesh"}, {d: [sizes[k] for k in names] for d in (0, 1)},
                  block=BLOCK, count=3)
    rng = np.random.default_rng(2)
    master = {k: rng.standard_normal(2 * n).astype(np.float32) for k, n in sizes.items()}
    opt = tx.init(master)
    for d in (0, 1):
        for i, k in enumerate(names):
            store.write_leaf(d, i, master[k][d * sizes[k]:(d + 1) * sizes[k]])
    streamed, fusedw = nvme.StreamedAdamW(spec, update, store.handle), FusedAdamW(spec, update)
    assert streamed.decay == fusedw.decay == [False, True]
    sharded = lambda tree: jax.tree.map(lambda x: P("data") if np.ndim(x) else P(), tree)

    def mine(grads, opt, scalars):
        shard = jax.lax.axis_index("data")
        return streamed((grads, *scalars), opt, shard)

    def ref(grads, opt, master, scalars):
        return fusedw((grads, *scalars), opt, master)

    put = lambda tree: jax.device_put(tree, jax.tree.map(
        lambda s: NamedSharding(mesh, s), sharded(tree)))
    ref_opt, ref_master = put(opt), put(master)
    for t in range(3):
        grads = {k: (rng.standard_normal(2 * n) * 0.1).astype(np.float32) for k, n in
                 sizes.items()}
        scalars = (jnp.float32(2.0), jnp.float32(1.5 + t), None, jnp.float32(0.0))
        ss = (P(), P(), None, P())
        new_opt, shards = jax.jit(jax.shard_map(
            mine, mesh=mesh, in_specs=(sharded(grads), sharded(opt), ss),
            out_specs=(sharded(opt), [P("data")] * 2)))(put(grads), put(opt), scalars)
        ref_master, ref_opt, ref_shards = jax.jit(jax.shard_map(
            ref, mesh=mesh, in_specs=(sharded(grads), sharded(opt), sharded(master), ss),
            out_specs=(sharded(master), sharded(opt), [P("data")] * 2)))(
            put(grads), ref_opt, ref_master, scalars)
        for a, b in zip(shards, ref_shards, strict=True):
            assert_bitwise(a, b)
        opt = new_opt
        counts = [jax.tree.leaves(o)[j] for o in (opt, ref_opt)
                  for j in (streamed.count, streamed.rate)]  # adam's and the schedule's
        assert [int(x) for x in counts] == [t + 1] * 4
        for i, k in enumerate(names):
            on_disk = np.concatenate([store.read_leaf(d, i, "master") for d in (0, 1)])
            assert_bitwise(on_disk, ref_master[k])
            for part, tree in (("mu", ref_opt[0].mu), ("nu", ref_opt[0].nu)):
                assert_bitwise(np.concatenate([store.read_leaf(d, i, part) for d in (0, 1)]),
                               tree[k])
    assert np.abs(np.asarray(ref_master["w"]) - master["w"]).max() > 1e-3


def test_bulk_transfers_roundtrip_a_block_at_a_time(tmp_path):
    """A leaf written from a numpy array, a memmap and a jax array (moments default to zeros)
    reads back bitwise, whole and by blocks; transfers that are not whole 4 KiB units inside
    a leaf are refused; the layout pads each region to 4 KiB."""
    offsets, size = layout([5000, 1])
    assert offsets == [(0, 20480, 40960), (61440, 65536, 69632)] and size == 73728
    store = Store(tmp_path / "s", {"run": "bulk"}, {0: [5000, 1]}, block=1024, count=2)
    assert store.chunk() == 3072 and (tmp_path / "s" / shard_file(0)).stat().st_size == size
    x = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    mm = np.memmap(tmp_path / "x.bin", np.float32, "w+", shape=(50, 100))
    mm[:] = x.reshape(50, 100)
    store.write_leaf(0, 0, mm, jnp.asarray(-x), None)
    store.write_leaf(0, 1, np.float32([7.0]), np.float32([8.0]), np.float32([9.0]))
    assert_bitwise(store.read_leaf(0, 0, "master"), x)
    assert_bitwise(store.read_leaf(0, 0, "mu"), -x)
    assert not store.read_leaf(0, 0, "nu").any()
    got = [(lo, b.size) for lo, b in store.blocks(0, 0, "master")]
    assert got == [(0, 3072), (3072, 1928)]
    out = np.memmap(tmp_path / "y.bin", np.float32, "w+", shape=(5000,))
    store.read_leaf(0, 0, "mu", out=out)
    assert_bitwise(out, -x)
    assert [float(store.read(0, 1, p)[0]) for p in ("master", "mu", "nu")] == [7.0, 8.0, 9.0]
    assert_bitwise(store.read(0, 0, "master", 1024, 2048), x[1024:3072])
    with pytest.raises(StoreError, match=r"\[100, 1124\) of a leaf of 5000: not whole"):
        store.read(0, 0, "master", 100, 1024)
    with pytest.raises(ValueError, match="an array of 4999 elements for a leaf of 5000"):
        store.write_leaf(0, 0, x[:-1])
    with pytest.raises(ValueError, match="block=1000: .* multiple of 1024"):
        store.configure(block=1000)
    c = store.counters()
    assert c["written"] == 3 * 20480 + 3 * 4096 and c["passes"] == 0


def test_a_store_belongs_to_one_run_and_one_process(tmp_path):
    """Another run's identity, other shard sizes, a store another process holds, a directory
    of other files and an unreadable metadata file: each refused by a StoreError naming the
    path and the fix. The same run reopens it."""
    path = tmp_path / "s"
    ident = {"run": "abc", "leaves": [["w", [8, 4], "float32"]]}
    with Store(path, ident, {0: [32]}):
        with pytest.raises(StoreError, match="in use by another process") as e:
            Store(path, ident, {0: [32]})  # another open file description: the lock refuses
        assert e.value.path == path
    Store(path, ident, {0: [32]}).close()  # the same run: reopened
    msg = (f"the NVMe store at {path} belongs to another run or shape \\(its run \"abc\", this "
           f"run's \"xyz\"\\); give this run another nvme_path, or delete {path} to start")
    with pytest.raises(StoreError, match=msg):
        Store(path, {**ident, "run": "xyz"}, {0: [32]})
    with pytest.raises(StoreError, match="its leaves .*\"float32\".*this run's .*\"bfloat16\""):
        Store(path, {**ident, "leaves": [["w", [8, 4], "bfloat16"]]}, {0: [32]})
    with pytest.raises(StoreError, match="its shards \\[\"0\"\\] of other sizes"):
        Store(path, ident, {0: [33]})
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    with pytest.raises(StoreError, match=f"nvme_path {other} holds files that are not a "
                                         f"zerojax store \\(notes.txt\\); give nvme_path an"):
        Store(other, ident, {0: [32]})
    assert (other / "notes.txt").read_text() == "keep" and not (other / META).exists()
    (path / META).write_text("{not json")
    with pytest.raises(StoreError, match=f"unreadable {META} .*delete {path} to start"):
        Store(path, ident, {0: [32]})
    assert isinstance(StoreError("x"), OSError) and isinstance(StoreError("x"), ValueError)


def test_a_store_is_dirty_until_committed(tmp_path):
    """A new store is dirty (nothing valid in it); `commit` makes it clean with its record,
    `begin` dirty again, durably: a process that dies in between (here: closes without a
    commit) leaves it dirty for the next to see."""
    path = tmp_path / "s"
    with Store(path, "run", {0: [4096]}) as s:
        assert not s.clean and s.state == "dirty" and s.record == {}
        s.begin()
        s.write_leaf(0, 0, np.ones(4096, np.float32))
        s.commit(step=7)
        assert s.clean and json.loads((path / META).read_text())["state"] == "clean"
    with Store(path, "run", {0: [4096]}) as s:
        assert s.clean and s.record == {"step": 7}
        assert_bitwise(s.read_leaf(0, 0, "master"), np.ones(4096, np.float32))
        s.begin()  # an update starts, and the process dies
    with Store(path, "run", {0: [4096]}) as s:
        assert not s.clean and s.record == {"step": 7}
    assert sorted(p.name for p in path.iterdir()) == sorted([LOCK, META, shard_file(0)])


def test_an_io_error_in_the_update_is_one_error_naming_the_store(tmp_path):
    """A shard's file cut short under an open store (a read past its end), and a shard whose
    writes meet a full disk (/dev/full): the update fails with one error naming the file and
    what happened, and the store stays dirty."""
    store = Store(tmp_path / "s", "run", {0: [8192]}, block=1024, count=2)
    store.begin()
    store.write_leaf(0, 0, np.ones(8192, np.float32))
    os.truncate(tmp_path / "s" / shard_file(0), 4096 * 5)
    g = jnp.ones(8192, jnp.float32)
    with pytest.raises(Exception, match=f"zerojax NVMe store {tmp_path / 's' / shard_file(0)}: "
                                        "a read failed: Input/output error"):
        jax.block_until_ready(nvme.update_leaf(store.handle, 0, _row(), jnp.int32(0), g,
                                               jnp.float32))
    assert not store.clean
    store.close()
    dll = nvme.library()[0]
    handle, got, err = dll.zjn_open(1024, 2), ctypes.c_int(0), ctypes.create_string_buffer(512)
    n, at = np.int64([8192]), np.int64([0, 32768, 65536])
    assert dll.zjn_add_shard(handle, 0, b"/dev/full", 1, n.ctypes.data, at.ctypes.data, 1, got,
                             err, 512) == 0
    with pytest.raises(Exception, match="zerojax NVMe store /dev/full: a write failed: No space "
                                        "left on device \\(ENOSPC\\): the disk under the store"):
        jax.block_until_ready(nvme.update_leaf(handle, 0, _row(), jnp.int32(0), g, jnp.float32))
    dll.zjn_close(handle)
    with pytest.raises(Exception, match="is not open in this process"):
        jax.block_until_ready(nvme.update_leaf(handle, 0, _row(), jnp.int32(0), g, jnp.float32))


@contextlib.contextmanager
def tmpfs(path, options, kind="tmpfs"):
    """A tmpfs (or `kind`) mounted at `path` with `options` (root only: skips otherwise)."""
    path.mkdir()
    made = subprocess.run(["mount", "-t", kind, *(["-o", options] if options else []), kind,
                           str(path)], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot mount a {kind} here ({made.stderr.strip() or 'not root'})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_read_only_path_and_a_full_disk_are_one_error_each(tmp_path, monkeypatch):
    """A read-only file system, and one too small for the store (told by its free space, and
    when that misleads, by the preallocation): one StoreError each, naming the path, the
    bytes and the fix, and nothing of the store left. ramfs refuses O_DIRECT (tmpfs takes it
    on recent kernels): the store runs buffered, says so, and the pass gives the same numbers."""
    with tmpfs(tmp_path / "ro", "ro,size=1M") as ro:
        with pytest.raises(StoreError, match=f"nvme_path {ro / 's'} is not writable \\(Read-only "
                                             "file system.*give nvme_path a writable") as e:
            Store(ro / "s", "run", {0: [1024]})
        assert e.value.errno == 30
    with tmpfs(tmp_path / "small", "size=1M") as small:
        need = layout([200_000])[1]
        with pytest.raises(StoreError, match=f"nvme_path {small / 's'} has [0-9,]+ bytes free; "
                                             f"the store needs {need:,}: free space there"):
            Store(small / "s", "run", {0: [200_000]})
        monkeypatch.setattr("shutil.disk_usage", lambda p: types.SimpleNamespace(
            free=1 << 40, total=1 << 41))
        with pytest.raises(StoreError, match=f"nvme_path {small / 's'}: no space left on its "
                                             f"disk \\(creating the store's files\\); the store "
                                             f"needs {need:,} bytes"):
            Store(small / "s", "run", {0: [200_000]})
        assert sorted(p.name for p in (small / "s").iterdir()) == [LOCK]
        monkeypatch.undo()
    with tmpfs(tmp_path / "ram", "", kind="ramfs") as ram:
        store = Store(ram / "s", "run", {0: [5000]}, block=BLOCK, count=3)
        assert store.io == {0: "buffered: the file system refused O_DIRECT"}
        (p, m, v), = _state([5000])
        store.write_leaf(0, 0, p, m, v)
        g = jnp.asarray(np.random.default_rng(3).standard_normal(5000).astype(np.float32))
        c = nvme.update_leaf(store.handle, 0, _row(), jnp.int32(0), g, jnp.float32)
        ref = _fused_pass(_row(), jnp.asarray(p), jnp.asarray(m), jnp.asarray(v), g)
        assert_bitwise(c, ref[3])
        assert_bitwise(store.read_leaf(0, 0, "nu"), ref[2])
        store.close()


def test_the_pass_has_a_side_effect_xla_keeps():
    """The streamed update's custom call is marked side-effecting: jit keeps a call whose
    output is unused (the store is updated all the same)."""
    fn = jax.jit(lambda g: [nvme.update_leaf(1, 0, jnp.asarray(_row()), jnp.int32(0), g,
                                             jnp.float32), 0][1])
    text = fn.lower(jnp.ones(4, jnp.float32)).as_text()
    assert f'custom_call @{nvme.TARGET}' in text and "has_side_effect = true" in text


def test_the_bench_reads_and_writes_the_state_once_a_step(tmp_path):
    """experiments/nvme_bench.py on a 3 MB state of two leaves, two buffer sizes: each step
    read and wrote the store's bytes once (the state, with each leaf's last 4 KiB unit
    whole), and the disk was measured before each point."""
    import nvme_bench

    res = nvme_bench.main(["--dir", str(tmp_path), "--state-gb", "0.003", "--leaves", "2",
                           "--blocks", "1024", "4096", "--counts", "2", "--steps", "2"])
    sizes = [124928, 124928 + 777]
    assert res["state_bytes"] == 12 * sum(sizes) and res["store_bytes"] == layout(sizes)[1]
    assert [(p["block"], p["count"]) for p in res["points"]] == [(1024, 2)] * 2 + [(4096, 2)] * 2
    for p in res["points"]:
        assert (p["read"], p["written"], p["passes"]) == (res["store_bytes"],) * 2 + (2,)
        assert p["seconds"] > 0 and p["serial"] > 0
    assert len(res["disk"]) == 2 and all(d["read"] > 0 and d["write"] > 0 for d in res["disk"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]  # the disk's file removed


def test_memcap_reports_the_peak_and_the_caps_kill():
    """scripts/memcap.py: a process that touches 300 MB under a 150 MB cap is killed by the
    cap, with a peak at the cap; one that touches 50 MB runs, with a peak of at least that."""
    import memcap

    why = memcap.available()
    if why:
        pytest.skip(why)
    touch = lambda n: [sys.executable, "-c", f"x = b'x' * {n}; print(len(x))"]
    big = memcap.run(touch(300_000_000), 150_000_000)
    assert big.oom_killed and big.rc == -9 and 0.9 * big.cap <= big.peak <= big.cap
    small = memcap.run(touch(50_000_000), 150_000_000)
    assert (small.rc, small.oom_killed, small.stdout.strip()) == (0, False, "50000000")
    assert 50_000_000 <= small.peak < small.cap


@pytest.mark.slow
def test_a_state_over_the_cap_streams_where_whole_it_is_killed():
    """experiments/nvme_memcap.py: under a cap of 0.8 GB, the streamed update of a 1.2 GB
    state (1.5x the cap) steps, reading and writing the store once, its peak under the cap;
    the same state loaded whole for the in-memory fused pass is killed by the cap."""
    import memcap
    import nvme_memcap

    why = memcap.available()
    if why:
        pytest.skip(why)
    res = nvme_memcap.main(["--cap", "8e8", "--factor", "1.5", "--steps", "1"])
    assert res["state_bytes"] >= 1.5 * res["cap"] - 12 * 4096 * 4
    streamed, whole = res["streamed"], res["whole"]
    assert streamed["rc"] == 0 and not streamed["oom_killed"] and streamed["peak"] < res["cap"]
    step = json.loads(streamed["out"][-1])
    sizes = nvme_memcap.sizes_for(1.5 * res["cap"])
    assert step["read"] == step["written"] == layout(sizes)[1]
    assert whole["oom_killed"] and whole["rc"] == -9 and res["holds"]


@pytest.mark.parametrize("kwargs, says", [
    (dict(stage=1, offload_device="nvme"), "needs offload='optimizer'"),
    (dict(stage=1, offload="optimizer", offload_device="nvme"), "needs nvme_path"),
    (dict(stage=1, offload="optimizer", nvme_path="/x"), "needs offload_device='nvme'"),
    (dict(stage=1, offload_device="disk"), "not an offload device"),
    (dict(stage=1, nvme_buffer_size=1000), "multiple of 1024"),
    (dict(stage=1, nvme_buffer_size=1024.0), "must be a positive multiple"),
    (dict(stage=1, nvme_buffer_count=1), ">= 2"),
])
def test_the_nvme_options_refuse_what_cannot_run(kwargs, says):
    with pytest.raises(zj.ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        zj.ZeroConfig(**kwargs)
    cfg = zj.ZeroConfig(stage=1, offload="optimizer", offload_device="nvme",
                        nvme_path=Path("/tmp/store"), nvme_buffer_size=4096)
    assert (cfg.nvme_path, cfg.nvme_buffer_size, cfg.nvme_buffer_count) == (
        "/tmp/store", 4096, 4)
