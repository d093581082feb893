"""The jitted generation steps of ``ModelRunner`` (``infer/runner.py``) as pure functions of
``(graphdef, state, cache, ...)``: a prefill chunk of one slot or of several, a decode step over
every slot, the image encoder, and the cache operations the prefix cache needs (KDA state
snapshots, page copies). ``infer/aot.py`` compiles the same functions for TPU topologies.

Cache leaves are ``[repeats, slots, ...]`` (the slot axis is axis 1); paged DSA pools
(``PagedDSACache``) are shared by all slots (on a mesh, by the slots of one device group, in
its partition) and pass through untouched by the per-slot helpers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kdsa.model.dsa_cache import DSACache
from kdsa.model.outputs import Collect, ImageInputs
from kdsa.model.paged_cache import BUFFERS, PAGE_SIZE, PagedCache, PagedDSACache
from kdsa.model.partitioning import current as current_sharding


def encode_step(graphdef, state, images):
    from kdsa.model.vision.assemble import encode_images

    return encode_images(nnx.merge(graphdef, state), images)            # [1, P / m, D]


def is_pool(x) -> bool:
    return isinstance(x, PagedDSACache)


def per_slot(fn, *trees):
    """``fn`` on every per-slot leaf (``[repeats, slots, ...]``); shared DSA pools are kept
    from the last tree."""
    return jax.tree.map(lambda *xs: xs[-1] if is_pool(xs[0]) else fn(*xs), *trees,
                        is_leaf=is_pool)


def states(fn, cache):
    """``fn`` of every per-slot (KDA) leaf, None for the shared DSA pools."""
    return jax.tree.map(lambda x: None if is_pool(x) else fn(x), cache, is_leaf=is_pool)


def save_state(cache, snapshots, slot, snapshot):
    """Slot ``slot``'s KDA states into snapshot ``snapshot`` (both split over devices alike on a
    mesh: :func:`take_slot` / :func:`put_slot` keep the copy to one row's traffic)."""
    return jax.tree.map(lambda s, a: put_slot(s, take_slot(a, slot), snapshot), snapshots,
                        states(lambda a: a, cache))


def restore_state(cache, snapshots, slot, snapshot):
    saved = iter(jax.tree.leaves(snapshots))  # the per-slot leaves, in the cache's order
    return jax.tree.map(lambda x: x if is_pool(x) else put_slot(
        x, take_slot(next(saved), snapshot), slot), cache, is_leaf=is_pool)


def copy_page(cache, src, dst):
    """Page ``src``'s rows into page ``dst`` (global page ids) in every pool: a gather and a
    scatter of 64 rows, which a pool split over devices does where the rows live."""
    def copy(pool, name):  # [..., R, D]: rows on axis -2
        buf = getattr(pool, name)
        src_rows = pool.page_rows(src) + jnp.arange(PAGE_SIZE)
        dst_rows = pool.page_rows(dst) + jnp.arange(PAGE_SIZE)
        return buf.at[..., dst_rows, :].set(buf[..., src_rows, :])
    return jax.tree.map(lambda x: x.replace(**{n: copy(x, n) for n in BUFFERS})
                        if is_pool(x) else x, cache, is_leaf=is_pool)


def slots_split() -> bool:
    """Whether the traced step runs under a layout that splits the cache's slots over devices."""
    ctx = current_sharding()
    return ctx is not None and ctx.size(ctx.axes("act_batch")) > 1


def take_slot(a: jax.Array, slot) -> jax.Array:
    """Slot ``slot`` of a per-slot cache leaf ``[repeats, S, ...]`` -> ``[repeats, 1, ...]``.

    With the slots split over devices, a dynamic slice of the slot axis makes XLA's partitioner
    gather every device's slots first (K3 on ``v5p:4x8x8``, 64 x 128K slots: 230 GB of
    temporaries per device); a one-hot select summed over the slot axis is a local reduction
    and an all-reduce of one row. Exact: every other term is a selected zero."""
    if not slots_split():
        return jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=1)
    return jnp.sum(jnp.where(_is_slot(a, slot), a, jnp.zeros((), a.dtype)), axis=1,
                   keepdims=True, dtype=a.dtype)


def put_slot(a: jax.Array, row: jax.Array, slot) -> jax.Array:
    """``a`` with slot ``slot`` replaced by ``row`` ``[repeats, 1, ...]`` (:func:`take_slot`'s
    inverse; with split slots a select, which each device applies to its own slots)."""
    if not slots_split():  # (a row cut to its first positions updates those)
        return jax.lax.dynamic_update_slice_in_dim(a, row.astype(a.dtype), slot, axis=1)
    assert row.shape[2:] == a.shape[2:], "no context widths with split slots (_context)"
    return jnp.where(_is_slot(a, slot), row.astype(a.dtype), a)


def _is_slot(a: jax.Array, slot) -> jax.Array:
    """``[1, S, 1, ...]`` bool, broadcasting against ``a`` ``[repeats, S, ...]``: slot ``slot``."""
    return (jnp.arange(a.shape[1]) == slot).reshape((1, -1) + (1,) * (a.ndim - 2))


def context_cut(cache, width: int | None):
    """The dense-slot DSA caches ``[repeats, rows, L, D]`` cut to their first ``width``
    positions (None: whole); KDA states and paged pools as they are."""
    if width is None:
        return cache
    return jax.tree.map(lambda x: x.replace(kv_latent=x.kv_latent[:, :, :width],
                                            k_rope=x.k_rope[:, :, :width],
                                            index_keys=x.index_keys[:, :, :width])
                        if isinstance(x, DSACache) else x,
                        cache, is_leaf=lambda x: isinstance(x, (DSACache, PagedDSACache)))


def prefill_step(graphdef, state, cache, slot, ids, start, length, fresh, embeds=None,
                  mask=None, table=None, *, width=None, record_routing=False):
    """``table`` ``[pages]``: the slot's first pages (paged cache; None: dense slots, of which
    the first ``width`` positions are read and written; None: all)."""
    model = nnx.merge(graphdef, state)
    b = ids.shape[1]
    row = per_slot(lambda a: take_slot(a, slot), context_cut(cache, width))  # only what it reads
    row = per_slot(lambda a: jnp.where(fresh, jnp.zeros_like(a), a), row)
    if table is not None:
        row = PagedCache(layers=row, block_table=table[None])
    idx = jnp.arange(b, dtype=jnp.int32)[None]                          # [1, b]
    images = None if embeds is None else ImageInputs(embeds=embeds, mask=mask)
    out = model.forward(ids, start + idx, row, segment_ids=(idx < length).astype(jnp.int32),
                        images=images, collect=Collect(routing=record_routing),
                        logits_at=jnp.reshape(length - 1, (1, 1)))  # the last real token only
    last = out.logits[:, 0]
    new = out.cache.layers if table is not None else out.cache
    cache = per_slot(lambda a, r: put_slot(a, r, slot), cache, new)
    if record_routing:                                                  # [b, L_moe, k]
        return last, cache, jnp.transpose(out.stats.expert_ids[:, 0], (1, 0, 2))
    return last, cache                                                  # [1, V]


def prefill_batch_step(graphdef, state, cache, slots, ids, starts, lengths, fresh,
                        table=None, *, width=None):
    """Chunks of several slots at once: ``slots`` ``[n]`` (``num_slots``: a padding row, read
    as zeros, written nowhere), ``ids`` ``[n, b]``, ``starts`` / ``lengths`` ``[n]``, ``fresh``
    ``[n]`` (a new request: its rows start from zeros), ``table`` ``[n, pages]``; ``width`` as
    in :func:`prefill_step`."""
    model = nnx.merge(graphdef, state)
    n, b = ids.shape
    rows = per_slot(lambda a: jnp.take(a, slots, axis=1, mode="fill", fill_value=0),
                    context_cut(cache, width))  # only what it reads
    rows = per_slot(lambda a: jnp.where(fresh.reshape((1, n) + (1,) * (a.ndim - 2)),
                                         jnp.zeros_like(a), a), rows)
    if table is not None:
        rows = PagedCache(layers=rows, block_table=table)
    idx = jnp.arange(b, dtype=jnp.int32)[None]                          # [1, b]
    out = model.forward(ids, starts[:, None] + idx, rows,
                        segment_ids=(idx < lengths[:, None]).astype(jnp.int32),
                        logits_at=jnp.maximum(lengths - 1, 0)[:, None])
    new = out.cache.layers if table is not None else out.cache
    cache = per_slot(lambda a, r: a.at[(slice(None), slots) + tuple(
        slice(0, d) for d in r.shape[2:])].set(r, mode="drop"), cache, new)
    return out.logits[:, 0], cache                                      # [n, V]


def decode_step(graphdef, state, cache, tokens, positions, active, table=None, *,
                 record_routing=False):
    """``table`` ``[S, max_pages]``: every slot's pages (paged cache; None: dense slots)."""
    model = nnx.merge(graphdef, state)
    out = model.forward(tokens[:, None], positions[:, None],
                        cache if table is None else PagedCache(layers=cache, block_table=table),
                        segment_ids=active[:, None].astype(jnp.int32),
                        collect=Collect(routing=record_routing))
    new = out.cache if table is None else out.cache.layers
    if record_routing:                                                  # [S, L_moe, k]
        return (out.logits[:, 0], new, jnp.transpose(out.stats.expert_ids[:, :, 0], (1, 0, 2)))
    return out.logits[:, 0], new                                        # [S, V]


# ---------------------------------------------------------------------- compiled (ModelRunner)

def step_pair(jit, graphdef, record_routing: bool):
    """The jitted (prefill, decode) steps of one model structure."""
    return (jit(functools.partial(prefill_step, graphdef, record_routing=record_routing),
                static_argnames=("width",)),
            jit(functools.partial(decode_step, graphdef, record_routing=record_routing)))


@functools.lru_cache(maxsize=16)
def shared_steps(graphdef, record_routing: bool, options: tuple):
    """One-device steps keyed by the model's structure (``GraphDef`` hashes by value): a second
    runner of the same model (another engine, a new RL sampler, a server restart in-process)
    reuses the programs compiled for the first instead of compiling them again."""
    return step_pair(functools.partial(jax.jit, donate_argnums=(1,),
                                       compiler_options=dict(options) or None),
                     graphdef, record_routing)


@functools.lru_cache(maxsize=16)
def shared_batch_step(graphdef, options: tuple):
    return jax.jit(functools.partial(prefill_batch_step, graphdef), donate_argnums=(1,),
                   compiler_options=dict(options) or None, static_argnames=("width",))


copy_page_jit = jax.jit(copy_page, donate_argnums=(0,))
save_state_jit = jax.jit(save_state, donate_argnums=(1,))
restore_state_jit = jax.jit(restore_state, donate_argnums=(0,))
