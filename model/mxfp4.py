"""MXFP4 (OCP Microscaling Formats v1.0): quantise, dequantise, fake-quantise, checkpoint layouts.

A block of 32 consecutive elements along the last axis shares one scale X = 2^(c - 127) stored as
an E8M0 byte c (0..254; 0xFF is NaN). Each element is an E2M1 code (bit 3 sign, bits 2-1
exponent with bias 1, bit 0 mantissa) worth LUT[code] * X with

    LUT = [+0, 0.5, 1, 1.5, 2, 3, 4, 6, -0, -0.5, -1, -1.5, -2, -3, -4, -6]

Storage is 32 x 4 + 8 = 136 bits per block, 4.25 bits per element (0.266 of bf16).

Layout (byte for byte the published checkpoints, so conversion is a reshape):

* ``blocks`` uint8 ``[..., K/32, 16]``: byte j of block g holds element k = 32 g + 2 j in its
  **low** nibble and k + 1 in its high nibble. ``scales`` uint8 ``[..., K/32]``, raw E8M0.
* gpt-oss (``*_blocks [E, rows, K/32, 16]``, ``*_scales [E, rows, K/32]``, rows = output
  features, blocks along the contracting dim): exactly this (reference file ``mxfp4.md`` §2;
  ``jax.lax.bitcast_convert_type(blocks, float4_e2m1fn)`` also yields the low nibble first).
* Kimi K3 compressed-tensors ``mxfp4-pack-quantized`` experts: ``weight_packed`` uint8
  ``[N, K/2]`` is the same bytes flattened over (K/32, 16), ``weight_scale`` uint8 ``[N, K/32]``
  the same E8M0 bytes. Checked against compressed-tensors
  ``compressors/quantized_compressors/fp4_quantized.py``: ``pack_fp4_to_uint8`` packs each
  consecutive pair as ``codes[2i] | codes[2i + 1] << 4`` (even element in the low nibble) and
  ``MXFP4PackedCompressor`` is an alias of that packer; ``quantization/utils/mxfp4_utils.py``
  stores scales as ``uint8(exponent + 127)`` and picks them as ``floor(log2(round_mantissa(amax)))
  - 2`` after rounding amax to one mantissa bit (the "even" rule below). See
  :func:`pack_to_compressed_tensors` / :func:`unpack_from_compressed_tensors`.

Scale rules (``shared_exp``; X = 2^shared_exp, clamped to the E8M0 range [-127, 127]):

* ``"floor"``: OCP MX v1.0 §6.3 example, ``floor(log2 amax) - 2``. amax/X lies in [4, 8), so a
  block maximum in (6X, 8X) is clipped to 6X (up to 25% error on the largest element).
* ``"ceil"``: ``ceil(log2(amax / 6))`` (jax ``scaled_dot_general``, triton_kernels, cuBLAS RCEIL).
  amax/X lies in (3, 6]: never clips, loses up to one binade of resolution.
* ``"even"`` (default; torchao EVEN, qwix OAS, compressed-tensors): round amax's mantissa to one
  bit (ties up) before the floor, i.e. ``floor(log2(amax / 3.5))``; amax/X lies in [3.5, 7), the
  only clipping is (6X, 7X) -> 6X. Best SQNR of the three; measured with this code on 6.4M
  values (same as ``mxfp4.md`` §1): Gaussian floor 18.79 dB, ceil 18.76, even 19.03; Student-t(3)
  floor 17.00, ceil 16.47, even 17.16.

Elements round to nearest, ties to even, and saturate at +-6. All exponent and rounding decisions
are made with integer operations on the float32 bit pattern: XLA on CPU flushes subnormal inputs
and results to zero (measured: ``2^-130 * 2^100 -> 0`` under jit), TPUs have no subnormals, and
``ml_dtypes`` casts turn NaN into 0 and pick E8M0 scales in linear space, so no float cast or
float ``max`` decides anything here. The encodings are exact: ``dequantize_mxfp4`` is bit-identical
to a NumPy LUT + ``ldexp`` reference for all 16 codes and all 255 scales, subnormal results
included (scale codes 0 and 1); products of magnitude >= 2^128 (codes >= 4.0 at scale 2^127,
4.0/6.0 at 2^126) overflow to +-inf in bf16/f32, which the format allows but our quantiser can
only produce for inputs near the float32 maximum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kdsa.kernels_pallas.mxfp4_matmul.decode import (BLOCK, E8M0_BIAS, SCALE_NAN,  # noqa: F401
                                                     block_bits)

SCALE_RULES = ("floor", "ceil", "even")
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_MANT = 0x7FFFFF
_INF_BITS = 0x7F800000


# ----------------------------------------------------------------------------- bit helpers

def _f32_bits(x: jax.Array) -> jax.Array:
    """int32 float32 bit pattern of ``x``; bf16 and f32 go through bits only (no flushing)."""
    if x.dtype == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.int32) << 16
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def _log2_parts(abs_bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(floor(log2 v), 23-bit fraction of v normalised to [1, 2))`` for v > 0 given its bits.

    Subnormals are normalised with a count-leading-zeros; the result for v = 0 is meaningless and
    must be masked by the caller."""
    exp = abs_bits >> 23
    mant = abs_bits & _MANT
    top = 31 - jax.lax.clz(jnp.maximum(mant, 1))       # position of the leading 1 of a subnormal
    sub_frac = (mant << jnp.clip(23 - top, 0, 31)) & _MANT
    flog2 = jnp.where(exp > 0, exp - 127, top - 149)
    frac = jnp.where(exp > 0, mant, sub_frac)
    return flog2, frac


def _bits_to_dtype(bits: jax.Array, dtype) -> jax.Array:
    """Exact view of float32 bits as ``dtype``: bf16 keeps the high half (our values have at
    most 2 significant bits, so the low half is zero); other dtypes convert from float32."""
    if dtype == jnp.bfloat16:
        high = jax.lax.shift_right_logical(bits, 16).astype(jnp.uint16)
        return jax.lax.bitcast_convert_type(high, jnp.bfloat16)
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


# ----------------------------------------------------------------------------- quantise

def shared_exponent(amax_bits: jax.Array, scale_rule: str = "even") -> jax.Array:
    """Shared exponent (int32, in [-127, 127]) of blocks whose |max| has float32 bits ``amax_bits``.

    ``floor``: floor(log2 amax) - 2; ``ceil``: smallest s with 6 2^s >= amax, i.e. one more than
    floor when the normalised mantissa exceeds 1.5; ``even``: one more than floor when the mantissa
    is >= 1.75 (amax rounded to one mantissa bit, ties up). All-zero blocks get -127 (code 0)."""
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    flog2, frac = _log2_parts(amax_bits)
    bump = {"floor": jnp.zeros_like(frac),
            "ceil": (frac > 0x400000).astype(jnp.int32),
            "even": (frac >= 0x600000).astype(jnp.int32)}[scale_rule]
    exp = jnp.where(amax_bits == 0, -E8M0_BIAS, flog2 - 2 + bump)
    return jnp.clip(exp, -E8M0_BIAS, E8M0_BIAS)


def _round_to_e2m1(abs_bits: jax.Array, exp: jax.Array) -> jax.Array:
    """E2M1 magnitude code (0..7) of |x| / 2^exp, round to nearest even, saturating at 6.

    v = |x| 2^-exp is built from bits (exponent subtraction); v < 2^-126 rounds to 0 anyway, so
    v is always zero or a normal float and the float ops below are exact on any backend."""
    flog2, frac = _log2_parts(abs_bits)
    v_exp = flog2 + 127 - exp                                   # biased exponent of v
    v_bits = jnp.where((abs_bits != 0) & (v_exp >= 1),
                       (jnp.clip(v_exp, 0, 254) << 23) | frac, 0)
    v = jax.lax.bitcast_convert_type(v_bits, jnp.float32)
    step_exp = jnp.maximum(v_exp - 127, 0) - 1                   # grid step 2^u of v's binade
    inv_step = jax.lax.bitcast_convert_type((127 - step_exp) << 23, jnp.float32)
    q = jnp.round(v * inv_step)                                  # half to even
    step2 = jax.lax.bitcast_convert_type((128 + step_exp) << 23, jnp.float32)   # 2^(u + 1)
    twice = jnp.minimum(q * step2, 12.0)                         # 2 |rounded|, saturated at 6
    return jnp.where(twice <= 4, twice, jnp.where(twice <= 6, 5, jnp.where(twice <= 8, 6, 7))
                     ).astype(jnp.int32)


def _raise_on_nonfinite(x, name: str) -> None:
    xs = np.asarray(x).astype(np.float32)
    bad = ~np.isfinite(xs).reshape(*xs.shape[:-1], -1, BLOCK).all(axis=-1)
    if bad.any():
        idx = np.unravel_index(int(np.argmax(bad)), bad.shape)
        idx = tuple(int(i) for i in idx)
        raise ValueError(
            f"{name}: NaN or Inf in block {idx} (block grid {bad.shape}; elements "
            f"{idx[-1] * BLOCK}..{idx[-1] * BLOCK + BLOCK - 1} of the last axis); "
            f"{int(bad.sum())} bad block(s) in all")


def quantize_mxfp4(x: jax.Array, scale_rule: str = "even", *, check: bool = True
                   ) -> tuple[jax.Array, jax.Array]:
    """``x [..., K]`` -> ``(blocks uint8 [..., K/32, 16], scales uint8 [..., K/32])``.

    Blocks run along the last axis (K % 32 == 0). Any float dtype; f32 and bf16 are read through
    their bits (exact, subnormals included), others are first converted to float32.
    ``check=True`` raises ``ValueError`` naming the first block holding a NaN or Inf, but only for
    concrete input: this is an offline/conversion function and under ``jit`` nothing can raise,
    so the check is skipped and such a block gets scale 0xFF (NaN) and zero codes, which
    dequantises to NaN (as torchao and the Triton upcast do). ``check=False`` skips it always.
    """
    if x.ndim < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"quantize_mxfp4: last axis must be a multiple of {BLOCK}, "
                         f"got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quantize_mxfp4: x must be floating point, got {x.dtype}")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    if check and _is_concrete(x):
        _raise_on_nonfinite(x, "quantize_mxfp4")
    lead, k = x.shape[:-1], x.shape[-1]
    bits = _f32_bits(jnp.asarray(x)).reshape(*lead, k // BLOCK, BLOCK)   # [..., G, 32]
    abs_bits = bits & 0x7FFFFFFF
    nonfinite = jnp.max(abs_bits, axis=-1) >= _INF_BITS                  # [..., G]
    amax_bits = jnp.max(abs_bits, axis=-1)                               # int order == float order
    exp = shared_exponent(amax_bits, scale_rule)                         # [..., G]
    mag = _round_to_e2m1(abs_bits, exp[..., None])                       # [..., G, 32]
    codes = jnp.where(nonfinite[..., None], 0, mag | ((bits >> 28) & 8))
    pairs = codes.reshape(*lead, k // BLOCK, BLOCK // 2, 2)              # [..., G, 16, 2]
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)
    scales = jnp.where(nonfinite, SCALE_NAN, exp + E8M0_BIAS).astype(jnp.uint8)
    return blocks, scales


# ----------------------------------------------------------------------------- dequantise

def _check_layout(blocks, scales, name: str) -> None:
    if blocks.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
        raise ValueError(f"{name}: blocks and scales must be uint8, got {blocks.dtype}, "
                         f"{scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"{name}: expected blocks [..., K/32, 16] and scales [..., K/32], got "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")


def dequantize_mxfp4(blocks: jax.Array, scales: jax.Array, dtype=jnp.bfloat16, *,
                     check: bool = True) -> jax.Array:
    """``(blocks [..., G, 16], scales [..., G])`` -> ``[..., 32 G]`` in ``dtype``.

    Exact in bf16 and f32 (every LUT value times a power of two has at most two significant bits;
    subnormals are produced from bits, see ``decode.mxfp4_f32_bits``), except that magnitudes >= 2^128
    overflow to inf. A scale byte 0xFF raises ``ValueError`` for concrete input (``check=True``);
    under ``jit`` it decodes to NaN.
    """
    _check_layout(blocks, scales, "dequantize_mxfp4")
    if check and _is_concrete(scales):
        bad = np.asarray(scales) == SCALE_NAN
        if bad.any():
            idx = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape))
            raise ValueError(f"dequantize_mxfp4: scale byte 0xFF (E8M0 NaN) at block {idx} of "
                             f"scales {tuple(scales.shape)}")
    bits = block_bits(blocks, scales)                                     # [..., G, 32]
    return _bits_to_dtype(bits, dtype).reshape(*blocks.shape[:-2], -1)


# ----------------------------------------------------------------------------- QAT

def _fake_quantize(w: jax.Array, scale_rule: str) -> jax.Array:
    blocks, scales = quantize_mxfp4(w, scale_rule, check=False)
    return dequantize_mxfp4(blocks, scales, jnp.float32, check=False).astype(w.dtype)


_fake_quantize_ste = jax.custom_vjp(_fake_quantize, nondiff_argnums=(1,))
_fake_quantize_ste.defvjp(lambda w, rule: (_fake_quantize(w, rule), None),
                          lambda rule, _, g: (g,))


def fake_quantize_mxfp4(w: jax.Array, scale_rule: str = "even", *, axis: int = -1) -> jax.Array:
    """QAT fake quantisation: forward ``dequant(quant(w))`` in w's dtype, backward identity (STE).

    Blocks of 32 run along ``axis`` (the contracting dim of the weight: -1 for Hugging Face
    ``[out, in]`` tensors, -2 for this repo's ``[..., in, out]`` kernels). jit-safe: no NaN checks;
    a block holding NaN/Inf comes out NaN. Master weights stay in their own dtype; the power-of-two
    scale is recomputed every call and gets no gradient (``mxfp4.md`` §5)."""
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"fake_quantize_mxfp4: w must be floating point, got {w.dtype}")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    w_moved = jnp.moveaxis(w, axis, -1)
    if w_moved.shape[-1] % BLOCK:
        raise ValueError(f"fake_quantize_mxfp4: axis {axis} of shape {tuple(w.shape)} is not a "
                         f"multiple of {BLOCK}")
    return jnp.moveaxis(_fake_quantize_ste(w_moved, scale_rule), -1, axis)


# ----------------------------------------------------------------------------- layouts

def pack_to_compressed_tensors(blocks: jax.Array) -> jax.Array:
    """gpt-oss ``blocks [..., K/32, 16]`` -> compressed-tensors ``weight_packed [..., K/2]``
    (a reshape: both put element 2i in the low nibble of byte i)."""
    if blocks.dtype != jnp.uint8 or blocks.ndim < 2 or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"pack_to_compressed_tensors: expected uint8 [..., K/32, 16], got "
                         f"{blocks.dtype} {tuple(blocks.shape)}")
    return blocks.reshape(*blocks.shape[:-2], -1)


def unpack_from_compressed_tensors(weight_packed: jax.Array) -> jax.Array:
    """compressed-tensors ``weight_packed [..., K/2]`` -> ``blocks [..., K/32, 16]``."""
    if (weight_packed.dtype != jnp.uint8 or weight_packed.ndim < 1
            or weight_packed.shape[-1] % (BLOCK // 2)):
        raise ValueError(f"unpack_from_compressed_tensors: expected uint8 [..., K/2] with K a "
                         f"multiple of {BLOCK}, got {weight_packed.dtype} "
                         f"{tuple(weight_packed.shape)}")
    return weight_packed.reshape(*weight_packed.shape[:-1], -1, BLOCK // 2)
