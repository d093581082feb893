"""Kimi K3 (``moonshotai/Kimi-K3``, ``model_type: kimi_k3`` wrapping a ``kimi_linear`` text config)
and our own K3+DSA export (the same names plus ``self_attn.indexer.{wq_b, wk, k_norm,
weights_proj}`` on the MLA layers).

Names and shapes: ``shared/reference/kimi_k3.md`` section 2. Text tensors carry the
``language_model.`` prefix (``language_model.model.layers.{i}.*``, ``language_model.lm_head``).
Routed experts are MXFP4 compressed-tensors ``experts.{e}.w{1,3,2}.weight_packed [N, K/2]`` /
``weight_scale [N, K/32]`` uint8 (bf16 ``.weight`` also accepted). ``A_log`` holds 128 values
for 96 heads; we keep the first H (vLLM loader, FLA kernels) and export the published length
(``mappings.a_log_hf_len``; the source's values past H when it had them). The vision
tower and projector are not part of the text model: skipped and reported, as are layers past
``num_hidden_layers`` (MTP), which vLLM's loader skips too.
"""

from __future__ import annotations

from kdsa.train.mappings import Layout, base_hf_config
from kdsa.train.mappings.kimi_linear import EXPERTS, NOPE, TOP, layer_rules


def hf_config(config, experts: str, dtype: str) -> dict:
    text = base_hf_config(config, experts, dtype)
    d = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
         "text_config": text, "torch_dtype": dtype}
    if "quantization_config" in text:
        d["quantization_config"] = text["quantization_config"]
    return d


LAYOUT = Layout(
    name="kimi_k3", prefix="language_model.", top=TOP, layer=layer_rules("a_log_heads"),
    experts=EXPERTS,
    ignore=(r"vision_tower\..*", r"mm_projector\..*",
            r"language_model\.model\.layers\.\d+\.self_attn\.rotary_emb\..*"),
    hf_config=hf_config, defaults=NOPE)
