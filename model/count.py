"""Parameter counts, weight bytes and decode-cache bytes from abstract shapes.

The model is built with ``nnx.eval_shape`` (no memory is allocated), so ``k3-2.8t`` is counted
on a laptop. Each parameter is assigned to one component by its path; activated parameters per
token count the routed experts at ``num_experts_per_token / num_experts`` and everything else in
full (embedding and head included); ``matmul_params``, what MFU counts, leaves out the input
embedding table (a lookup) and the vision tower and projector.
"""

from __future__ import annotations

import dataclasses
import math

from flax import nnx

from kdsa.model.config import ModelConfig
from kdsa.model.dsa_cache import dsa_cache_bytes_per_token
from kdsa.model.kda_layer import kda_cache_bytes_per_sequence
from kdsa.model.paged_cache import PAGE_SIZE
from kdsa.model.transformer import abstract_model  # noqa: F401 (the counting model; re-exported)

COMPONENTS = (
    "embeddings_and_head", "kda", "dsa_attention", "dsa_indexer", "dense_ffn", "routed_experts",
    "shared_experts", "latent_projections", "router", "norms", "attn_res", "vision_tower",
    "mm_projector",
)
MXFP4_BITS = 4.25  # 32 x 4-bit E2M1 codes + one 8-bit E8M0 scale per block


@dataclasses.dataclass(frozen=True)
class ParamReport:
    preset: str
    total_params: int
    active_params: int
    # the active parameters a text token multiplies by (MFU's ``6 N``): without the input
    # embedding table (a row lookup; the head still counts, tied or not) and the vision tower
    # and projector (they run on image patches)
    matmul_params: int
    components: dict[str, int]
    active_components: dict[str, int]
    weight_bytes_bf16: int
    weight_bytes_mxfp4_experts: int
    cache_bytes_per_token: int  # all DSA layers: KV latent + rope key + indexer key
    cache_bytes_per_sequence: int  # all KDA layers: recurrent + conv state
    num_kda_layers: int
    num_dsa_layers: int

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _component(path: tuple, mixer_of_layer) -> str:
    names = [p for p in path if isinstance(p, str)]
    if names[0] in ("vision_tower", "mm_projector"):  # model/vision (every image token runs both)
        return names[0]
    if names[0] in ("embed_tokens", "lm_head"):
        return "embeddings_and_head"
    if names[0] == "output_attn_res" or "self_attention_res" in names or "mlp_res" in names:
        return "attn_res"
    if names[0] == "norm" or names[-2] in ("input_layernorm", "post_attention_layernorm"):
        return "norms"
    if "self_attn" in names:
        if mixer_of_layer(path) == "kda":
            return "kda"
        return "dsa_indexer" if "indexer" in names else "dsa_attention"
    if "mlp" in names:
        return "dense_ffn"
    if "shared_experts" in names:
        return "shared_experts"
    if "experts" in names:
        return "routed_experts"
    if "gate" in names:
        return "router"
    if any(n.startswith("routed_expert_") for n in names):
        return "latent_projections"
    raise ValueError(f"parameter {'/'.join(map(str, path))} has no component")


def _num_params(var: nnx.Variable) -> int:
    """Elements, or for packed MXFP4 experts their logical weight count (metadata
    ``param_count`` per unstacked variable; scales count 0), times the scan-stacking factor."""
    meta = var.get_metadata()
    if "param_count" not in meta:
        return math.prod(var.shape)
    stacked = var.ndim - len(meta.get("axes", var.shape))
    return meta["param_count"] * math.prod(var.shape[:stacked])


def count_params(config: ModelConfig, preset: str = "custom") -> ParamReport:
    model = abstract_model(config)
    layout = model.segment_layout

    def mixer_of_layer(path):  # ('segments', s, 'layers', i, ...)
        start = layout[path[1]][0]
        return config.mixer_kinds[start + path[3]]

    comps = {c: 0 for c in COMPONENTS}
    lookup = 0  # the input embedding table, when the head is a matrix of its own
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable)):
        comps[_component(path, mixer_of_layer)] += _num_params(var)
        if path[0] == "embed_tokens" and not config.tie_word_embeddings:
            lookup += _num_params(var)
    total = sum(comps.values())
    frac = config.num_experts_per_token / config.num_experts if config.num_experts else 0.0
    active = {c: (round(n * frac) if c == "routed_experts" else n) for c, n in comps.items()}
    n_kda = config.mixer_kinds.count("kda")
    n_dsa = config.mixer_kinds.count("dsa")
    routed = comps["routed_experts"]
    return ParamReport(
        preset=preset, total_params=total, active_params=sum(active.values()),
        matmul_params=sum(active.values()) - lookup - active["vision_tower"]
        - active["mm_projector"],
        components=comps, active_components=active,
        weight_bytes_bf16=2 * total,
        weight_bytes_mxfp4_experts=2 * (total - routed) + math.ceil(routed * MXFP4_BITS / 8),
        cache_bytes_per_token=n_dsa * dsa_cache_bytes_per_token(config),
        cache_bytes_per_sequence=n_kda * kda_cache_bytes_per_sequence(config),
        num_kda_layers=n_kda, num_dsa_layers=n_dsa)


def _human(n: float, unit: str = "") -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def _bytes(n: float) -> str:
    for suffix, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n:.0f} B"


def format_report(r: ParamReport, context_len: int | None = None) -> str:
    lines = [f"{'component':<22}{'total':>12}{'active/token':>16}"]
    for c in COMPONENTS:
        if r.components[c]:
            lines.append(f"{c:<22}{_human(r.components[c]):>12}{_human(r.active_components[c]):>16}")
    lines.append(f"{'TOTAL':<22}{_human(r.total_params):>12}{_human(r.active_params):>16}")
    lines.append(f"exact: total={r.total_params:,} active={r.active_params:,}")
    lines.append(f"layers: {r.num_kda_layers} KDA + {r.num_dsa_layers} Gated DSA")
    lines.append(f"weights: {_bytes(r.weight_bytes_bf16)} in bf16, "
                 f"{_bytes(r.weight_bytes_mxfp4_experts)} with MXFP4 routed experts")
    lines.append(f"decode cache: {_bytes(r.cache_bytes_per_token)} per token (DSA layers) + "
                 f"{_bytes(r.cache_bytes_per_sequence)} per sequence (KDA layers); paged "
                 f"(--num-pages): {_bytes(r.cache_bytes_per_token * PAGE_SIZE)} per page of "
                 f"{PAGE_SIZE} tokens")
    if context_len:
        total = r.cache_bytes_per_token * context_len + r.cache_bytes_per_sequence
        lines.append(f"decode cache at {context_len:,} tokens: {_bytes(total)} per sequence")
    return "\n".join(lines)
