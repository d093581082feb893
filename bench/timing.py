"""Timing helper shared by the benchmark scripts (run as ``python bench/bench_x.py``)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

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


def matmul_flops(n: int, reps: int) -> float:
    """FLOP/s of an ``[n, n] @ [n, n]`` float32 matmul on one device: this machine's plain
    matmul rate, the roofline the model-FLOP ratios are measured against."""
    import jax.numpy as jnp

    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (n, n), jnp.float32)
    b = jax.random.normal(k2, (n, n), jnp.float32)
    return 2.0 * n ** 3 / seconds(jax.jit(jnp.matmul), a, b, reps=reps)


def write_results(path, result: dict) -> None:
    """Write a benchmark's results as JSON (parent folders created) and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
