"""The decoder: embedding -> scanned layer groups -> final AttnRes mix / norm -> logits.

Layers are grouped by structure so compile time does not grow with depth: ``layer_segments``
splits the per-layer kinds ``(mixer, ffn)`` into runs of a repeating period (K3: layer 0 alone
(dense FFN), then 22 repeats of [KDA, KDA, DSA, KDA], then 2 x [KDA] and 2 x [DSA]). Each
segment's parameters are stacked on a leading axis (built with ``nnx.vmap``) and applied with
``lax.scan``; ``scan_layers=False`` loops over the same stacked parameters instead, so the
parameter tree is the same either way.

Public API::

    model = Transformer(config, rngs=nnx.Rngs(0))
    logits = model(input_ids)                       # [B, T] int32 -> [B, T, V] float32
    out = model.forward(input_ids, pos, model.init_cache(B, max_len))   # prefill / decode
    out.logits, out.cache
    out = model.forward(input_ids, collect=Collect(expert_load=True))  # training statistics
    out.stats.expert_load                           # [L_moe, E]  (model/outputs.py)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdsa.model.attn_res import AttnResScorer, Residual, initial_residual
from kdsa.model.block import ACT, LayerGroup
from kdsa.model.config import ModelConfig
from kdsa.model.dsa_cache import DSACache, init_dsa_cache
from kdsa.model.kda_layer import init_kda_cache
from kdsa.model.layers import Embed, Linear, RMSNorm, dtype_of
from kdsa.model.outputs import Collect, ImageInputs, Output, RoutingReplay, Stats, layers_of
from kdsa.model.paged_cache import PagedCache, PagedDSACache, init_paged_dsa_cache
from kdsa.model.partitioning import constrain
from kdsa.model.stacked_experts import StackedWeight, is_expert_weight, keep_stacked

Segment = tuple[int, int, int]  # (first layer, period, repeats)

_REMAT_POLICIES = {
    "full": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
}


def layer_segments(kinds: tuple, max_period: int = 8) -> tuple[Segment, ...]:
    """Greedy split of per-layer kinds into (start, period, repeats) runs.

    At each position take the period that covers the most layers with repeats of one pattern
    (ties go to the shorter period); a layer that repeats nothing becomes a run of one.
    """
    segments, i, n = [], 0, len(kinds)
    while i < n:
        best = (1, 1)  # (period, repeats)
        for p in range(1, min(max_period, n - i) + 1):
            r = 1
            while i + (r + 1) * p <= n and kinds[i + r * p:i + (r + 1) * p] == kinds[i:i + p]:
                r += 1
            if r > 1 and p * r > best[0] * best[1]:
                best = (p, r)
        segments.append((i, best[0], best[1]))
        i += best[0] * best[1]
    return tuple(segments)


def default_positions(input_ids: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Positions 0..T-1 per row, restarting at each segment start when packed."""
    b, t = input_ids.shape
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
        return idx
    starts = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                             axis=1)
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


class Transformer(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        pdt, cdt = dtype_of(config.param_dtype), dtype_of(config.compute_dtype)
        kinds = tuple(zip(config.mixer_kinds, config.ffn_kinds))
        self.kinds = kinds
        self.segment_layout = layer_segments(kinds)
        self.embed_tokens = Embed(config.vocab_size, config.hidden_size, rngs=rngs,
                                  param_dtype=pdt, compute_dtype=cdt)
        self.segments = nnx.List([
            _stacked_group(config, kinds[s:s + p], r, rngs) for s, p, r in self.segment_layout])
        if config.attn_res_block_size is not None:
            self.output_attn_res = AttnResScorer(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, axes=("embed", "vocab"),
                                  rngs=rngs, param_dtype=pdt, compute_dtype=cdt)
        if config.vision_config is not None:  # model/vision: tower + projector (docs/vision.md)
            from kdsa.model.vision.projector import Projector
            from kdsa.model.vision.tower import VisionTower

            dts = {"param_dtype": config.param_dtype, "compute_dtype": config.compute_dtype}
            self.vision_tower = VisionTower(config.vision_config, rngs=rngs, **dts)
            self.mm_projector = Projector(config.vision_config, config.hidden_size, rngs=rngs,
                                          **dts)

    def __call__(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        return self.forward(input_ids, positions=positions, segment_ids=segment_ids).logits

    def forward(self, input_ids: jax.Array, positions: jax.Array | None = None,
                cache: tuple | None = None, segment_ids: jax.Array | None = None,
                images: ImageInputs | None = None, *, collect: Collect | None = None,
                replay: RoutingReplay | None = None,
                logits_at: jax.Array | None = None) -> Output:
        """Full forward (cache None), prefill or decode (cache from ``init_cache``).

        ``input_ids`` [B, T] int32. ``positions`` [B, T] int32 (default: 0..T-1, restarting per
        segment); with a cache they are the absolute slots the tokens are written to.
        ``segment_ids`` [B, T] int32: packed documents (no cache) or padding marks (0 = pad,
        right padding). ``images``: features placed at the image placeholders.

        ``collect`` asks for training statistics and ``replay`` applies MoE routing replay
        (``model/outputs.py``); with either, ``out.stats`` holds what was asked for, stacked
        over the layers that have it. Without, ``out.stats`` is None.

        ``logits_at`` ``[B, n]`` int32: compute the logits at these positions of each row only
        (``out.logits`` ``[B, n, V]``), e.g. a prompt chunk's last token in prefill, so the
        vocabulary projection is not paid for every prompt token.
        """
        cfg = self.config
        collect = Collect() if collect is None else collect
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
        if positions is None:
            if cache is not None:
                raise ValueError("positions are required with a cache (the slots to write)")
            positions = default_positions(input_ids, segment_ids)
        if cache is not None:
            _check_right_padding(segment_ids)
        h = self.embed_tokens(input_ids)
        if images is not None:
            h = jnp.where(images.mask[..., None], images.embeds.astype(h.dtype), h)
        res = initial_residual(constrain(h, ACT), cfg.num_attn_res_blocks)
        res = res.replace(blocks=constrain(res.blocks, ACT[:2] + (None, ACT[2])))
        block_table = None
        if isinstance(cache, PagedCache):  # DSA rows in shared pages (model/paged_cache.py)
            cache, block_table = cache.layers, cache.block_table
        moe_rows = {layer: row for row, layer in enumerate(layers_of(cfg, ffn="moe"))}
        replayed = None if replay is None else _check_replay(replay.expert_ids, input_ids.shape,
                                                             len(moe_rows))
        new_caches, pieces = [], {}  # pieces[name]: (layer indices, values [R, ...]) per slot
        for seg_i, (start, period, repeats) in enumerate(self.segment_layout):
            rows = [start + j + period * np.arange(repeats) for j in range(period)]
            seg_ids = None if replayed is None else tuple(
                replayed[np.asarray([moe_rows[int(i)] for i in r])] if int(r[0]) in moe_rows
                else None for r in rows)  # per period position: [R, B, T, k] or None
            res, seg_cache, stats = self._run_segment(
                self.segments[seg_i], res, start, period, repeats, positions=positions,
                segment_ids=segment_ids, caches=None if cache is None else cache[seg_i],
                collect=collect, expert_ids=seg_ids, block_table=block_table)
            new_caches.append(seg_cache)
            for layer_rows, st in zip(rows, stats):
                for name, value in st.items():
                    pieces.setdefault(name, []).append((layer_rows, value))
        hidden, blocks = res.hidden, res.blocks  # [B, T, D], [B, T, NB, D]
        if logits_at is not None:  # only these positions go on: [B, n, D], [B, n, NB, D]
            at = logits_at.astype(jnp.int32)
            hidden = jnp.take_along_axis(hidden, at[..., None], axis=1)
            blocks = jnp.take_along_axis(blocks, at[..., None, None], axis=1)
        h = hidden
        if cfg.attn_res_block_size is not None:
            h = self.output_attn_res(hidden, blocks, res.n_blocks)
        h = self.norm(h)
        logits = self.embed_tokens.attend(h) if cfg.tie_word_embeddings else self.lm_head(h)
        logits = constrain(logits, ("act_batch", "act_seq", "act_vocab"))
        stats = None
        if collect.anything or replay is not None:
            stacked = {name: _in_layer_order(p) for name, p in pieces.items()}
            if "replay_agreement" in stacked:
                stacked["replay_agreement"] = jnp.sum(stacked["replay_agreement"], axis=0)
            stats = Stats(**stacked)
        new_cache = None if cache is None else tuple(new_caches)
        if block_table is not None:
            new_cache = PagedCache(layers=new_cache, block_table=block_table)
        return Output(logits=logits.astype(jnp.float32), cache=new_cache, stats=stats)

    def _run_segment(self, stack: LayerGroup, res: Residual, start: int, period: int,
                     repeats: int, *, positions, segment_ids, caches, collect, expert_ids,
                     block_table=None):
        graphdef, state = nnx.split(stack)
        firsts = start + period * jnp.arange(repeats, dtype=jnp.int32)
        if caches is not None:  # DSA caches written in place (dense-slot and paged)
            return self._run_cached_segment(graphdef, state, firsts, res, caches, expert_ids,
                                           positions=positions, segment_ids=segment_ids,
                                           collect=collect, block_table=block_table)

        def body(carry, xs):  # no cache: the forward of training and scoring
            st, first, ids = xs
            group = nnx.merge(graphdef, st)
            carry, _, stats = group(carry, first, positions=positions, segment_ids=segment_ids,
                                    caches=None, collect=collect, expert_ids=ids)
            return carry, stats

        if self.config.remat_policy != "none":
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[self.config.remat_policy],
                                  prevent_cse=False)
        xs = (state, firsts, expert_ids)
        if self.config.scan_layers:
            res, stats = jax.lax.scan(body, res, xs)
            return res, None, stats
        outs = []
        for j in range(repeats):
            res, out = body(res, jax.tree.map(lambda a: a[j], xs))
            outs.append(out)
        return res, None, jax.tree.map(lambda *a: jnp.stack(a), *outs)

    def _run_cached_segment(self, graphdef, state, firsts, res, caches, expert_ids, *,
                            positions, segment_ids, collect, block_table):
        """``_run_segment`` with a cache (prefill and decode, no gradients): the caches ride in
        the scan's carry; each layer gets its own slice of the per-row (KDA) leaves, and the
        whole stack's DSA buffers (dense slots or paged pools) with its index, which it updates
        in place (``DSACache.layer``, ``PagedDSACache.layer``): XLA copied every DSA cache
        several times per step when a layer's was sliced out and stacked back. Compiled for
        TPU, the routed experts' weights stay whole too (``model/stacked_experts.py``)."""
        is_pool = lambda x: isinstance(x, (DSACache, PagedDSACache))  # noqa: E731
        per_layer = any(isinstance(x, LayerSlices) for x in jax.tree.leaves(
            state, is_leaf=lambda x: isinstance(x, LayerSlices)))
        whole = []  # (path, Variable) of the expert stacks each layer reads with its index
        if keep_stacked() and not per_layer and len(firsts) > 1:
            flat = nnx.to_flat_state(state)
            whole = [(p, v) for p, v in flat if is_expert_weight(p)]
            state = nnx.from_flat_state([(p, v) for p, v in flat if not is_expert_weight(p)])

        def body(carry, xs):
            res, stacked = carry
            st, first, i, ids = xs
            if whole:
                st = nnx.from_flat_state(list(nnx.to_flat_state(st)) + [
                    (p, v.replace(StackedWeight(v[...], i))) for p, v in whole])
            cache = jax.tree.map(lambda a: a.replace(layer=i) if is_pool(a) else
                                 jax.lax.dynamic_index_in_dim(a, i, keepdims=False),
                                 stacked, is_leaf=is_pool)
            group = nnx.merge(graphdef, st)
            res, cache, stats = group(res, first, positions=positions, segment_ids=segment_ids,
                                      caches=cache, collect=collect, expert_ids=ids,
                                      block_table=block_table)
            stacked = jax.tree.map(lambda old, new: new.replace(layer=None) if is_pool(new) else
                                   jax.lax.dynamic_update_index_in_dim(
                                       old, new.astype(old.dtype), i, 0),
                                   stacked, cache, is_leaf=is_pool)
            return (res, stacked), stats

        xs = (state, firsts, jnp.arange(len(firsts), dtype=jnp.int32), expert_ids)
        if self.config.scan_layers and not per_layer:
            (res, caches), stats = jax.lax.scan(body, (res, caches), xs)
            return res, caches, stats
        outs, carry = [], (res, caches)
        for j in range(len(firsts)):
            carry, out = body(carry, jax.tree.map(
                lambda a: a.parts[j] if isinstance(a, LayerSlices) else a[j], xs,
                is_leaf=lambda x: isinstance(x, LayerSlices)))
            outs.append(out)
        return carry[0], carry[1], jax.tree.map(lambda *a: jnp.stack(a), *outs)

    def init_cache(self, batch_size: int, max_len: int, rope_lanes: int | None = None) -> tuple:
        """Zeroed decode caches: per segment, per period position, stacked over repeats
        (``rope_lanes``: ``dsa_cache.rope_cache_width``)."""
        cfg = self.config
        if cfg.context_limit is not None and max_len > cfg.context_limit:
            raise ValueError(f"max_len={max_len} exceeds max_position_embeddings="
                             f"{cfg.context_limit} (this model encodes positions with RoPE)")
        return self._caches(lambda: init_kda_cache(cfg, batch_size),
                            lambda: init_dsa_cache(cfg, batch_size, max_len, rope_lanes))

    def init_paged_cache(self, batch_size: int, num_pages: int, max_pages: int,
                         parts: int = 1, rope_lanes: int | None = None) -> PagedCache:
        """Zeroed paged caches: KDA states for ``batch_size`` running rows, one pool of
        ``num_pages`` pages per DSA layer (in ``parts`` partitions, one per device group of a
        mesh's batch axes: ``model/paged_cache.py``), and an empty block table
        ``[batch_size, max_pages]`` (-1: no page)."""
        cfg = self.config
        if max_pages < 1:
            raise ValueError(f"max_pages must be >= 1, got {max_pages}")
        layers = self._caches(lambda: init_kda_cache(cfg, batch_size),
                              lambda: init_paged_dsa_cache(cfg, num_pages, parts,
                                                           rope_lanes))
        return PagedCache(layers=layers,
                          block_table=jnp.full((batch_size, max_pages), -1, jnp.int32))

    def _caches(self, kda, dsa) -> tuple:
        out = []
        for start, period, repeats in self.segment_layout:
            group = []
            for mixer, _ in self.kinds[start:start + period]:
                one = kda() if mixer == "kda" else dsa()
                group.append(jax.tree.map(lambda a: jnp.broadcast_to(a, (repeats,) + a.shape),
                                          one))
            out.append(tuple(group))
        return tuple(out)


def abstract_model(config: ModelConfig) -> Transformer:
    """The model built abstractly: every variable holds a ``jax.ShapeDtypeStruct`` (no memory).

    Tracing the constructor takes 0.2-0.6 s on 2 CPU cores, and checkpoints, plans, exports and
    the trainer ask for the same config's abstract model again and again, so its parts are kept
    per config (and per abstract mesh, in case a caller's context changes what is traced). Each
    call gets its own module and ``Variable`` objects (``nnx.merge(..., copy=True)``): a caller
    that sets a variable's value or metadata changes no other caller's model."""
    graphdef, state = _abstract_parts(config, jax.sharding.get_abstract_mesh())
    return nnx.merge(graphdef, state, copy=True)


@functools.lru_cache(maxsize=16)
def _abstract_parts(config: ModelConfig, mesh) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))


def per_layer_state(state: nnx.State, segment_layout: tuple[Segment, ...]) -> nnx.State:
    """``state`` (``nnx.split(model)[1]``) with each repeated segment's stacked parameters
    ``[R, ...]`` held as their R per-layer arrays (:class:`LayerSlices`, copies), for the decode
    step on CPU (``infer/runner.py``): XLA:CPU copies a layer's weights out of a stacked array on
    every use, sliced by a scan or by a static index alike (the routed experts of a ``k3-slice``
    MoE layer: 504 MB per layer and decode step), and a weight passed as its own array is read
    where it lies. The cached path then loops over the layers in Python. The stacked arrays stay
    in the model; the copies double those weights' memory."""
    flat = []
    for path, var in nnx.to_flat_state(state):
        if _repeated(path, segment_layout):
            value = var[...]
            var = var.replace(LayerSlices([value[j] for j in range(value.shape[0])]))
        flat.append((path, var))
    return nnx.from_flat_state(flat)


def repeated_layer_bytes(state: nnx.State, segment_layout: tuple[Segment, ...]) -> int:
    """The largest weight bytes of one layer repeat among the segments that repeat (what
    :func:`per_layer_state` would copy per layer)."""
    per_segment: dict[int, int] = {}
    for path, var in nnx.to_flat_state(state):
        if _repeated(path, segment_layout):
            per_segment[int(path[1])] = per_segment.get(int(path[1]), 0) + var[...].nbytes
    return max((n // segment_layout[i][2] for i, n in per_segment.items()), default=0)


def _repeated(path: tuple, segment_layout: tuple[Segment, ...]) -> bool:
    """Whether a state path lies in a segment of more than one repeat (stacked ``[R, ...]``)."""
    return path[0] == "segments" and segment_layout[int(path[1])][2] > 1


@jax.tree_util.register_pytree_node_class
class LayerSlices:
    """A stacked parameter ``[R, ...]`` as its R per-layer arrays (:func:`per_layer_state`); a
    pytree whose children are the arrays."""

    def __init__(self, parts):
        self.parts = tuple(parts)

    def tree_flatten(self):
        return self.parts, None

    @classmethod
    def tree_unflatten(cls, _, parts):
        return cls(parts)


def _check_right_padding(segment_ids: jax.Array | None) -> None:
    """With a cache, ``segment_ids`` mark right padding only: each row's tokens, then its
    padding (a KDA layer carries a row's state and conv window up to its last valid token, so a
    left-padded row would continue from the wrong window). Checked when the ids are concrete
    (an eager call); under ``jit`` it is the caller's contract, as in the engine's steps."""
    if segment_ids is None or isinstance(segment_ids, jax.core.Tracer):
        return
    valid = np.asarray(segment_ids) != 0                                  # [B, T]
    bad = np.nonzero((valid[:, 1:] & ~valid[:, :-1]).any(axis=1))[0]
    if bad.size:
        raise ValueError(f"segment_ids with a cache may mark right padding only (0s after a "
                         f"row's tokens); rows {bad[:4].tolist()} have tokens after padding "
                         f"(left padding?): pad each row on the right")


def _check_replay(expert_ids: jax.Array, ids_shape: tuple, num_moe: int) -> jax.Array:
    if expert_ids.ndim != 4 or expert_ids.shape[:3] != (num_moe,) + tuple(ids_shape):
        raise ValueError(f"RoutingReplay.expert_ids must be [L_moe={num_moe}, B={ids_shape[0]}, "
                         f"T={ids_shape[1]}, k], got {expert_ids.shape}")
    return expert_ids


def _in_layer_order(pieces: list) -> jax.Array:
    """``(layer indices [R], values [R, ...])`` pieces -> values stacked in layer order."""
    order = np.argsort(np.concatenate([rows for rows, _ in pieces]), kind="stable")
    return jnp.concatenate([v for _, v in pieces])[order]


def _stacked_group(config: ModelConfig, kinds, repeats: int, rngs: nnx.Rngs) -> LayerGroup:
    """``repeats`` independently initialised LayerGroups stacked on a leading axis."""

    @nnx.split_rngs(splits=repeats)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> LayerGroup:
        return LayerGroup(config, kinds, rngs=rngs)

    return make(rngs)
