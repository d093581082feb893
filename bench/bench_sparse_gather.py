"""What reading zeros for unused top-k slots costs the XLA sparse MLA attention.

``model/dsa.py : sparse_mla_attention`` gathers each query's top-k rows of the cache. Unused
slots (-1) read a row of zeros (``take_along_axis(mode="fill")``), so a non-finite value in
another token's row cannot reach the output through a zero weight (0 x NaN). Before 2026-12-07
they read row 0 (indices clamped). This times both gathers in one process, the calls
alternated, at one decode query per row of a full cache (every slot used, as at 64K keys).

    python bench/bench_sparse_gather.py     # batch 8, 64K keys, top-2048 -> results/sparse_gather.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from timing import write_results  # noqa: E402

from kdsa.model import dsa  # noqa: E402

f32 = jnp.float32


def clamped_rows(parts, idx):
    """The gather before 2026-12-07: indices clamped into the cache (an unused slot reads a
    real row, weighted 0)."""
    b, c, k = idx.shape
    flat = idx.reshape(b, c * k, 1)
    return [jnp.take_along_axis(p, flat, axis=1, mode="clip").astype(f32).reshape(b, c, k, -1)
            for p in parts]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--keys", type=int, default=65536)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    b, s, k, n = args.batch, args.keys, args.topk, args.heads
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (b, 1, n, 576))  # absorbed queries: latent 512 + RoPE 64
    latent = jax.random.normal(ks[1], (b, s, 512)).astype(jnp.bfloat16)
    rope = jax.random.normal(ks[2], (b, s, 64)).astype(jnp.bfloat16)
    idx = jax.vmap(lambda kk: jax.random.permutation(kk, s)[:k])(
        jax.random.split(ks[3], b)).astype(jnp.int32)[:, None, :]  # [B, 1, K]

    zeros = dsa._gather_part_rows
    fns = {}
    try:
        for name, gather in (("zeros_for_unused", zeros), ("clamped", clamped_rows)):
            dsa._gather_part_rows = gather  # traced now, so each program keeps its gather
            fns[name] = jax.jit(
                lambda *a: dsa.sparse_mla_attention(a[0], (a[1], a[2]), a[3], 0.07, 512)[0])
            jax.block_until_ready(fns[name](q, latent, rope, idx))
    finally:
        dsa._gather_part_rows = zeros
    out = {name: np.asarray(f(q, latent, rope, idx)) for name, f in fns.items()}
    times = {name: [] for name in fns}
    for _ in range(args.reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(q, latent, rope, idx))
            times[name].append(time.perf_counter() - t0)
    rows = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
    for name, ms in rows.items():
        print(f"{name:18s} {ms:7.2f} ms")
    diff = float(np.max(np.abs(out["zeros_for_unused"] - out["clamped"])))
    print(f"zeros / clamped: {rows['zeros_for_unused'] / rows['clamped']:.3f}  "
          f"(max |difference| of the outputs {diff:.1e}: no slot is unused here)")
    write_results(Path(__file__).parent / "results" / "sparse_gather.json",
                  {"backend": jax.default_backend(), "batch": b, "keys": s, "topk": k,
                   "heads": n, "reps": args.reps, "ms": rows,
                   "zeros_over_clamped": rows["zeros_for_unused"] / rows["clamped"],
                   "max_abs_difference": diff})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
