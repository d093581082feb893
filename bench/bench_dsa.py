"""Gated DSA vs dense gated MLA: decode-step time by context length, prefill time by length.

Tiny layer dims (the ``tiny`` preset: D 64, 4 heads, kv_lora 32, rope 8, indexer 4 x 16) with
DeepSeek-V3.2's ``index_topk`` 2048, on whatever device JAX picks (CPU here). Measured side by
side in one run:

* decode: one layer step (T = 1, query at the last position of a full cache of L slots, the
  cache donated so it is written in place), Gated DSA vs the same layer with
  ``index_topk=None``; and its parts: indexer top-k over L keys,
  sparse attention over the K selected keys, dense attention over L keys. The sparse part stays
  flat past K; the indexer grows linearly with L (``dsa.md`` 6).
* prefill: the cache prefill of L tokens (absorbed form), DSA vs dense.
* kernel rows: the Pallas sparse MLA kernel (``kdsa.kernels_pallas.sparse_mla``) beside the XLA
  gather reference in the decode parts (``sparse_pallas``), and the decode step of the layer
  with ``attention_impl="pallas"``. On CPU the kernel runs in interpret mode, so those times
  measure the Pallas interpreter, not the kernel; GPU numbers come from ``bench/gpu_check.py``.

Prints ratios dense / DSA (> 1: DSA faster) and writes bench/results/dsa.json.

``--preset k3-slice`` runs the same at K3's widths (kv_lora 512 + RoPE 64, 8 heads of 128,
8 index heads of 128, top-2048; issue #21): decode at batch 8 and 8K / 64K / 128K, prefill at
4K / 16K, the indexer's share of the DSA step, and a plain float32 matmul's FLOP/s measured in
the same run (``matmul_flops_per_s``); no Pallas rows (the interpreter at these widths only
measures itself). Writes bench/results/dsa_k3-slice.json.

``--prefill-only`` skips the decode rows; ``--without-windows`` also times each prefill with
causal key windows off (``model/query_chunks.py : causal_windows``; the before/after in one
run, rows ``*_no_windows_ms``); ``--without-gather-chunks`` times Gated DSA's prefill with the
sparse gathers in chunks of ``dsa_query_chunk_size`` queries, as before the CPU sized them to
its cache (``model/dsa.py : gather_chunk``; rows ``dsa_no_gather_chunks_ms``);
``--f32-index`` times Gated DSA's decode step and prefill once more with float32 index queries
and keys (``index_dtype``; ``k3-slice`` keeps them in bfloat16 as K3 does; rows
``dsa_f32_index_*``); ``--without-threshold-topk`` also times Gated DSA with the plain top-k
(no sampled threshold, ``model/topk.py``; rows ``dsa_plain_topk_step_ms``,
``indexer_topk_plain_ms``, ``dsa_no_threshold_topk_ms``); ``--lengths`` sets the prefill
lengths, ``--prefill-reps`` the timed calls per prefill (1: compiled ahead, one call timed);
with ``--prefill-only`` the results go to ``dsa_PRESET_prefill.json``.

    .venv/bin/python bench/bench_dsa.py [--quick] [--topk 2048] [--batch 4]
    .venv/bin/python bench/bench_dsa.py --preset k3-slice [--prefill-only --without-windows]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from kdsa.kernels_pallas import common  # noqa: E402
from kdsa.kernels_pallas import sparse_mla_attention as sparse_mla_kernel  # noqa: E402
from kdsa.model import dsa, query_chunks, topk as topk_mod  # noqa: E402
from kdsa.model.config import get_preset  # noqa: E402
from kdsa.model.dsa import dense_attention, indexer_topk, sparse_mla_attention  # noqa: E402
from kdsa.model.dsa_cache import init_dsa_cache  # noqa: E402
from kdsa.model.dsa_layer import GatedDSA  # noqa: E402
from kdsa.model.kda_layer import KDA, init_kda_cache  # noqa: E402
from timing import matmul_flops, seconds, write_results  # noqa: E402  (bench/timing.py)




def decode_seconds(step, state, x, positions, cache, reps: int) -> float:
    """Median time of one decode step, the (donated) cache threaded from step to step."""
    y, cache = step(state, x, positions, cache)
    jax.block_until_ready(y)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        y, cache = step(state, x, positions, cache)
        jax.block_until_ready(y)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prefill_seconds(step, args: tuple, reps: int) -> float:
    """Median time of ``step(*args)`` over ``reps`` calls after a warm-up call; with ``reps ==
    1``, the step is compiled ahead and one call is timed (no warm-up: at 64K a dense MLA
    prefill takes minutes a call)."""
    if reps > 1:
        return seconds(step, *args, reps=reps)
    compiled = step.lower(*args).compile()
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - t0


@contextlib.contextmanager
def switched_off(module, attr: str, on: bool = True):
    """Within (when ``on``): ``module.attr``, a size threshold read at trace time, is out of
    reach, so functions traced here run as before that change (jit traces at the first call)."""
    kept = getattr(module, attr)
    if on:
        setattr(module, attr, 1 << 62)
    try:
        yield
    finally:
        setattr(module, attr, kept)


def layer_fn(cfg, donate: bool):
    """Jitted layer call ``(state, x, positions, cache) -> (y, cache)``; donating the cache lets
    decode write it in place, as a server would."""
    graphdef, state = nnx.split(GatedDSA(cfg, rngs=nnx.Rngs(0)))

    def step(state, x, positions, cache):
        return nnx.merge(graphdef, state)(x, positions=positions, cache=cache)[:2]

    return jax.jit(step, donate_argnums=(3,) if donate else ()), state


def kda_fn(cfg):
    """Jitted KDA layer call ``(state, x, positions, cache) -> (y, cache)`` (positions unused:
    the same signature as :func:`layer_fn`)."""
    graphdef, state = nnx.split(KDA(cfg, rngs=nnx.Rngs(0)))

    def step(state, x, positions, cache):
        return nnx.merge(graphdef, state)(x, cache=cache)[:2]

    return jax.jit(step), state


def projection_flops(state, tokens: int) -> float:
    """``2 x tokens x`` the layer's matrix weights (every kernel with 2+ dims is used once per
    token: projections, the absorbed ``kv_b_proj``, the indexer's, KDA's short convolutions)."""
    return 2.0 * tokens * sum(x.size for x in jax.tree.leaves(state) if x.ndim >= 2)


def attention_flops(cfg, name: str, t: int) -> float:
    """The attention math of a causal prefill of ``t`` tokens, batch 1 (query ``i`` sees ``i + 1``
    keys): the multiply-adds the model needs, not what an implementation happens to execute.

    * dense MLA (absorbed): ``2 N (Dk + Dv)`` per visible (query, key): the logits over the
      latent + RoPE key (``Dk``) and the latent values (``Dv = kv_lora``);
    * Gated DSA: the indexer's ``2 J (Di + 1)`` per visible (query, key), then the same as dense
      over ``min(i + 1, topk)`` keys;
    * KDA: ``6 Dk Dv`` per token and head (the recurrent form's three matrix-vector products:
      ``S^T k``, the rank-1 update, ``S^T q``); the chunked form executes more.
    """
    if name == "kda":
        lac = cfg.linear_attn_config
        return 6.0 * t * lac.num_heads * lac.head_dim * lac.head_dim
    per_key = 2.0 * cfg.num_attention_heads * (cfg.kv_lora_rank + cfg.qk_rope_head_dim
                                               + cfg.kv_lora_rank)
    pairs = t * (t + 1) / 2  # visible (query, key) pairs
    if name == "dense":
        return per_key * pairs
    k = min(cfg.index_topk, t)
    selected = k * (k + 1) / 2 + (t - k) * k  # sum over queries of min(i + 1, k)
    return 2.0 * cfg.index_n_heads * (cfg.index_head_dim + 1) * pairs + per_key * selected


def filled_cache(cfg, b: int, length: int):
    c = init_dsa_cache(cfg, b, length)
    ks = jax.random.split(jax.random.key(1), 3)
    fill = lambda k, a: jax.random.normal(k, a.shape, a.dtype)  # noqa: E731
    return type(c)(kv_latent=fill(ks[0], c.kv_latent), k_rope=fill(ks[1], c.k_rope),
                   index_keys=fill(ks[2], c.index_keys))


def decode_parts(cfg, b: int, length: int, reps: int, pallas: bool = True) -> dict:
    """The three attention-side parts of one decode step, on random inputs."""
    n, dk, v = cfg.num_attention_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    j, di = cfg.index_n_heads, cfg.index_head_dim
    ks = jax.random.split(jax.random.key(2), 5)
    q = jax.random.normal(ks[0], (b, 1, n, dk))
    kv = jax.random.normal(ks[1], (b, length, dk))
    idt = cfg.index_compute_dtype  # the layer's index queries and keys
    iq = jax.random.normal(ks[2], (b, 1, j, di)).astype(idt)
    ik = jax.random.normal(ks[3], (b, length, di)).astype(idt)
    iw = jax.random.normal(ks[4], (b, 1, j))
    vis = dict(q_pos=jnp.full((b, 1), length - 1, jnp.int32),
               kv_pos=jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length)),
               q_seg=jnp.ones((b, 1), jnp.int32), kv_seg=jnp.ones((b, length), jnp.int32),
               chunk_size=1)
    topk = jax.jit(lambda iq, ik, iw: indexer_topk(iq, ik, iw, cfg.index_topk, **vis))
    idx = topk(iq, ik, iw)
    scale = dk ** -0.5
    sparse = jax.jit(lambda q, kv, idx: sparse_mla_attention(q, kv, idx, scale, v, chunk_size=1))
    kernel = jax.jit(lambda q, kv, idx: sparse_mla_kernel(q, kv, idx, scale, v, chunk_size=1))
    dense = jax.jit(lambda q, kv: dense_attention(q, kv[:, :, None], kv[:, :, None, :v], scale,
                                                  **vis))
    out = {"indexer_topk_ms": 1e3 * seconds(topk, iq, ik, iw, reps=reps),
           "sparse_attention_ms": 1e3 * seconds(sparse, q, kv, idx, reps=reps),
           "dense_attention_ms": 1e3 * seconds(dense, q, kv, reps=reps)}
    if pallas:
        out["sparse_pallas_ms"] = 1e3 * seconds(kernel, q, kv, idx, reps=reps)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer lengths and repetitions")
    p.add_argument("--preset", default="tiny", help="layer widths (tiny or k3-slice)")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--batch", type=int, default=None, help="decode batch (4; k3-slice: 8)")
    p.add_argument("--prefill-only", action="store_true", help="skip the decode rows")
    p.add_argument("--without-windows", action="store_true",
                   help="also time each prefill with causal key windows off")
    p.add_argument("--without-gather-chunks", action="store_true",
                   help="also time Gated DSA's prefill with the sparse gathers in chunks of "
                        "dsa_query_chunk_size queries (before the CPU sized them to its cache)")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="prefill lengths (default 4K and 16K for k3-slice)")
    p.add_argument("--without-threshold-topk", action="store_true",
                   help="also time Gated DSA with the plain top-k (no sampled threshold: "
                        "model/topk.py) in the decode step, its parts and prefill")
    p.add_argument("--prefill-reps", type=int, default=None,
                   help="timed calls per prefill (default 2); 1 compiles ahead and times one "
                        "call, without the warm-up call (dense MLA at 64K: ~11 min a call)")
    p.add_argument("--f32-index", action="store_true",
                   help="also time Gated DSA with float32 index queries and keys")
    p.add_argument("--out", default=None, help="results file (default: bench/results/dsa.json, "
                                               "dsa_PRESET.json for another preset, with "
                                               "_prefill before .json for --prefill-only)")
    args = p.parse_args()
    if args.prefill_reps is not None and args.prefill_reps < 1:
        p.error(f"--prefill-reps must be >= 1, got {args.prefill_reps}")
    wide = args.preset != "tiny"
    reps = 5 if args.quick else (10 if wide else 20)
    if wide:
        contexts = [8192, 65536] if args.quick else [8192, 65536, 131072]
        prefills = args.lengths or ([4096] if args.quick else [4096, 16384])
    else:
        contexts = [4096, 16384] if args.quick else [4096, 16384, 65536]
        prefills = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192]
    dsa_cfg = get_preset(args.preset).replace(index_topk=args.topk, dsa_query_chunk_size=256)
    dense_cfg = dsa_cfg.replace(index_n_heads=None, index_head_dim=None, index_topk=None)
    cfgs = {"dsa": dsa_cfg, "dense": dense_cfg}
    if args.f32_index:
        cfgs["dsa_f32_index"] = dsa_cfg.replace(index_dtype="float32")
    if args.without_threshold_topk:
        cfgs["dsa_plain_topk"] = dsa_cfg
    if not wide:
        cfgs["dsa_pallas"] = dsa_cfg.replace(attention_impl="pallas")
    decoders = {name: layer_fn(cfg, donate=True) for name, cfg in cfgs.items()}
    prefillers = {name: layer_fn(cfgs[name], donate=False) for name in ("dsa", "dense")}
    if wide:  # the KDA layer at the same widths (chunked; its state is constant-size)
        prefillers["kda"] = kda_fn(dsa_cfg)
    interpret = common.use_interpret()
    if interpret:
        print("note: the Pallas kernel runs in interpret mode here (CPU): its rows time the "
              "interpreter, not the kernel; GPU numbers: bench/gpu_check.py", flush=True)
    b = args.batch or (8 if wide else 4)
    x = jax.random.normal(jax.random.key(0), (b, 1, dsa_cfg.hidden_size))

    decode = []
    for length in [] if args.prefill_only else contexts:
        row = {"context": length}
        pos = jnp.full((b, 1), length - 1, jnp.int32)
        for name, (step, state) in decoders.items():
            cache = filled_cache(cfgs[name], b, length)
            with switched_off(topk_mod, "TOPK_SAMPLE_FROM", name == "dsa_plain_topk"):
                row[f"{name}_step_ms"] = 1e3 * decode_seconds(step, state, x, pos, cache,
                                                              reps=reps)
        row.update(decode_parts(dsa_cfg, b, length, reps, pallas=not wide))
        if args.without_threshold_topk:
            with switched_off(topk_mod, "TOPK_SAMPLE_FROM"):
                plain = decode_parts(dsa_cfg, b, length, reps, pallas=False)
            row["indexer_topk_plain_ms"] = plain["indexer_topk_ms"]
        row["step_ratio_dense_over_dsa"] = row["dense_step_ms"] / row["dsa_step_ms"]
        row["indexer_share_of_dsa_step"] = row["indexer_topk_ms"] / row["dsa_step_ms"]
        row["attention_ratio_dense_over_sparse"] = (row["dense_attention_ms"]
                                                    / row["sparse_attention_ms"])
        decode.append(row)
        print(f"decode L={length:>6}: step dsa {row['dsa_step_ms']:8.3f} ms, dense "
              f"{row['dense_step_ms']:8.3f} ms, dense/dsa {row['step_ratio_dense_over_dsa']:5.2f}x"
              f" | parts: indexer {row['indexer_topk_ms']:7.3f} ms, sparse attn "
              f"{row['sparse_attention_ms']:7.3f} ms, dense attn {row['dense_attention_ms']:7.3f}"
              f" ms (indexer {100 * row['indexer_share_of_dsa_step']:.0f}% of the step)"
              + ("" if wide else f" | pallas: step {row['dsa_pallas_step_ms']:8.3f} ms, sparse "
                 f"attn {row['sparse_pallas_ms']:7.3f} ms")
              + (f" | f32 index: step {row['dsa_f32_index_step_ms']:8.3f} ms" if args.f32_index
                 else "")
              + (f" | plain top-k: step {row['dsa_plain_topk_step_ms']:8.3f} ms, indexer "
                 f"{row['indexer_topk_plain_ms']:7.3f} ms" if args.without_threshold_topk
                 else ""), flush=True)

    prefill = []
    prefill_reps = args.prefill_reps or max(2, reps // 5)
    for length in prefills:
        row = {"length": length}
        xs = jax.random.normal(jax.random.key(3), (1, length, dsa_cfg.hidden_size))
        pos = jnp.arange(length, dtype=jnp.int32)[None]
        for name, (step, state) in prefillers.items():
            cache = (init_kda_cache(dsa_cfg, 1) if name == "kda"
                     else init_dsa_cache(cfgs[name], 1, length))
            row[f"{name}_ms"] = 1e3 * prefill_seconds(step, (state, xs, pos, cache), prefill_reps)
            switches = ([("windows", query_chunks, "CAUSAL_WINDOWS_FROM")]
                        if args.without_windows and name != "kda" else [])
            if args.without_gather_chunks and name == "dsa":
                switches.append(("gather_chunks", dsa, "CPU_GATHER_BYTES"))
            if args.without_threshold_topk and name == "dsa":
                switches.append(("threshold_topk", topk_mod, "TOPK_SAMPLE_FROM"))
            if args.f32_index and name == "dsa":
                f32, f32_state = layer_fn(cfgs["dsa_f32_index"], donate=False)
                row["dsa_f32_index_ms"] = 1e3 * prefill_seconds(
                    f32, (f32_state, xs, pos, init_dsa_cache(cfgs["dsa_f32_index"], 1, length)),
                    prefill_reps)
            for label, module, attr in switches:  # a fresh jit: both chosen at trace time
                with switched_off(module, attr):
                    off, off_state = layer_fn(cfgs[name], donate=False)
                    row[f"{name}_no_{label}_ms"] = 1e3 * prefill_seconds(
                        off, (off_state, xs, pos, cache), prefill_reps)
            if wide:  # the model's FLOPs; XLA's count (it counts a loop body once)
                row[f"{name}_model_flops"] = (projection_flops(state, length) + attention_flops(
                    dsa_cfg, name, length))
                cost = step.lower(state, xs, pos, cache).compile().cost_analysis()
                cost = cost[0] if isinstance(cost, (list, tuple)) else cost
                row[f"{name}_executed_flops"] = float(cost.get("flops", 0.0))
        row["ratio_dense_over_dsa"] = row["dense_ms"] / row["dsa_ms"]
        if "kda_ms" in row:
            row["ratio_dense_over_kda"] = row["dense_ms"] / row["kda_ms"]
            row["kda_tokens_per_s"] = length / (row["kda_ms"] / 1e3)
        row["dsa_tokens_per_s"] = length / (row["dsa_ms"] / 1e3)
        row["dense_tokens_per_s"] = length / (row["dense_ms"] / 1e3)
        prefill.append(row)
        print(f"prefill T={length:>5}: dsa {row['dsa_ms']:9.2f} ms, dense "
              f"{row['dense_ms']:9.2f} ms, dense/dsa {row['ratio_dense_over_dsa']:5.2f}x"
              + (f", kda {row['kda_ms']:9.2f} ms, dense/kda {row['ratio_dense_over_kda']:5.2f}x"
                 if "kda_ms" in row else "")
              + (f" | windows off: dsa {row['dsa_no_windows_ms']:9.2f} ms, dense "
                 f"{row['dense_no_windows_ms']:9.2f} ms" if args.without_windows else "")
              + (f" | plain top-k: dsa {row['dsa_no_threshold_topk_ms']:9.2f} ms"
                 if args.without_threshold_topk else "")
              + (f" | gathers in chunks of {dsa_cfg.dsa_query_chunk_size}: dsa "
                 f"{row['dsa_no_gather_chunks_ms']:9.2f} ms" if args.without_gather_chunks
                 else "")
              + (f" | f32 index: dsa {row['dsa_f32_index_ms']:9.2f} ms" if args.f32_index
                 else ""),
              flush=True)

    growth = None
    if decode:
        first, last = decode[0], decode[-1]
        growth = {part: last[part] / first[part]
                  for part in ("indexer_topk_ms", "sparse_attention_ms", "dense_attention_ms",
                               "dsa_step_ms", "dense_step_ms")}
        print(f"growth {first['context']} -> {last['context']} "
              f"({last['context'] // first['context']}x context): "
              + ", ".join(f"{k[:-3]} {v:.2f}x" for k, v in growth.items()))
    c = dsa_cfg
    result = {"device": str(jax.devices()[0]), "quick": args.quick, "batch": b,
              "pallas_interpret": interpret, "index_topk": args.topk,
              "config": f"{args.preset} (D {c.hidden_size}, N {c.num_attention_heads}, kv_lora "
                        f"{c.kv_lora_rank}, rope {c.qk_rope_head_dim}, J {c.index_n_heads}, Di "
                        f"{c.index_head_dim})",
              "prefill_reps": prefill_reps,
              "decode": decode, "prefill": prefill, "decode_growth_first_to_last": growth}
    if wide:
        rate = result["matmul_flops_per_s"] = matmul_flops(2048, reps=10)
        print(f"plain f32 matmul: {rate / 1e9:.1f} GFLOP/s; model FLOP/s of each prefill as a "
              "fraction of it (XLA's executed count, loop bodies once, in brackets):")
        for row in prefill:
            for name in ("dsa", "dense", "kda"):
                sec = row[f"{name}_ms"] / 1e3
                row[f"{name}_model_flops_fraction"] = row[f"{name}_model_flops"] / sec / rate
                row[f"{name}_executed_flops_fraction"] = row[f"{name}_executed_flops"] / sec / rate
            print(f"  T={row['length']:>5}: " + ", ".join(
                f"{n} {row[f'{n}_model_flops_fraction']:.2f} "
                f"({row[f'{n}_executed_flops_fraction']:.2f})" for n in ("dsa", "dense", "kda")))
    suffix = "_prefill" if args.prefill_only else ""
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / (
        f"dsa{suffix}.json" if not wide else f"dsa_{args.preset}{suffix}.json")
    write_results(out, result)


if __name__ == "__main__":
    main()
