"""Rotary position embedding for Gated DSA: YaRN frequencies, mscale, and the two pair layouts.

Two layouts rotate the same frequencies (``dsa.md`` 1.2, 1.3; DeepSeek-V3.2 ``inference/model.py``
as fixed in Nov 2025):

* **interleaved** (MLA ``q_pe`` / ``k_pe``): dims ``(2i, 2i+1)`` form pair ``i``;
* **half-split** (lightning indexer, "NeoX"): dim ``i`` pairs with ``i + R/2``.

Pair ``i`` at position ``p`` turns by the angle ``p * inv_freq[i]``:
``(a, b) -> (a cos - b sin, a sin + b cos)``. Angles are formed in float32 (as the Hugging Face and
DeepSeek references do); the rotation runs in float32 and is cast back to the input dtype.

YaRN (DeepSeek-V3 ``precompute_freqs_cis`` / ``yarn_get_mscale``): frequencies whose wavelength
exceeds the original context are divided by ``factor``, those that rotate more than
``beta_fast`` times keep their value, and a linear ramp blends the band between. YaRN is applied
whenever ``rope_scaling`` is set (Hugging Face behaviour; DeepSeek's reference applies it when
``max_seq_len > original_seq_len``, which holds for every published config). The softmax-scale
correction ``mscale**2`` lives in :func:`mla_softmax_scale`. Hugging Face additionally multiplies
cos/sin by ``get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)``; that ratio is 1 for
every published config (``mscale == mscale_all_dim``) and DeepSeek's reference omits it, so we do.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kdsa.model.config import ModelConfig, YarnConfig


def yarn_get_mscale(scale: float, mscale: float) -> float:
    """DeepSeek ``yarn_get_mscale``: ``0.1 * mscale * ln(scale) + 1`` for ``scale > 1``, else 1."""
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_len: int) -> float:
    """The (fractional) pair index whose frequency completes ``num_rotations`` over ``max_len``."""
    return dim * math.log(max_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def rope_inv_freq(dim: int, theta: float, scaling: YarnConfig | None = None) -> np.ndarray:
    """Inverse frequencies ``[dim // 2]`` (float32) for a rotary part of ``dim`` dims.

    ``inv_freq[i] = theta ** (-2i / dim)``; with YaRN,
    ``inv_freq / factor * (1 - s) + inv_freq * s`` where ``s = 1 - ramp(i)`` and ``ramp`` rises
    linearly from 0 at ``floor(dim(beta_fast))`` to 1 at ``ceil(dim(beta_slow))``, ``dim(r)``
    being the pair that turns ``r`` times over the original context (DeepSeek-V3
    ``find_correction_range`` / ``linear_ramp_factor``).
    """
    if dim % 2:
        raise ValueError(f"RoPE needs an even number of dims, got {dim}")
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if scaling is not None:
        orig = scaling.original_max_position_embeddings
        low = max(math.floor(_yarn_correction_dim(scaling.beta_fast, dim, theta, orig)), 0)
        high = min(math.ceil(_yarn_correction_dim(scaling.beta_slow, dim, theta, orig)), dim - 1)
        if low == high:
            high += 0.001  # DeepSeek: avoid a zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        keep = 1.0 - ramp
        inv = inv / scaling.factor * (1.0 - keep) + inv * keep
    return inv.astype(np.float32)


def mla_softmax_scale(config: ModelConfig) -> float:
    """``(qk_nope + qk_rope) ** -0.5``, times ``yarn_get_mscale(factor, mscale_all_dim) ** 2``
    when ``rope_scaling`` is set (DeepSeek-V3 ``MLA.__init__``; 1.369**2 for V3.2's factor 40)."""
    scale = config.qk_head_dim ** -0.5
    if config.rope_scaling is not None:
        m = yarn_get_mscale(config.rope_scaling.factor, config.rope_scaling.mscale_all_dim)
        scale *= m * m
    return scale


def _cos_sin(x: jax.Array, positions: jax.Array, inv_freq) -> tuple[jax.Array, jax.Array]:
    """cos, sin ``[B, T, (1,)*, R/2]`` broadcastable against ``x [B, T, ..., R]``."""
    if positions.shape != x.shape[:2]:
        raise ValueError(f"positions {positions.shape} must be [B, T] = {x.shape[:2]} of x "
                         f"{x.shape}")
    if 2 * len(inv_freq) != x.shape[-1]:
        raise ValueError(f"x has {x.shape[-1]} rotary dims but inv_freq has {len(inv_freq)} pairs")
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    angle = angle.reshape(angle.shape[:2] + (1,) * (x.ndim - 3) + angle.shape[-1:])
    return jnp.cos(angle), jnp.sin(angle)


def rope_interleaved(x: jax.Array, positions: jax.Array, inv_freq) -> jax.Array:
    """Rotate pairs ``(2i, 2i+1)`` of ``x [B, T, ..., R]`` (MLA layout)."""
    cos, sin = _cos_sin(x, positions, inv_freq)
    pairs = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]  # [B, T, ..., R/2]
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def rope_half_split(x: jax.Array, positions: jax.Array, inv_freq) -> jax.Array:
    """Rotate pairs ``(i, i + R/2)`` of ``x [B, T, ..., R]`` (indexer layout, NeoX)."""
    cos, sin = _cos_sin(x, positions, inv_freq)
    a, b = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [B, T, ..., R/2] each
    out = jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return out.astype(x.dtype)
