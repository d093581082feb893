"""Pallas Triton (GPU) kernel: lightning-indexer scores of queries against their rows' pages,
the pool rows gathered through the block table by pointer arithmetic, with no contiguous copy
of the keys. Same problem and result as ``kernel_tpu.py``; a different layout, since Triton
gathers rows from a ref directly (no DMA) and its matmul tiles have at least 16 rows.

Layout (prepared by ``ops.py``): ``q [B, T, Jp, D]`` (the ``J`` index heads zero-padded to a
power of two of at least 16), ``w [B, T, Jp]`` float32 (zeros in the padding), the pool
``[R, D]`` whole (``D`` a power of two of at least 16: padding it would copy the pool), the
block table ``[B, Wp]`` padded with -1 to a multiple of ``ppb`` pages.

Grid ``(B, T, Wp / ppb)``: one program per row, query and block of ``ppb`` pages. It reads the
block's page ids, expands them to the pool rows of its ``n = ppb * page`` keys (a -1 page reads
page 0), gathers those rows ``[n, D]``, and computes ``sum_j w_j relu(q_j . k)`` as one matmul
``[Jp, D] x [D, n]`` (float32 accumulation) and a weighted sum over the heads. A -1 page's
columns are written as 0 (the reference's convention).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kdsa.kernels_pallas.common import DIMS_NT, dot_f32

f32 = jnp.float32


def check_tiles(width: int, page_size: int, pages_per_block: int, pool_rows: int = 0,
                itemsize: int = 2) -> None:
    """ValueError for what Triton's power-of-two tiles and offsets cannot hold (module
    docstring). Pallas's Triton lowering addresses an operand with 64-bit offsets past 2^32
    bytes and 32-bit ones below, so only a pool of 1-byte keys with 2^31 .. 2^32 elements
    overflows them."""
    n = pool_rows * width
    if n > 2 ** 31 and n * itemsize <= 2 ** 32:
        raise ValueError(f"paged_index_scores Triton kernel: a pool of {pool_rows} x {width} "
                         f"1-byte elements passes 2^31, beyond the int32 offsets Triton uses "
                         f"below 2^32 bytes")
    for name, v in (("index key width D", width), ("page_size * pages_per_block",
                                                   page_size * pages_per_block)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"paged_index_scores Triton kernel: {name} = {v} must be a power "
                             f"of two >= 16")
    if pages_per_block & (pages_per_block - 1):
        raise ValueError(f"paged_index_scores Triton kernel: pages_per_block = "
                         f"{pages_per_block} must be a power of two")


def _kernel(table_ref, q_ref, w_ref, pool_ref, out_ref, *, page: int, ppb: int):
    ids = table_ref[...]                                                     # [ppb] int32
    n = ppb * page
    col = jax.lax.broadcasted_iota(jnp.int32, (n,), 0)
    which = jax.lax.div(col, jnp.int32(page))                                # page in the block
    lane = jax.lax.broadcasted_iota(jnp.int32, (ppb,), 0)
    page_of = jnp.zeros((n,), jnp.int32)
    for i in range(ppb):  # each key's page id: no vector gather in Triton, ppb selects
        page_of = jnp.where(which == i, jnp.sum(jnp.where(lane == i, ids, 0)), page_of)
    rows = jnp.maximum(page_of, 0) * page + (col - which * page)             # -1: page 0
    keys = pool_ref[rows, :]                                                 # [n, D]
    logits = dot_f32(q_ref[...], keys, DIMS_NT)                              # [Jp, n]
    scores = jnp.sum(jnp.maximum(logits, 0.0) * w_ref[...][:, None], axis=0)  # [n]
    out_ref[...] = jnp.where(page_of >= 0, scores, 0.0)


def paged_index_scores_triton(q, w, pool, table, *, page: int, ppb: int, interpret: bool,
                              num_warps: int = 4):
    """Prepared layout (module docstring) -> scores ``[B, T, Wp * page]`` float32."""
    b, t, jp, d = q.shape
    wp = table.shape[1]
    n = ppb * page
    check_tiles(d, page, ppb, pool.shape[0], pool.dtype.itemsize)
    return pl.pallas_call(
        functools.partial(_kernel, page=page, ppb=ppb),
        out_shape=jax.ShapeDtypeStruct((b, t, wp * page), f32),
        grid=(b, t, wp // ppb),
        in_specs=[pl.BlockSpec((None, ppb), lambda i, s, j: (i, j)),
                  pl.BlockSpec((None, None, jp, d), lambda i, s, j: (i, s, 0, 0)),
                  pl.BlockSpec((None, None, jp), lambda i, s, j: (i, s, 0)),
                  pl.BlockSpec(pool.shape, lambda i, s, j: (0, 0))],
        out_specs=pl.BlockSpec((None, None, n), lambda i, s, j: (i, s, j)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret, name="paged_index_scores",
    )(table, q, w, pool)
