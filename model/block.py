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
                 segment_ids: jax.Array | None, cache, indexer_loss: str,
                 expert_ids: jax.Array | None = None, record_routing: bool = False):
        """Returns ``(residual, new_cache, aux)``; aux has ``indexer_kl`` [] and
        ``expert_load`` [E] (zeros for dense layers and KDA layers respectively),
        ``replay_agreement`` [2] (sum, count; zeros without replay) and, with
        ``record_routing``, ``expert_ids`` [B, T, k] (the experts used; -1 for a dense FFN).
        ``expert_ids`` [B, T, k]: routing replay (``MoE``); ignored by a dense FFN."""
        cfg = self.config
        attn_res = cfg.attn_res_block_size is not None
        if attn_res:
            h = self.self_attention_res(res.hidden, res.blocks, res.n_blocks)
            res = push_block(res, layer_idx % cfg.attn_res_block_size == 0)
        else:
            h = res.hidden
        mixer_in = self.input_layernorm(h)
        if self.mixer_kind == "kda":
            out, cache = self.self_attn(mixer_in, segment_ids=segment_ids, cache=cache)
            kl = jnp.zeros((), jnp.float32)
        else:
            out, cache, mixer_aux = self.self_attn(mixer_in, positions=positions,
                                                   segment_ids=segment_ids, cache=cache,
                                                   indexer_loss=indexer_loss)
            kl = mixer_aux["indexer_kl"].astype(jnp.float32)
        stream = constrain(res.hidden + out.astype(res.hidden.dtype), ACT)
        h = self.mlp_res(stream, res.blocks, res.n_blocks) if attn_res else stream
        ffn_in = self.post_attention_layernorm(h)
        if self.ffn_kind == "moe":
            token_mask = None if segment_ids is None else segment_ids != 0
            ffn_out, stats = self.block_sparse_moe(ffn_in, token_mask=token_mask,
                                                   expert_ids=expert_ids)
            load = stats["expert_load"].astype(jnp.float32)
            dropped = stats.get("moe_dropped", jnp.zeros((), jnp.int32))  # expert parallel
        else:
            ffn_out = self.mlp(ffn_in)
            load = jnp.zeros((max(cfg.num_experts, 1),), jnp.float32)
            dropped = jnp.zeros((), jnp.int32)
            stats = {}
        res = res.replace(hidden=constrain(stream + ffn_out.astype(stream.dtype), ACT),
                          blocks=constrain(res.blocks, ACT[:2] + (None, ACT[2])))
        aux = {"indexer_kl": kl, "expert_load": load, "moe_dropped": dropped,
               "replay_agreement": stats.get("replay_agreement", jnp.zeros((2,), jnp.float32))}
        if record_routing:  # -1: a dense FFN has no experts
            aux["expert_ids"] = stats.get("expert_ids", jnp.full(
                ffn_in.shape[:2] + (max(cfg.num_experts_per_token, 1),), -1, jnp.int32))
        return res, cache, aux


class LayerGroup(nnx.Module):
    """``period`` consecutive layers; the stack scans over repeats of such a group."""

    def __init__(self, config: ModelConfig, kinds: tuple[tuple[MixerKind, FfnKind], ...], *,
                 rngs: nnx.Rngs):
        self.layers = nnx.List([DecoderLayer(config, m, f, rngs=rngs) for m, f in kinds])

    def __call__(self, res: Residual, first_layer: jax.Array, *, positions, segment_ids, caches,
                 indexer_loss: str, expert_ids: jax.Array | None = None,
                 record_routing: bool = False):
        """``expert_ids`` [P, B, T, k] or None; aux entries stacked over the P layers."""
        new_caches, auxs = [], []
        for i, layer in enumerate(self.layers):
            cache = None if caches is None else caches[i]
            res, cache, aux = layer(res, first_layer + i, positions=positions,
                                    segment_ids=segment_ids, cache=cache,
                                    indexer_loss=indexer_loss,
                                    expert_ids=None if expert_ids is None else expert_ids[i],
                                    record_routing=record_routing)
            new_caches.append(cache)
            auxs.append(aux)
        # indexer_kl [P], expert_load [P, E], moe_dropped [P], replay_agreement [P, 2],
        # expert_ids [P, B, T, k]
        aux = {k: jnp.stack([a[k] for a in auxs]) for k in auxs[0]}
        return res, (None if caches is None else tuple(new_caches)), aux
