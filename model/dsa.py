"""DeepSeek Sparse Attention maths: lightning indexer, top-k selection, attention, indexer losses.

Pure functions, arrays in and arrays out (``dsa.md`` sections 1-3; DeepSeek-V3.2-Exp paper
eq. 1-2 and section 2.1). Letters: B batch, T queries, S keys, N attention heads, J indexer heads,
D head dim, K selected keys (top-k), C query chunk.

Visibility. A key ``s`` is visible to query ``t`` iff ``kv_pos[s] <= q_pos[t]`` and
``kv_seg[s] == q_seg[t]`` (``model/query_chunks.py``). The layer passes token order and segment
ids in training, cache slot numbers and positions in decode.

Memory. Everything that scores queries against keys runs over query chunks of ``chunk_size``
(``query_chunks.map_query_chunks``: ``lax.map`` of a ``jax.checkpoint``-ed body), so at most
``[B, C, N, S]`` (dense) or ``[B, C, K, D]`` (sparse gather) exists at once, in the backward
pass too.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from kdsa.model.partitioning import compile_platform, current as current_sharding
from kdsa.model.query_chunks import check_visibility, map_query_chunks, visible_mask
from kdsa.model.topk import select_topk

f32 = jnp.float32


# ---------------------------------------------------------------------------------------------
# lightning indexer and top-k
# ---------------------------------------------------------------------------------------------

def indexer_scores(q: jax.Array, k: jax.Array, weights: jax.Array) -> jax.Array:
    """Index scores ``I[b,t,s] = sum_j w[b,t,j] * relu(q[b,t,j] . k[b,s])`` in float32.

    q ``[B, T, J, D]`` (RoPE'd index queries), k ``[B, S, D]`` (one key per token shared by all
    index heads), weights ``[B, T, J]`` (``weights_proj(x) * J**-0.5 * D**-0.5``). Paper eq. 1;
    DeepSeek's ``fp8_index`` without FP8. Unmasked: callers add the visibility mask. q and k
    multiply in their own dtype (``index_dtype``), accumulating in float32.
    """
    if q.ndim != 4 or k.ndim != 3 or weights.shape != q.shape[:3] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"indexer_scores wants q [B,T,J,D], k [B,S,D], weights [B,T,J]; got "
                         f"{q.shape}, {k.shape}, {weights.shape}")
    dt = jnp.promote_types(q.dtype, k.dtype)  # bfloat16 keys: a bfloat16 product into float32
    q, k, weights = q.astype(dt), k.astype(dt), weights.astype(f32)
    # A decode step (one query) on XLA:CPU: many heads (K3: 64 x 128) or narrow keys (tiny's 16)
    # score keys-major, wide keys with few heads (k3-slice: 8 x 128) query-major, 1.5x faster
    # there (docs/performance.md; docs/serving.md has the narrow keys).
    if q.shape[1] == 1 and (q.shape[2] >= 32 or q.shape[3] < 64):
        logits = jnp.einsum("bsd,btjd->bstj", k, q, preferred_element_type=f32)
        if q.shape[2] >= 32:  # relu and the weights in one pass, 2.1x
            return jnp.moveaxis((jax.nn.relu(logits) * weights[:, None]).sum(-1), 1, 2)
        return jnp.einsum("bstj,btj->bts", jax.nn.relu(logits), weights)
    logits = jnp.einsum("btjd,bsd->btjs", q, k, preferred_element_type=f32)
    return jnp.einsum("btj,btjs->bts", weights, jax.nn.relu(logits))


def indexer_topk(q: jax.Array, k: jax.Array, weights: jax.Array, topk: int, *, q_pos, kv_pos,
                 q_seg, kv_seg, chunk_size: int, key_rows: jax.Array | None = None,
                 windows: int = 1, key_slack: int = 0,
                 decode_scores: Callable | None = None) -> jax.Array:
    """Chunked :func:`indexer_scores` + :func:`select_topk`: indices ``[B, T, min(topk, S)]``.

    ``k`` is ``[B, S, D]``; or, with ``key_rows [B, S]`` int32, a pool ``[R, D]`` (a paged cache,
    ``model/paged_cache.py``) whose row ``key_rows[b, s]`` is key ``s`` of batch row ``b``. A
    decode step (one query per row) whose rows reach over half the pool scores the whole pool
    and gathers the scores (one float per key instead of a ``D``-wide row: measured 1.6-2.7x
    faster at 128K keys); otherwise the key rows are gathered once for all query chunks. Same
    products either way.

    Never holds more than ``[B, C, J, max(S, R)]`` scores. Indices are not differentiable.
    ``windows`` / ``key_slack``: causal key windows (:func:`map_query_chunks`; the same indices).
    ``decode_scores(q, weights)``: a decode step's (one query per row) scores ``[B, 1, S]``
    computed elsewhere, the same sum (a paged cache's Pallas kernel reads the keys through the
    block table: ``model/paged_attention.py``).
    """
    b, t, s = q.shape[0], q.shape[1], (k if key_rows is None else key_rows).shape[1]
    check_visibility(b, t, s, q_pos, kv_pos, q_seg, kv_seg)
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if decode_scores is not None and t == 1:
        mask = visible_mask(q_pos, kv_pos, q_seg, kv_seg)
        return jax.lax.stop_gradient(select_topk(decode_scores(q, weights), mask, topk))
    if key_rows is not None and t == 1 and k.shape[0] <= 2 * s:
        def chunk(qc, wc, pc, sc):  # [1, B*C] queries against the pool, then each row's keys
            _, c, j, d = qc.shape
            pooled = indexer_scores(qc.reshape(1, b * c, j, d), k[None], wc.reshape(1, b * c, j))
            scores = jnp.take_along_axis(pooled.reshape(b, c, -1), key_rows[:, None, :], axis=2)
            return select_topk(scores, visible_mask(pc, kv_pos, sc, kv_seg), topk)

        return jax.lax.stop_gradient(map_query_chunks(chunk, chunk_size,
                                                      (q, weights, q_pos, q_seg)))
    keys = k if key_rows is None else k[key_rows]  # [B, S, D]: rows gathered once

    def chunk(qc, wc, pc, sc, keys_w, pos_w, seg_w):  # key side: the first W of S keys
        return select_topk(indexer_scores(qc, keys_w, wc), visible_mask(pc, pos_w, sc, seg_w),
                           topk)

    def pad(idx, num_keys):  # a window narrower than topk: its -1 columns past the window
        width = min(topk, num_keys)
        return jnp.pad(idx, [(0, 0), (0, 0), (0, width - idx.shape[2])], constant_values=-1)

    idx = map_query_chunks(chunk, chunk_size, (q, weights, q_pos, q_seg), (keys, kv_pos, kv_seg),
                           windows=windows, key_slack=key_slack, pad_keys=pad)
    return jax.lax.stop_gradient(idx)


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------

def _softmax_attend(logits: jax.Array, values: Callable[[jax.Array], jax.Array]):
    """Masked softmax over the last axis of ``logits`` (-inf = masked), then ``values(p)``.

    Returns ``(values(p) / l, lse)``: a row with nothing visible gives output 0 and lse -inf, and
    finite gradients (the max is a stop-gradient shift; no ``log 0`` or ``0/0`` is evaluated).
    """
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)  # masked entries give exp(-inf) = 0
    l = jnp.sum(p, axis=-1)
    live = l > 0
    l_safe = jnp.where(live, l, 1.0)
    out = values(p) / l_safe[..., None]
    lse = jnp.where(live, m[..., 0] + jnp.log(l_safe), -jnp.inf)
    return out, lse


def _key_parts(kv, b: int, dk: int, what: str = "kv") -> tuple[jax.Array, ...]:
    """``kv`` as a tuple of ``[B, S, D_i]`` parts with ``sum D_i = Dk`` (checked)."""
    parts = tuple(kv) if isinstance(kv, (tuple, list)) else (kv,)
    shapes = [p.shape for p in parts]
    if (any(len(sh) != 3 or sh[:2] != shapes[0][:2] for sh in shapes) or shapes[0][0] != b
            or sum(sh[2] for sh in shapes) != dk):
        raise ValueError(f"{what} must be [B, S, Dk] = [{b}, S, {dk}] (or parts whose last dims "
                         f"add up to Dk), got {shapes}")
    return parts


def _gather_part_rows(parts: tuple[jax.Array, ...], idx: jax.Array) -> list[jax.Array]:
    """Rows ``[B, C, K, D_i]`` (float32) of each key part at ``idx [B, C, K]``, kept apart (a
    concatenation would copy them all once more); an index outside ``[0, S)`` gives a row of
    zeros (not another token's row: a non-finite value there would reach the output through
    its zero weight, 0 x NaN)."""
    b, c, k = idx.shape
    flat = idx.reshape(b, c * k, 1)
    return [jnp.take_along_axis(p, flat, axis=1, mode="fill", fill_value=0).astype(f32)
            .reshape(b, c, k, -1) for p in parts]


def _gather_rows(parts: tuple[jax.Array, ...], idx: jax.Array) -> jax.Array:
    """Rows ``[B, C, K, Dk]`` (float32) of the key parts at ``idx [B, C, K]`` (valid indices)."""
    return jnp.concatenate(_gather_part_rows(parts, idx), axis=-1)


# A CPU gathers rows fastest while a chunk's gathered rows stay in its last-level cache (32 MiB
# here): at K3's widths (top-2048 rows of 576 float32, 4.7 MB a query) chunks of one query ran
# the sparse attention 1.9x faster than chunks of 256 (16K keys), its gradient 2.8x
# (docs/performance.md). An accelerator keeps the caller's chunk.
CPU_GATHER_BYTES = 6 << 20


def gather_chunk(chunk_size: int, rows: int, row_floats: int) -> int:
    """Queries per chunk of a gather-based function that gathers ``rows`` rows (``B x K``) of
    ``row_floats`` per query: ``chunk_size``; on CPU at most that, the largest power of two
    whose float32 rows fit :data:`CPU_GATHER_BYTES` (1 when even one query's rows do not)."""
    if compile_platform() != "cpu":
        return chunk_size
    fits = max(1, CPU_GATHER_BYTES // (4 * rows * row_floats))
    return max(1, min(chunk_size, 1 << (fits.bit_length() - 1)))


def sparse_mla_attention(q: jax.Array, kv: jax.Array, indices: jax.Array, sm_scale: float,
                         v_dim: int, *, chunk_size: int = 256) -> tuple[jax.Array, jax.Array]:
    """Gather-based sparse MLA attention (absorbed / MQA form), the reference for the kernel.

    q ``[B, T, N, Dk]`` absorbed queries (``q_nope @ W_UK`` then ``q_pe``), kv ``[B, S, Dk]``
    (latent then RoPE key; ``kv[..., :v_dim]`` are the values), indices ``[B, T, K]`` int32 with -1
    (or any value outside ``[0, S)``) for unused slots. Returns out ``[B, T, N, v_dim]`` float32 and
    lse ``[B, T, N]`` (natural log; -inf and out 0 for a row with no valid index).

    kv may also be a tuple of parts ``([B, S, Dc], [B, S, Dr])`` that concatenate to ``Dk`` (the
    layer's cache keeps latent and RoPE key apart): each part is gathered separately, so the
    whole cache is never copied into one array per decode step.

    ``out[t,n] = sum_k softmax_k(sm_scale * q[t,n] . kv[idx[t,k]]) kv[idx[t,k], :v_dim]``: each
    slot counts, so a duplicated index counts twice (FlashMLA ``flash_mla_sparse_fwd`` semantics;
    a kernel must match). Cost O(T K Dk N); per query chunk (:func:`gather_chunk`) ``[B, C, K,
    Dk]`` rows are gathered with ``take_along_axis``; no ``[T, S]`` array exists. On one CPU
    device, when one query position's rows of all B rows outgrow the cache budget, the rows are
    joined first (B x T queries of one row over B x S keys), so a chunk gathers ``[1, C, K,
    Dk]``. Gradients by autodiff (gather -> scatter-add into kv). Measured against the
    dense-mask reference (``kdsa.kernels_pallas.sparse_mla.ref.dense_masked_mla_attention``;
    f32, CPU, B 2, T 64, N 8, S 128, Dk 40, K 16, chunk 16): max abs error out 4.8e-7, lse
    2.4e-7, dq 5.8e-7, dkv 1.2e-6 (|dkv| up to 6.9).
    """
    b, t, n, dk = q.shape
    parts = _key_parts(kv, b, dk)
    if indices.ndim != 3 or indices.shape[:2] != (b, t):
        raise ValueError(f"indices must be [B, T, K] = [{b}, {t}, K], got {indices.shape}")
    if not 0 < v_dim <= dk:
        raise ValueError(f"v_dim={v_dim} must be in (0, Dk={dk}]")
    s = parts[0].shape[1]

    widths = [p.shape[2] for p in parts]
    splits = [sum(widths[:i + 1]) for i in range(len(widths) - 1)]

    def chunk(qc, ic):  # qc [B, C, N, Dk], ic [B, C, K]
        valid = (ic >= 0) & (ic < s)
        rows = _gather_part_rows(parts, jnp.where(valid, ic, s))  # [B, C, K, D_i]; unused: 0
        qs = jnp.split(qc.astype(f32), splits, axis=-1)
        logits = sum(jnp.einsum("bcnd,bckd->bcnk", qp, r) for qp, r in zip(qs, rows))
        logits = jnp.where(valid[:, :, None, :], logits * sm_scale, -jnp.inf)
        # values: the first part when it holds them (the latent), sliced after the product (a
        # slice of the gathered rows before it cost 7x the product on XLA:CPU)
        values = rows[0] if widths[0] >= v_dim else jnp.concatenate(rows, axis=-1)
        return _softmax_attend(
            logits, lambda p: jnp.einsum("bcnk,bckd->bcnd", p, values)[..., :v_dim])

    if b > 1 and _rows_outgrow_cpu_cache(b * indices.shape[2], dk):
        # the rows' queries become one row's, so that the chunks cover the batch too (decode,
        # batch 8, 64K keys at K3's widths: 18.7 -> 8.8 ms); indices offset to the joined keys
        valid = (indices >= 0) & (indices < s)
        joined = jnp.where(valid, indices + s * jnp.arange(b, dtype=indices.dtype)[:, None, None],
                           -1).reshape(1, b * t, -1)
        out, lse = sparse_mla_attention(
            q.reshape(1, b * t, n, dk), tuple(p.reshape(1, b * s, -1) for p in parts), joined,
            sm_scale, v_dim, chunk_size=chunk_size)
        return out.reshape(b, t, n, v_dim), lse.reshape(b, t, n)
    chunk_size = gather_chunk(chunk_size, b * indices.shape[2], dk)
    return map_query_chunks(chunk, chunk_size, (q, indices))


def _rows_outgrow_cpu_cache(rows: int, row_floats: int) -> bool:
    """On one CPU device (no mesh): whether one query position's rows of every batch row
    (``rows = B x K``) outgrow :data:`CPU_GATHER_BYTES`."""
    return (4 * rows * row_floats > CPU_GATHER_BYTES and compile_platform() == "cpu"
            and current_sharding() is None)


def _gqa_logits(q: jax.Array, k: tuple[jax.Array, ...]) -> jax.Array:
    """``[B, T, N, S]`` logits of q ``[B, T, N, D]`` against key parts ``[B, S, G, D_i]``
    (``sum D_i = D``, N % G == 0): one einsum per part, summed."""
    b, t, n, _ = q.shape
    g = k[0].shape[2]
    out, start = 0.0, 0
    for part in k:
        d = part.shape[-1]
        qg = q[..., start:start + d].astype(f32).reshape(b, t, g, n // g, d)
        out = out + jnp.einsum("btgrd,bsgd->btgrs", qg, part.astype(f32))
        start += d
    return out.reshape(b, t, n, -1)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, sm_scale: float, *, q_pos, kv_pos,
                    q_seg, kv_seg, chunk_size: int, windows: int = 1,
                    key_slack: int = 0) -> tuple[jax.Array, jax.Array]:
    """Chunked dense attention over visible keys; out ``[B, T, N, Dv]`` f32, lse ``[B, T, N]``.

    q ``[B, T, N, D]``, k ``[B, S, G, D]``, v ``[B, S, G, Dv]`` with ``N % G == 0`` (each group of
    N/G query heads reads one key/value head): G = N is MLA's MHA (training) form, G = 1 its
    absorbed MQA (decode) form with ``k = kv`` and ``v = kv[..., :v_dim]``. k may be a tuple of
    parts ``[B, S, G, D_i]`` that concatenate to D (latent and RoPE key kept apart).
    ``windows`` / ``key_slack``: causal key windows (:func:`map_query_chunks`).
    """
    b, t, n, _ = q.shape
    k = tuple(k) if isinstance(k, (tuple, list)) else (k,)
    s, g = k[0].shape[1], k[0].shape[2]
    shapes = [p.shape for p in k]
    if (any(sh[:3] != shapes[0][:3] for sh in shapes) or shapes[0][0] != b
            or sum(sh[-1] for sh in shapes) != q.shape[-1] or v.shape[:3] != shapes[0][:3]
            or n % g):
        raise ValueError(f"dense_attention wants q [B,T,N,D], k [B,S,G,D] (or parts whose last "
                         f"dims add up to D), v [B,S,G,Dv] with N % G == 0; got {q.shape}, "
                         f"{shapes}, {v.shape}")
    check_visibility(b, t, s, q_pos, kv_pos, q_seg, kv_seg)
    if t == 1:
        return _dense_decode(q, k, v, sm_scale, visible_mask(q_pos, kv_pos, q_seg, kv_seg))

    def chunk(qc, pc, sc, pos_w, seg_w, v_w, *k_w):  # key side: the first W of S keys
        vis = visible_mask(pc, pos_w, sc, seg_w)  # [B, C, W]
        logits = jnp.where(vis[:, :, None, :], _gqa_logits(qc, k_w) * sm_scale, -jnp.inf)
        c, w = qc.shape[1], pos_w.shape[1]

        def values(p):  # p [B, C, N, W] -> [B, C, N, Dv]
            pg = p.reshape(b, c, g, n // g, w)
            return jnp.einsum("bcgrs,bsgd->bcgrd", pg, v_w.astype(f32)).reshape(b, c, n, -1)

        return _softmax_attend(logits, values)

    return map_query_chunks(chunk, chunk_size, (q, q_pos, q_seg), (kv_pos, kv_seg, v) + k,
                            windows=windows, key_slack=key_slack)


def _dense_decode(q, k: tuple[jax.Array, ...], v, sm_scale: float, visible):
    """:func:`dense_attention` of one query per row, keys-major: the logits are ``[B, S, G, R]``
    (``R = N / G``) and the softmax runs over S in place. The query-major chunked form measured
    3.6x slower for MLA's absorbed decode on XLA:CPU (8 x 32K keys of 576, 8 heads: 257 ms
    against 71; ``docs/performance.md``). Same maths as the chunked path; ``visible [B, 1, S]``.
    """
    b, _, n, _ = q.shape
    g = k[0].shape[2]
    # with one key head (MLA's absorbed form) the head axis is dropped from the keys: as a
    # dot batch dimension between S and D it made XLA transpose the whole cache first
    keys = lambda a: a[:, :, 0] if g == 1 else a  # noqa: E731
    spec = "bsd,brd->bsr" if g == 1 else "bsgd,bgrd->bsgr"
    logits, start = 0.0, 0
    for part in k:
        d = part.shape[-1]
        qg = q[:, 0, :, start:start + d].astype(f32).reshape(b, g, n // g, d)
        logits = logits + jnp.einsum(spec, keys(part).astype(f32), qg[:, 0] if g == 1 else qg)
        start += d
    if g == 1:
        logits = logits[:, :, None]  # [B, S, 1, R]
    logits = jnp.where(visible[:, 0, :, None, None], logits * sm_scale, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(logits, axis=1, keepdims=True))  # [B, 1, G, R]
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)  # [B, S, G, R]; masked keys give 0
    l = jnp.sum(p, axis=1)  # [B, G, R]
    live = l > 0
    l_safe = jnp.where(live, l, 1.0)
    if g == 1:
        out = jnp.einsum("bsr,bsd->brd", p[:, :, 0], keys(v).astype(f32))[:, None]
    else:
        out = jnp.einsum("bsgr,bsgd->bgrd", p, v.astype(f32))
    out = out / l_safe[..., None]
    lse = jnp.where(live, m[:, 0] + jnp.log(l_safe), -jnp.inf)
    return out.reshape(b, 1, n, -1), lse.reshape(b, 1, n)


# ---------------------------------------------------------------------------------------------
# indexer KL losses (DeepSeek-V3.2 section 2.1)
# ---------------------------------------------------------------------------------------------

def kl_from_logits(attn_logits: jax.Array, index_logits: jax.Array) -> jax.Array:
    """Per-query ``KL(p || softmax(I))`` over the last axis, -inf marking excluded keys.

    attn_logits ``[B, T, N, S]`` (scaled, masked), index_logits ``[B, T, S]`` (masked alike).
    ``p = sum_n softmax(attn_logits[n]) / N`` is the head-summed, L1-normalised main attention
    distribution, held under ``stop_gradient``; the gradient reaches only ``index_logits``.
    A query with no keys gives 0. Returns ``[B, T]`` float32.
    """
    p = jax.nn.softmax(jnp.where(jnp.isfinite(attn_logits), attn_logits, -1e30), axis=-1)
    p = jnp.where(jnp.isfinite(attn_logits), p, 0.0)
    total = jnp.sum(p, axis=(-2, -1))[..., None]  # [B, T, 1]
    p = jax.lax.stop_gradient(jnp.sum(p, axis=-2) / jnp.where(total > 0, total, 1.0))
    live = jnp.isfinite(index_logits)
    log_q = jax.nn.log_softmax(jnp.where(live, index_logits, -1e30), axis=-1)
    terms = jnp.where(p > 0, p * (jnp.log(jnp.where(p > 0, p, 1.0)) - log_q), 0.0)
    return jnp.sum(terms, axis=-1)


def indexer_kl_dense(q: jax.Array, k: jax.Array, sm_scale: float, index_q: jax.Array,
                     index_k: jax.Array, index_w: jax.Array, *, q_pos, kv_pos, q_seg, kv_seg,
                     chunk_size: int) -> jax.Array:
    """Dense warm-up loss per query ``[B, T]``: ``KL(p_t || softmax(I_t))`` over visible keys.

    q ``[B, T, N, D]`` / k ``[B, S, G, D]`` are the main attention's queries and keys (as in
    :func:`dense_attention`); index_q ``[B, T, J, Di]``, index_k ``[B, S, Di]``, index_w
    ``[B, T, J]`` the indexer's. Chunked: ``[B, C, N, S]`` at a time.
    """
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    check_visibility(b, t, s, q_pos, kv_pos, q_seg, kv_seg)
    k = (k,)

    def chunk(qc, iqc, iwc, pc, sc):
        vis = visible_mask(pc, kv_pos, sc, kv_seg)
        attn = jnp.where(vis[:, :, None, :], _gqa_logits(qc, k) * sm_scale, -jnp.inf)
        index = jnp.where(vis, indexer_scores(iqc, index_k, iwc), -jnp.inf)
        return kl_from_logits(attn, index)

    return map_query_chunks(chunk, chunk_size, (q, index_q, index_w, q_pos, q_seg))


def indexer_kl_sparse(q: jax.Array, kv: jax.Array, indices: jax.Array, sm_scale: float,
                      index_q: jax.Array, index_k: jax.Array, index_w: jax.Array, *,
                      chunk_size: int) -> jax.Array:
    """Sparse-stage loss per query ``[B, T]``: the KL restricted to the selected set ``S_t``.

    q ``[B, T, N, Dk]`` / kv ``[B, S, Dk]`` (or its parts) as in :func:`sparse_mla_attention`;
    each head's softmax is renormalised within ``S_t`` (Megatron ``compute_dsa_indexer_loss``,
    sparse mode), and ``softmax(I)`` is taken over ``S_t`` too. Index keys are gathered with the
    same indices.
    """
    b, _, _, dk = q.shape
    parts = _key_parts(kv, b, dk)
    s = parts[0].shape[1]

    def chunk(qc, ic, iqc, iwc):
        valid = (ic >= 0) & (ic < s)
        safe = jnp.where(valid, ic, s)  # unused slots: rows of zeros (_gather_part_rows)
        rows, ik = _gather_rows(parts, safe), _gather_rows((index_k,), safe)  # [B, C, K, *]
        attn = jnp.einsum("bcnd,bckd->bcnk", qc.astype(f32), rows) * sm_scale
        attn = jnp.where(valid[:, :, None, :], attn, -jnp.inf)
        dots = jnp.einsum("bcjd,bckd->bcjk", iqc.astype(f32), ik)
        index = jnp.einsum("bcj,bcjk->bck", iwc.astype(f32), jax.nn.relu(dots))
        return kl_from_logits(attn, jnp.where(valid, index, -jnp.inf))

    chunk_size = gather_chunk(chunk_size, b * indices.shape[2], dk + index_k.shape[-1])
    return map_query_chunks(chunk, chunk_size, (q, indices, index_q, index_w))
