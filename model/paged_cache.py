"""Paged decode caches: the Gated DSA layers' rows live in pages of one pool shared by all
requests; a block table says which pages hold each request's positions.

Layout (PagedAttention, Kwon et al. 2023, applied to the MLA latent cache and the indexer keys)::

    pool rows        [(P + 1) * PAGE_SIZE, D]  one array per DSA layer and cache part (the
                                               last page: scratch, ``SCRATCH_ROWS``)
    block_table      [B, max_pages] int32      page id of positions [j * PAGE_SIZE, (j+1) * PAGE_SIZE)
                                               of row b; -1: no page (positions there are invisible)
    slot(b, p)     = block_table[b, p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE

The same token sits at the same slot in every DSA layer, so one table serves the whole stack.
KDA layers keep their constant-size state per running request (``[repeats, slots, ...]``, as in
the dense-slot cache): nothing of theirs grows with the context.

Top-k token positions become slots inside the jitted step (-1 stays -1), so the sparse attention
(reference or Pallas kernel) gathers its K rows straight from the pool: queries of all rows are
one batch of ``B * T`` against the pool, with no per-request copy of the cache. The indexer
reads every visible key of a row once per step, gathered through the table (it scores them
all in any case); dense MLA (no indexer) gathers the visible rows the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

PAGE_SIZE = 64
# Rows after each partition's pages, a page's worth: the last is the scratch row (the writes of
# tokens without a page), the others are unused. A whole page keeps every layer's rows a whole
# number of pages and TPU tiles: the TPU sparse attention kernel reads 16-bit rows as 32-bit
# row pairs and padded (copied) a pool with an odd row count at every step, and a layer reads
# its stack's pools as one ``[L * R, D]`` array (``PagedDSACache.stacked``), a free reshape only
# when ``R`` is a whole number of tiles.
SCRATCH_ROWS = PAGE_SIZE
BUFFERS = ("kv_latent", "k_rope", "index_keys")  # a DSA layer's cache buffers, by name


class LayerBuffers:
    """What a DSA layer's cache (``DSACache`` dense slots, :class:`PagedDSACache` pools) does
    with its three buffers ``kv_latent``, ``k_rope``, ``index_keys`` and its ``layer`` index:
    inside the layer scan a layer holds its whole stack's buffers ``[repeats, ...]`` and reads
    and writes its own ``[layer]`` in place."""

    def view(self, name: str) -> jax.Array:
        """This layer's buffer ``name``, to read."""
        buf = getattr(self, name)
        return buf if self.layer is None else jax.lax.dynamic_index_in_dim(
            buf, self.layer, keepdims=False)

    def settled(self):
        """The buffers after this step's writes, fenced from the reads that follow. Without the
        fence XLA fuses a small gather (the top-k rows of a decode step) with the write before
        it, reading the old buffer plus the written rows: the old buffer must then outlive the
        in-place write, which costs two whole-buffer copies per buffer and step."""
        bufs = jax.lax.optimization_barrier(tuple(getattr(self, n) for n in BUFFERS))
        return self.replace(**dict(zip(BUFFERS, bufs)))


@struct.dataclass
class PagedDSACache(LayerBuffers):
    """One DSA layer's pooled cache: kv_latent ``[R, kv_lora]``, k_rope ``[R, rope]`` (compute
    dtype; ``dsa_cache.rope_cache_width`` columns), index_keys ``[R, Di]`` (``index_dtype``)
    with ``R = (num_pages + 1) * PAGE_SIZE`` rows (:data:`SCRATCH_ROWS`): the last,
    :attr:`scratch_row`, belongs to no page and takes the writes of tokens that have no page
    (padding), so every write is in bounds (a write XLA must be ready to drop made it copy the
    whole pool to keep the old value); the rest of the last page is unused.

    On a mesh whose layout splits the batch over ``parts`` device groups the pool is ``parts``
    such pools end to end, ``R = parts * (num_pages / parts + 1) * PAGE_SIZE``, split over the
    same groups: group ``p`` holds pages ``[p * n, (p + 1) * n)`` (``n`` pages per part) for the
    slots it runs (``model/paged_attention.py``).

    Inside the layer scan a layer gets the pools of its whole stack, ``[repeats, R, D]``, with
    ``layer`` its index there, and reads and writes them as one ``[repeats * R, D]`` array whose
    rows ``[layer * R, (layer + 1) * R)`` are its own (:meth:`stacked`): slicing its own
    ``[R, D]`` out made XLA:TPU copy each of its pools at every step, and stacking it back
    copied every pool."""
    kv_latent: jax.Array
    k_rope: jax.Array
    index_keys: jax.Array
    layer: jax.Array | None = None
    parts: int = struct.field(pytree_node=False, default=1)

    @property
    def num_rows(self) -> int:
        return self.kv_latent.shape[-2]

    @property
    def pages_per_part(self) -> int:
        return (self.num_rows // self.parts - SCRATCH_ROWS) // PAGE_SIZE

    def page_rows(self, pages: jax.Array) -> jax.Array:
        """The first pool row of each page id (``pages`` >= 0): partition ``g // pages_per_part``
        holds page ``g`` at local page ``g % pages_per_part`` (``init_paged_dsa_cache``)."""
        per = self.pages_per_part
        return (pages // per) * (self.num_rows // self.parts) + (pages % per) * PAGE_SIZE

    @property
    def scratch_row(self) -> int:
        return self.num_rows - 1

    @property
    def first_row(self) -> jax.Array | int:
        """Where this layer's rows start in :meth:`stacked`'s arrays (a whole page: ``R`` is)."""
        return 0 if self.layer is None else self.layer * self.num_rows

    def stacked(self, name: str) -> jax.Array:
        """Pool ``name`` of the layer's whole stack as rows ``[repeats * R, D]`` (``[R, D]``
        outside a scan): its own row ``r`` is row ``first_row + r``. A reshape, no copy."""
        pool = getattr(self, name)  # (an indexer-less layer's index_keys are [.., R, 0])
        return pool if self.layer is None else pool.reshape(pool.shape[0] * pool.shape[1],
                                                            pool.shape[2])

    def write(self, name: str, rows: jax.Array, values: jax.Array) -> jax.Array:
        """Pool ``name`` with ``values [n, D]`` at this layer's ``rows [n]``, each in
        ``[0, num_rows)`` (the scratch row for a token without a page)."""
        pool = getattr(self, name)
        flat = self.stacked(name).at[rows + self.first_row].set(values.astype(pool.dtype),
                                                                  mode="promise_in_bounds")
        return flat.reshape(pool.shape)


@struct.dataclass
class PagedCache:
    """The whole stack's paged cache: ``layers`` has the dense-slot cache's structure (per
    segment, per period position, stacked over repeats) with :class:`PagedDSACache` pools for the
    DSA layers; ``block_table`` ``[B, max_pages]`` int32 maps the batch rows' positions to pages."""
    layers: tuple
    block_table: jax.Array


def pages_for(num_tokens: int) -> int:
    """Pages that hold ``num_tokens`` positions."""
    return -(-num_tokens // PAGE_SIZE)


def token_slots(block_table: jax.Array, positions: jax.Array, num_rows: int) -> jax.Array:
    """Pool rows ``[B, T]`` of ``positions`` ``[B, T]``; ``num_rows`` where the position has no
    page (a layer's writes pass its scratch row; -1 marks "none" for reads)."""
    page_idx = positions // PAGE_SIZE
    inside = (positions >= 0) & (page_idx < block_table.shape[1])
    page = jnp.take_along_axis(block_table, jnp.clip(page_idx, 0, block_table.shape[1] - 1),
                               axis=1)
    ok = inside & (page >= 0)
    return jnp.where(ok, page * PAGE_SIZE + positions % PAGE_SIZE, num_rows)


def context_slots(block_table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every position a row can hold: pool rows ``[B, max_pages * PAGE_SIZE]`` (0 where there is
    no page, so a gather stays in bounds) and whether a page backs it ``[B, max_pages * PAGE_SIZE]``."""
    b, m = block_table.shape
    rows = block_table[:, :, None] * PAGE_SIZE + jnp.arange(PAGE_SIZE, dtype=jnp.int32)
    backed = jnp.broadcast_to(block_table[:, :, None] >= 0, rows.shape)
    return jnp.where(backed, rows, 0).reshape(b, m * PAGE_SIZE), backed.reshape(b, m * PAGE_SIZE)


def positions_to_slots(indices: jax.Array, block_table: jax.Array) -> jax.Array:
    """Top-k token positions ``[B, T, K]`` (-1 unused) -> pool rows ``[B, T, K]`` (-1 stays -1)."""
    b, t, k = indices.shape
    flat = indices.reshape(b, t * k)
    rows = token_slots(block_table, jnp.maximum(flat, 0), -1)
    return jnp.where(flat >= 0, rows, -1).reshape(b, t, k)


def init_paged_dsa_cache(config, num_pages: int, parts: int = 1,
                         rope_lanes: int | None = None) -> PagedDSACache:
    """A zero pool of ``num_pages`` pages for one DSA layer, in ``parts`` partitions of
    ``num_pages / parts`` pages and :data:`SCRATCH_ROWS` rows each (``PagedDSACache``);
    ``rope_lanes``: ``dsa_cache.rope_cache_width``."""
    from kdsa.model.dsa_cache import rope_cache_width
    from kdsa.model.layers import dtype_of

    if num_pages < 1:
        raise ValueError(f"num_pages must be >= 1, got {num_pages}")
    if parts < 1 or num_pages % parts:
        raise ValueError(f"num_pages={num_pages} must be a multiple of the pool's {parts} "
                         f"partitions")
    dt = dtype_of(config.compute_dtype)
    di = config.index_head_dim if config.use_indexer else 0
    rows = parts * (num_pages // parts * PAGE_SIZE + SCRATCH_ROWS)  # + a scratch page each
    zeros = lambda d, dt=dt: jnp.zeros((rows, d), dt)  # noqa: E731
    return PagedDSACache(kv_latent=zeros(config.kv_lora_rank),
                         k_rope=zeros(rope_cache_width(config, rope_lanes)),
                         index_keys=zeros(di, dtype_of(config.index_compute_dtype)),
                         parts=parts)
