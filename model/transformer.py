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
    out = model.forward(input_ids, cache=model.init_cache(B, max_len), positions=pos)
    out.logits, out.cache, out.indexer_kl [L], out.expert_load [L, E]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from kdsa.model.attn_res import AttnResScorer, Residual, initial_residual
from kdsa.model.block import ACT, LayerGroup
from kdsa.model.config import ModelConfig
from kdsa.model.dsa_layer import init_dsa_cache
from kdsa.model.kda_layer import init_kda_cache
from kdsa.model.layers import Embed, Linear, RMSNorm, dtype_of
from kdsa.model.partitioning import constrain

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


@struct.dataclass
class ModelOutput:
    logits: jax.Array  # [B, T, V] float32
    cache: tuple | None  # per segment, per period position: stacked layer caches
    indexer_kl: jax.Array  # [L] float32 (0 for KDA layers)
    expert_load: jax.Array  # [L, E] float32 (0 for dense-FFN layers)
    moe_dropped: jax.Array | None = None  # [L] int32: expert-parallel assignments over capacity
    expert_ids: jax.Array | None = None  # [L, B, T, k] int32 with record_routing (-1: dense FFN)
    replay_agreement: jax.Array | None = None  # [2] float32: sum, count over replayed tokens


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

    def forward(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
                segment_ids: jax.Array | None = None, cache: tuple | None = None,
                indexer_loss: str = "none", image_embeds: jax.Array | None = None,
                image_mask: jax.Array | None = None, expert_ids: jax.Array | None = None,
                record_routing: bool = False) -> ModelOutput:
        """Full forward (cache None), prefill or decode (cache from ``init_cache``).

        ``positions`` [B, T] int32 (default: 0..T-1, restarting per segment); with a cache they
        are the absolute slots the tokens are written to. ``segment_ids`` [B, T] int32: packed
        documents (no cache) or padding marks (0 = pad, right padding). ``image_embeds``
        [B, T, D] replace the token embeddings where ``image_mask`` [B, T] is set (image
        placeholders, ``model/vision/assemble.py : image_inputs``).

        MoE routing replay (RL): ``expert_ids`` [L, B, T, k] int32 are the experts each MoE
        layer uses instead of its router's top-k (rows starting with -1, and dense layers'
        rows, are ignored); ``out.replay_agreement`` says how often the router agreed.
        ``record_routing``: ``out.expert_ids`` [L, B, T, k] are the experts every layer used.
        """
        cfg = self.config
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
        if positions is None:
            if cache is not None:
                raise ValueError("positions are required with a cache (the slots to write)")
            positions = default_positions(input_ids, segment_ids)
        h = self.embed_tokens(input_ids)
        if image_embeds is not None:
            h = jnp.where(image_mask[..., None], image_embeds.astype(h.dtype), h)
        res = initial_residual(constrain(h, ACT), cfg.num_attn_res_blocks)
        res = res.replace(blocks=constrain(res.blocks, ACT[:2] + (None, ACT[2])))
        b, t = input_ids.shape
        if expert_ids is not None and (expert_ids.ndim != 4 or expert_ids.shape[:3] != (
                cfg.num_hidden_layers, b, t)):
            raise ValueError(f"expert_ids must be [L={cfg.num_hidden_layers}, B={b}, T={t}, k], "
                             f"got {expert_ids.shape}")
        new_caches, kls, loads, drops, agree, used = [], [], [], [], [], []
        for seg_i, (start, period, repeats) in enumerate(self.segment_layout):
            seg_cache = None if cache is None else cache[seg_i]
            seg_ids = None if expert_ids is None else expert_ids[
                start:start + period * repeats].reshape((repeats, period) + expert_ids.shape[1:])
            res, seg_cache, aux = self._run_segment(
                self.segments[seg_i], res, start, period, repeats, positions=positions,
                segment_ids=segment_ids, caches=seg_cache, indexer_loss=indexer_loss,
                expert_ids=seg_ids, record_routing=record_routing)
            new_caches.append(seg_cache)
            kls.append(aux["indexer_kl"].reshape(period * repeats))
            loads.append(aux["expert_load"].reshape(period * repeats, -1))
            drops.append(aux["moe_dropped"].reshape(period * repeats))
            agree.append(aux["replay_agreement"].reshape(-1, 2))
            if record_routing:
                used.append(aux["expert_ids"].reshape((period * repeats,) +
                                                      aux["expert_ids"].shape[2:]))
        h = res.hidden
        if cfg.attn_res_block_size is not None:
            h = self.output_attn_res(res.hidden, res.blocks, res.n_blocks)
        h = self.norm(h)
        logits = self.embed_tokens.attend(h) if cfg.tie_word_embeddings else self.lm_head(h)
        logits = constrain(logits, ("act_batch", "act_seq", "act_vocab"))
        return ModelOutput(logits=logits.astype(jnp.float32),
                           cache=None if cache is None else tuple(new_caches),
                           indexer_kl=jnp.concatenate(kls), expert_load=jnp.concatenate(loads),
                           moe_dropped=jnp.concatenate(drops),
                           expert_ids=jnp.concatenate(used) if record_routing else None,
                           replay_agreement=jnp.sum(jnp.concatenate(agree), axis=0))

    def _run_segment(self, stack: LayerGroup, res: Residual, start: int, period: int,
                     repeats: int, *, positions, segment_ids, caches, indexer_loss,
                     expert_ids=None, record_routing=False):
        graphdef, state = nnx.split(stack)
        firsts = start + period * jnp.arange(repeats, dtype=jnp.int32)

        def body(carry, xs):
            st, first, cache, ids = xs
            group = nnx.merge(graphdef, st)
            carry, cache, aux = group(carry, first, positions=positions, segment_ids=segment_ids,
                                      caches=cache, indexer_loss=indexer_loss, expert_ids=ids,
                                      record_routing=record_routing)
            return carry, (cache, aux)

        if self.config.remat_policy != "none":
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[self.config.remat_policy],
                                  prevent_cse=False)
        if self.config.scan_layers:
            return _unpack(*jax.lax.scan(body, res, (state, firsts, caches, expert_ids)))
        outs = []
        for j in range(repeats):
            xs = jax.tree.map(lambda a: a[j], (state, firsts, caches, expert_ids))
            res, out = body(res, xs)
            outs.append(out)
        return _unpack(res, jax.tree.map(lambda *a: jnp.stack(a), *outs))

    def init_cache(self, batch_size: int, max_len: int) -> tuple:
        """Zeroed decode caches: per segment, per period position, stacked over repeats."""
        cfg = self.config
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_len={max_len} exceeds max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
        out = []
        for start, period, repeats in self.segment_layout:
            group = []
            for mixer, _ in self.kinds[start:start + period]:
                one = (init_kda_cache(cfg, batch_size) if mixer == "kda"
                       else init_dsa_cache(cfg, batch_size, max_len))
                group.append(jax.tree.map(lambda a: jnp.broadcast_to(a, (repeats,) + a.shape),
                                          one))
            out.append(tuple(group))
        return tuple(out)


def _unpack(res, ys):
    caches, aux = ys
    return res, caches, aux


def _stacked_group(config: ModelConfig, kinds, repeats: int, rngs: nnx.Rngs) -> LayerGroup:
    """``repeats`` independently initialised LayerGroups stacked on a leading axis."""

    @nnx.split_rngs(splits=repeats)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> LayerGroup:
        return LayerGroup(config, kinds, rngs=rngs)

    return make(rngs)
