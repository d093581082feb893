"""Streaming checkpoint conversion: Hugging Face safetensors <-> our Orbax checkpoints.

``hf_to_orbax``: read ``config.json`` (-> ``ModelConfig``, overridable), build the model
abstractly, plan every parameter from the layout's table (``train/mappings``), check the whole
plan against the safetensors headers (missing / unexpected / misshaped / wrongly typed tensors
are reported together, before anything is written), then produce one stacked parameter at a
time from memory-mapped tensors and stream it into ``kdsa.model.checkpoint.save_params``
(batched partial Orbax saves, atomic rename). Stacked (scanned) parameters are assembled per
stack from the per-layer tensors; routed experts from the per-expert tensors. With a ``mesh``
every parameter is created by ``jax.make_array_from_callback`` in its target sharding, and the
callback slices the memmaps, so each process reads only what its devices hold. Peak host memory
is about one stacked parameter plus one save batch.

``orbax_to_hf``: restore one parameter at a time (Orbax partial load) and write the layout's
tensors into size-capped shards with ``model.safetensors.index.json`` and ``config.json``, all
into a temporary directory renamed at the end.

Expert formats convert either way: bf16 experts -> MXFP4 (``quantize_mxfp4``, "even" scale
rule) or MXFP4 -> float (exact dequantisation).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import resource
import shutil
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from kdsa.model import checkpoint as ckpt
from kdsa.model.config import ModelConfig
from kdsa.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from kdsa.train import mappings as mp
from kdsa.train.safetensors_io import DTYPES, SafetensorsCheckpoint, TensorSpec, write_checkpoint

_FLOATS = ("F64", "F32", "F16", "BF16")
_quantize = jax.jit(lambda w: quantize_mxfp4(w, check=False))               # one compile per shape
_dequantize = jax.jit(lambda b, s: dequantize_mxfp4(b, s, jax.numpy.float32, check=False))


def _finite(w: np.ndarray, name: str) -> np.ndarray:
    """``w`` as float32, or ``ValueError`` naming the tensor if it holds NaN/Inf."""
    w = np.asarray(w, np.float32)
    if not np.isfinite(w).all():
        raise ValueError(f"{name}: NaN or Inf values cannot be quantised to MXFP4")
    return w
_NP_OF = {"bfloat16": DTYPES["BF16"], "float32": DTYPES["F32"], "float16": DTYPES["F16"]}


@dataclasses.dataclass
class Summary:
    direction: str
    layout: str
    tensors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    peak_rss_delta: int = 0
    fresh: list[str] = dataclasses.field(default_factory=list)
    ignored: list[str] = dataclasses.field(default_factory=list)
    dry_run: bool = False

    def format(self) -> str:
        mbps = self.bytes_read / 1e6 / max(self.seconds, 1e-9)
        dry = " dry run, nothing written" if self.dry_run else ""
        lines = [f"{self.direction} ({self.layout}){dry}: "
                 f"{self.tensors} tensors, read {self.bytes_read / 1e6:.1f} MB, wrote "
                 f"{self.bytes_written / 1e6:.1f} MB in {self.seconds:.2f} s ({mbps:.1f} MB/s), "
                 f"peak RSS +{self.peak_rss_delta / 2**20:.0f} MiB"]
        if self.fresh:
            lines.append(f"initialised fresh (not in the source; ready for the dense warm-up): "
                         f"{len(self.fresh)} parameters, e.g. {self.fresh[:3]}")
        if self.ignored:
            lines.append(f"skipped (not part of the text model): {len(self.ignored)} tensors, "
                         f"e.g. {self.ignored[:3]}")
        return "\n".join(lines)


class Progress:
    """A plain stderr progress bar (no dependency), redrawn at most every 0.2 s."""

    def __init__(self, total_bytes: int, total_items: int, enabled: bool = True):
        self.total, self.items, self.enabled = max(total_bytes, 1), total_items, enabled
        self.done = self.count = 0
        self.t0 = self.last = time.perf_counter()

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        self.count += 1
        now = time.perf_counter()
        if self.enabled and (now - self.last > 0.2 or self.count == self.items):
            self.last = now
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(30 * frac)
            print(f"\r  [{bar:<30}] {100 * frac:5.1f}%  {self.count}/{self.items}  "
                  f"{self.done / 1e6:.1f} MB  "
                  f"{self.done / 1e6 / max(now - self.t0, 1e-9):.1f} MB/s",
                  end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.count:
            print(file=sys.stderr, flush=True)


def _rss_now() -> int:
    """Current RSS; also resets the kernel's high-water mark (``clear_refs`` 5) where allowed,
    so :func:`_peak_rss` measures from here."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    """Peak RSS (``VmHWM``: per address space, not inherited across exec like ``ru_maxrss``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------ config

def read_hf_config(src: Path) -> dict:
    path = Path(src) / "config.json"
    if not path.is_file():
        raise ValueError(f"{src}: no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


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
class _Param:
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


def plan_params(config: ModelConfig, layout: mp.Layout) -> list[_Param]:
    """Every variable of the model for ``config`` with its rule (``ValueError`` if any has none)."""
    model = ckpt.abstract_model(config)
    out, missing_rules = [], []
    for path, v in nnx.to_flat_state(nnx.state(model)):
        key = ckpt.flat_key(path)
        if path[0] == "segments":
            start, period, repeats = model.segment_layout[path[1]]
            layers = [start + path[3] + period * r for r in range(repeats)]
            p = _Param(key, tuple(v.shape), np.dtype(v.dtype), ckpt.flat_key(path[4:]), layers)
            rule = layout.layer_rule(p.local)
            if rule is None and (er := layout.expert_rule(p.local)):
                rule, p.part = er
        else:
            p = _Param(key, tuple(v.shape), np.dtype(v.dtype), key, None)
            rule = layout.top_rule(key)
        if rule is None:
            missing_rules.append(key)
        p.rule = rule
        out.append(p)
    if missing_rules:
        raise ValueError(f"layout {layout.name} cannot express {len(missing_rules)} parameter(s) "
                         f"of this model, e.g. {missing_rules[:4]}")
    return out


def _names(p: _Param, layout: mp.Layout, config: ModelConfig, part: str) -> list[tuple]:
    """``[(row, expert, hf name)]`` of one parameter (row/expert None where not stacked)."""
    if p.layers is None:
        return [(None, None, layout.prefix + p.template)]
    if isinstance(p.rule, mp.Rule):
        return [(r, None, layout.layer_prefix(i) + p.template) for r, i in enumerate(p.layers)]
    return [(r, e, layout.layer_prefix(i) + p.rule.hf.format(e=e) + mp.EXPERT_SUFFIX[part])
            for r, i in enumerate(p.layers) for e in range(config.num_experts)]


def check_source(params: list[_Param], layout: mp.Layout, config: ModelConfig,
                 src: SafetensorsCheckpoint) -> tuple[set[str], list[str], dict[str, str]]:
    """Validate the whole plan against the headers: ``(consumed names, ignored, dtype per
    rule)``. Raises one ``ValueError`` listing missing / misshaped / mistyped / unexpected."""
    has_indexer = any(".indexer." in n for n in src.names())
    missing, bad, used, dtypes, names_used = [], [], set(), {}, {}
    for p in params:
        if ".indexer." in p.local and not has_indexer:
            p.fresh = True
            continue
        parts = ["float"]
        first = lambda: _names(p, layout, config, "")[0][2]  # noqa: E731
        if isinstance(p.rule, mp.Rule) and p.rule.alt and first() not in src:
            for alt in p.rule.alt:
                p.hf = alt
                if first() in src:
                    names_used[p.rule.hf] = alt
                    break
            else:
                p.hf = None
        if isinstance(p.rule, mp.ExpertRule):
            probe = _names(p, layout, config, "float")[0][2]
            p.src_part = "float" if probe in src else "packed"
            parts = ["float"] if p.src_part == "float" else ["packed", "scale"]
        for part in parts:
            for r, e, name in _names(p, layout, config, part):
                if name not in src:
                    missing.append(f"{name} (for {p.key})")
                    continue
                used.add(name)
                info = src.info(name)
                want = _source_shape(p, part, config)
                ok = (mp.shape_ok(p.rule.kind, p.shape[1:] if p.layers else p.shape, info.shape)
                      if isinstance(p.rule, mp.Rule) else info.shape == want)
                if not ok:
                    exp = want or mp.hf_shape(p.rule.kind, p.shape[1:] if p.layers else p.shape)
                    bad.append(f"{name}: expected shape {list(exp)}, found {list(info.shape)}")
                float_ok = info.dtype in _FLOATS
                if (part == "float") != float_ok or (part != "float" and info.dtype != "U8"):
                    wanted = "a float type" if part == "float" else "U8"
                    bad.append(f"{name}: expected dtype {wanted}, found {info.dtype}")
                dtypes.setdefault(_dtype_key(p, part), info.dtype)
    ignored, unexpected = [], []
    for name in src.names():
        if name in used:
            continue
        m = re.match(re.escape(layout.prefix) + r"model\.layers\.(\d+)\.", name)
        if layout.ignored(name) or (m and int(m.group(1)) >= config.num_hidden_layers):
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


def _source_shape(p: _Param, part: str, config: ModelConfig) -> tuple[int, ...] | None:
    """HF shape of one expert tensor (None for plain rules)."""
    if not isinstance(p.rule, mp.ExpertRule):
        return None
    from kdsa.model.moe import expert_matrix_shapes

    n, k = expert_matrix_shapes(config)[p.rule.ours.rsplit(".", 1)[1]]
    return {"float": (n, k), "packed": (n, k // 2), "scale": (n, k // 32)}[part]


def _dtype_key(p: _Param, part: str) -> str:
    return p.rule.hf + (mp.EXPERT_SUFFIX[part] if isinstance(p.rule, mp.ExpertRule) else "")


# ------------------------------------------------------------------------------ reading sources

def _one(p: _Param, src: SafetensorsCheckpoint, layout: mp.Layout, config: ModelConfig,
         r: int | None, e: int | None) -> np.ndarray:
    """One layer's (one expert's) tensor in our layout; lazy memmap views where possible."""
    row_shape = p.shape[1:] if p.layers is not None else p.shape
    if isinstance(p.rule, mp.Rule):
        name = (layout.prefix if r is None else layout.layer_prefix(p.layers[r])) + p.template
        return mp.to_ours(p.rule.kind, src.tensor(name), row_shape)
    base = layout.layer_prefix(p.layers[r]) + p.rule.hf.format(e=e)
    if p.src_part == "float":
        w = src.tensor(base + ".weight")                                   # [N, K]
        if p.part == "float":
            return w.T
        blocks, scales = _quantize(_finite(w, base + ".weight"))           # [N, K/32, 16]
        return (np.asarray(blocks).reshape(w.shape[0], -1) if p.part == "packed"
                else np.asarray(scales))
    packed, scale = src.tensor(base + ".weight_packed"), src.tensor(base + ".weight_scale")
    if p.part != "float":
        return packed if p.part == "packed" else scale
    w = _dequantize(packed.reshape(packed.shape[0], -1, 16), scale)
    return np.asarray(w).T                                                 # [K, N]


def host_slice(p: _Param, src: SafetensorsCheckpoint, layout: mp.Layout, config: ModelConfig,
               index: tuple = ()) -> np.ndarray:
    """``param[index]`` assembled on the host from the source tensors it covers (only those)."""
    idx = tuple(index) + (slice(None),) * (len(p.shape) - len(index))
    if p.layers is None:
        return np.ascontiguousarray(_one(p, src, layout, config, None, None)[idx], dtype=p.dtype)
    rows = range(*idx[0].indices(p.shape[0]))
    experts = isinstance(p.rule, mp.ExpertRule)
    es = range(*idx[1].indices(p.shape[1])) if experts else [None]
    rest = idx[2:] if experts else idx[1:]
    first = _one(p, src, layout, config, rows[0], es[0])[rest] if len(rows) else None
    out = np.empty((len(rows),) + ((len(es),) if experts else ()) + np.shape(first), p.dtype)
    for j, r in enumerate(rows):
        for k, e in enumerate(es):
            a = _one(p, src, layout, config, r, e)[rest]
            if experts:
                out[j, k] = a
            else:
                out[j] = a
    return out


def _fresh(p: _Param, config: ModelConfig, seed: int, cache: dict) -> np.ndarray:
    """A newly initialised indexer parameter, stacked over its layers (seed + layer index)."""
    from kdsa.model.dsa_layer import LightningIndexer

    sub = p.local.split("self_attn.indexer.", 1)[1]
    rows = []
    for i in p.layers:
        if i not in cache:
            mod = LightningIndexer(config, rngs=nnx.Rngs(seed + i))
            cache[i] = {ckpt.flat_key(k): v[...] for k, v in nnx.to_flat_state(nnx.state(mod))}
        rows.append(np.asarray(cache[i][sub]))
    return np.stack(rows).astype(p.dtype)


# ------------------------------------------------------------------------------ hf -> orbax

def hf_to_orbax(src: str | os.PathLike, dst: str | os.PathLike, *,
                config: ModelConfig | None = None, experts: str | None = None, mesh=None,
                layout: str | None = None, sharding_layout: str = "train",
                dry_run: bool = False, progress: bool = True, seed: int = 0,
                batch_bytes: int = ckpt.DEFAULT_BATCH_BYTES) -> Summary:
    """Convert a Hugging Face checkpoint directory into an Orbax checkpoint at ``dst``."""
    t0, rss0 = time.perf_counter(), _rss_now()
    src = Path(src)
    hf = read_hf_config(src)
    st = SafetensorsCheckpoint(src)
    name = layout or mp.detect_layout(hf, st.names())
    lay = mp.get_layout(name)
    if config is None:
        config = config_from_hf(hf, layout=name, experts=experts)
    elif experts is not None and experts != config.expert_weight_format:
        config = config.replace(expert_weight_format=experts,
                                moe_impl=config.moe_impl if experts == "mxfp4" else "xla")
    params = plan_params(config, lay)
    used, ignored, dtypes = check_source(params, lay, config, st)
    summary = Summary("hf-to-orbax", name, tensors=len(used), ignored=ignored, dry_run=dry_run,
                      bytes_read=sum(st.info(n).nbytes for n in used),
                      fresh=[p.key for p in params if p.fresh])
    if not dry_run:
        shardings = ckpt.target_shardings(nnx.state(ckpt.abstract_model(config)), mesh,
                                          sharding_layout)
        fresh_cache: dict = {}

        def produce(p: _Param) -> jax.Array:
            sh = shardings[p.key]
            if p.fresh:
                return jax.device_put(_fresh(p, config, seed, fresh_cache), sh)
            if mesh is None:
                a = jax.device_put(host_slice(p, st, lay, config), sh)
            else:
                a = jax.make_array_from_callback(
                    p.shape, sh, lambda idx: host_slice(p, st, lay, config, idx))
            st.release()  # the copies are made: drop the mapped pages from our RSS
            return a

        bar = Progress(sum(math.prod(p.shape) * p.dtype.itemsize for p in params), len(params),
                       progress)
        src_experts = next((p.src_part for p in params if isinstance(p.rule, mp.ExpertRule)),
                           None)
        meta = {"source": {"layout": name, "path": str(src),
                           "experts": {"float": "bf16", "packed": "mxfp4"}.get(src_experts)},
                "hf_dtypes": dtypes, "fresh": summary.fresh}
        try:
            ckpt.save_params(dst, config, ((p.key, (lambda p=p: produce(p))) for p in params),
                             metadata=meta, batch_bytes=batch_bytes,
                             on_saved=lambda k, a: bar.update(a.nbytes))
        finally:
            bar.close()
        summary.bytes_written = bar.done
    summary.seconds = time.perf_counter() - t0
    summary.peak_rss_delta = max(_peak_rss() - rss0, 0)
    return summary


# ------------------------------------------------------------------------------ orbax -> hf

class _Loader:
    """Restores parameters one at a time, keeping the last two (packed + scale pairs)."""

    def __init__(self, path: Path, config: ModelConfig):
        self.path, self.cache, self.bytes = path, {}, 0
        self.abstract = ckpt.flat_variables(nnx.state(ckpt.abstract_model(config)))
        self.device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def get(self, key: str) -> np.ndarray:
        if key not in self.cache:
            v = self.abstract[key]
            target = jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.device)
            a = np.asarray(ckpt.load_params(self.path, {key: target})[key])
            self.bytes += a.nbytes
            self.cache[key] = a
            while len(self.cache) > 2:
                self.cache.pop(next(iter(self.cache)))
        return self.cache[key]


def export_specs(params: list[_Param], layout: mp.Layout, config: ModelConfig, loader: _Loader,
                 experts: str, dtype: str, recorded: dict[str, str]) -> list[TensorSpec]:
    """The HF tensors (name, dtype, shape, producer) for every parameter, in parameter order."""
    main = _NP_OF[dtype]
    specs, stash = [], {}

    def dt(key: str, fixed: str | None) -> np.dtype:
        return DTYPES[recorded.get(key) or fixed] if (recorded.get(key) or fixed) else main

    for p in params:
        rows = [None] if p.layers is None else range(len(p.layers))
        if isinstance(p.rule, mp.Rule):
            p.hf = recorded.get("__names__", {}).get(p.rule.hf)
            row_shape = p.shape[1:] if p.layers is not None else p.shape
            d = dt(p.rule.hf, p.rule.hf_dtype)
            for r, _, name in _names(p, layout, config, "float"):
                specs.append(TensorSpec(
                    name, d, mp.hf_shape(p.rule.kind, row_shape),
                    lambda p=p, r=r, d=d: np.asarray(mp.to_hf(
                        p.rule.kind, loader.get(p.key) if r is None else loader.get(p.key)[r]
                    )).astype(d)))
            continue
        n, k = _source_shape(p, "float", config)
        out_parts = {"float": ["float"], "packed": ["packed"], "scale": ["scale"]}[p.part] \
            if experts == "mxfp4" else (["float"] if p.part in ("float", "packed") else [])
        if experts == "mxfp4" and p.part == "float":
            out_parts = ["packed", "scale"]
        for r in rows:
            for e in range(config.num_experts):
                for part in out_parts:
                    name = (layout.layer_prefix(p.layers[r]) + p.rule.hf.format(e=e)
                            + mp.EXPERT_SUFFIX[part])
                    d = DTYPES["U8"] if part != "float" else dt(_dtype_key(p, "float"), None)
                    shape = _source_shape(p, part, config)
                    specs.append(TensorSpec(name, d, shape, lambda p=p, r=r, e=e, part=part, d=d:
                                            _export_expert(p, r, e, part, d, loader, stash)))
    return specs


def _export_expert(p: _Param, r: int, e: int, part: str, d: np.dtype, loader: _Loader,
                   stash: dict) -> np.ndarray:
    a = loader.get(p.key)[r, e]
    if p.part in ("packed", "scale") and part == p.part:
        return np.asarray(a)                                               # packed/scale bytes
    if p.part == "float" and part == "float":
        return np.asarray(a.T).astype(d)                                   # [K, N] -> [N, K]
    if p.part == "float":                                                  # quantise once
        if part == "packed":
            blocks, scales = _quantize(_finite(a.T, p.key))
            stash[(p.key, r, e)] = np.asarray(scales)
            return np.asarray(blocks).reshape(blocks.shape[0], -1)
        return stash.pop((p.key, r, e))
    scale = loader.get(p.key[:-len("_packed")] + "_scale")[r, e]           # dequantise
    w = _dequantize(a.reshape(a.shape[0], -1, 16), scale)
    return np.asarray(w).astype(d)


def orbax_to_hf(src: str | os.PathLike, dst: str | os.PathLike, *, experts: str | None = None,
                layout: str | None = None, dtype: str | None = None,
                max_shard_bytes: int = 5 * 10**9, dry_run: bool = False,
                progress: bool = True) -> Summary:
    """Write a kdsa Orbax checkpoint as Hugging Face safetensors shards + index + config."""
    t0, rss0 = time.perf_counter(), _rss_now()
    src, dst = Path(src), Path(dst)
    config, info = ckpt.read_info(src)
    source = info.get("source") or {}
    name = layout or source.get("layout") or "kimi_k3"
    lay = mp.get_layout(name)
    experts = experts or config.expert_weight_format
    if experts not in ("bf16", "mxfp4"):
        raise ValueError(f"experts must be bf16 or mxfp4, got {experts!r}")
    dtype = dtype or config.param_dtype
    if dtype not in _NP_OF:
        raise ValueError(f"dtype must be one of {sorted(_NP_OF)}, got {dtype!r}")
    same = source.get("layout") == name and source.get("experts") == experts
    params = plan_params(config, lay)
    loader = _Loader(src, config)
    specs = export_specs(params, lay, config, loader, experts, dtype,
                         info.get("hf_dtypes", {}) if same else {})
    summary = Summary("orbax-to-hf", name, tensors=len(specs), dry_run=dry_run)
    if not dry_run:
        tmp = dst.parent / f"{dst.name}.kdsa-tmp"
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted run
        tmp.mkdir(parents=True)
        bar = Progress(sum(s.nbytes for s in specs), len(specs), progress)
        try:
            summary.bytes_written = write_checkpoint(
                tmp, specs, max_shard_bytes=max_shard_bytes, metadata={"format": "pt"},
                on_tensor=lambda s: bar.update(s.nbytes))
            (tmp / "config.json").write_text(
                json.dumps(lay.hf_config(config, experts, dtype), indent=2) + "\n")
            ckpt._replace(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            bar.close()
        summary.bytes_read = loader.bytes
    summary.seconds = time.perf_counter() - t0
    summary.peak_rss_delta = max(_peak_rss() - rss0, 0)
    return summary
