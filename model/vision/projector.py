"""2 x 2 patch merging and the projector into the language model (K2.5 ``patchmergerv2``,
``kimi_k3.md`` 5; vLLM ``KimiK25MultiModalProjector``).

Merging concatenates the ``mh * mw`` tower outputs of each merge window (patches arrive in merge
order, ``patching.py``): ``[B, P, D] -> [B, P / m, m * D]``. The projector is::

    post_norm(proj.2(gelu(proj.0(x))))      proj.0: m*D -> m*D, proj.2: m*D -> hidden_size

(exact erf GELU, no biases, RMSNorm with ``projector_ln_eps``). Checkpoint names
``mm_projector.proj.0``, ``mm_projector.proj.2``, ``mm_projector.post_norm``.
"""

from __future__ import annotations

import jax
from flax import nnx

from kdsa.model.layers import Linear, RMSNorm, dtype_of


def merge_patches(x: jax.Array, merge_size: int) -> jax.Array:
    """[B, P, D] (merge order) -> [B, P / m, m * D]."""
    b, p, d = x.shape
    if p % merge_size:
        raise ValueError(f"{p} patches do not split into merge windows of {merge_size}")
    return x.reshape(b, p // merge_size, merge_size * d)


class _Gelu(nnx.Module):
    """``proj.1`` of the checkpoint's ``Sequential`` (no parameters)."""

    def __call__(self, x):
        return jax.nn.gelu(x, approximate=False)


class Projector(nnx.Module):
    def __init__(self, vc, hidden_size: int, *, rngs: nnx.Rngs, param_dtype: str = "float32",
                 compute_dtype: str = "float32"):
        w = vc.hidden_size * vc.merge_size
        dt = {"param_dtype": dtype_of(param_dtype), "compute_dtype": dtype_of(compute_dtype)}
        self.proj = nnx.List([Linear(w, w, axes=(None, "vision_mlp"), rngs=rngs, **dt), _Gelu(),
                              Linear(w, hidden_size, axes=("vision_mlp", "embed"), rngs=rngs,
                                     **dt)])
        self.post_norm = RMSNorm(hidden_size, eps=vc.projector_ln_eps)

    def __call__(self, merged: jax.Array) -> jax.Array:           # [..., m D] -> [..., hidden]
        for layer in self.proj:
            merged = layer(merged)
        return self.post_norm(merged)
