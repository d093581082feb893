"""Shared test setup: CPU only, float32 compute, 8 host devices for sharding tests.

XLA's CPU backend runs at optimisation level 0 in tests: these are correctness checks on tiny
shapes, dominated by compile time, and level 0 about halves it (measured on
tests/test_transformer.py: 266 -> 150 CPU s), and copy insertion skips its region analysis.
``KDSA_TEST_XLA_OPT=1`` restores the defaults. After a test file JAX's compiled programs are
dropped once a worker maps many regions (``_release_compiled_programs``: its mappings of
machine code otherwise pass Linux's per-process limit).
"""

import gc
import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags += " --xla_force_host_platform_device_count=8"
if os.environ.get("KDSA_TEST_XLA_OPT") != "1" and "xla_backend_optimization_level" not in flags:
    flags += " --xla_backend_optimization_level=0"
    # copy insertion without region analysis: ~10% less compile time (tests/test_rl_step.py
    # 33.2 -> 30.2 s, two runs each, side by side); a compile-time choice, numerics unchanged
    flags += " --xla_cpu_copy_insertion_use_region_analysis=false"
os.environ["XLA_FLAGS"] = flags.strip()

# One persistent compilation cache for the whole run: both xdist workers and every subprocess
# they start (JAX reads ``JAX_COMPILATION_CACHE_DIR`` from the environment) reuse a program
# another file already compiled (the whole suite in the workspace: 927 -> 789 s, one run
# each, 2026-12-06). The process that makes the folder removes it at the end; programs
# compiling in under 0.1 s are not written.
if "KDSA_TEST_COMPILE_CACHE" not in os.environ:
    import tempfile
    os.environ["KDSA_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="kdsa-test-jax-")
    os.environ["KDSA_TEST_COMPILE_CACHE_OWNER"] = str(os.getpid())
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["KDSA_TEST_COMPILE_CACHE"])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

# The files that take longest (minutes of multi-process jobs and mesh compiles) start first:
# pytest-xdist hands whole files (``--dist loadfile``) to whichever worker is free, in
# collection order, so long files collected last leave one worker running alone at the end.
SLOW_FIRST = (  # by their seconds in a suite run (``--durations=0``, 2026-12-05 11:03 UTC)
    "test_sharded_train.py", "test_rl_multihost.py", "test_causal_windows.py",
    "test_paged_cache.py", "test_post_training.py", "test_sharding.py", "test_convert.py",
    "test_checkpointing.py", "test_quant_check.py", "test_transformer.py",
    "test_rl_routing_replay.py", "test_tpu_compile.py", "test_batched_prefill.py", "test_kda.py",
    "test_rl_loop.py", "test_vision_stack.py", "test_paged_mesh.py", "test_rl_step.py",
    "test_train_step.py", "test_generate_random_sharded.py", "test_prefix_cache.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order kept


# Mappings (``/proc/self/maps`` lines) above which a worker drops JAX's compiled programs after
# a test file: Linux's default per-process limit is 65,530 (``vm.max_map_count``).
MAX_MAPPINGS = 30_000


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after a test file once the worker maps many regions. Each
    program keeps its machine code in memory mappings, and a worker that ran half the suite's
    files passed Linux's limit: XLA then aborted the process in the middle of a compile
    (measured: 28K mappings per worker after 5 minutes of the suite, aborts at 98% of it).
    Only past :data:`MAX_MAPPINGS`, since every file's recompiles add up."""
    import jax  # (after the environment above)

    yield
    if _mappings() > MAX_MAPPINGS:
        jax.clear_caches()
        gc.collect()


def pytest_unconfigure(config):
    if os.environ.get("KDSA_TEST_COMPILE_CACHE_OWNER") == str(os.getpid()):
        import shutil
        shutil.rmtree(os.environ["KDSA_TEST_COMPILE_CACHE"], ignore_errors=True)
