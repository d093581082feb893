"""Named model configurations and where their numbers come from.

| preset | source |
|---|---|
| ``tiny`` | ours: every code path of ``k3-2.8t`` (KDA + Gated DSA, latent MoE, SiTU, AttnRes, dense first layer) at sizes where each test runs in seconds on a CPU |
| ``tiny-vl`` | ours: ``tiny`` plus a 2-block vision tower (hidden 32) and projector, for the vision tests |
| ``small`` | ours: the CPU demo size (RL/SFT demo, generation smoke runs) |
| ``kimi-linear-48b`` | the published ``moonshotai/Kimi-Linear-48B-A3B-Instruct`` ``config.json`` (dense MLA, no indexer) |
| ``k3-2.8t`` | the published ``moonshotai/Kimi-K3`` text config (``text_config`` of ``kimi_k3``), with DeepSeek-V3.2's indexer (64 heads x 128, top-2048, ``config_671B_v3.2.json``) on its 24 MLA layers |
| ``k3-slice`` | ours, for benchmarks: ``k3-2.8t``'s per-head and per-expert widths with fewer heads, experts and layers (below) |

Facts are collected in ``docs/reference/kimi_k3.md`` (sections 1 and 4) and
``docs/reference/dsa.md`` (1.1).
"""

from __future__ import annotations

import dataclasses

from kdsa.model.config import LinearAttnConfig, ModelConfig, VisionConfig


def _every_fourth(n: int, extra: tuple[int, ...] = ()) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """1-based (kda_layers, full_attn_layers): MLA at multiples of 4 plus ``extra``."""
    full = tuple(sorted({i for i in range(4, n + 1, 4)} | set(extra)))
    return tuple(i for i in range(1, n + 1) if i not in full), full


def tiny() -> ModelConfig:
    kda, full = _every_fourth(4)
    return ModelConfig(
        vocab_size=384, hidden_size=64, num_hidden_layers=4, intermediate_size=96,
        max_position_embeddings=1024, hidden_act="situ", activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0, attn_res_block_size=2,
        bos_token_id=256, eos_token_id=258, pad_token_id=383,
        num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, mla_use_nope=True, mla_use_output_gate=True,
        linear_attn_config=LinearAttnConfig(kda_layers=kda, full_attn_layers=full, num_heads=2,
                                            head_dim=16, short_conv_kernel_size=4,
                                            use_full_rank_gate=True, gate_lower_bound=-5.0),
        num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
        routed_expert_hidden_size=32, latent_moe_use_norm=True, use_grouped_topk=True,
        num_expert_group=1, topk_group=1, first_k_dense_replace=1, moe_layer_freq=1,
        index_n_heads=4, index_head_dim=16, index_topk=8,
        kda_chunk_size=16, dsa_query_chunk_size=16,
    )


def tiny_vl() -> ModelConfig:
    """``tiny`` reading images: a 2-block MoonViT-style tower; ``<|media_pad|>`` of the byte
    tokenizer (256 + 21) is the image placeholder."""
    return tiny().replace(vision_config=VisionConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        patch_size=14, init_pos_emb_height=8, init_pos_emb_width=8, merge_kernel_size=(2, 2),
        attn_bias=False, linear_bias=False, patch_embed_proj_bias=False,
        max_patches=1024, max_patches_per_side=64, media_placeholder_token_id=277))


def small() -> ModelConfig:
    kda, full = _every_fourth(8)
    return ModelConfig(
        vocab_size=512, hidden_size=256, num_hidden_layers=8, intermediate_size=512,
        max_position_embeddings=4096, hidden_act="situ", activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0, attn_res_block_size=4,
        bos_token_id=256, eos_token_id=258, pad_token_id=511,
        num_attention_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, mla_use_nope=True, mla_use_output_gate=True,
        linear_attn_config=LinearAttnConfig(kda_layers=kda, full_attn_layers=full, num_heads=4,
                                            head_dim=32, short_conv_kernel_size=4,
                                            use_full_rank_gate=True, gate_lower_bound=-5.0),
        num_experts=16, num_experts_per_token=4, num_shared_experts=1, moe_intermediate_size=128,
        routed_expert_hidden_size=128, latent_moe_use_norm=True, use_grouped_topk=True,
        num_expert_group=1, topk_group=1, first_k_dense_replace=1, moe_layer_freq=1,
        index_n_heads=4, index_head_dim=32, index_topk=64,
        kda_chunk_size=64, dsa_query_chunk_size=128,
    )


def kimi_linear_48b() -> ModelConfig:
    """``moonshotai/Kimi-Linear-48B-A3B-Instruct``: 27 layers, MLA at 4,8,...,24,27; no indexer."""
    kda, full = _every_fourth(27, extra=(27,))
    return ModelConfig(
        vocab_size=163840, hidden_size=2304, num_hidden_layers=27, intermediate_size=9216,
        rms_norm_eps=1e-5, max_position_embeddings=1048576, hidden_act="silu",
        bos_token_id=163584, eos_token_id=163585, pad_token_id=163839,
        num_attention_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True, mla_use_output_gate=False,
        linear_attn_config=LinearAttnConfig(kda_layers=kda, full_attn_layers=full, num_heads=32,
                                            head_dim=128, short_conv_kernel_size=4),
        num_experts=256, num_experts_per_token=8, num_shared_experts=1, moe_intermediate_size=1024,
        moe_router_activation_func="sigmoid", moe_renormalize=True, routed_scaling_factor=2.446,
        use_grouped_topk=True, num_expert_group=1, topk_group=1, first_k_dense_replace=1,
        moe_layer_freq=1, param_dtype="bfloat16", compute_dtype="bfloat16",
    )


def k3_2p8t() -> ModelConfig:
    """Kimi K3 (93 layers: MLA at 4,8,...,92 and 93) with DSA on its 24 MLA layers."""
    kda, full = _every_fourth(93, extra=(93,))
    return ModelConfig(
        vocab_size=163840, hidden_size=7168, num_hidden_layers=93, intermediate_size=33792,
        rms_norm_eps=1e-5, max_position_embeddings=1048576, hidden_act="situ",
        activation_situ_beta=4.0, activation_situ_linear_beta=25.0, attn_res_block_size=12,
        bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
        num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True, mla_use_output_gate=True,
        linear_attn_config=LinearAttnConfig(kda_layers=kda, full_attn_layers=full, num_heads=96,
                                            head_dim=128, short_conv_kernel_size=4,
                                            use_full_rank_gate=True, gate_lower_bound=-5.0),
        num_experts=896, num_experts_per_token=16, num_shared_experts=2, moe_intermediate_size=3072,
        routed_expert_hidden_size=3584, latent_moe_use_norm=True,
        moe_router_activation_func="sigmoid", moe_renormalize=True, routed_scaling_factor=1.0,
        use_grouped_topk=True, num_expert_group=1, topk_group=1, first_k_dense_replace=1,
        moe_layer_freq=1, index_n_heads=64, index_head_dim=128, index_topk=2048,
        param_dtype="bfloat16", compute_dtype="bfloat16",
        kda_chunk_size=64, dsa_query_chunk_size=256, remat_policy="full",
        # K2.5's MoonViT3d as K3 configures it (kimi_k3.md 5): 27 blocks, 1024 wide, 12 heads
        # over a 1536-wide attention, MLP 4096, 14 px patches, 2 x 2 merge, 64 x 64 pos grid
        vision_config=VisionConfig(
            hidden_size=1024, num_hidden_layers=27, num_attention_heads=12,
            intermediate_size=4096, qkv_hidden_size=1536, patch_size=14, init_pos_emb_height=64,
            init_pos_emb_width=64, merge_kernel_size=(2, 2), norm_type="rmsnorm",
            attn_bias=False, linear_bias=False, patch_embed_proj_bias=False,  # K3 config.json
            media_placeholder_token_id=163605),
    )


def k3_slice() -> ModelConfig:
    """A benchmark model with K3's widths where they set a layer's costs, small enough for one
    step in seconds on a CPU: KDA heads of 128 x 128; MLA with kv_lora 512 + RoPE 64, q_lora
    1536, nope / v head dims 128; the indexer's heads of 128 with top-2048; routed experts of
    K3's latent width 3584 and hidden 3072, two shared experts of 3072 (all taken from
    ``k3_2p8t``). Fewer of everything else: hidden 1024, 8 attention and 8 KDA heads (K3: 96),
    8 index heads (K3: 64 for 96 attention heads, so the indexer's share here is 1.5x K3's),
    4 experts top-2 (K3: 896 top-16; 4 x 3 MoE layers of K3-wide experts are already 0.4B
    parameters, and this machine's 24 GiB must hold them with AdamW's two float32 moments),
    4 layers in the 3:1 pattern (KDA + dense FFN, KDA, KDA, Gated DSA; MoE after the first),
    a 32K vocabulary (K3: 163,840), no vision tower, no remat. float32: on this project's CPU
    machine f32 matmuls beat bf16 (``--set compute_dtype=bfloat16 param_dtype=bfloat16`` for
    an accelerator); but the indexer's queries and keys are bfloat16 as in K3, whose
    bfloat16 x bfloat16 products into float32 run 1.9x faster than float32 on that CPU."""
    k3, (kda, full) = k3_2p8t(), _every_fourth(4)
    return k3.replace(
        vocab_size=32768, hidden_size=1024, num_hidden_layers=4, intermediate_size=4864,
        attn_res_block_size=2, bos_token_id=256, eos_token_id=258,  # the byte tokenizer's
        pad_token_id=32767, num_attention_heads=8,
        linear_attn_config=dataclasses.replace(k3.linear_attn_config, kda_layers=kda,
                                               full_attn_layers=full, num_heads=8),
        num_experts=4, num_experts_per_token=2, index_n_heads=8,
        param_dtype="float32", compute_dtype="float32", index_dtype="bfloat16",
        remat_policy="none", vision_config=None,
    )


PRESETS = {
    "tiny": tiny,
    "tiny-vl": tiny_vl,
    "small": small,
    "kimi-linear-48b": kimi_linear_48b,
    "k3-2.8t": k3_2p8t,
    "k3-slice": k3_slice,
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None
