"""Reference for the paged lightning-indexer scores, straight from the equations.

The DSA indexer scores key ``s`` of a query (DeepSeek-V3.2-Exp, eq. 1) as
``I[b, t, s] = sum_j w[b, t, j] * relu(q[b, t, j] . k[b, s])``. In a paged cache
(``model/paged_cache.py``) key ``s`` of batch row ``b`` lives at pool row
``block_table[b, s // page] * page + s % page``; a page id of -1 backs no key, and its
positions score 0 here (callers mask them as invisible anyway).

This reference gathers every row's keys into a contiguous ``[B, W * page, D]`` copy (the copy
the kernel exists to avoid) and scores it with two einsums; ``model/dsa.py : indexer_scores``
is the model's own formulation of the same sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_inputs(q, weights, pool, block_table, page_size: int) -> None:
    """ValueError naming the first shape that does not fit ``paged_index_scores``'s contract."""
    if q.ndim != 4:
        raise ValueError(f"paged_index_scores: q must be [B, T, J, D], got {q.shape}")
    b, t, j, d = q.shape
    if weights.shape != (b, t, j):
        raise ValueError(f"paged_index_scores: weights must be [B, T, J] = {(b, t, j)}, "
                         f"got {weights.shape}")
    if pool.ndim != 2 or pool.shape[1] != d:
        raise ValueError(f"paged_index_scores: pool must be [R, D] with D = {d}, got {pool.shape}")
    if block_table.ndim != 2 or block_table.shape[0] != b:
        raise ValueError(f"paged_index_scores: block_table must be [B, W] with B = {b}, got "
                         f"{block_table.shape}")
    if page_size < 1 or pool.shape[0] < page_size:
        raise ValueError(f"paged_index_scores: page_size must be in [1, R = {pool.shape[0]}], "
                         f"got {page_size}")


def paged_index_scores_ref(q: jax.Array, weights: jax.Array, pool: jax.Array,
                           block_table: jax.Array, page_size: int) -> jax.Array:
    """Scores ``[B, T, W * page_size]`` float32 of queries ``q [B, T, J, D]`` (weights
    ``[B, T, J]``) against the keys of each row's pages: pool ``[R, D]``, block table ``[B, W]``
    int32 (-1: no page, scores 0)."""
    check_inputs(q, weights, pool, block_table, page_size)
    b, w = block_table.shape
    rows = block_table[:, :, None] * page_size + jnp.arange(page_size, dtype=jnp.int32)
    backed = jnp.broadcast_to(block_table[:, :, None] >= 0, rows.shape).reshape(b, w * page_size)
    keys = pool[jnp.maximum(rows, 0).reshape(b, w * page_size)]               # [B, S, D]: a copy
    dt = jnp.promote_types(q.dtype, pool.dtype)  # bfloat16 products accumulate in float32
    logits = jnp.einsum("btjd,bsd->btjs", q.astype(dt), keys.astype(dt),
                        preferred_element_type=jnp.float32,
                        precision=jax.lax.Precision.HIGHEST)                  # [B, T, J, S]
    scores = jnp.einsum("btj,btjs->bts", weights.astype(jnp.float32),
                        jax.nn.relu(logits), precision=jax.lax.Precision.HIGHEST)
    return jnp.where(backed[:, None], scores, 0.0)
