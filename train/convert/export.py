"""Orbax -> Hugging Face: the tensors to write for every parameter, produced one at a time.

:class:`Loader` reads a parameter, or the part of a stacked one being written (a layer row,
one expert) from the block of storage chunks around it, and keeps only that block (plus the
partner of a packed expert weight, needed together): never a whole expert stack in a model
folder of ours. :func:`export_specs` lists every HF tensor (name, dtype, shape, producer); the
safetensors writer calls the producers in order, so only one HF tensor is materialised beyond
the block held.

``A_log`` in the ``kimi_k3`` layout is written in the published shape (``kimi_k3.md`` section 2:
``[128]`` for 96 heads of head_dim 128): the H values we use, then the values past H the source
held (kept in the checkpoint metadata by ``hf_to_orbax``), else zeros -- A_log's initial value
under K3's lower-bounded gate (``kda.md``), and never read by vLLM / FLA, which take
``A_log[h]`` for h < H.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kdsa.model import checkpoint as ckpt
from kdsa.model.config import ModelConfig
from kdsa.train.convert import mappings as mp
from kdsa.train.convert.plan import Param, dtype_key, expert_hf_shape, hf_names
from kdsa.train.convert.read import dequantize_rows, quantize_rows
from kdsa.train.convert.safetensors_io import DTYPES, TensorSpec

HF_NAME_OF = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}  # --dtype -> safetensors
NP_OF = {ours: DTYPES[hf] for ours, hf in HF_NAME_OF.items()}


def _partner(key: str) -> str | None:
    for a, b in (("_packed", "_scale"), ("_scale", "_packed")):
        if key.endswith(a):
            return key[:-len(a)] + b
    return None


class Loader:
    """Reads parameters for the export in bounded memory: an unstacked parameter whole; a part
    of a stacked one (``get(key, r)``: layer row ``r``; ``get(key, r, e)``: its expert ``e``)
    from the block of whole storage chunks around it (``ckpt.StoredParam``), kept while the
    export walks through it. One block per parameter, for the parameter in use and its packed /
    scale partner (needed together): a ``k3-2.8t`` expert stack (434 GB in bf16) is stored one
    expert of one layer per chunk (``ckpt.CHUNK_BYTES``) and read that way, never whole.
    ``peak``: the most bytes held at once; ``bytes``: all bytes read."""

    def __init__(self, path: Path):
        self.path, self.bytes, self.peak = path, 0, 0
        self.stored: dict[str, ckpt.StoredParam] = {}
        self.blocks: dict[str, tuple[tuple[int, ...], tuple[int, ...], np.ndarray]] = {}

    def get(self, key: str, *index: int) -> np.ndarray:
        block = self.blocks.get(key)
        if block is None or len(block[0]) != len(index) or not all(
                lo <= i < hi for i, lo, hi in zip(index, *block[:2])):
            keep = {key, _partner(key)}
            for k in [k for k in self.blocks if k not in keep]:
                del self.blocks[k]            # dropped before reading: bounded residency
            self.blocks.pop(key, None)
            block = self.blocks[key] = self._read(key, index)
            self.peak = max(self.peak, sum(b[2].nbytes for b in self.blocks.values()))
        return block[2][tuple(i - o for i, o in zip(index, block[0]))]

    def _read(self, key: str, index: tuple[int, ...]):
        """The block of whole chunks around ``index`` on the leading axes, the rest whole. Once
        an axis's block spans several indices the later axes are read whole: the export walks
        rows, then experts, and a block spanning rows but splitting experts (Orbax's default
        chunks, or an expert-sharded save) would otherwise be read again for every row."""
        if key not in self.stored:
            self.stored[key] = ckpt.StoredParam(self.path, key)
        sp = self.stored[key]
        lo, hi, spans = [], [], False
        for i, c, n in zip(index, sp.chunk, sp.shape):
            o = 0 if spans else i // c * c
            lo.append(o)
            hi.append(n if spans else min(o + c, n))
            spans = spans or hi[-1] - o > 1
        a = sp.read(tuple(slice(o, h) for o, h in zip(lo, hi)))
        self.bytes += a.nbytes
        return tuple(lo), tuple(hi), a


def a_log_values(a: np.ndarray, name: str, config: ModelConfig, tails: dict) -> np.ndarray:
    """``A_log`` as written in the ``a_log_heads`` layout: ours ``[H]``, then the recorded tail
    of ``name`` or zeros up to :func:`kdsa.train.convert.mappings.a_log_hf_len`."""
    tail = tails.get(name)
    if tail is None:
        tail = np.zeros(max(mp.a_log_hf_len(config) - a.shape[0], 0), np.float32)
    return np.concatenate([np.asarray(a, np.float32), np.asarray(tail, np.float32)])


def export_specs(params: list[Param], layout: mp.Layout, config: ModelConfig, loader: Loader,
                 experts: str, dtype: str, recorded: dict[str, str],
                 tails: dict[str, list[float]]) -> list[TensorSpec]:
    """The HF tensors (name, dtype, shape, producer) for every parameter, in parameter order.
    ``recorded``: HF dtypes and alternative names of the source; ``tails``: A_log values past H
    per HF name (both empty when the checkpoint did not come from this layout)."""
    main = NP_OF[dtype]
    specs, stash = [], {}

    def dt(key: str, fixed: str | None) -> np.dtype:
        return DTYPES[recorded.get(key) or fixed] if (recorded.get(key) or fixed) else main

    for p in params:
        rows = [None] if p.layers is None else range(len(p.layers))
        if isinstance(p.rule, mp.Rule):
            p.hf = recorded.get("__names__", {}).get(p.rule.hf)
            row_shape = p.shape[1:] if p.layers is not None else p.shape
            d = dt(p.rule.hf, p.rule.hf_dtype)
            for r, _, name in hf_names(p, layout, config, "float"):
                def row(p=p, r=r):
                    return loader.get(p.key) if r is None else loader.get(p.key, r)

                if p.rule.kind == "a_log_heads":
                    n = row_shape[0] + len(tails.get(name, ())) if name in tails \
                        else max(mp.a_log_hf_len(config), row_shape[0])
                    specs.append(TensorSpec(name, d, (n,), lambda row=row, name=name, d=d:
                                            a_log_values(row(), name, config, tails).astype(d)))
                    continue
                specs.append(TensorSpec(
                    name, d, mp.hf_shape(p.rule.kind, row_shape),
                    lambda p=p, row=row, d=d: np.ascontiguousarray(
                        mp.to_hf(p.rule.kind, row()), dtype=d)))
            continue
        out_parts = {"float": ["float"], "packed": ["packed"], "scale": ["scale"]}[p.part] \
            if experts == "mxfp4" else (["float"] if p.part in ("float", "packed") else [])
        if experts == "mxfp4" and p.part == "float":
            out_parts = ["packed", "scale"]
        for r in rows:
            for e in range(config.num_experts):
                for part in out_parts:
                    name = (layout.layer_prefix(p.layers[r]) + p.rule.hf.format(e=e)
                            + mp.EXPERT_SUFFIX[part])
                    d = DTYPES["U8"] if part != "float" else dt(dtype_key(p, "float"), None)
                    shape = expert_hf_shape(p, part, config)
                    specs.append(TensorSpec(name, d, shape, lambda p=p, r=r, e=e, part=part, d=d:
                                            _export_expert(p, r, e, part, d, loader, stash)))
    return specs


def _export_expert(p: Param, r: int, e: int, part: str, d: np.dtype, loader: Loader,
                   stash: dict) -> np.ndarray:
    a = loader.get(p.key, r, e)
    if p.part in ("packed", "scale") and part == p.part:
        return np.asarray(a)                                               # packed/scale bytes
    if p.part == "float" and part == "float":
        return np.ascontiguousarray(a.T, dtype=d)                          # [K, N] -> [N, K]
    if p.part == "float":                                                  # quantise once
        if part == "packed":
            packed, scales = quantize_rows(a.T, p.key)
            stash[(p.key, r, e)] = scales
            return packed
        return stash.pop((p.key, r, e))
    scale = loader.get(_partner(p.key), r, e)                              # dequantise
    return dequantize_rows(a, scale, d)
