"""Compile time of the ``tiny`` model at 8 vs 32 layers, scanned vs unrolled.

With ``scan_layers=True`` each repeating group of layers ([KDA, KDA, KDA, Gated DSA], all MoE
here: ``first_k_dense_replace=0`` so the pattern is uniform from layer 0) is compiled once, so
compile time stays flat with depth; the unrolled loop grows with it. A K3-like stack (dense first
layer, 3:1 pattern) compiles a few distinct group bodies, a number bounded by the pattern, not
the depth: its 32 -> 128 ratio is shown too. Prints the ratios measured in this run and writes
bench/results/compile.json.

``--first-step PRESET ...`` measures instead what a user waits for (issue #21 section 4): the
wall time from starting ``kdsa train --preset PRESET --steps 2`` (a fresh process, an empty
run directory, no persistent compile cache) to its first step's line in ``metrics.jsonl``,
and that step's own time (its compile included); bench/results/compile_first_step.json.

    .venv/bin/python bench/bench_compile.py [--quick]
    .venv/bin/python bench/bench_compile.py --first-step tiny [small]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from kdsa.model.config import LinearAttnConfig, get_preset  # noqa: E402
from kdsa.model.transformer import Transformer  # noqa: E402
from timing import write_results  # noqa: E402  (bench/timing.py; the script's folder)


REPEATS = 2


def config_with_layers(n: int, scan: bool, uniform: bool = True):
    base = get_preset("tiny").replace(first_k_dense_replace=0 if uniform else 1)
    full = tuple(range(4, n + 1, 4))
    kda = tuple(i for i in range(1, n + 1) if i not in full)
    lac = LinearAttnConfig(**{**base.linear_attn_config.__dict__, "kda_layers": kda,
                              "full_attn_layers": full})
    return base.replace(num_hidden_layers=n, linear_attn_config=lac, scan_layers=scan)


def compile_seconds(n: int, scan: bool, uniform: bool = True) -> float:
    model = Transformer(config_with_layers(n, scan, uniform), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    ids = jnp.zeros((1, 32), jnp.int32)

    def f(state, ids):
        return nnx.merge(graphdef, state)(ids)

    best = float("inf")
    for _ in range(REPEATS):  # min over repeats: compile time on a shared CPU is noisy
        jax.clear_caches()  # else the repeat is a cache hit
        t0 = time.perf_counter()
        jax.jit(f).lower(state, ids).compile()
        best = min(best, time.perf_counter() - t0)
    return best


def first_step(preset: str) -> dict:
    """Seconds from launching ``kdsa train`` to its first metrics line, and the run's end."""
    kdsa = Path(sys.executable).with_name("kdsa")
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "run" / "metrics.jsonl"
        t0 = time.perf_counter()
        proc = subprocess.Popen([str(kdsa), "train", "--preset", preset, "--steps", "2",
                                 "--run-dir", str(Path(tmp) / "run"), "--no-progress"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        first = None
        while proc.poll() is None and first is None:
            if metrics.exists() and metrics.read_text().strip():
                first = time.perf_counter() - t0
            time.sleep(0.05)
        err = proc.communicate()[1]
        total = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError(f"kdsa train --preset {preset} failed:\n{err[-2000:]}")
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"to_first_step_s": first if first is not None else total, "total_s": total,
            "first_step_time_s": rows[0]["step_time_s"], "second_step_time_s":
            rows[1]["step_time_s"] if len(rows) > 1 else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="skip the unrolled 32-layer compile")
    p.add_argument("--first-step", nargs="+", metavar="PRESET",
                   help="time to the first train step of these presets instead")
    args = p.parse_args()
    if args.first_step:
        result = {"device": str(jax.devices()[0]), "load_before": os.getloadavg()}
        for preset in args.first_step:
            result[preset] = r = first_step(preset)
            print(f"kdsa train --preset {preset}: first step after {r['to_first_step_s']:.1f} s "
                  f"(the step itself {r['first_step_time_s']:.1f} s with its compile); "
                  f"2 steps done after {r['total_s']:.1f} s", flush=True)
        out = Path(__file__).parent / "results" / "compile_first_step.json"
        write_results(out, result)
        return
    rows = {}
    for scan in (True, False):
        for n in (8, 32):
            if args.quick and not scan and n == 32:
                continue
            rows[f"{'scan' if scan else 'loop'}_{n}"] = s = compile_seconds(n, scan)
            print(f"{'scan' if scan else 'loop'} {n:>2} layers: compile {s:6.2f} s", flush=True)
    if not args.quick:
        for n in (32, 128):
            rows[f"k3like_scan_{n}"] = s = compile_seconds(n, True, uniform=False)
            print(f"K3-like scan {n:>3} layers: compile {s:6.2f} s", flush=True)
    result = {"device": str(jax.devices()[0]), "seconds": rows,
              "scan_ratio_32_over_8": rows["scan_32"] / rows["scan_8"]}
    print(f"scan: 32/8 layers compile-time ratio {result['scan_ratio_32_over_8']:.2f}x")
    if "loop_32" in rows:
        result["loop_ratio_32_over_8"] = rows["loop_32"] / rows["loop_8"]
        print(f"loop: 32/8 layers compile-time ratio {result['loop_ratio_32_over_8']:.2f}x")
    if "k3like_scan_128" in rows:
        result["k3like_ratio_128_over_32"] = rows["k3like_scan_128"] / rows["k3like_scan_32"]
        print(f"K3-like scan: 128/32 layers compile-time ratio "
              f"{result['k3like_ratio_128_over_32']:.2f}x")
    out = Path(__file__).parent / "results" / "compile.json"
    write_results(out, result)


if __name__ == "__main__":
    main()
