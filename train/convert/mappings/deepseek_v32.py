"""DeepSeek-V3.2 (``deepseek-ai/DeepSeek-V3.2-Exp``, ``model_type: deepseek_v32``).

Names: ``docs/reference/dsa.md`` sections 1.2-1.3 and 5, and transformers 5.18
``models/deepseek_v32`` (``save_pretrained`` writes per-expert ``mlp.experts.{e}.{gate,up,down}
_proj.weight``, the published names). Every layer is (sparse) MLA with q-LoRA and the lightning
indexer ``self_attn.indexer.{wq_b, wk, k_norm (LayerNorm weight+bias), weights_proj}``; the FFN
is ``mlp`` for both dense and MoE layers (``mlp.gate``, ``mlp.experts``, ``mlp.shared_experts``).
No KDA, AttnRes, latent MoE or output gate: a config with those cannot be written here. Layers
past ``num_hidden_layers`` (the MTP layer 61 of the release) are skipped and reported.
"""

from __future__ import annotations

from kdsa.train.convert.mappings import ExpertRule, Layout, Rule, base_hf_config

_t = lambda name, hf=None: Rule(f"{name}.kernel", f"{hf or name}.weight", "T")  # noqa: E731

TOP = (
    Rule("embed_tokens.embedding", "model.embed_tokens.weight"),
    Rule("norm.weight", "model.norm.weight"),
    Rule("lm_head.kernel", "lm_head.weight", "T"),
)

LAYER = (
    Rule("input_layernorm.weight", "input_layernorm.weight"),
    Rule("post_attention_layernorm.weight", "post_attention_layernorm.weight"),
    _t("self_attn.q_proj"), _t("self_attn.q_a_proj"),
    Rule("self_attn.q_a_layernorm.weight", "self_attn.q_a_layernorm.weight"),
    _t("self_attn.q_b_proj"), _t("self_attn.kv_a_proj_with_mqa"),
    Rule("self_attn.kv_a_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
    _t("self_attn.kv_b_proj"), _t("self_attn.o_proj"),
    _t("self_attn.indexer.wq_b"), _t("self_attn.indexer.wk"),
    Rule("self_attn.indexer.k_norm.weight", "self_attn.indexer.k_norm.weight"),
    Rule("self_attn.indexer.k_norm.bias", "self_attn.indexer.k_norm.bias"),
    _t("self_attn.indexer.weights_proj"),
    _t("mlp.gate_proj"), _t("mlp.up_proj"), _t("mlp.down_proj"),
    Rule("block_sparse_moe.gate.weight", "mlp.gate.weight", "T"),
    Rule("block_sparse_moe.gate.e_score_correction_bias", "mlp.gate.e_score_correction_bias",
         "id", "F32"),
    _t("block_sparse_moe.shared_experts.gate_proj", "mlp.shared_experts.gate_proj"),
    _t("block_sparse_moe.shared_experts.up_proj", "mlp.shared_experts.up_proj"),
    _t("block_sparse_moe.shared_experts.down_proj", "mlp.shared_experts.down_proj"),
)

EXPERTS = (
    ExpertRule("block_sparse_moe.experts.w1", "mlp.experts.{e}.gate_proj"),
    ExpertRule("block_sparse_moe.experts.w3", "mlp.experts.{e}.up_proj"),
    ExpertRule("block_sparse_moe.experts.w2", "mlp.experts.{e}.down_proj"),
)


def hf_config(config, experts: str, dtype: str) -> dict:
    """DeepSeek-V3 field names next to ours (``from_hf_config`` reads either)."""
    d = base_hf_config(config, experts, dtype)
    d.update(model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"],
             n_routed_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_token,
             n_shared_experts=config.num_shared_experts, n_group=config.num_expert_group,
             scoring_func=config.moe_router_activation_func, norm_topk_prob=config.moe_renormalize,
             topk_method="noaux_tc", mlp_layer_types=["sparse" if k == "moe" else "dense"
                                                      for k in config.ffn_kinds])
    d.pop("linear_attn_config", None)
    return d


LAYOUT = Layout(
    name="deepseek_v32", prefix="", top=TOP, layer=LAYER, experts=EXPERTS,
    ignore=(r"model\.layers\.\d+\.self_attn\.rotary_emb\..*",), hf_config=hf_config)
