"""Public paged lightning-indexer scores: choose the Pallas kernel or XLA.

``paged_index_scores(q, weights, pool, block_table, page_size)`` has the signature and semantics
of ``ref.paged_index_scores_ref``: scores ``[B, T, W * page_size]`` float32,
``I[b, t, s] = sum_j w[b, t, j] * relu(q[b, t, j] . k[b, s])`` with key ``s`` of row ``b`` at
pool row ``block_table[b, s // page] * page + s % page``, and 0 where the page id is -1.

``impl="pallas"`` runs the Mosaic kernel (``kernel_tpu.py``: pages fetched by DMA through the
block table) on TPU, and in interpret mode on CPU; on GPU it raises ``NotImplementedError``
(there is no Triton version yet: use ``impl="xla"``). ``impl="xla"`` runs the reference, which
gathers the keys into a contiguous copy first. Not differentiable: the indexer's scores only
choose the top-k keys (``model/dsa.py``), and its training loss runs on unpaged keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from kdsa.kernels_pallas import common
from kdsa.kernels_pallas.paged_index import kernel_tpu
from kdsa.kernels_pallas.paged_index.ref import check_inputs, paged_index_scores_ref

IMPLS = ("pallas", "xla")
f32 = jnp.float32


def has_kernel() -> bool:
    """Whether ``impl="pallas"`` has a kernel on this backend (TPU; CPU in interpret mode)."""
    return common.backend() in ("cpu", "tpu")


def default_pages_per_block(page_size: int) -> int:
    """Pages per grid step: 512 keys a step (at least one lane tile of 128), so that a step's
    fixed cost is spread over a few DMAs and a ``[TJp, 512]`` score tile."""
    ppb = max(1, 512 // page_size)
    while (ppb * page_size) % 128:
        ppb += 1
    return ppb


def prepare(q, weights, block_table, ppb: int):
    """Kernel layout (``kernel_tpu`` docstring): ``q [B, TJp, D]``, ``w [B, T, TJp]`` float32,
    the table ``[B * Wp]`` padded with -1 to a multiple of ``ppb`` pages."""
    b, t, j, d = q.shape
    tjp = common.round_up(t * j, kernel_tpu.sublanes(q.dtype))
    qf = jnp.pad(q.reshape(b, t * j, d), ((0, 0), (0, tjp - t * j), (0, 0)))
    eye = jnp.eye(t, dtype=f32)
    w = (eye[None, :, :, None] * weights.astype(f32)[:, None]).reshape(b, t, t * j)
    w = jnp.pad(w, ((0, 0), (0, 0), (0, tjp - t * j)))
    wp = common.round_up(block_table.shape[1], ppb)
    table = jnp.pad(block_table.astype(jnp.int32), ((0, 0), (0, wp - block_table.shape[1])),
                    constant_values=-1)
    return qf, w, table.reshape(-1)


def paged_index_scores(q: jax.Array, weights: jax.Array, pool: jax.Array,
                       block_table: jax.Array, page_size: int, *, impl: str = "pallas",
                       pages_per_block: int | None = None,
                       interpret: bool | pltpu.InterpretParams | None = None) -> jax.Array:
    """Scores ``[B, T, W * page_size]`` float32 (module docstring). ``pages_per_block``: pages
    per grid step (default :func:`default_pages_per_block`); ``interpret``: None (interpret on
    CPU only), a bool, or ``pltpu.InterpretParams`` (the TPU simulator)."""
    if impl not in IMPLS:
        raise ValueError(f"paged_index_scores: impl must be one of {IMPLS}, got {impl!r}")
    check_inputs(q, weights, pool, block_table, page_size)
    if impl == "xla":
        return paged_index_scores_ref(q, weights, pool, block_table, page_size)
    if not has_kernel():
        raise NotImplementedError("paged_index_scores: no GPU (Triton) kernel yet; use "
                                  "impl='xla'")
    dt = jnp.promote_types(q.dtype, pool.dtype)
    ppb = pages_per_block or default_pages_per_block(page_size)
    qf, w, table = prepare(q.astype(dt), weights, block_table, ppb)
    if not isinstance(interpret, pltpu.InterpretParams):
        interpret = common.resolve_interpret(interpret)
    scores = kernel_tpu.paged_index_scores_tpu(qf, w, pool.astype(dt), table, page=page_size,
                                               ppb=ppb, interpret=interpret)
    return jax.lax.stop_gradient(scores[:, :, :block_table.shape[1] * page_size])
