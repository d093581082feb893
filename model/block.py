"""One decoder layer: a token mixer (KDA or Gated DSA), then an FFN (dense or MoE).

Residual wiring is either the plain pre-norm residual (``attn_res_block_size is None``)::

    x = x + mixer(input_layernorm(x));  x = x + ffn(post_attention_layernorm(x))

or K3's Block AttnRes (see ``attn_res.py``). Parameter names follow the HF checkpoint:
``input_layernorm``, ``post_attention_layernorm``, ``self_attn``, ``mlp`` (dense) or
``block_sparse_moe`` (MoE), ``self_attention_res`` / ``mlp_res`` (AttnRes scorers).

The layer index is a traced value (the stack scans over layers), used only for AttnRes's block
boundaries; the layer's *kinds* are static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kdsa.model.attn_res import AttnResScorer, Residual, push_block
from kdsa.model.config import FfnKind, MixerKind, ModelConfig
from kdsa.model.dsa_layer import GatedDSA
from kdsa.model.ffn import DenseFFN
from kdsa.model.kda_layer import KDA
from kdsa.model.layers import RMSNorm
from kdsa.model.moe import MoE
from kdsa.model.outputs import Collect
from kdsa.model.partitioning import constrain

ACT = ("act_batch", "act_seq", "act_embed")  # residual stream [B, T, D]; no-op without rules


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, mixer: MixerKind, ffn: FfnKind, *, rngs: nnx.Rngs):
        self.config = config
        self.mixer_kind, self.ffn_kind = mixer, ffn
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps=eps)
        self.post_attention_layernorm = RMSNorm(d, eps=eps)
        self.self_attn = KDA(config, rngs=rngs) if mixer == "kda" else GatedDSA(config, rngs=rngs)
        if ffn == "moe":
            self.block_sparse_moe = MoE(config, rngs=rngs)
        else:
            self.mlp = DenseFFN(config, config.intermediate_size, rngs=rngs)
        if config.attn_res_block_size is not None:
            self.self_attention_res = AttnResScorer(d, eps=eps)
            self.mlp_res = AttnResScorer(d, eps=eps)

    def __call__(self, res: Residual, layer_idx: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None, cache, collect: Collect,
                 expert_ids: jax.Array | None = None, block_table: jax.Array | None = None):
        """Returns ``(residual, new_cache, stats)``. ``stats`` holds only what this layer has
        and ``collect`` asks for: ``indexer_kl`` [] (a DSA layer, ``collect.indexer_kl``),
        ``expert_load`` [E] and under expert parallelism ``moe_dropped`` [] (an MoE layer,
        ``collect.expert_load``), ``expert_ids`` [B, T, k] (an MoE layer, ``collect.routing``),
        ``replay_agreement`` [2] (an MoE layer given ``expert_ids`` [B, T, k], routing replay).
        """
        cfg = self.config
        stats = {}
        attn_res = cfg.attn_res_block_size is not None
        if attn_res:
            h = self.self_attention_res(res.hidden, res.blocks, res.n_blocks)
            res = push_block(res, layer_idx % cfg.attn_res_block_size == 0)
        else:
            h = res.hidden
        mixer_in = self.input_layernorm(h)
        if self.mixer_kind == "kda":
            out, cache = self.self_attn(mixer_in, segment_ids=segment_ids, cache=cache)
        else:
            out, cache, mixer_aux = self.self_attn(mixer_in, positions=positions,
                                                   segment_ids=segment_ids, cache=cache,
                                                   indexer_loss=collect.indexer_kl,
                                                   block_table=block_table)
            if collect.indexer_kl != "none":
                stats["indexer_kl"] = mixer_aux["indexer_kl"].astype(jnp.float32)
        stream = constrain(res.hidden + out.astype(res.hidden.dtype), ACT)
        h = self.mlp_res(stream, res.blocks, res.n_blocks) if attn_res else stream
        ffn_in = self.post_attention_layernorm(h)
        if self.ffn_kind == "moe":
            token_mask = None if segment_ids is None else segment_ids != 0
            ffn_out, moe = self.block_sparse_moe(ffn_in, token_mask=token_mask,
                                                 expert_ids=expert_ids)
            if collect.expert_load:
                stats["expert_load"] = moe["expert_load"].astype(jnp.float32)
                if "moe_dropped" in moe:  # expert parallel
                    stats["moe_dropped"] = moe["moe_dropped"]
            if collect.routing:
                stats["expert_ids"] = moe["expert_ids"]
            if expert_ids is not None:
                stats["replay_agreement"] = moe["replay_agreement"]
        else:
            ffn_out = self.mlp(ffn_in)
        res = res.replace(hidden=constrain(stream + ffn_out.astype(stream.dtype), ACT),
                          blocks=constrain(res.blocks, ACT[:2] + (None, ACT[2])))
        return res, cache, stats


class LayerGroup(nnx.Module):
    """``period`` consecutive layers; the stack scans over repeats of such a group."""

    def __init__(self, config: ModelConfig, kinds: tuple[tuple[MixerKind, FfnKind], ...], *,
                 rngs: nnx.Rngs):
        self.layers = nnx.List([DecoderLayer(config, m, f, rngs=rngs) for m, f in kinds])

    def __call__(self, res: Residual, first_layer: jax.Array, *, positions, segment_ids, caches,
                 collect: Collect, expert_ids: tuple | None = None, block_table=None):
        """``expert_ids``: per layer ``[B, T, k]`` or None (routing replay); returns the
        per-layer stats as a tuple of dicts (their keys differ by layer kind)."""
        new_caches, stats = [], []
        for i, layer in enumerate(self.layers):
            cache = None if caches is None else caches[i]
            res, cache, st = layer(res, first_layer + i, positions=positions,
                                   segment_ids=segment_ids, cache=cache, collect=collect,
                                   expert_ids=None if expert_ids is None else expert_ids[i],
                                   block_table=block_table)
            new_caches.append(cache)
            stats.append(st)
        return res, (None if caches is None else tuple(new_caches)), tuple(stats)
