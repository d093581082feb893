"""The MoE dispatch's inverse permutation: the sort it uses now (``model/layers.py :
inverse_permutation``, because XLA:TPU aborts on the merged scatters) against the scatter it
replaced, side by side in one run, medians of 30 calls; checks both give the same result.

    python bench/bench_inverse_permutation.py   # -> bench/results/inverse_permutation.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kdsa.model.layers import inverse_permutation

sys.path.insert(0, str(Path(__file__).parent))
from timing import write_results  # noqa: E402


def scatter_inverse(order):
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype),
                                               unique_indices=True)


def main() -> int:
    rows = {}
    for m in (4096, 8192, 65536):  # assignments N * k
        order = jnp.asarray(np.random.default_rng(0).permutation(m), jnp.int32)
        fns = {"scatter": jax.jit(scatter_inverse), "sort": jax.jit(inverse_permutation)}
        outs = {k: np.asarray(f(order)) for k, f in fns.items()}
        assert (outs["scatter"] == outs["sort"]).all()
        times = {k: [] for k in fns}
        for _ in range(30):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f(order).block_until_ready()
                times[k].append(time.perf_counter() - t0)
        rows[m] = {f"{k}_us": float(np.median(v)) * 1e6 for k, v in times.items()}
        print(f"M={m}: sort {rows[m]['sort_us']:.0f} us, scatter {rows[m]['scatter_us']:.0f} us")
    write_results(Path(__file__).parent / "results" / "inverse_permutation.json",
                  {"backend": jax.default_backend(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
