"""A Gated DSA (or dense MLA) layer's attention over its paged pool (``model/paged_cache.py``),
on one device or with the pool split over a mesh's batch device groups.

:func:`attend_pool` (one device, or one group's partition): the step's new rows are written at
their tokens' pool rows, the indexer reads each row's visible keys through the block table, its
top-k positions become pool rows (-1 stays -1) and the sparse attention gathers them from the
pool, all queries of the step as one batch (``dsa_cache_attention.attend_cache``). With
``impl="pallas"`` the sparse attention is the Pallas kernel and a decode step's index scores
come from ``kernels_pallas.paged_index``, which reads each row's pages of index keys through the
block table (DMA on TPU, pointer gathers on GPU) instead of gathering them into a copy first.

On a mesh (a sharding context, ``model/partitioning.py``) the same function runs inside a
``shard_map``: "DP attention" with pages. The layout's ``act_batch`` axes split the slots into
``parts`` device groups, and the pool into as many partitions (``PagedDSACache.parts``): group
``p`` holds pages ``[p * n, (p + 1) * n)`` and runs the rows of its own slots, whose pages the
host takes from that partition only (``infer/engine_pages.py``). So every gather and write is
local to the group: nothing of the pool crosses devices. Inside a group the queries' heads are
split as the rules split them (``tensor``); the indexer and the top-k run whole on each device
of the group (they read the one shared key). The block table holds global page ids; a group
reads its own as local ids and another group's as -1 (invisible).

A batch the groups do not divide (a prefill chunk of one slot) runs on every group against its
own partition: the group that owns the row's pages gives its output, the others see no key and
write only their scratch row, and the outputs are summed over the groups (one row's latent
output crosses devices).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kdsa.kernels_pallas.paged_index import paged_index_scores
from kdsa.kernels_pallas.paged_index.ops import supports as paged_index_supported
from kdsa.kernels_pallas.sparse_mla import sparse_mla_attention as sparse_mla_kernel
from kdsa.model import paged_cache as pc
from kdsa.model.dsa import sparse_mla_attention
from kdsa.model.dsa_cache_attention import attend_cache
from kdsa.model.paged_cache import BUFFERS, PagedDSACache
from kdsa.model.partitioning import current, without_sharding


def attend_pool(q_abs: jax.Array, index: tuple | None, written: dict, positions: jax.Array,
                segment_ids: jax.Array | None, cache: PagedDSACache, block_table: jax.Array, *,
                scale: float, topk: int | None, v_dim: int, chunk_size: int,
                impl: str = "xla") -> tuple[jax.Array, PagedDSACache]:
    """Latent outputs ``[B, T, N, v_dim]`` of absorbed queries ``q_abs [B, T, N, Dk]`` and the
    pool after this step's writes.

    ``index``: the indexer's queries ``[B, T, Hi, Di]`` and weights ``[B, T, Hi]``, or None
    (dense MLA); ``written``: this step's rows by buffer name (``kv_latent [B, T, kv_lora]``,
    ``k_rope [B, T, rope]``, ``index_keys [B, T, Di]`` with an indexer); ``block_table``
    ``[B, W]`` global page ids (-1: none); ``segment_ids`` 0 marks padding (not written, no
    output). On a mesh a batch the device groups divide is taken to be the slots in order
    (row ``b`` in group ``b // (B / G)``, as the runner's decode step passes them); any other
    batch runs in every group (module docstring)."""
    ctx = current()
    if ctx is not None:
        return _on_mesh(ctx, q_abs, index, written, positions, segment_ids, cache, block_table,
                        scale=scale, topk=topk, v_dim=v_dim, chunk_size=chunk_size, impl=impl)
    if cache.parts != 1:
        raise ValueError(f"a pool in {cache.parts} partitions runs on a mesh that splits the "
                         f"batch into as many device groups")
    b, t = positions.shape
    scratch = cache.scratch_row
    write = pc.token_slots(block_table, positions, scratch)  # [B, T]; no page: scratch
    q_seg = jnp.ones((b, t), jnp.int32)
    if segment_ids is not None:
        write = jnp.where(segment_ids != 0, write, scratch)
        q_seg = (segment_ids != 0).astype(jnp.int32)
    rows_w = write.reshape(-1)
    cache = cache.replace(**{name: cache.write(name, rows_w, v.reshape(b * t, -1))
                             for name, v in written.items()}).settled()
    # reads go to the layer's rows of its whole stack's pools (PagedDSACache.stacked: slicing
    # its own pool out copied it on TPU), so every row and page id is offset to the layer's own
    first = cache.first_row
    ctx_rows, backed = pc.context_slots(block_table)  # [B, S]: every position a row can hold
    ctx_rows = ctx_rows + first
    s = ctx_rows.shape[1]
    lat_pool, rope_pool = cache.stacked("kv_latent"), cache.stacked("k_rope")
    attention = sparse_mla_kernel if impl == "pallas" else sparse_mla_attention

    def sparse(q, idx):  # top-k positions -> pool rows (-1 stays -1); one batch of queries
        rows = pc.positions_to_slots(idx, block_table)  # [B, T', K]
        rows = jnp.where(rows >= 0, rows + first, -1)
        bt, n, dk = q.shape[0] * q.shape[1], q.shape[2], q.shape[3]
        o, _ = attention(q.reshape(1, bt, n, dk), (lat_pool[None], rope_pool[None]),
                         rows.reshape(1, bt, -1), scale, v_dim, chunk_size=chunk_size)
        return o.reshape(q.shape[0], q.shape[1], n, -1)

    indexer, decode_scores = None, None
    if index is not None:
        index_pool = cache.stacked("index_keys")
        indexer = (index[0], index_pool, index[1], ctx_rows)  # the indexer reads positions
        if impl == "pallas" and paged_index_supported(
                index_pool.shape[-1], pc.PAGE_SIZE, index_pool.shape[0], dtype=index_pool.dtype):
            # a decode step's scores read through the block table, no copy of the keys
            pages = jnp.where(block_table >= 0, block_table + first // pc.PAGE_SIZE, -1)

            def decode_scores(q, weights):
                return paged_index_scores(q, weights, index_pool, pages, pc.PAGE_SIZE)
    o_lat = attend_cache(
        q_abs, indexer, keys=lambda w: (lat_pool[ctx_rows[:, :w]], rope_pool[ctx_rows[:, :w]]),
        sparse=sparse, topk=topk, scale=scale, num_keys=s, q_pos=positions,
        kv_pos=jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)), q_seg=q_seg,
        # a position without a page is in no segment: -1, not padding's 0, which padding
        # queries (q_seg 0) would see, reading pool row 0 (another request's)
        kv_seg=jnp.where(backed, 1, -1).astype(jnp.int32), chunk_size=chunk_size,
        decode_scores=decode_scores)
    return o_lat, cache


def _on_mesh(ctx, q_abs, index, written, positions, segment_ids, cache, block_table, **kw):
    """:func:`attend_pool` per device group (module docstring)."""
    mesh = ctx.mesh
    groups = tuple(a for a in ctx.axes("act_batch") if mesh.shape[a] > 1)
    parts = ctx.size(groups)
    if cache.parts != parts:
        raise ValueError(f"the pool has {cache.parts} partitions but the layout splits the "
                         f"batch into {parts} device groups ({'x'.join(groups) or 'none'})")
    b = positions.shape[0]
    split = parts > 1 and b % parts == 0
    bt = groups if split else None
    hd = ctx.spec(("act_batch", None, "act_heads", None), q_abs.shape)[2]
    stacked = cache.layer is not None  # the layer scan's [repeats, R, D] buffers
    pool = (None, groups or None, None) if stacked else (groups or None, None)
    seg = (jnp.ones(positions.shape, jnp.int32) if segment_ids is None
           else segment_ids.astype(jnp.int32))
    names = tuple(written)
    args = [q_abs, positions, seg, block_table] + [written[n] for n in names]
    specs = [P(bt, None, hd, None), P(bt, None), P(bt, None), P(bt, None)] + \
        [P(bt, None, None)] * len(names)
    if index is not None:
        args += list(index)
        specs += [P(bt, None, None, None), P(bt, None, None)]
    args += [getattr(cache, n) for n in BUFFERS] + ([cache.layer] if stacked else [])
    specs += [P(*pool)] * len(BUFFERS) + ([P()] if stacked else [])

    def body(q, pos, sg, table, *rest):
        new = dict(zip(names, rest[:len(names)]))
        rest = rest[len(names):]
        idx = None
        if index is not None:
            idx, rest = tuple(rest[:2]), rest[2:]
        local = PagedDSACache(*rest[:3], layer=rest[3] if stacked else None, parts=1)
        me = jax.lax.axis_index(groups) if groups else 0
        per = local.pages_per_part
        mine = (table >= 0) & (table // per == me)  # this group's pages, as local ids
        o, local = _run_local(q, idx, new, pos, sg, local, jnp.where(mine, table % per, -1),
                              **kw)
        if parts > 1 and not split:  # every group ran the rows: the owner's output
            owner = jnp.any(mine, axis=1)[:, None, None, None]
            o = jax.lax.psum(jnp.where(owner, o, jnp.zeros((), o.dtype)), groups)
        return (o,) + tuple(getattr(local, n) for n in BUFFERS)

    fn = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs),
                       out_specs=(P(bt, None, hd, None),) + (P(*pool),) * len(BUFFERS),
                       check_vma=False)
    o, *bufs = fn(*args)
    return o, cache.replace(**dict(zip(BUFFERS, bufs)))


def _run_local(q, index, written, positions, seg, cache, table, **kw):
    """:func:`attend_pool` on one group's partition (inside the ``shard_map``: no context)."""
    with without_sharding():
        return attend_pool(q, index, written, positions, seg, cache, table, **kw)
