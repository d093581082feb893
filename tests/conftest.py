"""Shared test setup: CPU only, float32 compute, 8 host devices for sharding tests.

XLA's CPU backend runs at optimisation level 0 in tests: these are correctness checks on tiny
shapes, dominated by compile time, and level 0 about halves it (measured on
tests/test_transformer.py: 266 -> 150 CPU s). ``KDSA_TEST_XLA_OPT=1`` restores the default.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags += " --xla_force_host_platform_device_count=8"
if os.environ.get("KDSA_TEST_XLA_OPT") != "1" and "xla_backend_optimization_level" not in flags:
    flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = flags.strip()
