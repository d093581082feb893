"""Query chunks and visibility: the loop that every attention and indexer function of
``model/dsa.py`` runs over, so that at most one chunk of queries scores its keys at a time, and
causal key windows, which let each group of chunks score only the keys it can see.

Visibility. A key ``s`` is visible to query ``t`` iff ``kv_pos[s] <= q_pos[t]`` and
``kv_seg[s] == q_seg[t]`` (:func:`visible_mask`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

def map_query_chunks(fn: Callable, chunk_size: int, per_query: Sequence[jax.Array],
                     per_key: Sequence[jax.Array] = (), *, windows: int = 1,
                     key_slack: int = 0, pad_keys: Callable | None = None):
    """``fn(*chunks, *keys)`` over query chunks of ``per_query`` arrays (query axis 1), outputs
    joined.

    Pads T with zeros to a multiple of the chunk (padded rows are computed, then dropped), runs
    ``lax.map`` over a rematerialised body and puts the query axis back at position 1 of every
    output. ``fn`` may close over shared (key-side) arrays, or get them as ``per_key`` (key axis
    1) to be cut to causal windows:

    Causal windows (``windows > 1``): the chunks are split into that many consecutive groups and
    group ``g`` sees only the first ``W_g = min(S, key_slack + end_g)`` keys, ``end_g`` its last
    query index + 1. The caller promises that key ``s`` is invisible to query ``t`` whenever
    ``s > t + key_slack`` (a causal prefill whose keys sit at their positions: ``key_slack = 0``
    for a sequence attending to itself, ``S - T`` for T queries at the end of S keys), so the
    cut keys change nothing: a causal prefill from a cache's start (``S = T``, ``key_slack = 0``)
    scores about ``(windows + 1) / (2 windows)`` of the ``T x S`` pairs; with ``key_slack``
    keys before the queries, the saving shrinks to ``T (windows - 1) / (2 windows S)``. Groups
    may return outputs narrower than the full-width call along some axis (top-k over
    ``W_g < k`` keys); ``pad_keys(out, s)`` restores them.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    t = per_query[0].shape[1]
    c = min(chunk_size, t)
    n = -(-t // c)

    def split(a, lo, hi):  # [B, T, ...] -> [hi - lo, B, C, ...], chunks lo..hi
        a = jnp.pad(a, [(0, 0), (0, n * c - t)] + [(0, 0)] * (a.ndim - 2))[:, lo * c:hi * c]
        return jnp.moveaxis(a.reshape((a.shape[0], hi - lo, c) + a.shape[2:]), 1, 0)

    def join(a):  # [m, B, C, ...] -> [B, m * C, ...]
        a = jnp.moveaxis(a, 0, 1)
        return a.reshape((a.shape[0], a.shape[1] * c) + a.shape[3:])

    keys = tuple(per_key)
    if n == 1:  # decode and short inputs: no loop (a while loop would copy the key side)
        return jax.checkpoint(lambda xs: fn(*xs, *keys))(tuple(per_query))
    windows = max(1, min(windows, n)) if keys else 1
    s = keys[0].shape[1] if keys else 0
    outs = []
    for g in range(windows):  # one group (all of S) without windows
        lo, hi = g * n // windows, (g + 1) * n // windows
        width = s if windows == 1 else min(s, key_slack + hi * c)
        cut = tuple(a[:, :width] for a in keys)
        body = jax.checkpoint(lambda xs, cut=cut: fn(*xs, *cut))
        out = jax.tree.map(join, jax.lax.map(body, tuple(split(a, lo, hi) for a in per_query)))
        outs.append(out if pad_keys is None or width == s else pad_keys(out, s))
    return jax.tree.map(lambda *parts: jnp.concatenate(parts, axis=1)[:, :t], *outs)


# Causal key windows of a prefill of at least CAUSAL_WINDOWS_FROM queries (shorter calls keep
# one loop and one compile). 8 rather than 4 by a one-off k3-slice 4K prefill from an empty cache
# on XLA:CPU: dense MLA 2.63 -> 2.43 s, Gated DSA 3.44 -> 3.18 s (no windows: 3.98 / 4.83 s).
CAUSAL_WINDOWS, CAUSAL_WINDOWS_FROM = 8, 1024


def causal_windows(t: int, chunk_size: int) -> int:
    """How many causal key windows (:func:`map_query_chunks`) a prefill of ``t`` queries in
    chunks of ``chunk_size`` uses: at most one per chunk, 1 (none) for short calls."""
    if t < CAUSAL_WINDOWS_FROM:
        return 1
    return min(CAUSAL_WINDOWS, -(-t // min(chunk_size, t)))


def visible_mask(q_pos: jax.Array, kv_pos: jax.Array, q_seg: jax.Array,
                 kv_seg: jax.Array) -> jax.Array:
    """``[B, T, S]`` bool: ``kv_pos[s] <= q_pos[t]`` and ``kv_seg[s] == q_seg[t]``."""
    return ((kv_pos[:, None, :] <= q_pos[:, :, None])
            & (kv_seg[:, None, :] == q_seg[:, :, None]))


def check_visibility(b: int, t: int, s: int, q_pos, kv_pos, q_seg, kv_seg) -> None:
    """Raise unless the query-side arrays are ``[B, T]`` and the key-side ones ``[B, S]``."""
    for name, a, want in (("q_pos", q_pos, (b, t)), ("q_seg", q_seg, (b, t)),
                          ("kv_pos", kv_pos, (b, s)), ("kv_seg", kv_seg, (b, s))):
        if a.shape != want:
            raise ValueError(f"{name} has shape {a.shape}, expected {want}")
