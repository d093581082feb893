"""Timing helper shared by the benchmark scripts (run as ``python bench/bench_x.py``)."""

from __future__ import annotations

import json
import os
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


def machine() -> dict:
    """The CPU a benchmark ran on. This project's machines differ between sessions: an
    AVX2-only host (AMD family 25 model 1) ran the bfloat16 index scores of a k3-slice decode
    step 2-3x slower than the host of an earlier day (docs/performance.md), so results from
    different days compare only on the same CPU."""
    info: dict = {"cpus": os.cpu_count()}
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        mem = Path("/proc/meminfo").read_text().split("\n")[0]
    except OSError:  # not Linux
        return info
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in
                                                    first.splitlines())}
    flags = set(fields.get("flags", "").split())
    info.update(model_name=fields.get("model name"), cpu_family=fields.get("cpu family"),
                model=fields.get("model"), memory=mem.split(":", 1)[-1].strip(),
                flags=sorted(flags & {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni",
                                      "avx_vnni", "amx_bf16", "amx_tile"}))
    return info


def write_results(path, result: dict) -> None:
    """Write a benchmark's results as JSON (parent folders created), with the machine they
    were measured on, and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "machine": machine()}, indent=1) + "\n")
    print(f"wrote {path}")
