"""Compile time of the ``tiny`` model at 8 vs 32 layers, scanned vs unrolled.

With ``scan_layers=True`` the repeating [KDA, KDA, DSA, KDA] group is compiled once, so compile
time should stay nearly flat with depth; the unrolled loop grows with it. Prints the ratios
32-layer / 8-layer for both, measured in this run, and writes bench/results/compile.json.

    .venv/bin/python bench/bench_compile.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from kdsa.model.config import LinearAttnConfig, get_preset  # noqa: E402
from kdsa.model.transformer import Transformer  # noqa: E402


def config_with_layers(n: int, scan: bool):
    base = get_preset("tiny")
    full = tuple(range(4, n + 1, 4))
    kda = tuple(i for i in range(1, n + 1) if i not in full)
    lac = LinearAttnConfig(**{**base.linear_attn_config.__dict__, "kda_layers": kda,
                              "full_attn_layers": full})
    return base.replace(num_hidden_layers=n, linear_attn_config=lac, scan_layers=scan)


def compile_seconds(n: int, scan: bool) -> float:
    model = Transformer(config_with_layers(n, scan), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    ids = jnp.zeros((1, 32), jnp.int32)

    def f(state, ids):
        return nnx.merge(graphdef, state)(ids)

    t0 = time.perf_counter()
    jax.jit(f).lower(state, ids).compile()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="skip the unrolled 32-layer compile")
    args = p.parse_args()
    rows = {}
    for scan in (True, False):
        for n in (8, 32):
            if args.quick and not scan and n == 32:
                continue
            rows[f"{'scan' if scan else 'loop'}_{n}"] = s = compile_seconds(n, scan)
            print(f"{'scan' if scan else 'loop'} {n:>2} layers: compile {s:6.2f} s", flush=True)
    result = {"device": str(jax.devices()[0]), "seconds": rows,
              "scan_ratio_32_over_8": rows["scan_32"] / rows["scan_8"]}
    print(f"scan: 32/8 layers compile-time ratio {result['scan_ratio_32_over_8']:.2f}x")
    if "loop_32" in rows:
        result["loop_ratio_32_over_8"] = rows["loop_32"] / rows["loop_8"]
        print(f"loop: 32/8 layers compile-time ratio {result['loop_ratio_32_over_8']:.2f}x")
    out = Path(__file__).parent / "results" / "compile.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
