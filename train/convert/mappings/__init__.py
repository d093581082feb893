"""Checkpoint layouts: one declarative table per Hugging Face format, and the shape transforms.

A :class:`Layout` maps every parameter of our model to Hugging Face tensor names:

* ``top`` rules: parameters outside the layer stack (names relative to ``prefix``);
* ``layer`` rules: per-layer parameters, keyed by their path inside a decoder layer
  (``self_attn.q_proj.kernel``); the HF name is relative to ``{prefix}model.layers.{i}.``;
* ``experts`` rules: routed experts, one HF tensor per expert ``e`` (``{e}`` in the name),
  float (``.weight``) or MXFP4 (``.weight_packed`` + ``.weight_scale``, compressed-tensors);
* ``ignore``: regular expressions of HF tensors that are not part of our text model (vision
  tower, MTP layers) -- skipped and reported, never an error.

A parameter without a rule, a tensor the table expects but the file lacks, or a tensor in the file
that no rule consumes and ``ignore`` does not cover, is an error (``train/convert/pipeline.py``).

Transforms (``kind``; ours <- HF, inverted on export): ``id``; ``T`` (HF ``[out, in]`` -> our
``[in, out]``); ``conv`` (``[C, 1, W]`` -> ``[C, W]``); ``row`` (``[1, D]`` -> ``[D]``);
``patch`` (the vision patch conv ``[D, C, p, p]`` -> our ``[C, p, p, D]``); ``a_log_4d`` (Kimi Linear ``A_log [1, 1, H, 1]`` -> ``[H]``); ``a_log_heads`` (Kimi K3 stores
``A_log`` with 128 values for 96 heads of head_dim 128, ``kimi_k3.md`` section 2: import keeps
the first H, as vLLM's loader and the FLA kernels read ``A_log[h]``; export writes the published
length, :func:`a_log_hf_len`, see ``train/convert/export.py``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from kdsa.model.config import ModelConfig

KINDS = ("id", "T", "conv", "row", "a_log_4d", "a_log_heads", "patch")


@dataclasses.dataclass(frozen=True)
class Rule:
    ours: str          # parameter path (dotted) inside a layer, or from the model root (top rules)
    hf: str            # HF tensor name (relative to the layer / layout prefix)
    kind: str = "id"
    hf_dtype: str | None = None  # fixed HF dtype name ("F32"); None: the checkpoint's main dtype
    alt: tuple[str, ...] = ()    # other names accepted on import (the one found is kept on export)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"rule {self.ours}: unknown transform {self.kind!r}")


@dataclasses.dataclass(frozen=True)
class ExpertRule:
    ours: str          # float parameter path ("...experts.w1"); packed: + "_packed" / "_scale"
    hf: str            # per-expert base name with {e} ("block_sparse_moe.experts.{e}.w1")


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    prefix: str
    top: tuple[Rule, ...]
    layer: tuple[Rule, ...]
    experts: tuple[ExpertRule, ...]
    ignore: tuple[str, ...]
    hf_config: Callable[[ModelConfig, str, str], dict]  # (config, experts format, dtype) -> json
    defaults: tuple[tuple[str, object], ...] = ()  # config.json fields implied when absent

    def top_name(self, template: str) -> str:
        """HF name of a top rule: relative to ``prefix``, or from the root when it starts with
        ``/`` (K3's ``vision_tower.*`` / ``mm_projector.*`` sit outside ``language_model.``)."""
        return template[1:] if template.startswith("/") else self.prefix + template

    def layer_prefix(self, i: int) -> str:
        return f"{self.prefix}model.layers.{i}."

    def top_rule(self, ours: str) -> Rule | None:
        return next((r for r in self.top if r.ours == ours), None)

    def layer_rule(self, ours: str) -> Rule | None:
        return next((r for r in self.layer if r.ours == ours), None)

    def expert_rule(self, ours: str) -> tuple[ExpertRule, str] | None:
        """``(rule, part)`` for an expert parameter path; part is float | packed | scale."""
        for r in self.experts:
            for part, suffix in (("float", ""), ("packed", "_packed"), ("scale", "_scale")):
                if ours == r.ours + suffix:
                    return r, part
        return None

    def ignored(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.ignore)


EXPERT_SUFFIX = {"float": ".weight", "packed": ".weight_packed", "scale": ".weight_scale"}


# ------------------------------------------------------------------------------ transforms

def hf_shape(kind: str, ours: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor shape that ``kind`` maps to our shape ``ours`` (export shape)."""
    if kind == "T":
        return tuple(reversed(ours))
    if kind == "conv":
        return (ours[0], 1, ours[1])
    if kind == "row":
        return (1, ours[0])
    if kind == "a_log_4d":
        return (1, 1, ours[0], 1)
    if kind == "patch":
        return (ours[3], ours[0], ours[1], ours[2])
    return tuple(ours)


def a_log_hf_len(config: ModelConfig) -> int:
    """Length of K3's ``A_log`` for our config: ``max(H, head_dim)``. The one published data
    point (``kimi_k3.md``: ``[128]`` for H = 96, head_dim = 128) fits both a per-key-channel
    length and padding up to head_dim; this rule reproduces it and never drops a head."""
    lin = config.linear_attn_config
    return max(lin.num_heads, lin.head_dim)


def shape_ok(kind: str, ours: tuple[int, ...], found: tuple[int, ...]) -> bool:
    """Whether an HF tensor of shape ``found`` can give our ``ours`` (import check)."""
    if kind == "a_log_heads":
        return len(found) == 1 and found[0] >= ours[0]
    return tuple(found) == hf_shape(kind, ours)


def to_ours(kind: str, a: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
    """HF array -> our layout (a view where possible: memmaps stay lazy)."""
    if kind == "T":
        return a.T
    if kind in ("conv", "row", "a_log_4d"):
        return a.reshape(ours)
    if kind == "a_log_heads":
        return a[:ours[0]]
    if kind == "patch":
        return a.transpose(1, 2, 3, 0)
    return a


def to_hf(kind: str, a: np.ndarray) -> np.ndarray:
    """Our array -> HF layout (inverse of :func:`to_ours`; ``a_log_heads`` is padded by the
    exporter, which knows the source's values past H)."""
    if kind == "T":
        return a.T
    if kind == "patch":
        return a.transpose(3, 0, 1, 2)
    return a.reshape(hf_shape(kind, a.shape))


# ------------------------------------------------------------------------------ registry

def get_layout(name: str) -> Layout:
    from kdsa.train.convert.mappings import deepseek_v32, kimi_k3, kimi_linear

    layouts = {"kimi_k3": kimi_k3.LAYOUT, "kimi_linear": kimi_linear.LAYOUT,
               "deepseek_v32": deepseek_v32.LAYOUT}
    try:
        return layouts[name]
    except KeyError:
        raise ValueError(f"unknown layout {name!r}; choose from {sorted(layouts)}") from None


LAYOUTS = ("kimi_k3", "kimi_linear", "deepseek_v32")


def detect_layout(hf_config: dict, tensor_names: list[str]) -> str:
    """Layout of a Hugging Face checkpoint from its ``config.json`` and tensor names."""
    model_type = hf_config.get("model_type")
    if model_type == "kimi_k3" or any(n.startswith("language_model.") for n in tensor_names):
        return "kimi_k3"
    if model_type in ("deepseek_v32", "deepseek_v3", "deepseek_v2"):
        return "deepseek_v32"
    if model_type == "kimi_linear":
        return "kimi_linear"
    raise ValueError(f"cannot tell the checkpoint layout: model_type {model_type!r}; supported: "
                     f"kimi_k3, kimi_linear, deepseek_v32 (pass --layout)")


def normalize_hf_config(hf: dict, layout: Layout | None = None) -> dict:
    """Fill our names from the spellings transformers 5 writes, then ``from_hf_config`` reads it.

    ``model_max_length`` (Kimi Linear's alias of max_position_embeddings), ``num_local_experts``,
    ``rope_parameters`` (``rope_theta`` + YaRN ``rope_scaling``), ``mlp_layer_types`` (-> the
    dense prefix ``first_k_dense_replace``), ``layer_types`` + ``linear_*`` (-> Kimi Linear's
    ``linear_attn_config``), ``n_group`` (transformers' DeepSeek/Kimi routers always apply the
    group limit, so ``use_grouped_topk`` follows), ``dtype``/``torch_dtype`` -> ``param_dtype``;
    then the layout's ``defaults`` for fields its configs leave implicit.
    """
    d = dict(hf.get("text_config") or hf)
    for key, want in (("mlp_layer_types", list), ("layer_types", list), ("kdsa", dict),
                      ("rope_parameters", dict), ("linear_attn_config", dict)):
        if d.get(key) is not None and not isinstance(d[key], want):  # (TypeErrors below)
            raise ValueError(f"config {key} must be {'a list' if want is list else 'an object'}"
                             f", got {d[key]!r}")
    if hf.get("vision_config") and "vision_config" not in d:  # K3 / K2.5 wrapper level
        d["vision_config"] = hf["vision_config"]
    for key, value in (layout.defaults if layout is not None else ()):
        d.setdefault(key, value)
    alias = {"model_max_length": "max_position_embeddings", "num_local_experts": "num_experts"}
    for theirs, ours in alias.items():
        if theirs in d and ours not in d:
            d[ours] = d[theirs]
    rp = d.get("rope_parameters")
    if isinstance(rp, dict):
        d.setdefault("rope_theta", rp.get("rope_theta", 10000.0))
        if rp.get("rope_type", "default") == "yarn" and not d.get("rope_scaling"):
            d["rope_scaling"] = dict(rp, type="yarn")
    mlp_types = d.get("mlp_layer_types")
    if mlp_types and "first_k_dense_replace" not in d:
        d["first_k_dense_replace"] = next((i for i, t in enumerate(mlp_types) if t != "dense"),
                                          len(mlp_types))
    types = d.get("layer_types")
    if not d.get("linear_attn_config") and types and "linear_attention" in types:
        d["linear_attn_config"] = {
            "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
            "full_attn_layers": [i + 1 for i, t in enumerate(types) if t != "linear_attention"],
            "num_heads": d.get("linear_num_heads", 32), "head_dim": d.get("linear_head_dim", 128),
            "short_conv_kernel_size": d.get("linear_conv_kernel_dim", 4)}
    if ("n_group" in d or "num_expert_group" in d) and "use_grouped_topk" not in d:
        d["use_grouped_topk"] = True
    dtype = d.get("dtype") or d.get("torch_dtype")
    kdsa = dict(d.get("kdsa") or {})
    if dtype in ("bfloat16", "float32", "float16") and "param_dtype" not in kdsa:
        kdsa["param_dtype"] = dtype
        d["kdsa"] = kdsa
    return d


def check_ffn_pattern(config: ModelConfig, hf: dict) -> None:
    """The HF ``mlp_layer_types`` (if given) must equal our dense/MoE pattern."""
    types = (hf.get("text_config") or hf).get("mlp_layer_types")
    if types:
        ours = ["sparse" if k == "moe" else "dense" for k in config.ffn_kinds]
        if list(types) != ours:
            raise ValueError(f"config mlp_layer_types {types} cannot be expressed with "
                             f"first_k_dense_replace/moe_layer_freq (would give {ours})")


def base_hf_config(config: ModelConfig, experts: str, dtype: str) -> dict:
    """Our config as Kimi ``kimi_linear`` JSON, with dtype and (MXFP4 experts) the
    compressed-tensors ``quantization_config`` K3 publishes, whose ``ignore`` names every
    ``Linear`` we keep in the float dtype (a loader quantizes the Linears it does not name)."""
    d = config.to_hf_config()
    d["kdsa"] = dict(d["kdsa"], expert_weight_format=experts, param_dtype=dtype)
    d["torch_dtype"] = dtype
    if experts == "mxfp4":
        d["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None,
                "weights": {"num_bits": 4, "type": "float", "group_size": 32,
                            "strategy": "group", "symmetric": True, "dynamic": False,
                            "scale_dtype": "torch.uint8"}}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "lm_head",
                       # the dense FFN as transformers 5.18 saves it (kimi_linear.py)
                       "re:.*block_sparse_moe\\.(gate|up|down)_proj.*",
                       "re:.*vision_tower.*", "re:.*mm_projector.*",
                       # the other Linears we write in the float dtype: lm_head under the VL
                       # wrapper's prefix, the latent-MoE projections, Block AttnRes scores
                       "re:.*lm_head$", "re:.*routed_expert_(down|up)_proj$",
                       "re:.*_res_proj$"]}
    return d


# What our config.json leaves out on purpose when the source had it: the MXFP4 scheme of
# bfloat16 experts, the vision config of a text-only model.
DROPPED_UNLESS_OURS = ("quantization_config", "vision_config")


def with_source_fields(source: dict, ours: dict, config: ModelConfig, *,
                       new_tensors: bool = False) -> dict:
    """The exported ``config.json`` of a converted checkpoint: ``ours`` over the source's, so
    what we do not write travels along (``auto_map``, token ids, ``transformers_version``,
    ``use_cache``, ...). The source's spellings of what ``config`` decides are rewritten from
    it (``layer_types``, ``mlp_layer_types``, ``linear_*``, ``model_max_length``,
    ``num_local_experts``, ``rope_parameters``, ``dtype``); multi-token-prediction layers,
    which export does not write, become 0; :data:`DROPPED_UNLESS_OURS` go unless ours has them.
    ``new_tensors`` (parameters the source did not have, e.g. a DSA indexer added to K3): the
    source's remote code (``auto_map``) would load without them, so it goes. A source whose
    nesting (a ``text_config`` or not) differs from ours gives nothing.
    """
    if ("text_config" in source) != ("text_config" in ours):
        return ours
    out = _overlay(source, ours)
    if new_tensors:
        out.pop("auto_map", None)
    text = out["text_config"] if isinstance(out.get("text_config"), dict) else out
    # the source's word for its attention layers: "full_attention" (Kimi Linear),
    # "indexed_attention" (DeepSeek-V3.2); KDA layers are "linear_attention"
    full = [t for t in text.get("layer_types") or () if t != "linear_attention"]
    full_word = max(sorted(set(full)), key=full.count) if full else "full_attention"
    derived = {
        "layer_types": ["linear_attention" if k == "kda" else full_word
                        for k in config.mixer_kinds],
        "mlp_layer_types": ["sparse" if k == "moe" else "dense" for k in config.ffn_kinds],
        "linear_num_heads": config.linear_attn_config.num_heads,
        "linear_head_dim": config.linear_attn_config.head_dim,
        "linear_conv_kernel_dim": config.linear_attn_config.short_conv_kernel_size,
        "model_max_length": config.max_position_embeddings,
        "num_local_experts": config.num_experts,
        "qk_head_dim": config.qk_head_dim,
        "num_nextn_predict_layers": 0}
    for key, value in derived.items():
        if key in text:
            text[key] = value
    if "rope_parameters" in text:  # rewritten whole: the source's may hold another scaling's keys
        text["rope_parameters"] = {"rope_theta": config.rope_theta, "rope_type": "default"}
        if config.rope_scaling is not None:
            text["rope_parameters"].update(dataclasses.asdict(config.rope_scaling),
                                           rope_type="yarn")
    for d in {id(out): out, id(text): text}.values():
        if "dtype" in d:
            d["dtype"] = ours["torch_dtype"]
    return out


def _overlay(source: dict, ours: dict) -> dict:
    """``source`` with ``ours`` written over it, nested dicts merged key by key; a key of
    :data:`DROPPED_UNLESS_OURS` that ``ours`` lacks (at that level) is dropped."""
    out = {k: v for k, v in source.items() if k not in DROPPED_UNLESS_OURS or k in ours}
    for key, value in ours.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key in (
                "text_config", "linear_attn_config"):
            out[key] = _overlay(out[key], value)
        else:
            out[key] = value
    return out
