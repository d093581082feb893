"""The vision tower's attention: softmax attention within each image of a packed row.

A request's images are packed into one row of patches (``assemble.pack_images``), each image a
run with its own segment id. K3's processor allows 65,536 patches per image
(``in_patch_limit``) and a request several images, so the row's ``P x P`` scores cannot be
built whole: one 4096 x 4096 image is 66K patches, about 800 GB of float32 scores at 12 heads
(vLLM runs the tower with variable-length flash attention for the same reason).

* :func:`vision_attention_dense` is the reference: ``[B, H, P, P]`` scores, a mask of equal
  segment ids, one softmax. Used for rows of at most ``block`` patches.
* :func:`vision_attention_blocked` computes the same in ``block x block`` tiles with an online
  softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; the
  FlashAttention recurrence, Dao et al. 2022): per query block a running max ``m``, sum ``l``
  and output ``acc`` over the key blocks. A key block whose segment ids cannot meet the query
  block's (their ``[min, max]`` ranges do not overlap) is skipped by a ``lax.cond``, so a
  packed row costs about the sum of its images' squares, not the square of their sum. Memory
  is ``O(B H P block)``; each query block is rematerialised in the backward pass
  (``jax.checkpoint``), so gradients stay within it too.

Segment semantics are the reference's exactly: queries see keys of the same id, padding (id 0)
included (its outputs are discarded by the caller).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 512  # patches per tile; rows up to this length use the dense reference


def vision_attention_dense(q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array
                           ) -> jax.Array:
    """q, k, v [B, P, H, d]; segment [B, P] -> [B, P, H, d]: softmax attention within each
    image (equal segment ids), scale ``d^-0.5``, float32 scores."""
    scale = q.shape[-1] ** -0.5
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    same = segment[:, None, :, None] == segment[:, None, None, :]          # [B, 1, P, P]
    p = jax.nn.softmax(jnp.where(same, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)).astype(v.dtype)


def vision_attention_blocked(q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array, *,
                             block: int = BLOCK) -> jax.Array:
    """:func:`vision_attention_dense` in ``block x block`` tiles (module docstring)."""
    b, p, h, d = q.shape
    n = -(-p // block)
    pad = n * block - p
    if pad:  # tail patches in a segment of their own (an id no caller uses): only each other
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        segment = jnp.pad(segment.astype(jnp.int32), ((0, 0), (0, pad)),
                          constant_values=jnp.iinfo(jnp.int32).min)
    scale = d ** -0.5
    qb = q.astype(jnp.float32).reshape(b, n, block, h, d) * scale
    kb = k.astype(jnp.float32).reshape(b, n, block, h, d)
    vb = v.astype(jnp.float32).reshape(b, n, block, h, d)
    sb = segment.astype(jnp.int32).reshape(b, n, block)
    lo, hi = jnp.min(sb, axis=-1), jnp.max(sb, axis=-1)                   # [B, n]

    @jax.checkpoint
    def query_block(i):
        qi, si = qb[:, i], sb[:, i]                                        # [B, C, H, d], [B, C]

        def key_block(carry, j):
            def visit(carry):
                m, l, acc = carry                                          # [B, H, C] x2, [B, C, H, d]
                s = jnp.einsum("bqhd,bkhd->bhqk", qi, kb[:, j])            # [B, H, C, C]
                same = si[:, None, :, None] == sb[:, j][:, None, None, :]
                s = jnp.where(same, s, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # no key seen yet: 0
                e = jnp.exp(s - m_safe[..., None])
                fix = jnp.exp(m - m_safe)                                  # old terms' rescale
                l = l * fix + jnp.sum(e, axis=-1)
                acc = acc * jnp.moveaxis(fix, 1, 2)[..., None] + jnp.einsum(
                    "bhqk,bkhd->bqhd", e, vb[:, j])
                return m_new, l, acc

            meets = jnp.any((lo[:, i] <= hi[:, j]) & (lo[:, j] <= hi[:, i]))
            return jax.lax.cond(meets, visit, lambda c: c, carry), None

        init = (jnp.full((b, h, block), -jnp.inf, jnp.float32),
                jnp.zeros((b, h, block), jnp.float32), jnp.zeros((b, block, h, d), jnp.float32))
        (_, l, acc), _ = jax.lax.scan(key_block, init, jnp.arange(n))
        return acc / jnp.moveaxis(l, 1, 2)[..., None]  # every query sees itself: l > 0

    out = jax.lax.map(query_block, jnp.arange(n))                          # [n, B, C, H, d]
    out = jnp.moveaxis(out, 0, 1).reshape(b, n * block, h, d)[:, :p]
    return out.astype(v.dtype)


def vision_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array, *,
                     block: int | None = None) -> jax.Array:
    """The tower's attention: dense up to ``block`` (default :data:`BLOCK`) patches per row,
    tiled beyond."""
    block = BLOCK if block is None else block
    if q.shape[1] <= block:
        return vision_attention_dense(q, k, v, segment)
    return vision_attention_blocked(q, k, v, segment, block=block)
