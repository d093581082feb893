"""The Gated DSA layer's dense-slot decode cache (``model/dsa_layer.py``): one row of
``max_len`` slots per batch row, slot ``s`` holding the token at position ``s``; the latent KV,
the RoPE keys and the indexer's keys, and their widths and bytes. The paged form, a pool shared
by every request, is ``model/paged_cache.py``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kdsa.model.config import ModelConfig
from kdsa.model.layers import dtype_of
from kdsa.model.paged_cache import LayerBuffers


@struct.dataclass
class DSACache(LayerBuffers):
    """Per-layer decode cache, compute dtype (index_keys: ``index_dtype``). Slot ``s`` holds the
    token at position ``s``.

    kv_latent ``[B, L, kv_lora]`` (after ``kv_a_layernorm``), k_rope ``[B, L, rope]`` (after
    RoPE; unrotated with NoPE; zero columns past ``rope`` up to :func:`rope_cache_width`),
    index_keys ``[B, L, Di]`` (after ``k_norm`` and RoPE; ``Di = 0`` without an indexer).

    Inside the layer scan a layer gets its whole stack's arrays, ``[repeats, B, L, D]``, with
    ``layer`` its index there (``LayerBuffers``, shared with ``PagedDSACache``): slicing its
    own ``[B, L, D]`` out and stacking it back made XLA copy the stack's caches several times
    per decode step. ``rows_major``: whoever placed the stacks laid them out row-major (the
    engine's runner does: ``infer/cache_layout.py``), so on TPU too a layer's sparse attention
    reads its stack as rows in place, where XLA:TPU's default layout for a narrow buffer (rows
    minor) would make that reshape a copy of the stack.
    """

    kv_latent: jax.Array
    k_rope: jax.Array
    index_keys: jax.Array
    layer: jax.Array | None = None
    rows_major: bool = struct.field(pytree_node=False, default=False)

    @property
    def max_len(self) -> int:
        return self.kv_latent.shape[-2]

    def write(self, name: str, positions: jax.Array, values: jax.Array) -> jax.Array:
        """Buffer ``name`` with ``values [B, T, D]`` at slots ``positions [B, T]`` (slots
        ``>= max_len`` are dropped: padding)."""
        buf = getattr(self, name)
        rows = jnp.arange(positions.shape[0])[:, None]
        values = values.astype(buf.dtype)
        if self.layer is None:
            return buf.at[rows, positions].set(values, mode="drop")
        return buf.at[self.layer, rows, positions].set(values, mode="drop")


def index_dim(config: ModelConfig) -> int:
    return config.index_head_dim if config.use_indexer else 0


def init_dsa_cache(config: ModelConfig, batch_size: int, max_len: int,
                   rope_lanes: int | None = None) -> DSACache:
    """A zero cache for ``batch_size`` rows of ``max_len`` slots; ``rope_lanes``: see
    :func:`rope_cache_width`."""
    if batch_size < 1 or max_len < 1:
        raise ValueError(f"batch_size and max_len must be >= 1, got {batch_size}, {max_len}")
    dt = dtype_of(config.compute_dtype)
    zeros = lambda d, dt=dt: jnp.zeros((batch_size, max_len, d), dt)  # noqa: E731
    return DSACache(kv_latent=zeros(config.kv_lora_rank),
                    k_rope=zeros(rope_cache_width(config, rope_lanes)),
                    index_keys=zeros(index_dim(config), dtype_of(config.index_compute_dtype)))


def rope_cache_width(config: ModelConfig, rope_lanes: int | None = None) -> int:
    """Columns of a cache's RoPE-key buffer: ``qk_rope_head_dim``, or with ``rope_lanes``
    rounded up to a multiple of it, the extra columns zero (as are the absorbed queries' extra
    columns, so every score is the same). The engine pads to TPU's 128 lanes: XLA:TPU lays out
    a narrower bfloat16 stack ``[repeats, R, 64]`` rows-minor, and re-laid K3's 22-layer
    RoPE-key stack at every decode step: a 704 MiB copy in, one out and one per layer inside
    the scan, per device (docs/sharding.md, section 9). Padded, its row-major tiles hold the
    bytes a row-major 64-wide buffer takes anyway (TPU tiles are 128 lanes wide)."""
    return in_lanes(config.qk_rope_head_dim, rope_lanes)


def in_lanes(width: int, lanes: int | None) -> int:
    """``width`` rounded up to a multiple of ``lanes`` (unchanged without ``lanes``)."""
    return width if not lanes else -(-width // lanes) * lanes


def rope_lanes_pad(x: jax.Array, width: int) -> jax.Array:
    """``x [..., d]`` with zero columns up to ``width`` (the cache's RoPE-key width)."""
    pad = width - x.shape[-1]
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def dsa_cache_bytes_per_token(config: ModelConfig, rope_lanes: int | None = None) -> int:
    """Cache bytes per token per layer: ``(kv_lora + rope) * itemsize + Di * index itemsize``
    (K3 bf16: 1408). With ``rope_lanes`` (the engine on TPU) every row as it lies in HBM: each
    buffer's width rounded up to that many lanes, the RoPE key's explicitly
    (:func:`rope_cache_width`), the others by the row-major layout the runner gives them
    (``infer/cache_layout.py``): K3 1536, ``tiny``'s 32 + 8 + 16 columns 3 x 128."""
    size = lambda name: jnp.dtype(dtype_of(name)).itemsize  # noqa: E731
    return ((in_lanes(config.kv_lora_rank, rope_lanes) + rope_cache_width(config, rope_lanes))
            * size(config.compute_dtype)
            + in_lanes(index_dim(config), rope_lanes) * size(config.index_compute_dtype))
