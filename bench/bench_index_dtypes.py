"""Narrower lightning-indexer keys on this machine: the decode step's index scores (one query
per row, ``relu(q . k)`` per index head, weighted sum over heads) with the queries and keys in
float32, bfloat16, float8 (e4m3) and int8, side by side in one run (medians of alternated
calls), and how much of the float32 top-k set each keeps.

A quantized row is ``round(x / s)`` with ``s = max|x| / 127`` per key and per query head (int8)
or ``s = max|x| / 448`` (float8 e4m3, as DeepSeek-V3.2's inference keeps index keys: one scale
per 128-wide row). Since ``s > 0``, ``relu(s_q s_k (q' . k')) = s_q s_k relu(q' . k')``: the
scales apply after the integer product. The model does not use int8 or float8 keys; this
measures whether they would pay (docs/performance.md).

    python bench/bench_index_dtypes.py           # 8 rows x 64K keys -> results/index_dtypes.json
    python bench/bench_index_dtypes.py --keys 8192
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from timing import write_results  # noqa: E402

f32 = jnp.float32


def quantize(x, dtype, top: float):
    """Per-row (last axis) symmetric quantization: (values in ``dtype``, float32 scales)."""
    s = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), 1e-30) / top
    v = x / s[..., None]
    v = jnp.round(v) if jnp.issubdtype(dtype, jnp.integer) else v
    return v.astype(dtype), s


def scores(q, k, w, q_scale=None, k_scale=None):
    """q [B, J, D], k [B, S, D], w [B, J] -> [B, S]: sum_j w_j relu(q_j . k_s). Quantized:
    ``k_scale[s] * sum_j (w_j q_scale_j) relu(q'_j . k'_s)``, the same sum (scales > 0)."""
    acc = jnp.int32 if jnp.issubdtype(q.dtype, jnp.integer) else f32
    logits = jnp.einsum("bjd,bsd->bjs", q, k, preferred_element_type=acc).astype(f32)
    if q_scale is None:
        return jnp.einsum("bj,bjs->bs", w, jax.nn.relu(logits))
    return jnp.einsum("bj,bjs->bs", w * q_scale, jax.nn.relu(logits)) * k_scale


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--keys", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    b, s, j, d = args.batch, args.keys, args.heads, args.dim
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, j, d)), f32)
    k = jnp.asarray(rng.standard_normal((b, s, d)), f32)
    w = jnp.asarray(rng.standard_normal((b, j)) * (j * d) ** -0.5, f32)

    bf16 = jnp.bfloat16
    inputs = {"float32": (q, k, w), "bfloat16": (q.astype(bf16), k.astype(bf16), w)}
    for name, dtype, top in (("int8", jnp.int8, 127.0),
                             ("float8_e4m3fn", jnp.float8_e4m3fn, 448.0)):
        (qq, qs), (kq, ks) = quantize(q, dtype, top), quantize(k, dtype, top)
        inputs[name] = (qq, kq, w, qs, ks)
    fn = jax.jit(scores)
    exact = set_of = None
    rows = {}
    for name, a in inputs.items():
        out = fn(*a)
        chosen = np.asarray(jax.lax.top_k(out, args.topk)[1])
        if exact is None:
            exact = chosen
            set_of = [set(r) for r in exact]
        kept = np.mean([len(set_of[i] & set(chosen[i])) / args.topk for i in range(b)])
        rows[name] = {"topk_kept_of_float32": float(kept), "times": []}
    for _ in range(args.reps):
        for name, a in inputs.items():
            t0 = time.perf_counter()
            fn(*a).block_until_ready()
            rows[name]["times"].append(time.perf_counter() - t0)
    for name, r in rows.items():
        r["scores_ms"] = float(np.median(r.pop("times"))) * 1e3
        r["key_bytes_per_token"] = int(d * jnp.dtype(inputs[name][1].dtype).itemsize
                                       + (4 if len(inputs[name]) > 3 else 0))
        print(f"{name:14s} {r['scores_ms']:7.2f} ms   top-{args.topk} kept "
              f"{r['topk_kept_of_float32']:.4f}   {r['key_bytes_per_token']} B/key")
    write_results(Path(__file__).parent / "results" / "index_dtypes.json",
                  {"backend": jax.default_backend(), "batch": b, "keys": s, "heads": j,
                   "dim": d, "topk": args.topk, "reps": args.reps, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
