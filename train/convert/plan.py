"""Conversion plan: ``config.json`` -> ``ModelConfig``, every model variable -> its HF tensors,
and the whole plan checked against the safetensors headers before anything is read or written.

A :class:`Param` is one variable of our model (stacked over the scanned layers it covers) with
the layout rule (``train/mappings``) that names its Hugging Face tensors: one per layer, or one
per layer and expert. :func:`check_source` reports every missing, misshaped, mistyped and
unexpected tensor in one ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
from flax import nnx

from kdsa.model import checkpoint as ckpt
from kdsa.model.config import ModelConfig
from kdsa.train.convert import mappings as mp
from kdsa.train.convert.safetensors_io import SafetensorsCheckpoint

FLOATS = ("F64", "F32", "F16", "BF16")


# ------------------------------------------------------------------------------ config

def read_hf_config(src: Path) -> dict:
    path = Path(src) / "config.json"
    if not path.is_file():
        raise ValueError(f"{src}: no config.json")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(hf, dict) or not isinstance(hf.get("text_config") or {}, dict):
        raise ValueError(f"{path}: not a model config (a JSON object)")
    return hf


def config_from_hf(hf: dict, *, layout: str, experts: str | None = None) -> ModelConfig:
    """``ModelConfig`` of an HF ``config.json`` in ``layout``, optionally with another expert
    format."""
    d = mp.normalize_hf_config(hf, mp.get_layout(layout))
    config = ModelConfig.from_hf_config(d)
    mp.check_ffn_pattern(config, hf)
    if experts is not None and experts != config.expert_weight_format:
        impl = config.moe_impl if experts == "mxfp4" else "xla"
        config = config.replace(expert_weight_format=experts, moe_impl=impl)
    return config


# ------------------------------------------------------------------------------ the plan

@dataclasses.dataclass
class Param:
    key: str
    shape: tuple[int, ...]
    dtype: np.dtype
    local: str                       # path inside the layer (or from the root when top-level)
    layers: list[int] | None         # HF layer per stacked row (None: top-level)
    rule: mp.Rule | mp.ExpertRule | None = None
    part: str = "float"              # experts: float | packed | scale (our storage)
    src_part: str = "float"          # experts: float | packed (the source's storage)
    fresh: bool = False
    hf: str | None = None            # HF name template in use (a rule's alt, when found)

    @property
    def template(self) -> str:
        return self.hf or self.rule.hf


def plan_params(config: ModelConfig, layout: mp.Layout) -> list[Param]:
    """Every variable of the model for ``config`` with its rule (``ValueError`` if any has none)."""
    model = ckpt.abstract_model(config)
    out, missing_rules = [], []
    for path, v in nnx.to_flat_state(nnx.state(model)):
        key = ckpt.flat_key(path)
        if path[0] == "segments":
            start, period, repeats = model.segment_layout[path[1]]
            layers = [start + path[3] + period * r for r in range(repeats)]
            p = Param(key, tuple(v.shape), np.dtype(v.dtype), ckpt.flat_key(path[4:]), layers)
            rule = layout.layer_rule(p.local)
            if rule is None and (er := layout.expert_rule(p.local)):
                rule, p.part = er
        else:
            p = Param(key, tuple(v.shape), np.dtype(v.dtype), key, None)
            rule = layout.top_rule(key)
        if rule is None:
            missing_rules.append(key)
        p.rule = rule
        out.append(p)
    if missing_rules:
        raise ValueError(f"layout {layout.name} cannot express {len(missing_rules)} parameter(s) "
                         f"of this model, e.g. {missing_rules[:4]}")
    return out


def hf_names(p: Param, layout: mp.Layout, config: ModelConfig, part: str) -> list[tuple]:
    """``[(row, expert, hf name)]`` of one parameter (row/expert None where not stacked)."""
    if p.layers is None:
        return [(None, None, layout.top_name(p.template))]
    if isinstance(p.rule, mp.Rule):
        return [(r, None, layout.layer_prefix(i) + p.template) for r, i in enumerate(p.layers)]
    return [(r, e, layout.layer_prefix(i) + p.rule.hf.format(e=e) + mp.EXPERT_SUFFIX[part])
            for r, i in enumerate(p.layers) for e in range(config.num_experts)]


def check_source(params: list[Param], layout: mp.Layout, config: ModelConfig,
                 src: SafetensorsCheckpoint, *, source_layers: int | None = None,
                 mtp_layers: int = 0) -> tuple[set[str], list[str], dict[str, str]]:
    """Validate the whole plan against the headers: ``(consumed names, ignored, dtype per
    rule)``. Raises one ``ValueError`` listing missing / misshaped / mistyped / unexpected.

    Layers past ``config``'s are ignored only up to the source config's ``source_layers`` (a
    partial conversion, ``--allow-partial``) plus its ``mtp_layers`` (DeepSeek's multi-token
    prediction layers, ``num_nextn_predict_layers``); any further layer is unexpected: a
    config.json that undercounts its tensors would otherwise drop layers silently."""
    keep = max(config.num_hidden_layers, source_layers or 0) + mtp_layers
    has_indexer = any(".indexer." in n for n in src.names())
    missing, bad, used, dtypes, names_used = [], [], set(), {}, {}
    for p in params:
        if ".indexer." in p.local and not has_indexer:
            p.fresh = True
            continue
        parts = ["float"]
        first = lambda: hf_names(p, layout, config, "")[0][2]  # noqa: E731
        if isinstance(p.rule, mp.Rule) and p.rule.alt and first() not in src:
            for alt in p.rule.alt:
                p.hf = alt
                if first() in src:
                    names_used[p.rule.hf] = alt
                    break
            else:
                p.hf = None
        if isinstance(p.rule, mp.ExpertRule):
            probe = hf_names(p, layout, config, "float")[0][2]
            p.src_part = "float" if probe in src else "packed"
            parts = ["float"] if p.src_part == "float" else ["packed", "scale"]
        for part in parts:
            for r, e, name in hf_names(p, layout, config, part):
                if name not in src:
                    missing.append(f"{name} (for {p.key})")
                    continue
                used.add(name)
                info = src.info(name)
                want = expert_hf_shape(p, part, config)
                ok = (mp.shape_ok(p.rule.kind, p.shape[1:] if p.layers else p.shape, info.shape)
                      if isinstance(p.rule, mp.Rule) else info.shape == want)
                if not ok:
                    exp = want or mp.hf_shape(p.rule.kind, p.shape[1:] if p.layers else p.shape)
                    bad.append(f"{name}: expected shape {list(exp)}, found {list(info.shape)}")
                float_ok = info.dtype in FLOATS
                allowed = ("U8", "F8_E8M0") if part == "scale" else ("U8",)  # E8M0: the same
                if (part == "float") != float_ok or (part != "float" and  # bytes, named
                                                     info.dtype not in allowed):
                    wanted = "a float type" if part == "float" else " or ".join(allowed)
                    bad.append(f"{name}: expected dtype {wanted}, found {info.dtype}")
                dtypes.setdefault(dtype_key(p, part), info.dtype)
    ignored, unexpected = [], []
    for name in src.names():
        if name in used:
            continue
        m = re.match(re.escape(layout.prefix) + r"model\.layers\.(\d+)\.", name)
        if layout.ignored(name) or (m and config.num_hidden_layers <= int(m.group(1)) < keep):
            ignored.append(name)
        else:
            unexpected.append(name)
    problems = []
    for what, items in (("missing", missing), ("bad", bad), ("unexpected", unexpected)):
        if items:
            problems.append(f"{len(items)} {what} tensor(s): " + "; ".join(items[:6])
                            + (" ..." if len(items) > 6 else ""))
    if problems:
        raise ValueError(f"{src.directory} does not match layout {layout.name} for this config: "
                         + " | ".join(problems))
    dtypes["__names__"] = names_used
    return used, ignored, dtypes


def expert_hf_shape(p: Param, part: str, config: ModelConfig) -> tuple[int, ...] | None:
    """HF shape of one expert tensor (None for plain rules)."""
    if not isinstance(p.rule, mp.ExpertRule):
        return None
    from kdsa.model.moe_mxfp4 import expert_matrix_shapes

    n, k = expert_matrix_shapes(config)[p.rule.ours.rsplit(".", 1)[1]]
    return {"float": (n, k), "packed": (n, k // 2), "scale": (n, k // 32)}[part]


def dtype_key(p: Param, part: str) -> str:
    return p.rule.hf + (mp.EXPERT_SUFFIX[part] if isinstance(p.rule, mp.ExpertRule) else "")
