"""Simulated CPU devices and strict numerics for every test; set before jax starts its backend.

LLVM -O0 and XLA:CPU's legacy (non-fusion-emitter) codegen compile the suite's tiny programs
~5x faster, within every test's tolerance; the tests check numerics and program structure,
not speed. The emitters change fusion, and with it temp bytes by up to 1 %, so tests that read
XLA's buffer figures compile with the default emitters (`helpers.DEFAULT_BUFFERS`).
"""

import gc
import os
import shutil
import tempfile

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for the session, in a fresh directory: every subprocess the
# workers start (environment variables reach them all) compiles each program once. The workers
# themselves import jax before this file and run without it (docs/testing.md says why it stays
# so). Not every executable loaded from the cache runs as the one XLA compiled: a multi-device
# program's collectives can go wrong (docs/testing.md, experiments/cpu_cache_collectives.py),
# which a subprocess running collectives over several devices is exposed to.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="zerojax-tests-xla-")
    os.environ["ZEROJAX_TESTS_OWN_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
# The workers and every subprocess make their temporary files in one directory of the session,
# removed with it: a process a test kills (or that leaves by os._exit) leaves no finalizer to
# clean up what it made (wandb's media and artifact directories, an interrupted save's files).
if "ZEROJAX_TESTS_OWN_TMP" not in os.environ:
    os.environ["ZEROJAX_TESTS_OWN_TMP"] = tempfile.mkdtemp(prefix="zerojax-tests-tmp-")
    os.environ["TMPDIR"] = os.environ["ZEROJAX_TESTS_OWN_TMP"]
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# A worker's heap grows with every test it runs: jax keeps each traced and compiled program in
# its caches, hundreds of thousands of long-lived objects, which CPython's collector scanned
# again after every 700 allocations' worth of young objects: 23 s of each worker's ~260 s
# quick tier went to collections, 9 s with young objects collected every 100,000 allocations
# (the same tests, the same machine; every test passed either way). Only the test processes:
# the CLI's subprocesses and the package keep CPython's defaults (the main job spends 0.7 s
# of ~50 in collections).
gc.set_threshold(100_000, 50, 100)

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")

# The longest files of each tier (~5-90 s on 2 cores, measured), longest first: `--dist loadfile`
# hands files out in collection order, so the short ones come last and even out the two
# workers' finish. Tiers: the README's command runs every test but the `slow` ones (end-to-end
# runs, the rest of each sweep: `helpers.sweep`); CI also runs `pytest -m slow`.
LONGEST_FIRST = ("test_adapters.py", "test_planning.py", "test_zeropp.py", "test_offload.py",
                 "test_optimizers_sharded.py", "test_optimizer_costs.py", "test_compiled.py",
                 "test_checkpoint.py", "test_train.py", "test_nvme.py", "test_published.py",
                 "test_tied.py", "test_model_axis.py", "test_fused.py", "test_parity.py",
                 "test_measure.py", "test_scripts.py", "test_state.py", "test_optimizers.py",
                 "test_delayed.py", "test_twin_flow.py", "test_model_axis_memory.py",
                 "test_seed.py", "test_offload_checkpoint.py", "test_update_parts.py",
                 "test_save_contract.py", "test_precision.py", "test_readme.py",
                 "test_tp_styles.py", "test_models.py", "test_engine.py", "test_errors.py",
                 "test_bench.py", "test_nvme_store.py")
SLOW_LONGEST_FIRST = ("test_tied.py", "test_train.py", "test_model_axis.py", "test_tp_styles.py",
                      "test_nvme.py",
                      "test_kills.py", "test_bench.py", "test_delayed.py", "test_parity.py",
                      "test_optimizers_sharded.py", "test_checkpoint.py", "test_optimizers.py",
                      "test_published.py", "test_engine.py", "test_adapters.py", "test_offload.py",
                      "test_planning.py", "test_scripts.py", "test_compiled.py", "test_measure.py")


def pytest_collection_modifyitems(config, items):
    order = SLOW_LONGEST_FIRST if config.option.markexpr == "slow" else LONGEST_FIRST
    rank = {name: i for i, name in enumerate(order)}
    items.sort(key=lambda item: rank.get(item.path.name, len(order)))


def pytest_unconfigure(config):
    """The session that made the compilation cache and the temporary directory removes them
    (the workers share them)."""
    if hasattr(config, "workerinput"):
        return
    for own in ("ZEROJAX_TESTS_OWN_CACHE", "ZEROJAX_TESTS_OWN_TMP"):
        if os.environ.get(own):
            shutil.rmtree(os.environ[own], ignore_errors=True)
