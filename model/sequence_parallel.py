"""Sequence (context) parallelism: KDA and Gated DSA with the sequence split over mesh axes.

Each function has the signature of its single-device counterpart in ``kdsa.model`` and routes
to it unless the active rules (``partitioning.current()``, which
``kdsa.sharding.constrain.use_sharding`` sets) shard ``act_seq`` over a mesh axis and the
length divides; then it runs an explicit ``shard_map`` over the whole mesh (batch and
heads stay sharded as the rules say, the sequence axes are split in token order).

KDA (``kda.md`` section 1, affine chunk map; tokamax's context-parallel form). A shard's piece
maps the incoming state affinely, ``S -> M S + B`` (``kda_chunk_affine``). Every shard computes
its ``(M_p, B_p)`` and its first/last document ids, all-gathers them (``P x [B, H, K, K + V]``
float32 per device), folds them in order to get its own incoming state (zero where its first
document is new: the fold tracks the last non-padding id before each shard), then runs
``kda_chunked`` on its piece from that state. Cost per shard: one extra chunk pass (the affine
map) and ``P`` small ``K x K`` products; no sequential dependency between shards.

Gated DSA (``dsa.md`` sections 1-2). Queries stay local; the keys they may select (indexer keys,
latent KV and RoPE key) are all-gathered over the sequence axes, so each query ranks the
whole causal prefix of its row (global positions), exactly as unsharded. Work is causal-
imbalanced (the last shard's queries see the most keys); striping is not done here. The dense
MHA path (no indexer, or the dense warm-up) works the same way: keys and values gathered, heads
stay split over ``tensor``. The indexer KL losses (dense warm-up and sparse stage) gather the
keys over the sequence and the queries' heads over ``tensor`` (the loss sums the attention
distribution over all heads); each shard returns its own queries' per-token losses.

The KDA ``shard_map`` runs with ``check_vma=False``: ``kda_chunk_affine``'s scan starts from an
invariant identity carry that becomes device-varying, which the type check rejects; the body
is per-device maths plus gathers, and its gradients match (below).

Measured (float32 CPU, 8 devices, ``sequence=4,data=2`` and ``sequence=2,tensor=2,fsdp=2``;
B 2, T 48, H 2, K 8, chunk 8): KDA outputs and final state max abs error 2.4e-7 vs unsharded,
with packed documents crossing shard boundaries and padding, gradients 1.9e-6; DSA (T 32,
top-8) indices identical, outputs bitwise equal, gradients 2.9e-6. With the Pallas kernel
(``impl="pallas"``, interpret mode, ``sequence=2,tensor=2,fsdp=2``): the tiny Gated DSA layer's
output 4.8e-7, parameter gradients 3.8e-6 vs the single-device XLA layer
(``tests/test_sparse_mla_kernel.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kdsa.kernels_pallas.sparse_mla import sparse_mla_attention as sparse_mla_kernel
from kdsa.model import dsa as dsa_math
from kdsa.model import kda as kda_math
from kdsa.model.partitioning import ShardingContext, compile_platform, current, spec_axes

_HI = jax.lax.Precision.HIGHEST


def _seq_spec(ctx: ShardingContext | None, logical, shape) -> P | None:
    """The rules' spec for an array whose dim 1 is the sequence; None unless it is split."""
    if ctx is None or not ctx.axes("act_seq"):
        return None
    spec = ctx.spec(logical, shape)
    return spec if spec[1] is not None else None


def _axis_name(entry):
    """A spec entry as a collective's axis name (a name, or a tuple of names)."""
    axes = spec_axes(entry)
    return axes[0] if len(axes) == 1 else axes


def _vary(x, axes):
    """Explicitly varying over ``axes`` (cotangent psum-ed there); see ``expert_parallel``."""
    return jax.lax.pcast(x, axes if len(axes) > 1 else axes[0], to="varying") if axes else x


def _gather_seq(x, axis, dim: int = 1):
    """All shards' pieces of ``x`` along ``dim``, in token order (varying; transposes to a
    reduce-scatter)."""
    return jax.lax.all_gather(x, axis, axis=dim, tiled=True)


# ---------------------------------------------------------------------------------------------
# KDA
# ---------------------------------------------------------------------------------------------

def kda_chunked(q, k, v, g, beta, scale=None, initial_state=None, chunk_size=64,
                segment_ids=None, gate_lower_bound=None):
    """``kdsa.model.kda.kda_chunked``, sequence-parallel when the rules split ``act_seq``."""
    ctx = current()
    spec = _seq_spec(ctx, ("act_batch", "act_seq", "act_heads", None), q.shape)
    if spec is None:
        return kda_math.kda_chunked(q, k, v, g, beta, scale, initial_state, chunk_size,
                                    segment_ids, gate_lower_bound)
    return kda_chunked_sp(q, k, v, g, beta, scale, initial_state, chunk_size, segment_ids,
                          ctx=ctx, spec=spec, gate_lower_bound=gate_lower_bound)


def _first_last_ids(seg):
    """First and last non-padding id per row ``[B]`` (0 when the row piece is all padding)."""
    valid = seg != 0
    t = seg.shape[1]
    first = jnp.take_along_axis(seg, jnp.argmax(valid, axis=1)[:, None], axis=1)[:, 0]
    last = jnp.take_along_axis(seg, (t - 1 - jnp.argmax(valid[:, ::-1], axis=1))[:, None],
                               axis=1)[:, 0]
    return jnp.where(valid.any(1), first, 0), jnp.where(valid.any(1), last, 0)


def kda_chunked_sp(q, k, v, g, beta, scale, initial_state, chunk_size, segment_ids, *,
                   ctx: ShardingContext, spec: P, gate_lower_bound=None):
    """The shard_map form (see the module docstring). Same returns as ``kda_chunked``."""
    kda_math._check(q, k, v, g, beta, initial_state, segment_ids)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    bt, sq, hd = spec[0], spec[1], spec[2]
    seq_axes, axis = spec_axes(sq), _axis_name(sq)
    scale = dk ** -0.5 if scale is None else scale
    s0 = (jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    seg = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)

    def body(q, k, v, g, beta, s0, seg):
        me, n_shards = jax.lax.axis_index(axis), jax.lax.axis_size(axis)
        m, bb = kda_math.kda_chunk_affine(k, v, g, beta, chunk_size, segment_ids=seg)
        first, last = _first_last_ids(seg)                              # [B], [B]
        ms, bs, firsts, lasts = (jax.lax.all_gather(x, axis) for x in (m, bb, first, last))

        def fold(carry, xs):  # state entering shard p, and the last real id before it
            s, prev = carry
            m_p, b_p, f_p, l_p = xs
            reset = (f_p != 0) & (prev != 0) & (f_p != prev)              # [B]
            s_in = jnp.where(reset[:, None, None, None], 0.0, s)
            s_out = jnp.einsum("bhkj,bhjv->bhkv", m_p, s_in, precision=_HI) + b_p
            return (s_out, jnp.where(l_p != 0, l_p, prev)), s_in

        start = (_vary(s0, seq_axes), first * 0)  # (zeros_like would drop the vma)
        (final, _), s_ins = jax.lax.scan(fold, start, (ms, bs, firsts, lasts))
        o, _ = kda_math.kda_chunked(q, k, v, g, beta, scale, initial_state=s_ins[me],
                                    chunk_size=chunk_size, segment_ids=seg,
                                    gate_lower_bound=gate_lower_bound)
        final = jax.lax.psum(jnp.where(me == n_shards - 1, final, 0.0), axis)  # one copy
        return o, final

    x4, x3 = P(bt, sq, hd, None), P(bt, sq, hd)
    st = P(bt, hd, None, None)
    fn = jax.shard_map(body, mesh=ctx.mesh, in_specs=(x4, x4, x4, x4, x3, st, P(bt, sq)),
                       out_specs=(x4, st), check_vma=False)
    return fn(q, k, v, g, beta, s0, seg)


# ---------------------------------------------------------------------------------------------
# Gated DSA: indexer top-k and sparse MLA attention with gathered keys
# ---------------------------------------------------------------------------------------------

def _split_self_attention(spec, q_len: int, kv_len: int) -> bool:
    """SP applies when the rules split the sequence and keys are the queries' own tokens."""
    return spec is not None and q_len == kv_len


def indexer_topk(q, k, weights, topk: int, *, q_pos, kv_pos, q_seg, kv_seg, chunk_size: int,
                 windows: int = 1):
    """``kdsa.model.dsa.indexer_topk``; with ``act_seq`` split, keys gathered, queries local.

    Returned indices are global key positions, as unsharded. ``windows``: causal key windows
    of a sequence attending to itself (``key_slack`` 0), unsplit only (a split's local query
    indices are not their positions)."""
    ctx = current()
    spec = _seq_spec(ctx, ("act_batch", "act_seq", None, None), q.shape)
    if not _split_self_attention(spec, q.shape[1], k.shape[1]):
        return dsa_math.indexer_topk(q, k, weights, topk, q_pos=q_pos, kv_pos=kv_pos,
                                     q_seg=q_seg, kv_seg=kv_seg, chunk_size=chunk_size,
                                     windows=windows)
    bt, sq = spec[0], spec[1]
    axis = _axis_name(sq)

    def body(q, k, w, q_pos, kv_pos, q_seg, kv_seg):
        k, kv_pos, kv_seg = (_gather_seq(x, axis) for x in (k, kv_pos, kv_seg))
        return dsa_math.indexer_topk(q, k, w, topk, q_pos=q_pos, kv_pos=kv_pos, q_seg=q_seg,
                                     kv_seg=kv_seg, chunk_size=chunk_size)

    r2, r3 = P(bt, sq), P(bt, sq, None)
    fn = jax.shard_map(body, mesh=ctx.mesh,
                       in_specs=(P(bt, sq, None, None), r3, r3, r2, r2, r2, r2), out_specs=r3)
    return fn(q, k, weights, q_pos, kv_pos, q_seg, kv_seg)


def sparse_mla_attention(q, kv, indices, sm_scale: float, v_dim: int, *, chunk_size: int = 256,
                         impl: str = "xla", layer=None, rows_major: bool = False):
    """``kdsa.model.dsa.sparse_mla_attention`` (``impl="pallas"``: the Pallas kernel); with
    ``act_seq`` split, the key parts are gathered and each shard attends for its own queries
    (heads stay sharded over tensor). ``layer``: the key parts are a layer scan's dense-slot
    stacks ``[L, B, S, D]`` (``DSACache.layer``) and ``layer`` the index of the layer's own,
    read in place (:func:`_in_stack`) where the stacks are row-major: CPU and GPU layouts, or
    ``rows_major`` (``DSACache.rows_major``: the engine's runner places them so on TPU)."""
    attend = sparse_mla_kernel if impl == "pallas" else dsa_math.sparse_mla_attention
    ctx = current()
    parts = tuple(kv) if isinstance(kv, (tuple, list)) else (kv,)
    spec = _seq_spec(ctx, ("act_batch", "act_seq", "act_heads", None), q.shape)
    if layer is not None:
        # XLA:TPU's default layout keeps a buffer under 128 lanes (a small model's latent)
        # rows minor, where a whole-stack reshape would re-lay the stack
        if ((rows_major or compile_platform() != "tpu")
                and not _split_self_attention(spec, q.shape[1], parts[0].shape[2])
                and parts[0].shape[1] == q.shape[0] and parts[0].size < 2**31 * parts[0].shape[3]):
            return _in_stack(ctx, attend, q, parts, layer, indices, sm_scale, v_dim, chunk_size)
        parts = tuple(jax.lax.dynamic_index_in_dim(x, layer, keepdims=False) for x in parts)
        kv = parts
    if not _split_self_attention(spec, q.shape[1], parts[0].shape[1]):
        if impl == "pallas" and ctx is not None and parts[0].shape[0] == q.shape[0]:
            return _local_kernel(ctx, attend, q, parts, indices, sm_scale, v_dim, chunk_size)
        return attend(q, kv, indices, sm_scale, v_dim, chunk_size=chunk_size)
    bt, sq, hd = spec[0], spec[1], spec[2]
    axis = _axis_name(sq)

    def body(q, idx, *parts):
        parts = tuple(_gather_seq(_vary(p, spec_axes(hd)), axis) for p in parts)
        return attend(q, parts, idx, sm_scale, v_dim, chunk_size=chunk_size)

    r3 = P(bt, sq, None)
    # check_vma off for the Pallas kernel: in interpret mode its grid loop carries the key refs
    # as invariant, which the type check rejects (the KDA shard_map above does the same)
    fn = jax.shard_map(body, mesh=ctx.mesh,
                       in_specs=(P(bt, sq, hd, None), r3) + (r3,) * len(parts),
                       out_specs=(P(bt, sq, hd, None), P(bt, sq, hd)),
                       check_vma=impl != "pallas")
    return fn(q, indices, *parts)


def _local_kernel(ctx: ShardingContext, attend, q, parts, indices, sm_scale, v_dim, chunk_size):
    """The Pallas kernel on each device's own rows and heads, the sequence whole (a cache, or
    ``act_seq`` not split). XLA cannot partition a Mosaic or Triton call itself ("Mosaic kernels
    cannot be automatically partitioned"), so the kernel runs inside an explicit ``shard_map``:
    q ``[B, T, N, Dk]`` split as the rules split batch and heads, the key parts ``[B, S, D]``
    and indices ``[B, T, K]`` by batch only (every head reads the shared MLA key)."""
    spec = ctx.spec(("act_batch", None, "act_heads", None), q.shape)
    bt, hd = spec[0], spec[2]

    def body(q, idx, *parts):
        return attend(q, parts, idx, sm_scale, v_dim, chunk_size=chunk_size)

    r3 = P(bt, None, None)
    # check_vma off, as in sparse_mla_attention: the interpret-mode grid loop carries the key
    # refs as invariant
    fn = jax.shard_map(body, mesh=ctx.mesh,
                       in_specs=(P(bt, None, hd, None), r3) + (r3,) * len(parts),
                       out_specs=(P(bt, None, hd, None), P(bt, None, hd)), check_vma=False)
    return fn(q, indices, *parts)


def _in_stack(ctx: ShardingContext | None, attend, q, stacks, layer, indices, sm_scale, v_dim,
              chunk_size):
    """Sparse attention of q ``[B, T, N, Dk]`` over layer ``layer``'s rows of dense-slot stacks
    ``[L, B, S, D]``, without slicing them out: each device reads its ``[L, B', S, D]`` as rows
    ``[1, L * B' * S, D]`` (a reshape), its queries as one row of ``B' * T``, with the top-k
    slots ``[B, T, K]`` offset to their rows (-1 stays -1), as a paged pool is read
    (``model/paged_attention.py``). The layer's ``[B, S, D]`` slice was a copy of its cache
    at every step on XLA:TPU, for the Pallas kernel's operands and the reference's gather alike.
    On a mesh it runs in a ``shard_map``: slots as the rules split ``act_batch`` (the cache's
    layout, ``infer/cache_layout.py``), heads as they split ``act_heads``."""

    def local(q, idx, layer, *stacks):
        l, b, s = stacks[0].shape[:3]
        t, n = q.shape[1], q.shape[2]
        first = (layer * b + jnp.arange(b, dtype=jnp.int32)) * s  # [B'] each slot's slot 0
        idx = idx.astype(jnp.int32)
        rows = jnp.where((idx >= 0) & (idx < s), idx + first[:, None, None], -1)
        flat = tuple(x.reshape(1, l * b * s, x.shape[3]) for x in stacks)
        o, lse = attend(q.reshape(1, b * t, n, q.shape[3]), flat, rows.reshape(1, b * t, -1),
                        sm_scale, v_dim, chunk_size=chunk_size)
        return o.reshape(b, t, n, -1), lse.reshape(b, t, n)

    if ctx is None:
        return local(q, indices, layer, *stacks)
    spec = ctx.spec(("act_batch", None, "act_heads", None), q.shape)
    bt, hd = spec[0], spec[2]
    # check_vma off, as in sparse_mla_attention (the Pallas kernel's interpret-mode grid loop)
    fn = jax.shard_map(local, mesh=ctx.mesh,
                       in_specs=(P(bt, None, hd, None), P(bt, None, None), P())
                       + (P(None, bt, None, None),) * len(stacks),
                       out_specs=(P(bt, None, hd, None), P(bt, None, hd)), check_vma=False)
    return fn(q, indices, layer, *stacks)


# ---------------------------------------------------------------------------------------------
# Dense MHA attention (no indexer, dense warm-up) and the indexer KL losses
# ---------------------------------------------------------------------------------------------

def dense_attention(q, k, v, sm_scale: float, *, q_pos, kv_pos, q_seg, kv_seg, chunk_size: int,
                    windows: int = 1):
    """``kdsa.model.dsa.dense_attention``; with ``act_seq`` split, keys, values and their
    positions gathered, queries local, heads as the rules split them (k, v with G = N heads
    follow the queries' heads; G < N key heads stay whole). ``windows`` as in
    :func:`indexer_topk`."""
    ctx = current()
    ks = tuple(k) if isinstance(k, (tuple, list)) else (k,)
    spec = _seq_spec(ctx, ("act_batch", "act_seq", "act_heads", None), q.shape)
    if not _split_self_attention(spec, q.shape[1], ks[0].shape[1]):
        return dsa_math.dense_attention(q, k, v, sm_scale, q_pos=q_pos, kv_pos=kv_pos,
                                        q_seg=q_seg, kv_seg=kv_seg, chunk_size=chunk_size,
                                        windows=windows)
    bt, sq, hd = spec[0], spec[1], spec[2]
    kh = hd if ks[0].shape[2] == q.shape[2] else None
    axis = _axis_name(sq)

    vary = (lambda x: x) if kh is not None else (lambda x: _vary(x, spec_axes(hd)))  # noqa: E731

    def body(q, v, q_pos, kv_pos, q_seg, kv_seg, *ks):
        ks, v = tuple(_gather_seq(vary(x), axis) for x in ks), _gather_seq(vary(v), axis)
        kv_pos, kv_seg = _gather_seq(kv_pos, axis), _gather_seq(kv_seg, axis)
        return dsa_math.dense_attention(q, ks, v, sm_scale, q_pos=q_pos, kv_pos=kv_pos,
                                        q_seg=q_seg, kv_seg=kv_seg, chunk_size=chunk_size)

    r2, h4 = P(bt, sq), P(bt, sq, kh, None)
    fn = jax.shard_map(body, mesh=ctx.mesh,
                       in_specs=(P(bt, sq, hd, None), h4, r2, r2, r2, r2) + (h4,) * len(ks),
                       out_specs=(P(bt, sq, hd, None), P(bt, sq, hd)))
    return fn(q, v, q_pos, kv_pos, q_seg, kv_seg, *ks)


def indexer_kl_dense(q, k, sm_scale: float, index_q, index_k, index_w, *, q_pos, kv_pos, q_seg,
                     kv_seg, chunk_size: int):
    """``kdsa.model.dsa.indexer_kl_dense`` -> ``[B, T]``; with ``act_seq`` split, keys (main
    and indexer) gathered over the sequence, every head on each shard, queries local."""
    ctx = current()
    spec = _seq_spec(ctx, ("act_batch", "act_seq", None, None), q.shape)
    if not _split_self_attention(spec, q.shape[1], k.shape[1]):
        return dsa_math.indexer_kl_dense(q, k, sm_scale, index_q, index_k, index_w, q_pos=q_pos,
                                         kv_pos=kv_pos, q_seg=q_seg, kv_seg=kv_seg,
                                         chunk_size=chunk_size)
    bt, sq = spec[0], spec[1]
    axis = _axis_name(sq)

    def body(q, k, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg):
        k, ik, kv_pos, kv_seg = (_gather_seq(x, axis) for x in (k, ik, kv_pos, kv_seg))
        return dsa_math.indexer_kl_dense(q, k, sm_scale, iq, ik, iw, q_pos=q_pos,
                                         kv_pos=kv_pos, q_seg=q_seg, kv_seg=kv_seg,
                                         chunk_size=chunk_size)

    r2, r3, r4 = P(bt, sq), P(bt, sq, None), P(bt, sq, None, None)
    fn = jax.shard_map(body, mesh=ctx.mesh, in_specs=(r4, r4, r4, r3, r3, r2, r2, r2, r2),
                       out_specs=r2)
    return fn(q, k, index_q, index_k, index_w, q_pos, kv_pos, q_seg, kv_seg)


def indexer_kl_sparse(q, kv, indices, sm_scale: float, index_q, index_k, index_w, *,
                      chunk_size: int):
    """``kdsa.model.dsa.indexer_kl_sparse`` -> ``[B, T]``; with ``act_seq`` split, the key
    parts and indexer keys gathered (the indices are global positions), every head on each
    shard, queries local."""
    ctx = current()
    parts = tuple(kv) if isinstance(kv, (tuple, list)) else (kv,)
    spec = _seq_spec(ctx, ("act_batch", "act_seq", None, None), q.shape)
    if not _split_self_attention(spec, q.shape[1], parts[0].shape[1]):
        return dsa_math.indexer_kl_sparse(q, kv, indices, sm_scale, index_q, index_k, index_w,
                                          chunk_size=chunk_size)
    bt, sq = spec[0], spec[1]
    axis = _axis_name(sq)

    def body(q, idx, iq, ik, iw, *parts):
        parts, ik = tuple(_gather_seq(x, axis) for x in parts), _gather_seq(ik, axis)
        return dsa_math.indexer_kl_sparse(q, parts, idx, sm_scale, iq, ik, iw,
                                          chunk_size=chunk_size)

    r2, r3, r4 = P(bt, sq), P(bt, sq, None), P(bt, sq, None, None)
    fn = jax.shard_map(body, mesh=ctx.mesh, in_specs=(r4, r3, r4, r3, r3) + (r3,) * len(parts),
                       out_specs=r2)
    return fn(q, indices, index_q, index_k, index_w, *parts)
