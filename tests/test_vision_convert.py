"""Checkpoint conversion of the vision tower and projector in the kimi_k3 layout: names at the
checkpoint root (``vision_tower.*``, ``mm_projector.*``), the patch conv as ``[D, 3, p, p]``,
``vision_config`` on the wrapper; orbax -> hf -> orbax keeps every parameter exactly; a
text-only config skips the vision tensors and reports them."""

import dataclasses
import json
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdsa.model import checkpoint as ckpt
from kdsa.model.config import get_preset
from kdsa.train import convert
from kdsa.train.convert.safetensors_io import SafetensorsCheckpoint


def _config():
    cfg = get_preset("tiny-vl")
    lac = dataclasses.replace(cfg.linear_attn_config, kda_layers=(1,), full_attn_layers=(2,))
    return cfg.replace(num_hidden_layers=2, attn_res_block_size=None, linear_attn_config=lac)


def _params(config):
    rng = np.random.default_rng(0)
    out = {}
    for key, v in ckpt.flat_variables(nnx.state(ckpt.abstract_model(config))).items():
        out[key] = rng.standard_normal(v.shape).astype(np.dtype(v.dtype))
    return out


def test_vision_round_trip_kimi_k3(tmp_path):
    cfg = _config()
    params = _params(cfg)
    src = ckpt.save_params(tmp_path / "orbax", cfg, [(k, lambda a=a: jnp.asarray(a))
                                                      for k, a in params.items()])
    convert.orbax_to_hf(src, tmp_path / "hf", layout="kimi_k3", progress=False)
    hf = SafetensorsCheckpoint(tmp_path / "hf")
    names = set(hf.names())
    assert "vision_tower.encoder.blocks.1.wqkv.weight" in names
    assert "mm_projector.proj.2.weight" in names and "mm_projector.post_norm.weight" in names
    assert not any(n.startswith("language_model.vision") for n in names)
    conv = hf.tensor("vision_tower.patch_embed.proj.weight")                 # [D, 3, p, p]
    assert conv.shape == (32, 3, 14, 14)
    np.testing.assert_array_equal(conv, params["vision_tower.patch_embed.proj.kernel"]
                                  .transpose(3, 0, 1, 2))
    np.testing.assert_array_equal(hf.tensor("mm_projector.proj.0.weight"),
                                  params["mm_projector.proj.0.kernel"].T)
    wrapper = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert wrapper["vision_config"]["hidden_size"] == 32
    assert "vision_config" not in wrapper["text_config"]
    s = convert.hf_to_orbax(tmp_path / "hf", tmp_path / "back", progress=False)
    assert s.layout == "kimi_k3" and not s.ignored
    config, model = ckpt.load_model(tmp_path / "back")
    assert config.vision_config == cfg.vision_config
    for key, v in ckpt.flat_variables(nnx.state(model)).items():
        np.testing.assert_array_equal(np.asarray(v[...]), params[key], err_msg=key)
    # a text-only target: the vision tensors are skipped and reported, not an error
    text = convert.hf_to_orbax(tmp_path / "hf", tmp_path / "text", progress=False,
                               config=cfg.replace(vision_config=None))
    assert any(n.startswith("vision_tower.") for n in text.ignored)
    assert any(n.startswith("mm_projector.") for n in text.ignored)


def test_mxfp4_export_leaves_every_plain_linear_out_of_its_quantization_config(tmp_path):
    """compressed-tensors quantizes every ``Linear`` its ``ignore`` list does not name: with
    MXFP4 experts, each module exported as a plain float ``weight`` (attention, shared experts,
    dense MLPs, the vision tower, the projector, lm_head) is ignored, and each packed expert
    module is not. (The vision tower and projector were missing, so a loader would have
    looked for packed weights there.)"""
    cfg = _config().replace(attn_res_block_size=1)  # with the Block AttnRes projections
    assert any(k == "moe" for k in cfg.ffn_kinds)
    params = _params(cfg)
    src = ckpt.save_params(tmp_path / "orbax", cfg, [(k, lambda a=a: jnp.asarray(a))
                                                      for k, a in params.items()])
    convert.orbax_to_hf(src, tmp_path / "hf", layout="kimi_k3", experts="mxfp4",
                        progress=False)
    ignore = json.loads((tmp_path / "hf" / "config.json").read_text())[
        "quantization_config"]["ignore"]

    def ignored(module):
        return any(re.match(p[3:], module) if p.startswith("re:") else module == p
                   for p in ignore)

    hf = SafetensorsCheckpoint(tmp_path / "hf")
    plain, packed = set(), set()
    for name in hf.names():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight_packed":
            packed.add(module)
        elif leaf == "weight" and len(hf.info(name).shape) == 2 and not re.search(
                r"embed_tokens$|\.gate$", module):  # an Embedding; the router (no Linear)
            plain.add(module)
    assert packed and any(m.startswith("vision_tower.") for m in plain)
    assert [m for m in sorted(plain) if not ignored(m)] == []
    assert [m for m in sorted(packed) if ignored(m)] == []
