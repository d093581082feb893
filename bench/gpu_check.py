"""Accelerator check of the Pallas sparse MLA and paged index-score kernels: compile, run,
compare with the references, time. On a GPU it runs the Triton kernel (``backend="triton"``), on a TPU the Mosaic kernel
(``backend="mosaic"``, rows gathered by DMA); it refuses to run on CPU.

Written without either (the CPU tests run the kernels in interpret mode and only lower them for
CUDA / TPU); run it on the first machine with one. K3 / DeepSeek-V3.2 sizes: 128 heads, latent
512 + RoPE key 64 (Dk 576, v_dim 512), top-2048, bf16. Stages, each printed as it finishes (a
stage that fails to compile or run is logged with its error and the next one runs):

1. correctness (f32 and bf16, B 2, T 8, S 4096, K 2048 with -1 slots and duplicates): kernel
   forward and gradients vs ``kdsa.model.dsa.sparse_mla_attention`` (XLA gather + autodiff).
2. tile sweep at the decode shape: GPU ``block_h`` x ``block_k`` x ``num_warps``; TPU
   ``block_h`` x ``block_k``.
3. decode (T = 1, batch 64) at 32K and 128K context: kernel vs XLA gather reference vs dense
   MQA attention over the whole context (``jax.nn.dot_product_attention``, XLA, value = the
   576-wide key, so dense does ~6% extra work); achieved TFLOP/s = 2 B T N K (576 + 512) / t
   against FlashMLA's published 640 (H800, prefill) / 410 (decode).
4. prefill (B 1, T = S = 32K, causal top-2048 indices) forward and forward + backward, kernel vs
   XLA reference (``chunk_size`` 256); dense prefill is not run (no cuDNN kernel for 576-wide
   heads, the XLA one needs [N, T, S] scores).
5. paged index scores (``kdsa.kernels_pallas.paged_index``; K3's 64 index heads of 128, bf16
   keys, pages of 64 scattered over a pool, batch 64, one query per row): correctness against
   the reference in f32 and bf16, then at 32K and 128K context the kernel against XLA's
   gather-then-score path and against XLA scoring contiguous (dense-slot) keys
   (``paged_over_dense``: the pages' cost and the kernel's against XLA's together; issue #18
   asks <= 1.1x of the whole decode step), and against itself over pages in pool order
   (``scattered_over_in_order``: what scattered pages alone cost).

Writes ``bench/results/sparse_mla_gpu.json`` or ``sparse_mla_tpu.json`` (with the device
name). ``--quick`` drops 128K, the prefill backward and most of the sweep (about 2 minutes after
start-up on a GPU; untimed on TPU).

    .venv/bin/python bench/gpu_check.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kdsa.kernels_pallas import common
from kdsa.kernels_pallas.paged_index import paged_index_scores, paged_index_scores_ref
from kdsa.kernels_pallas.sparse_mla import sparse_mla_attention, sparse_mla_attention_ref
from kdsa.model.dsa import indexer_scores
from timing import seconds  # noqa: E402  (bench/timing.py)

N, DC, DR, TOPK = 128, 512, 64, 2048
SCALE = (192 ** -0.5) * 1.369 ** 2   # K3 / V3.2: 192^-1/2 * mscale^2


def problem(key, b, t, s, dtype, causal=False):
    kq, kc, kr, ki = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, t, N, DC + DR), dtype)
    kv = (jax.random.normal(kc, (b, s, DC), dtype), jax.random.normal(kr, (b, s, DR), dtype))
    hi = (s - t + jnp.arange(t))[None, :, None] + 1 if causal else s   # visible prefix
    idx = (jax.random.uniform(ki, (b, t, TOPK)) * hi).astype(jnp.int32)
    if causal:
        idx = jnp.where(jnp.arange(TOPK)[None, None] < hi, idx, -1)
    return q, kv, idx


def flops(b, t, valid_slots=TOPK):
    return 2.0 * b * t * N * valid_slots * (DC + DR + DC)


def check_correctness(log):
    for dtype, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)):
        q, kv, idx = problem(jax.random.key(0), 2, 8, 4096, dtype)
        idx = idx.at[0, 1, 100:].set(-1).at[1, 2, :50].set(7)            # -1 and duplicates
        w = jax.random.normal(jax.random.key(1), (2, 8, N, DC), jnp.float32)

        def loss(attend):
            return lambda q, c, r: jnp.sum(attend(q, (c, r), idx, SCALE, DC)[0] * w)

        got = jax.jit(lambda *a: sparse_mla_attention(*a, SCALE, DC))(q, kv, idx)
        want = jax.jit(lambda *a: sparse_mla_attention_ref(*a, SCALE, DC))(q, kv, idx)
        g = jax.jit(jax.grad(loss(sparse_mla_attention), argnums=(0, 1, 2)))(q, *kv)
        gr = jax.jit(jax.grad(loss(sparse_mla_attention_ref), argnums=(0, 1, 2)))(q, *kv)
        errs = {"out": float(jnp.max(jnp.abs(got[0] - want[0]))),
                "lse": float(jnp.max(jnp.abs(got[1] - want[1])))}
        for name, a, r in zip(("dq", "dlatent", "drope"), g, gr):
            a, r = a.astype(jnp.float32), r.astype(jnp.float32)
            errs[name] = float(jnp.max(jnp.abs(a - r)) / jnp.maximum(jnp.max(jnp.abs(r)), 1e-6))
        ok = errs["out"] < tol * 10 and all(errs[k] < tol for k in ("dq", "dlatent", "drope"))
        log("correctness", {"dtype": jnp.dtype(dtype).name, "max_abs_out_lse": [errs["out"],
            errs["lse"]], "max_rel_grads": [errs["dq"], errs["dlatent"], errs["drope"]],
            "ok": bool(ok)})


def tile_configs(platform, quick):
    """Tile settings to sweep: Triton (block_h, block_k, num_warps); Mosaic (block_h, block_k)."""
    if platform == "gpu":
        grid = ([(64, 64, 8), (64, 64, 4)] if quick else
                [(bh, bk, w) for bh in (32, 64) for bk in (32, 64) for w in (4, 8)])
        return [dict(block_h=bh, block_k=bk, num_warps=w) for bh, bk, w in grid]
    grid = ([(128, 128), (64, 128)] if quick else
            [(bh, bk) for bh in (64, 128) for bk in (64, 128, 256)])
    return [dict(block_h=bh, block_k=bk) for bh, bk in grid]


def sweep(log, platform, quick):
    """Decode-shape time of each tile setting; returns the fastest ``(ms, tiles)`` or None."""
    q, kv, idx = problem(jax.random.key(2), 64, 1, 32768, jnp.bfloat16)
    best = None
    for tiles in tile_configs(platform, quick):
        fn = jax.jit(lambda q, kv, i, tiles=tiles: sparse_mla_attention(q, kv, i, SCALE, DC,
                                                                        **tiles))
        try:
            ms = 1e3 * seconds(fn, q, kv, idx, reps=10)
        except Exception as e:  # a tile that does not fit (shared memory / registers / VMEM)
            log("sweep", {**tiles, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        log("sweep", {**tiles, "ms": ms, "tflops": flops(64, 1) / ms / 1e9})
        if best is None or ms < best[0]:
            best = (ms, tiles)
    return best


def decode(log, contexts, tiles):
    for s in contexts:
        q, kv, idx = problem(jax.random.key(3), 64, 1, s, jnp.bfloat16)
        kern = jax.jit(lambda q, kv, i: sparse_mla_attention(q, kv, i, SCALE, DC, **tiles))
        ref = jax.jit(lambda q, kv, i: sparse_mla_attention_ref(q, kv, i, SCALE, DC))

        def dense(q, kv):
            k = jnp.concatenate(kv, -1)[:, :, None]                        # [B, S, 1, 576]
            return jax.nn.dot_product_attention(q, k, k, scale=SCALE, implementation="xla")

        row = {"context": s, "batch": 64, "tiles": tiles,
               "kernel_ms": 1e3 * seconds(kern, q, kv, idx, reps=10),
               "xla_gather_ms": 1e3 * seconds(ref, q, kv, idx, reps=10),
               "dense_ms": 1e3 * seconds(jax.jit(dense), q, kv, reps=5)}
        row["kernel_tflops"] = flops(64, 1) / row["kernel_ms"] / 1e9
        row["dense_over_kernel"] = row["dense_ms"] / row["kernel_ms"]
        log("decode", row)


def prefill(log, t, backward):
    q, kv, idx = problem(jax.random.key(4), 1, t, t, jnp.bfloat16, causal=True)
    valid = float(jnp.mean(jnp.sum(idx >= 0, -1)))
    row = {"length": t, "mean_valid_slots": valid}
    impls = (("kernel", sparse_mla_attention), ("xla_gather", sparse_mla_attention_ref))
    for name, attend in impls:
        fwd = jax.jit(lambda q, kv, i, f=attend: f(q, kv, i, SCALE, DC, chunk_size=256))
        row[f"{name}_fwd_ms"] = 1e3 * seconds(fwd, q, kv, idx, reps=3)
        if backward:
            g = jax.jit(jax.grad(lambda q, c, r, f=attend: jnp.sum(
                f(q, (c, r), idx, SCALE, DC, chunk_size=256)[0].astype(jnp.float32)),
                argnums=(0, 1, 2)))
            row[f"{name}_fwd_bwd_ms"] = 1e3 * seconds(g, q, *kv, reps=2)
    row["kernel_fwd_tflops"] = flops(1, t, valid) / row["kernel_fwd_ms"] / 1e9
    log("prefill", row)


def paged_problem(key, b, s, dtype, heads=64, width=128, page=64):
    """Index queries ``[B, 1, J, D]``, weights, a pool of ``b * s / page`` pages (+ a scratch
    page, as ``PagedDSACache``'s) and each row's pages in a random order."""
    kq, kw, kp, kt = jax.random.split(key, 4)
    pages = b * s // page
    q = jax.random.normal(kq, (b, 1, heads, width), dtype)
    w = jax.random.normal(kw, (b, 1, heads), jnp.float32) * heads ** -0.5
    pool = jax.random.normal(kp, ((pages + 1) * page, width), dtype)
    table = jax.random.permutation(kt, pages).reshape(b, s // page).astype(jnp.int32)
    return q, w, pool, table


def paged_index(log, contexts):
    for dtype in (jnp.float32, jnp.bfloat16):
        q, w, pool, table = paged_problem(jax.random.key(5), 4, 4096, dtype)
        got = jax.jit(lambda *a: paged_index_scores(*a, 64))(q, w, pool, table)
        want = paged_index_scores_ref(q, w, pool, table, 64)
        err, top = float(jnp.max(jnp.abs(got - want))), float(jnp.max(jnp.abs(want)))
        log("paged_index_correctness", {"dtype": jnp.dtype(dtype).name, "max_abs_err": err,
                                        "max_abs": top, "ok": err <= 1e-3 * max(top, 1.0)})
    for s in contexts:
        q, w, pool, table = paged_problem(jax.random.key(6), 64, s, jnp.bfloat16)
        rows = (table[:, :, None] * 64 + jnp.arange(64)).reshape(64, s)
        dense_keys = jax.block_until_ready(pool[rows])                  # a dense-slot cache
        in_order = jnp.arange(table.size, dtype=jnp.int32).reshape(table.shape)
        kernel = jax.jit(lambda *a: paged_index_scores(*a, 64))
        row = {"context": s, "batch": 64,
               "kernel_ms": 1e3 * seconds(kernel, q, w, pool, table, reps=10),
               # the same kernel over each row's pages in pool order: what scattering costs
               "kernel_in_order_ms": 1e3 * seconds(kernel, q, w, pool, in_order, reps=10),
               "xla_gather_ms": 1e3 * seconds(jax.jit(lambda *a: paged_index_scores(
                   *a, 64, impl="xla")), q, w, pool, table, reps=10),
               "dense_slots_ms": 1e3 * seconds(jax.jit(indexer_scores), q, dense_keys, w,
                                               reps=10)}
        row["paged_over_dense"] = row["kernel_ms"] / row["dense_slots_ms"]  # + kernel vs XLA
        row["scattered_over_in_order"] = row["kernel_ms"] / row["kernel_in_order_ms"]
        row["key_gb_per_s"] = pool.dtype.itemsize * 64 * s * 128 / row["kernel_ms"] / 1e6
        log("paged_index", row)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    platform = common.backend()
    if platform == "cpu":
        sys.exit(f"gpu_check.py needs a GPU or TPU; the default JAX backend is "
                 f"{jax.default_backend()}")
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "quick": args.quick,
               "kernel_backend": "triton" if platform == "gpu" else "mosaic", "stages": []}
    out = Path(__file__).parent / "results" / f"sparse_mla_{platform}.json"
    start = time.perf_counter()

    def log(stage, row):
        row = {"stage": stage, "t_s": round(time.perf_counter() - start, 1), **row}
        results["stages"].append(row)
        print(json.dumps(row), flush=True)
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(results, indent=2))   # partial results survive a timeout

    def stage(name, fn, *a):
        try:
            return fn(*a)
        except Exception as e:  # e.g. a kernel the compiler rejects: record it, go on
            log(name, {"error": f"{type(e).__name__}: {str(e)[:500]}"})

    stage("correctness", check_correctness, log)
    best = stage("sweep", sweep, log, platform, args.quick)
    tiles = best[1] if best else tile_configs(platform, True)[0]
    stage("decode", decode, log, [32768] if args.quick else [32768, 131072], tiles)
    stage("prefill", prefill, log, 32768 if not args.quick else 8192, not args.quick)
    stage("paged_index", paged_index, log, [32768] if args.quick else [32768, 131072])
    print(f"wrote {out}")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
