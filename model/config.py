"""Model configuration: one frozen, validated dataclass with Hugging Face field names.

Field names follow the published configs so that ``ModelConfig.from_hf_config`` and
``to_hf_config`` round-trip: Kimi K3 / Kimi Linear (``kimi_linear`` text config, including the
``linear_attn_config`` dict with 1-based ``kda_layers`` / ``full_attn_layers``) plus the
DeepSeek-V3.2 indexer fields ``index_n_heads``, ``index_head_dim``, ``index_topk``. DeepSeek
names (``n_routed_experts``, ``num_experts_per_tok``, ``scoring_func`` ...) are read too.

Fields that are ours and not in any published config (dtypes, scan/remat, chunk sizes, kernel
selection) live under the ``"kdsa"`` key of the exported dict.

Every config is validated when built: a broken constraint raises ``ValueError`` naming the field,
before any parameter exists. Configs are hashable (they are static data of NNX modules).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from kdsa.model.config_checks import (build_config, check_positive, check_types,
                                     validate_model_config)

MixerKind = Literal["kda", "dsa"]
FfnKind = Literal["dense", "moe"]



@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearAttnConfig:
    """Kimi Linear's ``linear_attn_config``: which layers are KDA and the KDA layer sizes.

    ``kda_layers`` and ``full_attn_layers`` are **1-based** layer numbers, as in the published
    configs (0-based layer ``i`` is KDA iff ``i + 1 in kda_layers``).
    """

    kda_layers: tuple[int, ...]
    full_attn_layers: tuple[int, ...]
    num_heads: int
    head_dim: int
    short_conv_kernel_size: int = 4
    use_full_rank_gate: bool = False
    gate_lower_bound: float | None = None

    def __post_init__(self):
        check_types(self, "linear_attn_config.")
        object.__setattr__(self, "kda_layers", tuple(int(i) for i in self.kda_layers))
        object.__setattr__(self, "full_attn_layers", tuple(int(i) for i in self.full_attn_layers))
        check_positive(self, "linear_attn_config.", "num_heads", "head_dim", "short_conv_kernel_size")
        lb = self.gate_lower_bound
        if lb is not None and not -20.0 <= lb < 0.0:
            raise ValueError(f"linear_attn_config.gate_lower_bound must be in [-20, 0), got {lb}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnConfig:
    """YaRN RoPE scaling (DeepSeek-V3 ``rope_scaling`` with ``type: yarn``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self):
        check_types(self, "rope_scaling.")
        if not self.factor > 0:  # (a NaN fails too)
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.original_max_position_embeddings < 1:
            raise ValueError(f"rope_scaling.original_max_position_embeddings must be >= 1, got "
                             f"{self.original_max_position_embeddings}")
        if not self.beta_fast > self.beta_slow > 0:
            raise ValueError(f"rope_scaling needs beta_fast > beta_slow > 0, got beta_fast="
                             f"{self.beta_fast}, beta_slow={self.beta_slow}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """MoonViT-style vision tower + projector (K2.5's ``vision_config``, reused by K3).

    Names follow vLLM's ``KimiK25VisionConfig`` (``kimi_k3.md`` 5; the published ``vt_*``
    spellings are read too). Off (``ModelConfig.vision_config = None``) in text-only presets.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    qkv_hidden_size: int | None = None  # attention width (K3: 1536); None = hidden_size
    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    merge_kernel_size: tuple[int, int] = (2, 2)
    norm_type: str = "rmsnorm"  # rmsnorm (K3) | layernorm (K2.5)
    # None: PyTorch's default of the reference (vLLM nn.RMSNorm(dim) / nn.LayerNorm(dim)):
    # rmsnorm finfo(bfloat16).eps = 2^-7 (the checkpoint's dtype), layernorm 1e-5
    norm_eps: float | None = None
    pos_emb_interpolation_mode: str = "bilinear"  # K3 config.json; bicubic (K2.5) not built
    attn_bias: bool = True
    linear_bias: bool = True
    patch_embed_proj_bias: bool = True
    rope_theta: float = 10000.0
    projector_ln_eps: float = 1e-5
    # the processor's in_patch_limit / patch_limit_on_one_side (K3: 65536 / 512): larger
    # images are downscaled to fit (model/vision/patching.py)
    max_patches: int = 65536
    max_patches_per_side: int = 512
    media_placeholder_token_id: int = 163605  # <|media_pad|>

    def __post_init__(self):
        check_types(self, "vision_config.")
        object.__setattr__(self, "merge_kernel_size", tuple(int(k) for k in self.merge_kernel_size))
        if self.norm_eps is None:
            eps = 2.0 ** -7 if self.norm_type == "rmsnorm" else 1e-5
            object.__setattr__(self, "norm_eps", eps)
        if self.pos_emb_interpolation_mode != "bilinear":
            raise ValueError(f"vision_config.pos_emb_interpolation_mode="
                             f"{self.pos_emb_interpolation_mode!r}: only 'bilinear' (K3) is "
                             f"implemented")
        check_positive(self, "vision_config.", "hidden_size", "num_hidden_layers",
                  "num_attention_heads", "intermediate_size", "patch_size",
                  "init_pos_emb_height", "init_pos_emb_width", "max_patches",
                  "max_patches_per_side")
        if len(self.merge_kernel_size) != 2 or min(self.merge_kernel_size) < 1:
            raise ValueError(f"vision_config.merge_kernel_size must be two positive integers, "
                             f"got {self.merge_kernel_size}")
        if self.norm_type not in ("rmsnorm", "layernorm"):
            raise ValueError(f"vision_config.norm_type must be rmsnorm or layernorm, got "
                             f"{self.norm_type!r}")
        q = self.attn_width
        if q % self.num_attention_heads or (q // self.num_attention_heads) % 4:
            raise ValueError(f"vision_config: attention width {q} must split into "
                             f"num_attention_heads={self.num_attention_heads} heads whose size "
                             f"is a multiple of 4 (2-D RoPE)")

    @property
    def attn_width(self) -> int:
        return self.qkv_hidden_size or self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.attn_width // self.num_attention_heads

    @property
    def merge_size(self) -> int:
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @classmethod
    def from_hf(cls, d: dict) -> "VisionConfig":
        d = {_VISION_ALIASES.get(k, k): v for k, v in d.items()}
        names = {f.name for f in dataclasses.fields(cls)}
        return build_config(cls, {k: v for k, v in d.items() if k in names and v is not None},
                      "vision_config.")


_VISION_ALIASES = {"vt_hidden_size": "hidden_size", "vt_num_hidden_layers": "num_hidden_layers",
                   "vt_num_attention_heads": "num_attention_heads",
                   "vt_intermediate_size": "intermediate_size"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The whole model. See ``PRESETS`` for named instances and their sources."""

    # ---- core (Kimi Linear / K3 names) ----
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float | None = None
    attn_res_block_size: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # ---- MLA ----
    num_attention_heads: int
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = False
    mla_use_output_gate: bool = False
    rope_theta: float = 10000.0
    rope_scaling: YarnConfig | None = None
    # ---- KDA ----
    linear_attn_config: LinearAttnConfig
    # ---- MoE ----
    num_experts: int = 0
    num_experts_per_token: int = 1
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    use_grouped_topk: bool = False
    num_expert_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    # ---- DeepSeek-V3.2 lightning indexer (None = dense MLA) ----
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None
    # ---- vision tower + projector (None = text only) ----
    vision_config: VisionConfig | None = None
    # ---- ours (exported under "kdsa") ----
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    # the indexer's queries, keys and key cache (None: compute_dtype); its scores accumulate in
    # float32 either way (bfloat16 x bfloat16 products are exact in float32)
    index_dtype: str | None = None
    initializer_range: float = 0.02
    scan_layers: bool = True
    remat_policy: str = "none"
    kda_chunk_size: int = 64
    dsa_query_chunk_size: int = 256
    attention_impl: str = "xla"
    moe_impl: str = "xla"
    # routed experts: "bf16" = float weights in param_dtype; "mxfp4" = packed MXFP4 bytes (frozen)
    expert_weight_format: str = "bf16"
    expert_qat: bool = False  # forward through fake_quantize_mxfp4 (STE) of the float experts

    def __post_init__(self):
        check_types(self, "")
        validate_model_config(self)

    # ---- derived structure ----
    @property
    def mixer_kinds(self) -> tuple[MixerKind, ...]:
        """Per 0-based layer: ``"kda"`` or ``"dsa"`` (gated MLA, sparse when ``index_topk``)."""
        kda = set(self.linear_attn_config.kda_layers)
        return tuple("kda" if i + 1 in kda else "dsa" for i in range(self.num_hidden_layers))

    @property
    def ffn_kinds(self) -> tuple[FfnKind, ...]:
        """Per 0-based layer: ``"moe"`` iff ``i >= first_k_dense_replace and i % moe_layer_freq == 0``."""
        return tuple(
            "moe"
            if self.num_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0
            else "dense"
            for i in range(self.num_hidden_layers)
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def use_indexer(self) -> bool:
        return self.index_topk is not None

    @property
    def index_compute_dtype(self) -> str:
        """The dtype of the indexer's queries, keys and key cache."""
        return self.index_dtype or self.compute_dtype

    @property
    def context_limit(self) -> int | None:
        """The longest context positions can encode: ``max_position_embeddings`` with RoPE,
        None (no limit) with NoPE MLA, where nothing in the stack encodes a position (KDA has
        none, MLA and the indexer use no RoPE), as in Kimi Linear and K3."""
        return None if self.mla_use_nope else self.max_position_embeddings

    @property
    def expert_hidden_size(self) -> int:
        """Width the routed experts run in (latent MoE when ``routed_expert_hidden_size``)."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def num_attn_res_blocks(self) -> int:
        """Size of the AttnRes block buffer: one entry per boundary ``layer % block_size == 0``."""
        if self.attn_res_block_size is None:
            return 0
        return -(-self.num_hidden_layers // self.attn_res_block_size)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json both ways ----
    def to_hf_config(self) -> dict[str, Any]:
        d: dict[str, Any] = {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"]}
        for f in dataclasses.fields(self):
            if f.name in _OURS:
                continue
            v = getattr(self, f.name)
            if dataclasses.is_dataclass(v):
                v = dataclasses.asdict(v)
                v = {k: list(x) if isinstance(x, tuple) else x for k, x in v.items()}
                if f.name == "rope_scaling":
                    v["type"] = "yarn"
            d[f.name] = v
        d["num_key_value_heads"] = self.num_attention_heads
        d["num_experts_per_tok"] = self.num_experts_per_token
        d["kdsa"] = {name: getattr(self, name) for name in _OURS}
        return d

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], **overrides) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (Kimi K3, Kimi Linear, DeepSeek-V3.x)."""
        if not isinstance(hf, dict):
            raise ValueError(f"a config must be a JSON object, got {type(hf).__name__}")
        for section in ("text_config", "vision_config", "linear_attn_config", "rope_scaling",
                        "kdsa"):
            if hf.get(section) is not None and not isinstance(hf[section], dict):
                raise ValueError(f"{section} must be an object, got {hf[section]!r}")
        kind = hf.get("model_type")
        if kind is not None and kind not in MODEL_TYPES:
            raise ValueError(f"model_type {kind!r}: kdsa reads {', '.join(MODEL_TYPES)} configs "
                             f"(or one without a model_type)")
        vision = hf.get("vision_config")
        if "text_config" in hf:  # kimi_k3 wrapper: the language model is its kimi_linear text_config
            hf = hf["text_config"]
        d = dict(hf)
        vision = d.get("vision_config", vision)
        for theirs, ours in _ALIASES.items():
            if theirs in d and ours not in d:
                d[ours] = d[theirs]
        if d.get("topk_method") in ("noaux_tc", "group_limited_greedy") and "n_group" in hf:
            d.setdefault("use_grouped_topk", True)
        kw: dict[str, Any] = {}
        names = {f.name for f in dataclasses.fields(cls)}
        for name in names - _OURS - {"linear_attn_config", "rope_scaling", "vision_config"}:
            if name in d and d[name] is not None or name in d and name in _NULLABLE:
                kw[name] = d[name]
        kw["linear_attn_config"] = _linear_attn_from_hf(d)
        if vision:
            kw["vision_config"] = (vision if isinstance(vision, VisionConfig)
                                   else VisionConfig.from_hf(vision))
        rs = d.get("rope_scaling")
        kind = rs.get("type", rs.get("rope_type")) if rs else None
        if kind == "yarn":
            kw["rope_scaling"] = build_config(YarnConfig, {k: rs[k] for k in _YARN_KEYS if k in rs},
                                        "rope_scaling.")
        elif kind not in (None, "default"):  # unscaled RoPE past the context would be wrong
            raise ValueError(f"rope_scaling.type={kind!r}: only 'yarn' is supported")
        ours = d.get("kdsa") or {}
        unknown = sorted(set(ours) - _OURS)
        if unknown:  # the section is ours: an unknown key is a typo, not another model's field
            raise ValueError(f"kdsa.{unknown[0]}: unknown field; the kdsa section holds "
                             f"{', '.join(sorted(_OURS))}")
        kw.update(ours)
        kw.update(overrides)
        return build_config(cls, kw, "")

    def to_json(self) -> str:
        return json.dumps(self.to_hf_config(), indent=2)


MODEL_TYPES = ("kimi_linear", "kimi_k3", "kimi_k25", "kimi_k2", "deepseek_v3", "deepseek_v32",
               "deepseek_v2")
_OURS = frozenset({
    "param_dtype", "compute_dtype", "index_dtype", "initializer_range", "scan_layers",
    "remat_policy", "kda_chunk_size", "dsa_query_chunk_size", "attention_impl", "moe_impl",
    "expert_weight_format", "expert_qat",
})
_NULLABLE = frozenset({
    "q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size", "index_n_heads",
    "index_head_dim", "index_topk", "activation_situ_linear_beta", "bos_token_id",
    "eos_token_id", "pad_token_id",
})
_ALIASES = {  # DeepSeek-V3 / V3.2 name -> our (Kimi) name
    "n_routed_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "scoring_func": "moe_router_activation_func",
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
}
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim")


def _linear_attn_from_hf(d: dict[str, Any]) -> LinearAttnConfig:
    lac = d.get("linear_attn_config")
    n = d.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"num_hidden_layers must be a positive integer, got {n!r}")
    if not lac:  # a DeepSeek config: every layer is (sparse) MLA, KDA sizes are unused
        return LinearAttnConfig(kda_layers=(), full_attn_layers=tuple(range(1, n + 1)),
                                num_heads=1, head_dim=1)
    keys = {f.name for f in dataclasses.fields(LinearAttnConfig)}
    lac = {k: v for k, v in lac.items() if k in keys}
    kda = lac.get("kda_layers")
    full = lac.get("full_attn_layers")
    if kda is None and full is not None:
        kda = [i for i in range(1, n + 1) if i not in set(full)]
    if full is None and kda is not None:
        full = [i for i in range(1, n + 1) if i not in set(kda)]
    for name, v in (("kda_layers", kda), ("full_attn_layers", full)):
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"linear_attn_config.{name} must be a list of layer numbers, "
                             f"got {v!r}")
    lac["kda_layers"], lac["full_attn_layers"] = tuple(kda), tuple(full)
    return build_config(LinearAttnConfig, lac, "linear_attn_config.")


def get_preset(name: str) -> ModelConfig:
    """A named preset (``tiny``, ``small``, ``kimi-linear-48b``, ``k3-2.8t``); see ``presets.py``."""
    from kdsa.model.presets import get_preset as _get

    return _get(name)
