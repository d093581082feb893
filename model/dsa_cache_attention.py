"""A Gated DSA (or dense MLA) layer's queries over its cache, dense slots or a paged pool:
the absorbed attention of ``model/dsa.py`` with two exact shortcuts for long prefills.

* **Causal key windows** (``query_chunks.map_query_chunks``): a prefill of T queries at the end
  of a cache of S keys (key ``s`` at position ``s``) scores each group of query chunks against
  only the keys its last query can see. The promise behind it (every real query ``t`` sits at
  position ``<= t + S - T``) is checked at run time; a ``lax.cond`` takes the full width when
  it fails (a chunk padded past the cache).
* **Queries that see at most top-k keys attend densely**: under the same promise, query ``t``
  sees at most ``t + S - T + 1`` keys; while that is within ``index_topk`` the indexer would
  select all of them, so those queries skip the indexer, the top-k and the row gathers and
  attend to their visible keys (the same set, the same softmax; DeepSeek-V3.2-Exp section 2.1:
  the top-k of fewer keys than k is all of them).

Decode (one query), short calls and chunks deep in a long context take the plain path (see
:func:`windowed`). The outputs of real queries (``q_seg != 0``) equal it up to rounding (the
same keys, the same selected sets; ``tests/test_causal_windows.py``).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from kdsa.model.dsa import dense_attention, indexer_topk
from kdsa.model.query_chunks import causal_windows


def attend_cache(q_abs: jax.Array, index: tuple | None, *, keys: Callable, sparse: Callable,
                 topk: int | None,
                 scale: float, num_keys: int, q_pos, kv_pos, q_seg, kv_seg,
                 chunk_size: int, decode_scores: Callable | None = None) -> jax.Array:
    """Latent outputs ``[B, T, N, kv_lora]`` of absorbed queries ``q_abs [B, T, N, Dk]``.

    ``index``: ``(q, keys, weights, key_rows)`` of the indexer (``dsa.indexer_topk``'s
    arguments; ``key_rows`` None for dense slots), or None for dense MLA. ``keys(w)``: the
    latent ``[B, w, kv_lora]`` and RoPE key ``[B, w, rope]`` of each row's first ``w`` positions.
    ``sparse(q_abs, idx)``: the sparse attention of queries ``[B, T', N, Dk]`` over top-k
    positions ``[B, T', K]``. Visibility as in ``model/dsa.py`` over ``num_keys`` positions.
    ``decode_scores``: ``dsa.indexer_topk``'s, for a decode step's index scores.
    """
    vis = dict(q_pos=q_pos, kv_pos=kv_pos, q_seg=q_seg, kv_seg=kv_seg, chunk_size=chunk_size)

    def attend(windows: int = 1, key_slack: int = 0):
        t = q_abs.shape[1]
        early = 0 if index is None or windows == 1 else dense_head(t, topk, key_slack,
                                                                   chunk_size)
        outs = []
        if index is None or early:
            w = num_keys if index is None else early + key_slack
            lat, rope = keys(w)
            e = t if index is None else early
            o, _ = dense_attention(q_abs[:, :e], (lat[:, :, None], rope[:, :, None]),
                                   lat[:, :, None], scale, q_pos=q_pos[:, :e],
                                   kv_pos=kv_pos[:, :w], q_seg=q_seg[:, :e], kv_seg=kv_seg[:, :w],
                                   chunk_size=chunk_size, windows=windows,
                                   key_slack=key_slack)  # MQA: G = 1
            outs.append(o)
        if index is not None and early < t:
            iq, ik, iw, key_rows = index
            idx = indexer_topk(iq[:, early:], ik, iw[:, early:], topk, key_rows=key_rows,
                               q_pos=q_pos[:, early:], kv_pos=kv_pos, q_seg=q_seg[:, early:],
                               kv_seg=kv_seg, chunk_size=chunk_size, windows=windows,
                               key_slack=key_slack + early, decode_scores=decode_scores)
            outs.append(sparse(q_abs[:, early:], idx))
        return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)

    return windowed(attend, num_keys, q_pos=q_pos, q_seg=q_seg, chunk_size=chunk_size,
                    topk=None if index is None else topk)


def windowed(attend: Callable, num_keys: int, *, q_pos, q_seg, chunk_size: int,
             topk: int | None = None):
    """``attend(windows=, key_slack=)`` with causal key windows when they are worth a second
    compiled branch and every real query ``t`` (``q_seg != 0``) has position ``<= t + S - T``
    (checked at run time; a ``lax.cond`` takes ``attend()``, the full width, otherwise); else
    ``attend()``. Worth it: a long call (``causal_windows``) with ``S - T < T`` (the windows
    then skip over a fifth of the products; with ``S - T >= T``, at most 22%), or with queries
    that see at most ``topk`` keys (:func:`dense_head`). A server's prefill chunk
    over a cache cut to its context width (``infer/runner.py : ModelRunner._context``) is the
    first case near the start of a prompt and the second below top-k; deep in a long context
    neither, so it compiles one branch."""
    t = q_pos.shape[1]
    windows = causal_windows(t, chunk_size)
    slack = num_keys - t
    if windows == 1 or slack < 0 or (
            slack >= t and (topk is None or not dense_head(t, topk, slack, chunk_size))):
        return attend()
    fits = jnp.all((q_seg == 0) | (q_pos - jnp.arange(t, dtype=q_pos.dtype) <= slack))
    return jax.lax.cond(fits, lambda: attend(windows=windows, key_slack=slack), attend)


def dense_head(t: int, topk: int, key_slack: int, chunk_size: int) -> int:
    """Leading queries (whole chunks) of ``t`` that see at most ``topk`` keys when query ``u``
    sees keys up to ``u + key_slack``: they attend densely (module docstring)."""
    return max(0, min(t, topk - key_slack)) // chunk_size * chunk_size
