"""The MXFP4 element decode (OCP Microscaling Formats v1.0), shared by the kernels and the model.

One function, :func:`mxfp4_f32_bits`: an E2M1 code and its block's E8M0 scale byte -> the
float32 bit pattern of ``LUT[code] * 2^(scale - 127)``. Integer ops and selects only, so it
runs unchanged in XLA and inside Pallas kernels (Triton, Mosaic), and subnormal results (scale
codes 0 and 1) are exact although XLA on CPU flushes subnormal float arithmetic to zero.
``kdsa.model.mxfp4`` (quantise, dequantise, checkpoint layouts) builds on it and tests it
bit for bit against a NumPy LUT + ``ldexp`` decode for all 16 codes and all 255 finite
scales (``tests/test_mxfp4.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 32  # elements sharing one scale
E8M0_BIAS = 127
SCALE_NAN = 0xFF  # the E8M0 NaN byte

_INF_BITS = 0x7F800000
_NAN_BITS = 0x7FC00000


def mxfp4_f32_bits(codes: jax.Array, scale_codes: jax.Array) -> jax.Array:
    """float32 bit pattern (int32) of ``LUT[code] * 2^(scale - 127)``, exactly.

    ``codes`` int32 in [0, 16), ``scale_codes`` int32 in [0, 256), broadcastable. Integer ops and
    selects only, so the same function runs in XLA and inside Pallas kernels (Triton, Mosaic)
    without relying on subnormal float arithmetic. Scale 0xFF decodes to NaN (OCP MX §5.1).
    With 2|v| = q in {0, 1, 2, 3, 4, 6, 8, 12}: a normal result has biased exponent
    ``E = E_elem + scale - 127``; a subnormal one (E <= 0, only for scale <= 1) has mantissa
    field ``q << (scale + 21)``, since v = q 2^(scale - 128) = (q 2^(scale + 21)) 2^-149.
    """
    mag = codes & 7
    e = mag >> 1
    m = mag & 1
    q = jnp.where(e == 0, m, (2 + m) << jnp.maximum(e - 1, 0))
    elem_exp = jnp.where(e == 0, 126, e + 126)           # biased exponent of LUT[mag], mag > 0
    mbit = jnp.where(e == 0, 0, m)
    big_e = elem_exp + scale_codes - E8M0_BIAS
    normal = (jnp.clip(big_e, 0, 254) << 23) | (mbit << 22)
    subnormal = q << (jnp.minimum(scale_codes, 1) + 21)
    bits = jnp.where(big_e >= 255, _INF_BITS, jnp.where(big_e >= 1, normal, subnormal))
    bits = jnp.where(mag == 0, 0, bits) | ((codes & 8) << 28)
    return jnp.where(scale_codes == SCALE_NAN, _NAN_BITS, bits)


def block_bits(blocks: jax.Array, scales: jax.Array) -> jax.Array:
    """``blocks [..., G, 16]`` uint8, ``scales [..., G]`` uint8 -> float32 bit patterns (int32)
    ``[..., G, 32]``: element ``32 g + 2 j`` from the low nibble of byte ``j``, ``32 g + 2 j + 1``
    from the high one (the Hugging Face / gpt-oss layout)."""
    b = blocks.astype(jnp.int32)
    codes = jnp.stack([b & 0xF, b >> 4], axis=-1).reshape(*blocks.shape[:-1], BLOCK)
    return mxfp4_f32_bits(codes, scales.astype(jnp.int32)[..., None])
