"""MoE experts stored as MXFP4 (frozen bytes) and quantisation-aware training of float experts.

Storage: each routed expert matrix ``[E, in, out]`` is kept as the Kimi K3 compressed-tensors
bytes (``weight_packed [E, out, in/2]`` uint8, ``weight_scale [E, out, in/32]`` E8M0; blocks
of 32 along the contracting dim, ``kdsa.model.mxfp4``) in a :class:`PackedExpertWeight`
variable that no optimizer sees. ``moe.RoutedExperts`` multiplies by those bytes
(``stacked_experts.PackedMatrix`` in ``moe.experts_ragged``: the Pallas grouped MXFP4 kernel,
``moe_impl="pallas"``) or by their exact dequantisation (``"xla"``). QAT (``expert_qat``)
trains float experts through a straight-through fake quantisation (:func:`qat_expert_weights`),
so the exported MXFP4 weights are the ones the training saw. :func:`pack_expert_arrays` /
:func:`unpack_expert_arrays` convert a flat parameter dict between the two forms
(``--init-from`` dequantises, the export packs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kdsa.model.config import ModelConfig
from kdsa.model.mxfp4 import (dequantize_mxfp4, fake_quantize_mxfp4, quantize_mxfp4,
                              unpack_from_compressed_tensors)


class PackedExpertWeight(nnx.Variable):
    """Frozen MXFP4 bytes of the routed experts (uint8); not an ``nnx.Param``, never trained.

    Layout = Kimi K3's compressed-tensors ``mxfp4-pack-quantized`` tensors stacked over experts:
    ``*_packed [E, N, K/2]`` (two E2M1 codes per byte, even k in the low nibble) and
    ``*_scale [E, N, K/32]`` (E8M0 bytes), rows N = output features, K = contracting dim
    (``kdsa.model.mxfp4``; ``docs/reference/kimi_k3.md`` section 2). Metadata ``param_count``
    is the number of weight elements encoded (``E*N*K`` on ``*_packed``, 0 on ``*_scale``), so
    counting by ``param_count`` instead of the byte shape reports the logical parameters.
    """


def expert_matrix_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(N, K)`` = (output features, contracting dim) of each expert matrix, HF orientation."""
    de, i = config.expert_hidden_size, config.moe_intermediate_size
    return {"w1": (i, de), "w3": (i, de), "w2": (de, i)}


def pack_expert_weight(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Our float ``[E, K, N]`` (``[in, out]``) -> ``(packed [E, N, K/2], scale [E, N, K/32])``
    uint8, quantised with the "even" scale rule (``quantize_mxfp4``)."""
    blocks, scales = quantize_mxfp4(jnp.swapaxes(w, -1, -2))         # [E, N, K/32, 16], [E, N, K/32]
    return blocks.reshape(*blocks.shape[:-2], -1), scales


def unpack_expert_weight(packed: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Inverse of :func:`pack_expert_weight`: exact dequantisation to ``[E, K, N]`` in ``dtype``."""
    w = dequantize_mxfp4(unpack_from_compressed_tensors(packed), scale, dtype, check=False)
    return jnp.swapaxes(w, -1, -2)                                   # [E, K, N]


EXPERT_MATRICES = ("w1", "w2", "w3")


def unpack_expert_arrays(flat: dict, dtype) -> dict:
    """A flat ``{key: array}`` of an MXFP4-expert model -> the same of its float-expert twin:
    every ``...experts.wN_packed`` / ``...experts.wN_scale`` pair becomes ``...experts.wN``
    (exact, :func:`unpack_expert_weight`; any leading layer axes), the rest passes through."""
    out = {}
    for key, a in flat.items():
        head, _, tail = key.rpartition(".")
        name, _, part = tail.partition("_")
        if name in EXPERT_MATRICES and part == "packed" and head.endswith("experts"):
            out[f"{head}.{name}"] = unpack_expert_weight(a, flat[f"{head}.{name}_scale"], dtype)
        elif not (name in EXPERT_MATRICES and part == "scale" and head.endswith("experts")):
            out[key] = a
    return out


def pack_expert_arrays(flat: dict) -> dict:
    """Inverse of :func:`unpack_expert_arrays` (the "even" scale rule of
    :func:`pack_expert_weight`): float ``...experts.wN`` -> ``wN_packed`` and ``wN_scale``."""
    out = {}
    for key, a in flat.items():
        head, _, name = key.rpartition(".")
        if name in EXPERT_MATRICES and head.endswith("experts"):
            out[f"{key}_packed"], out[f"{key}_scale"] = pack_expert_weight(a)
        else:
            out[key] = a
    return out


def qat_expert_weights(w1: jax.Array, w3: jax.Array, w2: jax.Array
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """QAT: ``dequant(quant(w))`` of each ``[E, in, out]`` weight, blocks of 32 along ``in`` (the
    contracting dim, as the exported MXFP4 tensors), straight-through gradient
    (``fake_quantize_mxfp4``; ``docs/reference/mxfp4.md`` section 5)."""
    return tuple(fake_quantize_mxfp4(w, axis=-2) for w in (w1, w3, w2))
