"""Public MXFP4 matmul ops: choose Pallas or XLA, own the gradient.

``impl="pallas"`` (default) runs ``kernel.py`` (interpret mode on CPU); ``impl="xla"`` runs
``ref.py``. Both are differentiable with respect to the activations; the packed weights are
frozen bytes and get no gradient. The Pallas path's backward is ``dx = dy @ dequant(W)`` in XLA
from the prepared layout (exact dequantisation, float32 ``HIGHEST`` dot), so it materialises
the dequantised weight for the backward pass only; a transposed kernel would avoid that.

Serving code prepares each weight once (``prepare_mxfp4_weights``) and calls the ``*_prepared``
ops; the ``(blocks, scales)`` forms re-lay the weight on every call.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kdsa.kernels_pallas.common import BlockSizes, vary_alike
from kdsa.kernels_pallas.mxfp4_matmul import kernel, ref
from kdsa.kernels_pallas.mxfp4_matmul.kernel import MXFP4Weights, prepare_mxfp4_weights
from kdsa.kernels_pallas.mxfp4_matmul.decode import BLOCK, mxfp4_f32_bits

_HIGHEST = jax.lax.Precision.HIGHEST
IMPLS = ("pallas", "xla")


def dequantize_prepared(w: MXFP4Weights) -> jax.Array:
    """Prepared weight -> ``[(E,) K, N]`` float32 (exact); inverse of the kernel re-layout."""
    b = w.packed.astype(jnp.int32) & 0xFF                                     # [.., Kp/2, Np]
    s = jnp.repeat(w.scales.astype(jnp.int32) & 0xFF, BLOCK // 2, axis=-2)    # [.., Kp/2, Np]
    lo = mxfp4_f32_bits(b & 0xF, s)                                           # even k
    hi = mxfp4_f32_bits(b >> 4, s)                                            # odd k
    bits = jnp.stack([lo, hi], axis=-2).reshape(*b.shape[:-2], -1, b.shape[-1])  # [.., Kp, Np]
    return jax.lax.bitcast_convert_type(bits, jnp.float32)[..., :w.k, :w.n]


# ----------------------------------------------------------------------------- dense

@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense(x, w, interpret, block_m):
    return kernel.mxfp4_matmul_prepared(x, w, interpret=interpret, block_m=block_m)


def _dense_fwd(x, w, interpret, block_m):
    return _dense(x, w, interpret, block_m), (x, w)


def _dense_bwd(interpret, block_m, res, dy):
    x, w = res
    dx = jnp.einsum("...n,kn->...k", dy.astype(jnp.float32), dequantize_prepared(w),
                    precision=_HIGHEST, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), None


_dense.defvjp(_dense_fwd, _dense_bwd)


def mxfp4_matmul_prepared(x: jax.Array, w: MXFP4Weights, *, interpret: bool | None = None,
                          block_m: int | None = None) -> jax.Array:
    """``x [..., K]`` (f32/bf16) times a prepared weight -> ``[..., N]`` float32 (Pallas)."""
    return _dense(x, w, interpret, block_m)


def mxfp4_matmul(x: jax.Array, blocks: jax.Array, scales: jax.Array, *, impl: str = "pallas",
                 interpret: bool | None = None,
                 block_sizes: BlockSizes | None = None) -> jax.Array:
    """``y[..., N] = x[..., K] @ dequant(W)^T`` in float32; W as HF ``blocks [N, K/32, 16]``,
    ``scales [N, K/32]`` uint8."""
    if impl == "xla":
        return ref.mxfp4_matmul_ref(x, blocks, scales)
    if impl != "pallas":
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    ref.check_weight(blocks, scales, 2, "mxfp4_matmul")
    w = prepare_mxfp4_weights(blocks, scales, block_sizes=block_sizes)
    return _dense(x, w, interpret, block_sizes.block_m if block_sizes else None)


# ----------------------------------------------------------------------------- grouped

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped(x, w, group_sizes, interpret, block_m, mode):
    return kernel.mxfp4_grouped_matmul_prepared(x, w, group_sizes, interpret=interpret,
                                                block_m=block_m, mode=mode)


def _grouped_fwd(x, w, group_sizes, interpret, block_m, mode):
    return _grouped(x, w, group_sizes, interpret, block_m, mode), (x, w, group_sizes)


def _grouped_bwd(interpret, block_m, mode, res, dy):
    x, w, group_sizes = res
    w_nk = jnp.swapaxes(dequantize_prepared(w), 1, 2)                         # [E, N, K]
    dx = jax.lax.ragged_dot(dy.astype(jnp.float32), w_nk, group_sizes.astype(jnp.int32),
                            precision=_HIGHEST, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), None, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def _vary_alike(x, w: MXFP4Weights, group_sizes):
    """Inside ``shard_map`` (``check_vma``): the operands made to vary over the same mesh axes
    before the custom VJP, so autodiff sums ``x``'s cotangent over the axes only the weights
    vary over (an expert-parallel body's tokens and its own experts); no-op outside."""
    (x, packed, scales, group_sizes), _ = vary_alike(x, w.packed, w.scales, group_sizes)
    return x, dataclasses.replace(w, packed=packed, scales=scales), group_sizes


def mxfp4_grouped_matmul_prepared(x_sorted: jax.Array, w: MXFP4Weights, group_sizes: jax.Array,
                                  *, interpret: bool | None = None, block_m: int | None = None,
                                  mode: str | None = None) -> jax.Array:
    """Grouped (MoE) matmul on prepared expert weights ``[E, ...]`` -> ``[M, N]`` float32."""
    return _grouped(*_vary_alike(x_sorted, w, group_sizes), interpret, block_m, mode)


def mxfp4_grouped_matmul(x_sorted: jax.Array, blocks: jax.Array, scales: jax.Array,
                         group_sizes: jax.Array, *, impl: str = "pallas",
                         interpret: bool | None = None,
                         block_sizes: BlockSizes | None = None) -> jax.Array:
    """Rows of ``x_sorted [M, K]`` sorted by expert (``group_sizes [E]`` rows each) times
    ``W[e]`` given as HF ``blocks [E, N, K/32, 16]``, ``scales [E, N, K/32]`` -> ``[M, N]``
    float32; rows past ``sum(group_sizes)`` give 0."""
    if impl == "xla":
        return ref.mxfp4_grouped_matmul_ref(x_sorted, blocks, scales, group_sizes)
    if impl != "pallas":
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    ref.check_weight(blocks, scales, 3, "mxfp4_grouped_matmul")
    w = prepare_mxfp4_weights(blocks, scales, block_sizes=block_sizes)
    return _grouped(*_vary_alike(x_sorted, w, group_sizes), interpret,
                    block_sizes.block_m if block_sizes else None, None)
