"""Top-k selection of the lightning indexer's keys: ``select_topk`` (DeepSeek-V3.2's top-k over
the index scores; ``model/dsa.py`` calls it per query chunk).

Long rows take an exact two-stage top-k (the blocks with the largest maxima, then a top-k of
their entries); on CPU, rows long against a large ``k`` first set to -inf what lies below a
threshold taken from a sample (:func:`thresholded_top_k`); short ones take ``lax.top_k``. The
same selected keys, in the same order, on every path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kdsa.model.partitioning import compile_platform

# Rows this many times longer than ``k`` blocks take the two-stage top-k: decode at 128K keys on
# ``tiny`` (top-8), 0.19 -> 0.10 ms; at ``k3``'s top-2048 it would need 4M keys (below that the
# candidates are a large share of the row and a second top-k costs more than it saves).
TOPK_BLOCK, TOPK_BLOCKS_FROM = 256, 8
# On CPU, for ``k >= TOPK_SAMPLE_MIN_K``, rows at least ``TOPK_SAMPLE_FROM`` times longer than
# ``k`` take the sampled threshold (every ``TOPK_SAMPLE_STRIDE``-th entry). At 8 x 64K, top-2048:
# 6.9 -> 4.4 ms on random scores, 11.9 -> 4.6 ms on scores rising with the position (one-off
# script; 3.1 ms is XLA:CPU's top-k itself over a row with 2,048 entries left, the floor of
# this route). A small ``k``'s heap is cheap already: ``tiny``'s top-8 keeps ``lax.top_k``.
# From 1,024 up the sample's share of the top ``k`` is 32+ entries and a row misses the
# threshold rarely (0.02% of random rows at 1,024, 5% at 256, where the plain top-k would run).
TOPK_SAMPLE_STRIDE, TOPK_SAMPLE_FROM, TOPK_SAMPLE_MIN_K = 64, 16, 1024


def select_topk(scores: jax.Array, visible: jax.Array, topk: int) -> jax.Array:
    """Top-k visible keys per query: indices ``[B, T, min(topk, S)]`` int32, -1 where unused.

    The top-k of the masked scores; a query with fewer than ``topk`` visible keys gets all of
    them (the rest -1), so with ``S <= topk`` DSA is dense attention. Ties break toward the lower
    index (``lax.top_k``), -0.0 and +0.0 counting as equal. A width above S would only hold -1,
    so the width is ``min(topk, S)``. Scores must not be NaN.
    """
    masked = jnp.where(visible, scores, -jnp.inf)
    masked = jnp.where(masked == 0, 0.0, masked)  # one zero: lax.top_k ranks -0.0 below +0.0
    k = min(topk, scores.shape[-1])
    if scores.shape[-1] >= TOPK_BLOCKS_FROM * k * TOPK_BLOCK:
        vals, idx = blockwise_top_k(masked, k, TOPK_BLOCK)
    elif (k >= TOPK_SAMPLE_MIN_K and scores.shape[-1] >= TOPK_SAMPLE_FROM * k
          and compile_platform() == "cpu"):
        vals, idx = thresholded_top_k(masked, k, TOPK_SAMPLE_STRIDE)
    else:
        vals, idx = jax.lax.top_k(masked, k)  # [B, T, K]
    return jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)


def blockwise_top_k(x: jax.Array, k: int, block: int) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k(x, k)`` over the last axis in two stages: the ``k`` blocks of ``block``
    entries with the largest maxima, then a top-k of those blocks' entries. The same values,
    and the same indices wherever the value is finite (``select_topk`` marks the rest -1), for x
    without NaN or -0.0.

    Why: each of the k largest entries lies in such a block, since a block holding one of them
    whose maximum ranked below k other blocks' would leave k + 1 entries at least as large. Ties:
    ``lax.top_k`` prefers lower indices, among the block maxima too, and the chosen blocks are
    read in ascending order, so equal entries keep their index order.
    """
    *lead, s = x.shape
    nb = -(-s // block)
    x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, nb * block - s)], constant_values=-jnp.inf)
    blocks = x.reshape(*lead, nb, block)
    _, chosen = jax.lax.top_k(blocks.max(axis=-1), k)                 # [..., k] block ids
    chosen = jnp.sort(chosen, axis=-1)
    cand = jnp.take_along_axis(blocks, chosen[..., None], axis=-2).reshape(*lead, k * block)
    vals, at = jax.lax.top_k(cand, k)                                 # [..., k]
    idx = jnp.take_along_axis(chosen, at // block, axis=-1) * block + at % block
    return vals, idx


def thresholded_top_k(x: jax.Array, k: int, stride: int) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k(x, k)`` over the last axis, values and indices, for x without NaN: the same
    top-k after the entries below a threshold ``lo`` are set to -inf, provided at least ``k``
    entries of every row reach ``lo`` (else the plain top-k runs; one ``lax.cond`` for all rows).

    Why it is exact: when ``k`` entries reach ``lo``, the ``k`` largest all do, so nothing they
    are ranked against changes, ties at the boundary included. Why it is faster on CPU: XLA:CPU's
    top-k keeps a heap of ``k`` and compares each entry with the heap's smallest, so an entry
    at -inf costs one comparison. ``lo`` is the ``2k / stride``-th largest (at most the
    sample's length) of every ``stride``-th entry: about ``2k`` entries reach it; fewer than
    ``k`` would take over twice the sample's expected share of the top ``k``.
    """
    sample = x[..., ::stride]                                          # [..., ceil(S / stride)]
    m = min(max(1, 2 * k // stride), sample.shape[-1])
    lo = jax.lax.top_k(sample, m)[0][..., -1:]                        # [..., 1]
    keep = x >= lo
    enough = jnp.all(jnp.sum(keep, axis=-1) >= k)
    return jax.lax.cond(enough, lambda x: jax.lax.top_k(jnp.where(keep, x, -jnp.inf), k),
                        lambda x: jax.lax.top_k(x, k), x)
