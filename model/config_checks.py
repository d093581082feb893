"""Validation of the model configs: field types against their annotations, ranges, choices and
the constraints between fields. ``config.py``'s dataclasses call these from ``__post_init__``,
so a broken config raises ``ValueError`` naming the field before any parameter exists.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdsa.model.config import ModelConfig

_ACTIVATIONS = ("silu", "situ")
_ROUTER_ACTS = ("sigmoid", "softmax")
_DTYPES = ("float32", "bfloat16", "float16")
_REMAT = ("none", "full", "dots_saveable", "nothing_saveable")
_IMPLS = ("xla", "pallas")  # "pallas": the sparse MLA attention kernel (Gated DSA top-k path)
_MOE_IMPLS = ("xla", "pallas")  # "pallas": the grouped MXFP4 kernel (expert_weight_format="mxfp4")
_EXPERT_FORMATS = ("bf16", "mxfp4")


def build_config(cls, kw: dict, prefix: str):
    """``cls(**kw)``, with a ValueError naming the required fields that ``kw`` lacks."""
    missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in kw
                     and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ValueError(f"the config has no value for "
                         f"{', '.join(prefix + m for m in missing)} (missing or null)")
    return cls(**kw)


def check_types(obj, prefix: str) -> None:
    """Each field's value against its annotation (``int``, ``float`` (an int is fine), ``str``,
    ``bool``, ``X | None``, ``tuple[int, ...]`` (a list is fine), nested configs), so a wrong
    JSON type is a ValueError naming the field rather than a TypeError deep inside."""
    hints = _type_hints(type(obj))
    for f in dataclasses.fields(obj):
        v, want = getattr(obj, f.name), hints[f.name]
        if not _is_a(v, want):
            raise ValueError(f"{prefix}{f.name} must be {_describe(want)}, got {v!r}")


@functools.cache
def _type_hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _is_a(v, want) -> bool:
    args = typing.get_args(want)
    if typing.get_origin(want) in (types.UnionType, typing.Union):
        return any(_is_a(v, a) for a in args)
    if want is type(None):
        return v is None
    if want is bool:
        return isinstance(v, bool)
    if want is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if want is float:  # finite: Infinity in a config.json made every logit NaN or 0
        try:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        except OverflowError:  # an integer too large for a float
            return False
    if typing.get_origin(want) is tuple:
        if not isinstance(v, (tuple, list)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[int, ...]
            return all(_is_a(x, args[0]) for x in v)
        return len(v) == len(args) and all(_is_a(x, a) for x, a in zip(v, args))
    if isinstance(want, type):
        return isinstance(v, want)
    return True  # an annotation this check does not know: left to the field's own checks


def _describe(want) -> str:
    if typing.get_origin(want) in (types.UnionType, typing.Union):
        return " or ".join(_describe(a) for a in typing.get_args(want))
    if want is type(None):
        return "null"
    if typing.get_origin(want) is tuple:
        return "a list of integers"
    names = {int: "an integer", float: "a finite number", str: "a string",
             bool: "true or false"}
    return names.get(want, getattr(want, "__name__", str(want)))


def check_positive(obj, prefix: str, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{prefix}{name} must be a positive integer, got {v!r}")


def _choice(cfg, name: str, allowed: tuple[str, ...]) -> None:
    v = getattr(cfg, name)
    if v not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {v!r}")


def validate_model_config(c: ModelConfig) -> None:
    check_positive(c, "", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
              "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
              "max_position_embeddings", "kda_chunk_size", "dsa_query_chunk_size",
              "num_experts_per_token", "num_expert_group", "topk_group", "moe_layer_freq")
    if not isinstance(c.qk_rope_head_dim, int) or c.qk_rope_head_dim < 0:
        raise ValueError(f"qk_rope_head_dim must be >= 0, got {c.qk_rope_head_dim!r}")
    if not c.mla_use_nope and c.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim must be even for RoPE, got {c.qk_rope_head_dim}")
    for name in ("q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size"):
        v = getattr(c, name)
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be None or a positive integer, got {v!r}")
    _choice(c, "hidden_act", _ACTIVATIONS)
    _choice(c, "moe_router_activation_func", _ROUTER_ACTS)
    _choice(c, "param_dtype", _DTYPES)
    _choice(c, "compute_dtype", _DTYPES)
    if c.index_dtype is not None:
        _choice(c, "index_dtype", _DTYPES)
    _choice(c, "remat_policy", _REMAT)
    _choice(c, "attention_impl", _IMPLS)
    _choice(c, "moe_impl", _MOE_IMPLS)
    _choice(c, "expert_weight_format", _EXPERT_FORMATS)
    _validate_expert_format(c)
    if c.hidden_act == "situ" and c.activation_situ_beta <= 0:
        raise ValueError(f"activation_situ_beta must be > 0, got {c.activation_situ_beta}")
    if c.activation_situ_linear_beta is not None and c.activation_situ_linear_beta <= 0:
        raise ValueError("activation_situ_linear_beta must be None or > 0")
    if c.rms_norm_eps <= 0:
        raise ValueError(f"rms_norm_eps must be > 0, got {c.rms_norm_eps}")
    if c.rope_theta <= 0:
        raise ValueError(f"rope_theta must be > 0, got {c.rope_theta}")
    if not isinstance(c.num_shared_experts, int) or c.num_shared_experts < 0:
        raise ValueError(f"num_shared_experts must be >= 0, got {c.num_shared_experts!r}")
    for name in ("routed_scaling_factor", "initializer_range"):
        if not getattr(c, name) > 0:
            raise ValueError(f"{name} must be > 0, got {getattr(c, name)}")
    # layer lists
    lac, n = c.linear_attn_config, c.num_hidden_layers
    kda, full = lac.kda_layers, lac.full_attn_layers
    for name, lst in (("kda_layers", kda), ("full_attn_layers", full)):
        bad = [i for i in lst if not 1 <= i <= n]
        if bad:
            raise ValueError(f"linear_attn_config.{name} holds {bad}: layers are 1-based and must be "
                             f"in [1, num_hidden_layers={n}]")
        if len(set(lst)) != len(lst):
            raise ValueError(f"linear_attn_config.{name} repeats a layer: {sorted(lst)}")
    overlap = sorted(set(kda) & set(full))
    if overlap:
        raise ValueError(f"linear_attn_config.kda_layers and full_attn_layers overlap at {overlap}")
    missing = sorted(set(range(1, n + 1)) - set(kda) - set(full))
    if missing:
        raise ValueError(f"layers {missing} are in neither linear_attn_config.kda_layers nor "
                         f"full_attn_layers (num_hidden_layers={n})")
    if c.num_experts_per_token and c.num_experts and c.num_experts_per_token > c.num_experts:
        raise ValueError(f"num_experts_per_token={c.num_experts_per_token} exceeds "
                         f"num_experts={c.num_experts}")
    if c.num_experts < 0:
        raise ValueError(f"num_experts must be >= 0, got {c.num_experts}")
    if c.num_experts > 0:
        if c.moe_intermediate_size < 1:
            raise ValueError("moe_intermediate_size must be positive when num_experts > 0")
        if c.num_experts % c.num_expert_group:
            raise ValueError(f"num_experts={c.num_experts} is not divisible by "
                             f"num_expert_group={c.num_expert_group}")
        if c.topk_group > c.num_expert_group:
            raise ValueError(f"topk_group={c.topk_group} exceeds num_expert_group={c.num_expert_group}")
        per_group = c.num_experts // c.num_expert_group
        if c.use_grouped_topk and c.topk_group * per_group < c.num_experts_per_token:
            raise ValueError(f"topk_group={c.topk_group} groups of {per_group} experts cannot hold "
                             f"num_experts_per_token={c.num_experts_per_token}")
    if c.first_k_dense_replace < 0:
        raise ValueError(f"first_k_dense_replace must be >= 0, got {c.first_k_dense_replace}")
    # indexer: all three or none
    idx = (c.index_n_heads, c.index_head_dim, c.index_topk)
    if any(v is not None for v in idx) and any(v is None for v in idx):
        raise ValueError("index_n_heads, index_head_dim and index_topk must be set together "
                         f"(got {idx}); index_topk=None means dense MLA")
    if c.index_topk is not None:
        check_positive(c, "", "index_n_heads", "index_head_dim", "index_topk")
        rope = 0 if c.mla_use_nope else c.qk_rope_head_dim
        if rope > c.index_head_dim:
            raise ValueError(f"index_head_dim={c.index_head_dim} is smaller than the RoPE part "
                             f"qk_rope_head_dim={rope}")
    if kda:
        if c.kda_chunk_size & (c.kda_chunk_size - 1):
            raise ValueError(f"kda_chunk_size must be a power of two, got {c.kda_chunk_size}")
    if c.tie_word_embeddings and c.vocab_size < 1:
        raise ValueError("tie_word_embeddings needs a vocabulary")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(c, name)
        if v is not None and not 0 <= v < c.vocab_size:
            raise ValueError(f"{name}={v} is outside the vocabulary [0, {c.vocab_size})")
    v = c.vision_config
    if v is not None and not 0 <= v.media_placeholder_token_id < c.vocab_size:
        raise ValueError(f"vision_config.media_placeholder_token_id="
                         f"{v.media_placeholder_token_id} is outside the vocabulary "
                         f"[0, {c.vocab_size})")


def _validate_expert_format(c: ModelConfig) -> None:
    """MXFP4 experts / QAT: 32-element blocks along each routed expert's contracting dim."""
    if not isinstance(c.expert_qat, bool):
        raise ValueError(f"expert_qat must be true or false, got {c.expert_qat!r}")
    if c.expert_qat and c.expert_weight_format != "bf16":
        raise ValueError("expert_qat=True trains float master weights: it needs "
                         f"expert_weight_format='bf16', got {c.expert_weight_format!r}")
    if c.moe_impl == "pallas" and c.expert_weight_format != "mxfp4":
        raise ValueError("moe_impl='pallas' is the grouped MXFP4 kernel: it needs "
                         f"expert_weight_format='mxfp4', got {c.expert_weight_format!r}")
    if c.num_experts and (c.expert_weight_format == "mxfp4" or c.expert_qat):
        for name, v in (("expert_hidden_size", c.expert_hidden_size),
                        ("moe_intermediate_size", c.moe_intermediate_size)):
            if v % 32:
                raise ValueError(f"MXFP4 experts need {name} to be a multiple of 32 (the block "
                                 f"size along the contracting dim), got {v}")
