"""ModelConfig validation, Hugging Face round trips and the CLI's config arguments."""

import dataclasses
import json

import pytest

from kdsa.model.overrides import apply_overrides
from kdsa.model.config import LinearAttnConfig, ModelConfig, get_preset
from kdsa.model.presets import PRESETS

ALL = sorted(PRESETS)


@pytest.mark.parametrize("name", ALL)
def test_hf_round_trip(name):
    c = get_preset(name)
    d = json.loads(c.to_json())
    assert ModelConfig.from_hf_config(d) == c
    assert d["linear_attn_config"]["kda_layers"] == list(c.linear_attn_config.kda_layers)
    hash(c)  # static data of NNX modules must be hashable


def test_k3_layer_pattern():
    c = get_preset("k3-2.8t")
    kinds = c.mixer_kinds
    assert kinds.count("kda") == 69 and kinds.count("dsa") == 24
    assert [i for i, k in enumerate(kinds) if k == "dsa"] == list(range(3, 92, 4)) + [92]
    assert c.ffn_kinds[0] == "dense" and set(c.ffn_kinds[1:]) == {"moe"}
    assert c.num_attn_res_blocks == 8


def test_k3_slice_keeps_k3_widths():
    """The benchmark preset: K3's per-head, per-expert and chunk widths, the 3:1 pattern."""
    k3, sl = get_preset("k3-2.8t"), get_preset("k3-slice")
    for f in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "moe_intermediate_size", "routed_expert_hidden_size",
              "num_shared_experts", "index_head_dim", "index_topk", "kda_chunk_size",
              "dsa_query_chunk_size", "hidden_act", "first_k_dense_replace"):
        assert getattr(sl, f) == getattr(k3, f), f
    assert sl.linear_attn_config.head_dim == k3.linear_attn_config.head_dim == 128
    assert sl.mixer_kinds == ("kda", "kda", "kda", "dsa")
    assert sl.ffn_kinds == ("dense", "moe", "moe", "moe")


def test_kimi_k3_wrapper_and_deepseek_names():
    k3 = get_preset("k3-2.8t")
    wrapped = {"model_type": "kimi_k3", "text_config": k3.to_hf_config()}
    assert ModelConfig.from_hf_config(wrapped) == k3
    ds = {  # DeepSeek-V3.2 names (config_671B_v3.2 shape, trimmed to 4 layers)
        "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_attention_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "moe_intermediate_size": 32, "scoring_func": "sigmoid",
        "norm_topk_prob": True, "n_group": 2, "topk_group": 1, "topk_method": "noaux_tc",
        "first_k_dense_replace": 1, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "torch_dtype": "bfloat16",
    }
    c = ModelConfig.from_hf_config(ds)
    assert c.num_experts == 8 and c.num_experts_per_token == 2 and c.num_shared_experts == 1
    assert c.num_expert_group == 2 and c.use_grouped_topk
    assert c.mixer_kinds == ("dsa",) * 4 and c.rope_scaling.factor == 40
    assert ModelConfig.from_hf_config(c.to_hf_config()) == c


BAD = [
    ({"num_hidden_layers": 5}, "neither"),
    ({"num_experts_per_token": 9}, "exceeds num_experts"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"index_topk": 0}, "index_topk"),
    ({"index_topk": None}, "set together"),
    ({"num_expert_group": 3}, "divisible"),
    ({"topk_group": 2}, "topk_group"),
    ({"kda_chunk_size": 24}, "power of two"),
    ({"q_lora_rank": 0}, "q_lora_rank"),
    ({"remat_policy": "some"}, "remat_policy"),
    ({"index_dtype": "int8"}, "index_dtype"),
    ({"eos_token_id": 10_000}, "eos_token_id"),
]


@pytest.mark.parametrize("change,msg", BAD)
def test_invalid_configs_name_the_field(change, msg):
    with pytest.raises(ValueError, match=msg):
        dataclasses.replace(get_preset("tiny"), **change)


def test_invalid_layer_lists():
    lac = get_preset("tiny").linear_attn_config
    for kda, full, msg in [((1, 2, 3), (3, 4), "overlap"), ((1, 2, 3), (5,), "1-based"),
                           ((1, 2), (4,), "neither"), ((1, 1, 2, 3), (4,), "repeats")]:
        with pytest.raises(ValueError, match=msg):
            dataclasses.replace(get_preset("tiny"), linear_attn_config=dataclasses.replace(
                lac, kda_layers=kda, full_attn_layers=full))
    with pytest.raises(ValueError, match="gate_lower_bound"):
        LinearAttnConfig(kda_layers=(1,), full_attn_layers=(), num_heads=1, head_dim=4,
                         gate_lower_bound=0.5)
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("k4")


def test_overrides():
    c = apply_overrides(get_preset("tiny"), ["num_experts=16", "linear_attn_config.num_heads=4",
                                             "compute_dtype=bfloat16", "index_topk=null",
                                             "index_n_heads=null", "index_head_dim=null"])
    assert c.num_experts == 16 and c.linear_attn_config.num_heads == 4
    assert c.compute_dtype == "bfloat16" and not c.use_indexer
    for bad, msg in [("nope=1", "unknown config field"), ("num_experts", "KEY=VALUE"),
                     ("linear_attn_config.x=1", "no field")]:
        with pytest.raises(ValueError, match=msg):
            apply_overrides(get_preset("tiny"), [bad])


@pytest.mark.parametrize("change, msg", [
    ({"rope_scaling": {"type": "yarn", "factor": 0, "original_max_position_embeddings": 4096}},
     "rope_scaling.factor must be > 0"),
    ({"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 0}},
     "rope_scaling.original_max_position_embeddings must be >= 1"),
    ({"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 8,
                       "beta_fast": 1, "beta_slow": 32}}, "beta_fast > beta_slow > 0"),
    ({"rope_scaling": {"type": "linear", "factor": 4}}, "only 'yarn' is supported"),
    ({"kdsa": {"compute_dtyp": "bfloat16"}}, "kdsa.compute_dtyp: unknown field"),
    ({"model_type": "llama"}, "model_type 'llama'"),
    ({"num_shared_experts": -1}, "num_shared_experts must be >= 0"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor must be > 0"),
])
def test_config_files_with_values_that_failed_late_or_silently(change, msg):
    """Accepted before: YaRN values that gave NaN frequencies (or a math domain error after the
    model was built), other RoPE scalings dropped (unscaled RoPE past the context), typos in
    our own section ignored, a Llama config read as an all-MLA model, negative shared experts
    read as none, a zero routed scale."""
    hf = get_preset("tiny").to_hf_config() | change
    with pytest.raises(ValueError, match=msg):
        ModelConfig.from_hf_config(hf)


def test_train_and_rl_numbers_must_be_finite():
    """NaN passed every ``< 0`` check of the RL config and infinity the train config's."""
    from kdsa.train.config import TrainConfig, apply_train_overrides
    from kdsa.train.rl.config import RLConfig, apply_rl_overrides

    for o in ("kl_coef=NaN", "truncation_penalty=NaN", "tau=NaN",
              'length_penalty={"low": NaN, "high": 0, "max": 0}',
              'effort_weights={"low": true, "high": 1, "max": 1}'):
        with pytest.raises(ValueError, match="must hold finite numbers"):
            apply_rl_overrides(RLConfig(), [o])
    with pytest.raises(ValueError, match="weight must be a finite number > 0"):
        apply_rl_overrides(RLConfig(), ['envs=[{"name": "tool_lookup", "weight": Infinity}]'])
    for o in ("learning_rate=Infinity", "weight_decay=1e400", "moe_capacity_factor=Infinity"):
        with pytest.raises(ValueError, match="train.(learning_rate|weight_decay|moe_capacity)"):
            apply_train_overrides(TrainConfig(), [o])
