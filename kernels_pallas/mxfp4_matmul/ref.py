"""Plain-JAX reference MXFP4 matmuls: dequantise the whole weight, then one XLA dot.

Weights use the Hugging Face / gpt-oss layout (rows = output features, blocks along the
contracting dim): ``blocks`` uint8 ``[(E,) N, K/32, 16]``, ``scales`` uint8 ``[(E,) N, K/32]``.
The dequantised weight is exact in float32 (``decode.py``), bf16 activations are widened to
float32 exactly, and the dot runs at ``Precision.HIGHEST`` with float32 accumulation, so the only
rounding is in the sums. Output float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kdsa.kernels_pallas.mxfp4_matmul.decode import BLOCK, block_bits

_HIGHEST = jax.lax.Precision.HIGHEST


def check_activation(x: jax.Array, k: int, name: str) -> None:
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"{name}: x must be float32 or bfloat16, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"{name}: x {tuple(x.shape)} does not match the weight's K = {k}")


def check_weight(blocks: jax.Array, scales: jax.Array, ndim: int, name: str) -> tuple[int, ...]:
    """Validate ``blocks [(E,) N, K/32, 16]``, ``scales [(E,) N, K/32]``; return ``((E,) N, K)``."""
    if blocks.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
        raise ValueError(f"{name}: blocks and scales must be uint8, got {blocks.dtype}, "
                         f"{scales.dtype}")
    if (blocks.ndim != ndim + 1 or blocks.shape[-1] != BLOCK // 2
            or scales.shape != blocks.shape[:-1]):
        lead = "[E, N" if ndim == 3 else "[N"
        raise ValueError(f"{name}: expected blocks {lead}, K/32, 16] and scales {lead}, K/32], "
                         f"got {tuple(blocks.shape)} and {tuple(scales.shape)}")
    return (*blocks.shape[:-2], blocks.shape[-2] * BLOCK)


def check_group_sizes(group_sizes: jax.Array, num_experts: int, m: int, name: str) -> None:
    if group_sizes.shape != (num_experts,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{name}: group_sizes must be integer [E={num_experts}], got "
                         f"{group_sizes.dtype} {tuple(group_sizes.shape)}")
    if not isinstance(group_sizes, jax.core.Tracer):
        gs = jax.device_get(group_sizes)
        if (gs < 0).any() or int(gs.sum()) > m:
            raise ValueError(f"{name}: group_sizes must be >= 0 with sum <= M = {m}, got "
                             f"{gs.tolist()}")


def dequantize_f32(blocks: jax.Array, scales: jax.Array) -> jax.Array:
    """``blocks [..., G, 16]``, ``scales [..., G]`` -> ``[..., 32 G]`` float32, exactly (element
    ``32 g + 2 j`` in the low nibble of byte j, ``32 g + 2 j + 1`` in the high one)."""
    bits = block_bits(blocks, scales)                                     # [..., G, 32]
    return jax.lax.bitcast_convert_type(bits, jnp.float32).reshape(*blocks.shape[:-2], -1)


def mxfp4_matmul_ref(x: jax.Array, blocks: jax.Array, scales: jax.Array) -> jax.Array:
    """``y[..., N] = x[..., K] @ dequant(W)[N, K]^T`` in float32."""
    n, k = check_weight(blocks, scales, 2, "mxfp4_matmul_ref")
    check_activation(x, k, "mxfp4_matmul_ref")
    w = dequantize_f32(blocks, scales)                                    # [N, K]
    return jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w, precision=_HIGHEST,
                      preferred_element_type=jnp.float32)


def mxfp4_grouped_matmul_ref(x_sorted: jax.Array, blocks: jax.Array, scales: jax.Array,
                             group_sizes: jax.Array) -> jax.Array:
    """MoE experts: rows of ``x_sorted [M, K]`` sorted by expert, ``group_sizes [E]`` rows each;
    row r of group e gets ``x[r] @ dequant(W[e])^T`` -> ``[M, N]`` float32. Rows past
    ``sum(group_sizes)`` give 0 (``jax.lax.ragged_dot`` semantics)."""
    e, n, k = check_weight(blocks, scales, 3, "mxfp4_grouped_matmul_ref")
    if x_sorted.ndim != 2:
        raise ValueError(f"mxfp4_grouped_matmul_ref: x_sorted must be [M, K], got "
                         f"{tuple(x_sorted.shape)}")
    check_activation(x_sorted, k, "mxfp4_grouped_matmul_ref")
    check_group_sizes(group_sizes, e, x_sorted.shape[0], "mxfp4_grouped_matmul_ref")
    w = dequantize_f32(blocks, scales)                                    # [E, N, K]
    return jax.lax.ragged_dot(x_sorted.astype(jnp.float32), jnp.swapaxes(w, 1, 2),
                              group_sizes.astype(jnp.int32), precision=_HIGHEST,
                              preferred_element_type=jnp.float32)
