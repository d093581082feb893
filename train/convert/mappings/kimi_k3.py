"""Kimi K3 (``moonshotai/Kimi-K3``, ``model_type: kimi_k3`` wrapping a ``kimi_linear`` text config)
and our own K3+DSA export (the same names plus ``self_attn.indexer.{wq_b, wk, k_norm,
weights_proj}`` on the MLA layers).

Names and shapes: ``docs/reference/kimi_k3.md`` section 2. Text tensors carry the
``language_model.`` prefix (``language_model.model.layers.{i}.*``, ``language_model.lm_head``).
Routed experts are MXFP4 compressed-tensors ``experts.{e}.w{1,3,2}.weight_packed [N, K/2]`` /
``weight_scale [N, K/32]`` uint8 (bf16 ``.weight`` also accepted). ``A_log`` holds 128 values
for 96 heads; we keep the first H (vLLM loader, FLA kernels) and export the published length
(``mappings.a_log_hf_len``; the source's values past H when it had them). Layers past
``num_hidden_layers`` (MTP) are skipped and reported, as vLLM's loader does.

The vision tower and projector (``kimi_k3.md`` 2, 5) sit at the checkpoint root, outside
``language_model.``: ``vision_tower.patch_embed.{proj, pos_emb}``,
``vision_tower.encoder.blocks.{i}.{wqkv, wo, norm0, norm1, mlp.fc0, mlp.fc1}``,
``vision_tower.encoder.final_layernorm``, ``mm_projector.{proj.0, proj.2, post_norm}``; they load
into a config with a ``vision_config`` (``k3-2.8t``) and are skipped and reported for a text-only
one. Biases are read when the config has them (``attn_bias``, ``linear_bias``,
``patch_embed_proj_bias``): K3's published ``vision_config`` has none (``k3-2.8t`` sets all three
off; checked in ``docs/vision.md``), vLLM's fallback defaults are on; a bias the config expects
but the checkpoint lacks is reported by name.
"""

from __future__ import annotations

from kdsa.train.convert.mappings import Layout, Rule, base_hf_config
from kdsa.train.convert.mappings.kimi_linear import EXPERTS, NOPE, TOP, layer_rules


MAX_VISION_BLOCKS = 64  # rules are written out per block (K3: 27)


def vision_rules() -> tuple[Rule, ...]:
    """Top rules of the tower and projector; ``/`` = a name from the checkpoint root."""
    t = lambda ours, hf: (Rule(f"{ours}.kernel", f"/{hf}.weight", "T"),  # noqa: E731
                          Rule(f"{ours}.bias", f"/{hf}.bias"))
    norm = lambda ours, hf: (Rule(f"{ours}.weight", f"/{hf}.weight"),  # noqa: E731
                             Rule(f"{ours}.bias", f"/{hf}.bias"))
    vt = "vision_tower"
    out = [Rule(f"{vt}.patch_embed.proj.kernel", f"/{vt}.patch_embed.proj.weight", "patch"),
           Rule(f"{vt}.patch_embed.proj.bias", f"/{vt}.patch_embed.proj.bias"),
           Rule(f"{vt}.patch_embed.pos_emb.weight", f"/{vt}.patch_embed.pos_emb.weight"),
           *norm(f"{vt}.encoder.final_layernorm", f"{vt}.encoder.final_layernorm")]
    for i in range(MAX_VISION_BLOCKS):
        b = f"{vt}.encoder.blocks.{i}"
        for name in ("wqkv", "wo", "mlp.fc0", "mlp.fc1"):
            out += t(f"{b}.{name}", f"{b}.{name}")
        for name in ("norm0", "norm1"):
            out += norm(f"{b}.{name}", f"{b}.{name}")
    out += [Rule("mm_projector.proj.0.kernel", "/mm_projector.proj.0.weight", "T"),
            Rule("mm_projector.proj.2.kernel", "/mm_projector.proj.2.weight", "T"),
            Rule("mm_projector.post_norm.weight", "/mm_projector.post_norm.weight")]
    return tuple(out)


def hf_config(config, experts: str, dtype: str) -> dict:
    text = base_hf_config(config, experts, dtype)
    vision = text.pop("vision_config", None)
    d = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
         "text_config": text, "torch_dtype": dtype}
    if vision:  # the wrapper carries it (K2.5 / K3 layout)
        d["vision_config"] = vision
    if "quantization_config" in text:
        d["quantization_config"] = text["quantization_config"]
    return d


LAYOUT = Layout(
    name="kimi_k3", prefix="language_model.", top=TOP + vision_rules(),
    layer=layer_rules("a_log_heads"),
    experts=EXPERTS,
    ignore=(r"vision_tower\..*", r"mm_projector\..*",
            r"language_model\.model\.layers\.\d+\.self_attn\.rotary_emb\..*"),
    hf_config=hf_config, defaults=NOPE)
