"""Timing helper shared by the benchmark scripts (run as ``python bench/bench_x.py``)."""

from __future__ import annotations

import statistics
import time

import jax


def seconds(fn, *args, reps: int) -> float:
    """Median wall time of ``fn(*args)`` after one compile-and-warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
