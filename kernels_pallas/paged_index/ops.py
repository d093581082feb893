"""Public paged lightning-indexer scores: choose a Pallas kernel or XLA.

``paged_index_scores(q, weights, pool, block_table, page_size)`` has the signature and semantics
of ``ref.paged_index_scores_ref``: scores ``[B, T, W * page_size]`` float32,
``I[b, t, s] = sum_j w[b, t, j] * relu(q[b, t, j] . k[b, s])`` with key ``s`` of row ``b`` at
pool row ``block_table[b, s // page] * page + s % page``, and 0 where the page id is -1.

``impl="pallas"`` runs a kernel that reads the keys through the block table: ``backend=
"triton"`` (``kernel.py``, GPU; rows gathered by pointer arithmetic) or ``"mosaic"``
(``kernel_tpu.py``, TPU; pages fetched by DMA). The default is the platform's (Triton on GPU,
Mosaic on TPU); CPU runs either in interpret mode, Triton by default, as for the sparse MLA
kernel. ``impl="xla"`` runs the reference, which gathers the keys into a contiguous copy first.
Not differentiable: the indexer's scores only choose the top-k keys (``model/dsa.py``), and
its training loss runs on unpaged keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from kdsa.kernels_pallas import common
from kdsa.kernels_pallas.paged_index import kernel, kernel_tpu
from kdsa.kernels_pallas.paged_index.ref import check_inputs, paged_index_scores_ref

IMPLS = ("pallas", "xla")
BACKENDS = ("triton", "mosaic")
f32 = jnp.float32


def supports(width: int, page_size: int, pool_rows: int, backend: str | None = None,
             dtype=jnp.bfloat16) -> bool:
    """Whether the platform's (or ``backend``'s) kernel takes ``dtype`` keys of ``width`` in
    pages of ``page_size`` from a pool of ``pool_rows`` rows with its default blocks; the model
    falls back to XLA where it does not (``model/paged_attention.py``)."""
    backend = backend or default_backend()
    ppb = default_pages_per_block(page_size, KEYS_PER_BLOCK[backend])
    try:
        if backend == "mosaic":
            kernel_tpu.check_tiles(page_size, ppb, dtype)
        else:
            kernel.check_tiles(width, page_size, ppb, pool_rows, jnp.dtype(dtype).itemsize)
    except (ValueError, NotImplementedError):
        return False
    return True


def default_backend() -> str:
    """The kernel of this platform (or :func:`common.compile_target`): Mosaic on TPU, else
    Triton (GPU; CPU interprets it)."""
    return "mosaic" if common.backend() == "tpu" else "triton"


KEYS_PER_BLOCK = {"triton": 512, "mosaic": 2048}  # a Mosaic grid step costs ~0.35 us on its own


def default_pages_per_block(page_size: int, keys: int = 512) -> int:
    """Pages per grid step: about ``keys`` keys a step (at least one lane tile of 128, a power of
    two for Triton), so that a step's fixed cost is spread over a ``[rows, keys]`` score tile
    (:data:`KEYS_PER_BLOCK` per backend)."""
    ppb = max(1, keys // page_size)
    while (ppb * page_size) % 128 or ppb & (ppb - 1):
        ppb += 1
    return ppb


def _pad_table(block_table, ppb: int):
    wp = common.round_up(block_table.shape[1], ppb)
    return jnp.pad(block_table.astype(jnp.int32), ((0, 0), (0, wp - block_table.shape[1])),
                   constant_values=-1)                                        # [B, Wp]


def prepare_mosaic(q, weights, block_table, ppb: int):
    """``kernel_tpu``'s layout: ``q [B, TJp, D]``, ``w [B, T, TJp]`` float32 (row ``t`` holds
    query ``t``'s head weights in its ``J`` columns), the table ``[B, Wp]``."""
    b, t, j, d = q.shape
    tjp = common.round_up(t * j, common.sublanes(q.dtype))
    qf = jnp.pad(q.reshape(b, t * j, d), ((0, 0), (0, tjp - t * j), (0, 0)))
    eye = jnp.eye(t, dtype=f32)
    w = (eye[None, :, :, None] * weights.astype(f32)[:, None]).reshape(b, t, t * j)
    w = jnp.pad(w, ((0, 0), (0, 0), (0, tjp - t * j)))
    return qf, w, _pad_table(block_table, ppb)


def prepare_triton(q, weights, block_table, ppb: int):
    """``kernel``'s layout: heads padded to ``Jp`` (a power of two >= 16), ``q [B, T, Jp, D]``,
    ``w [B, T, Jp]`` float32, the table ``[B, Wp]``."""
    j = q.shape[2]
    jp = max(16, common.next_pow2(j))
    qp = jnp.pad(q, ((0, 0), (0, 0), (0, jp - j), (0, 0)))
    wp = jnp.pad(weights.astype(f32), ((0, 0), (0, 0), (0, jp - j)))
    return qp, wp, _pad_table(block_table, ppb)


def paged_index_scores(q: jax.Array, weights: jax.Array, pool: jax.Array,
                       block_table: jax.Array, page_size: int, *, impl: str = "pallas",
                       backend: str | None = None, pages_per_block: int | None = None,
                       interpret: bool | pltpu.InterpretParams | None = None) -> jax.Array:
    """Scores ``[B, T, W * page_size]`` float32 (module docstring). ``backend``: None (the
    platform's), "triton" or "mosaic"; ``pages_per_block``: pages per grid step (default
    :func:`default_pages_per_block`); ``interpret``: None (interpret on CPU only), a bool, or
    ``pltpu.InterpretParams`` (the TPU simulator; Mosaic only)."""
    if impl not in IMPLS:
        raise ValueError(f"paged_index_scores: impl must be one of {IMPLS}, got {impl!r}")
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"paged_index_scores: backend must be one of {BACKENDS}, got "
                         f"{backend!r}")
    check_inputs(q, weights, pool, block_table, page_size)
    if impl == "xla":
        return paged_index_scores_ref(q, weights, pool, block_table, page_size)
    if q.dtype != pool.dtype:  # casting the pool would copy it, the copy the kernel avoids
        raise ValueError(f"paged_index_scores: q ({q.dtype}) and pool ({pool.dtype}) must share "
                         f"a dtype (the model keeps both in index_dtype); or use impl='xla'")
    ppb = pages_per_block or default_pages_per_block(page_size, KEYS_PER_BLOCK[backend])
    if not isinstance(interpret, pltpu.InterpretParams):
        interpret = common.resolve_interpret(interpret)
    if backend == "mosaic":
        qf, w, table = prepare_mosaic(q, weights, block_table, ppb)
        scores = kernel_tpu.paged_index_scores_tpu(qf, w, pool, table, page=page_size, ppb=ppb,
                                                   interpret=interpret)
    else:
        if isinstance(interpret, pltpu.InterpretParams) or (
                not interpret and common.backend() == "tpu"):
            raise NotImplementedError("paged_index_scores: the Triton kernel runs on GPU or in "
                                      "the generic interpreter; use backend='mosaic' on TPU")
        qp, w, table = prepare_triton(q, weights, block_table, ppb)
        scores = kernel.paged_index_scores_triton(qp, w, pool, table, page=page_size, ppb=ppb,
                                                  interpret=interpret)
    return jax.lax.stop_gradient(scores[:, :, :block_table.shape[1] * page_size])
