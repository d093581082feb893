"""Kimi Linear (``moonshotai/Kimi-Linear-48B-A3B-Instruct``, ``model_type: kimi_linear``).

Tensor names and shapes: ``docs/reference/kimi_k3.md`` section 2 (the Kimi Linear 48B notes)
and transformers 5.18 ``models/kimi_linear`` (whose ``save_pretrained`` writes these checkpoint
names: ``conversion_mapping.py`` "kimi_linear"). Shapes are HF ``[out, in]``; our kernels are
``[in, out]``. ``A_log`` is ``[1, 1, H, 1]``; conv weights ``[H*K, 1, W]``. K3's extra tensors
(AttnRes scorers, latent MoE projections, full-rank gates, MLA output gate, q-LoRA) use the same
naming scheme, so this table carries them too and ``kimi_k3`` reuses it.
"""

from __future__ import annotations

from kdsa.train.convert.mappings import ExpertRule, Layout, Rule, base_hf_config

F32 = "F32"  # tensors published in float32 (kimi_k3.md section 1)
# Kimi's MLA is NoPE: transformers' KimiLinear has no rotary embedding at all and its config.json
# has no mla_use_nope field (the published configs say "mla_use_nope": true).
NOPE = (("mla_use_nope", True),)

TOP = (
    Rule("embed_tokens.embedding", "model.embed_tokens.weight"),
    Rule("norm.weight", "model.norm.weight"),
    Rule("lm_head.kernel", "lm_head.weight", "T"),
    Rule("output_attn_res.norm", "model.output_attn_res_norm.weight"),
    Rule("output_attn_res.proj", "model.output_attn_res_proj.weight", "row"),
)


def layer_rules(a_log_kind: str) -> tuple[Rule, ...]:
    t = lambda name: Rule(f"{name}.kernel", f"{name}.weight", "T")  # noqa: E731
    return (
        Rule("input_layernorm.weight", "input_layernorm.weight"),
        Rule("post_attention_layernorm.weight", "post_attention_layernorm.weight"),
        Rule("self_attention_res.norm", "self_attention_res_norm.weight"),
        Rule("self_attention_res.proj", "self_attention_res_proj.weight", "row"),
        Rule("mlp_res.norm", "mlp_res_norm.weight"),
        Rule("mlp_res.proj", "mlp_res_proj.weight", "row"),
        # KDA
        t("self_attn.q_proj"), t("self_attn.k_proj"), t("self_attn.v_proj"),
        Rule("self_attn.q_conv1d", "self_attn.q_conv1d.weight", "conv", F32),
        Rule("self_attn.k_conv1d", "self_attn.k_conv1d.weight", "conv", F32),
        Rule("self_attn.v_conv1d", "self_attn.v_conv1d.weight", "conv", F32),
        t("self_attn.f_a_proj"), t("self_attn.f_b_proj"), t("self_attn.b_proj"),
        Rule("self_attn.A_log", "self_attn.A_log", a_log_kind, F32),
        Rule("self_attn.dt_bias", "self_attn.dt_bias", "id", F32),
        t("self_attn.g_proj"), t("self_attn.g_a_proj"), t("self_attn.g_b_proj"),
        Rule("self_attn.o_norm.weight", "self_attn.o_norm.weight", "id", F32),
        t("self_attn.o_proj"),
        # gated MLA (g_proj and o_proj share the KDA rules above)
        t("self_attn.q_a_proj"),
        Rule("self_attn.q_a_layernorm.weight", "self_attn.q_a_layernorm.weight"),
        t("self_attn.q_b_proj"), t("self_attn.kv_a_proj_with_mqa"),
        Rule("self_attn.kv_a_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
        t("self_attn.kv_b_proj"),
        # DSA lightning indexer (our K3+DSA export; DeepSeek-V3.2 names)
        t("self_attn.indexer.wq_b"), t("self_attn.indexer.wk"),
        Rule("self_attn.indexer.k_norm.weight", "self_attn.indexer.k_norm.weight"),
        Rule("self_attn.indexer.k_norm.bias", "self_attn.indexer.k_norm.bias"),
        t("self_attn.indexer.weights_proj"),
        # dense FFN (first_k_dense_replace layers). transformers 5.18's save_pretrained writes it
        # as block_sparse_moe.* (its reverse rename block_sparse_moe -> mlp is applied to all).
        *(Rule(f"mlp.{n}.kernel", f"mlp.{n}.weight", "T", alt=(f"block_sparse_moe.{n}.weight",))
          for n in ("gate_proj", "up_proj", "down_proj")),
        # MoE
        Rule("block_sparse_moe.gate.weight", "block_sparse_moe.gate.weight", "T"),
        Rule("block_sparse_moe.gate.e_score_correction_bias",
             "block_sparse_moe.gate.e_score_correction_bias", "id", F32),
        t("block_sparse_moe.routed_expert_down_proj"),
        Rule("block_sparse_moe.routed_expert_norm.weight",
             "block_sparse_moe.routed_expert_norm.weight"),
        t("block_sparse_moe.routed_expert_up_proj"),
        t("block_sparse_moe.shared_experts.gate_proj"),
        t("block_sparse_moe.shared_experts.up_proj"),
        t("block_sparse_moe.shared_experts.down_proj"),
    )


EXPERTS = (  # w1 = gate, w3 = up, w2 = down (kimi_k3.md section 2)
    ExpertRule("block_sparse_moe.experts.w1", "block_sparse_moe.experts.{e}.w1"),
    ExpertRule("block_sparse_moe.experts.w3", "block_sparse_moe.experts.{e}.w3"),
    ExpertRule("block_sparse_moe.experts.w2", "block_sparse_moe.experts.{e}.w2"),
)


def hf_config(config, experts: str, dtype: str) -> dict:
    d = base_hf_config(config, experts, dtype)
    d["model_type"], d["architectures"] = "kimi_linear", ["KimiLinearForCausalLM"]
    return d


LAYOUT = Layout(
    name="kimi_linear", prefix="", top=TOP, layer=layer_rules("a_log_4d"), experts=EXPERTS,
    ignore=(r"model\.layers\.\d+\.self_attn\.rotary_emb\..*",), hf_config=hf_config,
    defaults=NOPE)
