"""References and input checks for the sparse MLA attention kernel.

The plain-JAX reference is the model's own gather path, ``kdsa.model.dsa.sparse_mla_attention``
(query chunks, ``take_along_axis`` of the selected rows, masked softmax); the second, independent
one is ``dense_masked_mla_attention`` (full ``[T, S]`` scores plus ``log`` of the index
multiplicities, DeepSeek's dense-mask formulation). Both are re-exported here so kernel code and
tests name one place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kdsa.model.dsa import dense_masked_mla_attention
from kdsa.model.dsa import sparse_mla_attention as sparse_mla_attention_ref

__all__ = ["sparse_mla_attention_ref", "dense_masked_mla_attention", "check_inputs"]

_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_inputs(q: jax.Array, kv, indices: jax.Array, v_dim: int,
                 name: str = "sparse_mla_attention") -> tuple[jax.Array, ...]:
    """Validate ``q [B, T, N, Dk]``, ``kv [B, S, Dk]`` or parts ``[B, S, D_i]`` with
    ``sum D_i = Dk``, ``indices [B, T, K]`` integer and ``0 < v_dim <= Dk``; return the parts."""
    if q.ndim != 4 or q.dtype not in _FLOATS:
        raise ValueError(f"{name}: q must be float [B, T, N, Dk], got {q.dtype}{list(q.shape)}")
    b, t, _, dk = q.shape
    parts = tuple(kv) if isinstance(kv, (tuple, list)) else (kv,)
    shapes = [tuple(p.shape) for p in parts]
    if (not parts or any(len(sh) != 3 or sh[:2] != shapes[0][:2] for sh in shapes)
            or shapes[0][0] != b or sum(sh[2] for sh in shapes) != dk):
        raise ValueError(f"{name}: kv must be [B, S, Dk] = [{b}, S, {dk}] (or parts whose last "
                         f"dims add up to Dk), got {shapes}")
    if any(p.dtype not in _FLOATS for p in parts):
        raise ValueError(f"{name}: kv must be float, got {[str(p.dtype) for p in parts]}")
    if (indices.ndim != 3 or indices.shape[:2] != (b, t)
            or not jnp.issubdtype(indices.dtype, jnp.integer)):
        raise ValueError(f"{name}: indices must be integer [B, T, K] = [{b}, {t}, K], got "
                         f"{indices.dtype}{list(indices.shape)}")
    if not 0 < v_dim <= dk:
        raise ValueError(f"{name}: v_dim={v_dim} must be in (0, Dk={dk}]")
    return parts
