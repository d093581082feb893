"""Pallas TPU (Mosaic) kernel: lightning-indexer scores of queries against their rows' pages,
read from the pool by DMA through the block table, with no contiguous copy of the keys.

What XLA does without it (``model/dsa.py : indexer_topk`` on a paged cache): gather each row's
index keys into a ``[B, S, D]`` copy, then score the copy. The copy is written and read once
more per layer and step; at K3's widths (one 128-wide bfloat16 key per token) and 1M tokens it
is 256 MB per row. The same problem is what DeepGEMM's ``fp8_paged_mqa_logits`` solves for
DeepSeek-V3.2's decode on GPU.

Layout (prepared by ``ops.py``):

* ``q [B, TJp, D]``: the ``T`` queries' ``J`` index heads folded into rows, zero-padded to a
  multiple of the sublane tile; ``w [B, T, TJp]`` float32: row ``t`` holds query ``t``'s head
  weights at columns ``t * J .. t * J + J - 1``, zeros elsewhere, so the weighted sum over heads
  is one matmul ``w @ relu(q k^T)``;
* the pool ``[R, D]`` stays in HBM (``memory_space=pltpu.HBM``): page ``p`` is rows
  ``[p * page, (p + 1) * page)``, a run of whole ``(8, 128)`` tiles when ``page`` is a multiple
  of the sublane tile (8 rows for 32-bit keys, 16 for bfloat16);
* the block table ``[B, Wp]`` (``Wp`` a multiple of ``ppb``, padded with -1): each program
  reads its row as an SMEM block, whose entries are the DMA addresses (a row, not the whole
  table, so SMEM holds 64 KB at 1M tokens whatever the batch).

Grid ``(B, Wp / ppb)``; the second axis walks a row's pages in blocks of ``ppb`` ("arbitrary"),
the first is "parallel". At block ``j`` the kernel starts the ``ppb`` page DMAs of block
``j + 1`` into the other half of a ``[2, ppb * page, D]`` VMEM double buffer (one semaphore per
half, waited once for all its pages), waits for block ``j`` and computes ``[T, ppb * page]``
scores: ``(w @ relu(q @ keys^T))``, float32 accumulation. A page id of -1 is not fetched (its
start and wait are skipped: a row shorter than the table costs no reads) and its columns are
written as 0 (the reference's convention).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kdsa.kernels_pallas.common import DIMS_NT, dot_f32, sublanes

f32 = jnp.float32


def check_tiles(page_size: int, pages_per_block: int, dtype) -> None:
    """ValueError / NotImplementedError for what this kernel cannot tile (module docstring)."""
    if jnp.dtype(dtype) not in (jnp.dtype(f32), jnp.dtype(jnp.bfloat16)):
        raise NotImplementedError(f"paged_index_scores TPU kernel: dtype {jnp.dtype(dtype)} not "
                                  f"supported (float32 or bfloat16)")
    if page_size % sublanes(dtype):
        raise ValueError(f"paged_index_scores TPU kernel: page_size = {page_size} must be a "
                         f"multiple of {sublanes(dtype)} for {jnp.dtype(dtype)} (whole tiles)")
    if pages_per_block < 1 or (pages_per_block * page_size) % 128:
        raise ValueError(f"paged_index_scores TPU kernel: pages_per_block * page_size = "
                         f"{pages_per_block} * {page_size} must be a positive multiple of 128 "
                         f"(the score block's lanes)")


def _kernel(table_ref, q_ref, w_ref, pool_hbm, out_ref, buf, sems, *, page: int, ppb: int):
    j, nj = pl.program_id(1), pl.num_programs(1)
    slot = j % 2

    def page_dma(block, half, i):  # page i of page block `block` into buffer half `half`
        page_id = table_ref[0, block * ppb + i]
        src = pool_hbm.at[pl.ds(pl.multiple_of(jnp.maximum(page_id, 0) * page, page), page)]
        return page_id >= 0, pltpu.make_async_copy(src, buf.at[half, pl.ds(i * page, page)],
                                                   sems.at[half])

    def start(block, half):  # a -1 page is not fetched: its columns are written as 0
        for i in range(ppb):
            backed, dma = page_dma(block, half, i)
            pl.when(backed)(dma.start)

    @pl.when(j == 0)
    def _():
        start(0, 0)

    @pl.when(j + 1 < nj)
    def _():
        start(j + 1, 1 - slot)

    for i in range(ppb):  # one wait per fetched page (the semaphore counts bytes)
        backed, dma = page_dma(j, slot, i)
        pl.when(backed)(dma.wait)
    logits = dot_f32(q_ref[...], buf[slot], DIMS_NT)                          # [TJp, n]
    scores = dot_f32(w_ref[...], jnp.maximum(logits, 0.0))                    # [T, n]
    col_page = jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (1, ppb * page), 1),
                           jnp.int32(page))                          # no floor: all >= 0
    backed = jnp.zeros((1, ppb * page), jnp.bool_)
    for i in range(ppb):  # (a skipped page's buffer rows hold stale data, maybe NaN)
        backed = backed | ((col_page == i) & (table_ref[0, j * ppb + i] >= 0))
    out_ref[...] = jnp.where(backed, scores, 0.0)


def paged_index_scores_tpu(q, w, pool, table, *, page: int, ppb: int, interpret):
    """Prepared layout (module docstring) -> scores ``[B, T, Wp * page]`` float32.

    ``q [B, TJp, D]``, ``w [B, T, TJp]`` float32, ``pool [R, D]``, ``table [B, Wp]`` int32;
    ``interpret``: False (Mosaic), True (the generic interpreter) or ``pltpu.InterpretParams``
    (the TPU simulator)."""
    b, tjp, d = q.shape
    t, wp = w.shape[1], table.shape[1]
    n = ppb * page
    check_tiles(page, ppb, pool.dtype)
    pool = pltpu.with_memory_space_constraint(pool, pltpu.HBM)  # else XLA may copy it to VMEM
    return pl.pallas_call(
        functools.partial(_kernel, page=page, ppb=ppb),
        out_shape=jax.ShapeDtypeStruct((b, t, wp * page), f32),
        grid=(b, wp // ppb),
        in_specs=[pl.BlockSpec((None, 1, wp), lambda i, j: (i, 0, 0), memory_space=pltpu.SMEM),
                  pl.BlockSpec((None, tjp, d), lambda i, j: (i, 0, 0)),
                  pl.BlockSpec((None, t, tjp), lambda i, j: (i, 0, 0)),
                  pl.BlockSpec(memory_space=pltpu.HBM)],
        out_specs=pl.BlockSpec((None, t, n), lambda i, j: (i, 0, j)),
        scratch_shapes=[pltpu.VMEM((2, n, d), pool.dtype), pltpu.SemaphoreType.DMA((2,))],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret, name="paged_index_scores_tpu",
    )(table[:, None], q, w, pool)
