"""Positions in the vision tower: the interpolated learnable grid and 2-D rotary embeddings.

**Position-embedding grid** (MoonViT ``Learnable2DInterpPosEmbDivided_fixed``, ``kimi_k3.md`` 5):
a learnable ``[Hg, Wg, D]`` table (K3: 64 x 64) resized to each image's patch grid
``gh x gw`` by bilinear interpolation with half-pixel centres (PyTorch ``F.interpolate(...,
mode="bilinear", align_corners=False)``, no antialiasing): output row ``i`` samples source row
``s = max((i + 0.5) * Hg / gh - 0.5, 0)``, between rows ``floor(s)`` and ``min(floor(s) + 1,
Hg - 1)`` with weight ``s - floor(s)`` on the second; columns likewise. When ``gh = Hg`` and
``gw = Wg`` this is the table itself. It is evaluated per patch (a gather of four table rows),
so images of different sizes share one static-shape computation.

**2-D RoPE** (MoonViT ``Rope2DPosEmbRepeated``; RoFormer, Su et al. 2021, extended to two
axes): a head of size ``d`` is split into ``d / 2`` interleaved pairs ``(x[2j], x[2j + 1])``;
pair ``j = 2k`` rotates by ``col * f_k`` and pair ``j = 2k + 1`` by ``row * f_k``, with
``f_k = theta^(-4k / d)``, ``k = 0 .. d/4 - 1`` (rotation ``x' = x cos a - y sin a``,
``y' = x sin a + y cos a``, i.e. complex multiplication by ``e^{ia}``, "non-neox" layout).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _source_index(dst: jax.Array, n_in: int, n_out: jax.Array):
    """Half-pixel source coordinate -> (lower index, upper index, upper weight)."""
    s = jnp.maximum((dst.astype(jnp.float32) + 0.5) * (n_in / n_out.astype(jnp.float32)) - 0.5,
                    0.0)
    lo = jnp.minimum(jnp.floor(s).astype(jnp.int32), n_in - 1)
    hi = jnp.minimum(lo + 1, n_in - 1)
    return lo, hi, s - lo.astype(jnp.float32)


def interpolate_pos_emb(table: jax.Array, pos: jax.Array, grid: jax.Array) -> jax.Array:
    """table [Hg, Wg, D]; pos [..., 2] (row, col); grid [..., 2] (gh, gw) of each patch's
    image -> [..., D] bilinearly interpolated position embeddings (module doc)."""
    hg, wg, _ = table.shape
    grid = jnp.maximum(grid, 1)  # padding patches carry a 0 x 0 grid
    y0, y1, wy = _source_index(pos[..., 0], hg, grid[..., 0])
    x0, x1, wx = _source_index(pos[..., 1], wg, grid[..., 1])
    t = table.astype(jnp.float32)
    top = t[y0, x0] * (1 - wx)[..., None] + t[y0, x1] * wx[..., None]
    bot = t[y1, x0] * (1 - wx)[..., None] + t[y1, x1] * wx[..., None]
    return top * (1 - wy)[..., None] + bot * wy[..., None]


def rope_2d_angles(pos: jax.Array, head_dim: int, theta: float = 10000.0) -> jax.Array:
    """pos [..., 2] (row, col) -> rotation angles [..., head_dim // 2] (x/col, y/row
    interleaved per frequency)."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs a head size divisible by 4, got {head_dim}")
    freqs = theta ** (-jnp.arange(0, head_dim, 4, dtype=jnp.float32) / head_dim)  # [d/4]
    ax = pos[..., 1:2].astype(jnp.float32) * freqs                              # [..., d/4]
    ay = pos[..., 0:1].astype(jnp.float32) * freqs
    return jnp.stack([ax, ay], axis=-1).reshape(pos.shape[:-1] + (head_dim // 2,))


def apply_rope_2d(x: jax.Array, angles: jax.Array) -> jax.Array:
    """x [..., P, H, d]; angles [..., P, d/2] -> x with interleaved pairs rotated (float32
    math, cast back)."""
    x32 = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]  # [..., P, 1, d/2]
    a, b = x32[..., 0], x32[..., 1]
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)
