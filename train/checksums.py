"""Checkpoint checksums: one ``uint32`` per array, exact and independent of the sharding.

Per array: the sum, modulo 2^32, of each element's bit pattern times an odd weight drawn from
its flat index (Knuth's multiplicative hash). Integer addition modulo 2^32 is associative, so
the value does not depend on the reduction order, that is on how the array is split: a state
saved on one mesh checks exactly when restored onto another, where a float32 sum differs in its
last bits. A changed element changes it (odd weights are invertible modulo 2^32), and so does a
moved one, unless two changes cancel exactly. The checkpoint's ``meta`` item holds them
(``checksums``); steps written before them hold float32 sums (``fingerprint``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _bits(x: jax.Array) -> jax.Array:
    """The array's bit patterns as uint32 (a 1- or 2-byte dtype zero-extended, an 8-byte one's
    two words mixed)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if x.dtype.itemsize == 8:  # (64-bit types under JAX_ENABLE_X64) two words, mixed
        words = lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
        return words[..., 0] ^ (words[..., 1] * jnp.uint32(0x85EBCA6B))
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(x.dtype.itemsize)
    if width is None:
        raise ValueError(f"cannot checksum a {x.dtype} array")
    return lax.bitcast_convert_type(x, width).astype(jnp.uint32)


@jax.jit
def _checksums(flat: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """``{key: uint32 scalar}``: the checksum of each array (module docstring)."""
    out = {}
    for k, v in flat.items():
        index = jnp.zeros(v.shape, jnp.uint32)
        for d in range(v.ndim):  # the row-major flat index, modulo 2^32
            index = index * jnp.uint32(v.shape[d]) + lax.broadcasted_iota(jnp.uint32, v.shape, d)
        weight = index * jnp.uint32(0x9E3779B1) | jnp.uint32(1)  # Knuth's multiplicative hash
        out[k] = jnp.sum(_bits(v) * weight, dtype=jnp.uint32)
    return out


@jax.jit
def _float_sums(flat: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The float32 sum of each array: what steps saved before the checksums recorded."""
    return {k: jnp.sum(v.astype(jnp.float32)) for k, v in flat.items()}


def checksums(flat: dict[str, jax.Array]) -> dict[str, int]:
    return {k: int(v) for k, v in jax.device_get(_checksums(flat)).items()}


def mismatched(meta: dict, flat: dict[str, jax.Array]) -> list[str]:
    """The keys whose arrays do not match the checkpoint's record: exact ``checksums``, or for a
    step saved before them, its float32 ``fingerprint`` sums within a relative 1e-4 or 1e-3 (the
    sums' rounding depends on the sharding the step was saved from, and a sum near zero keeps
    only its rounding)."""
    if "checksums" in meta:
        want, have = meta["checksums"], checksums(flat)
        return [k for k in have if want.get(k) != have[k]]
    want, have = meta.get("fingerprint", {}), jax.device_get(_float_sums(flat))
    return [k for k in have if not np.isclose(float(have[k]), want.get(k, np.nan),
                                              rtol=1e-4, atol=1e-3)]
