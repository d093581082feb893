"""Streaming checkpoint conversion: Hugging Face safetensors <-> our Orbax checkpoints.

``hf_to_orbax``: read ``config.json`` (-> ``ModelConfig``, overridable), build the model
abstractly, plan every parameter from the layout's table and check the whole plan against the
safetensors headers (``train/convert/plan.py``: missing / unexpected / misshaped / wrongly typed
tensors are reported together, before anything is written), then produce one stacked parameter
at a time from memory-mapped tensors (``train/convert/read.py``) and stream it into
``kdsa.model.checkpoint.save_params`` (partial Orbax saves, atomic rename). With a ``mesh`` every
parameter is created by ``jax.make_array_from_callback`` in its target sharding, and the callback
slices the memmaps, so each process reads only what its devices hold. Peak host memory is about
one stacked parameter plus the save batch (``batch_bytes``), plus one chunk of source pages.

``orbax_to_hf``: read one parameter, or one block of storage chunks of a stacked one (a layer's
experts; ``export.Loader``), at a time and write the layout's tensors
(``train/convert/export.py``) into size-capped shards with ``model.safetensors.index.json`` and
``config.json``, all into a temporary directory renamed at the end.

Expert formats convert either way: bf16 experts -> MXFP4 (``quantize_mxfp4``, "even" scale
rule) or MXFP4 -> float (exact dequantisation).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import jax
from flax import nnx

from kdsa.model import checkpoint as ckpt
from kdsa.model.config import ModelConfig
from kdsa.model.folders import check_destination, locate, replace_folder
from kdsa.progress import Progress
from kdsa.sharding.rules import layout_shardings
from kdsa.train.convert import mappings as mp
from kdsa.train.convert.export import HF_NAME_OF, NP_OF, Loader, export_specs
from kdsa.train.convert.plan import (FLOATS, Param, check_source, config_from_hf, plan_params,
                                     read_hf_config)
from kdsa.train.convert.read import (CycleCollector, ReadStats, a_log_tails, fresh_param,
                                     host_slice)
from kdsa.train.convert.safetensors_io import SafetensorsCheckpoint, write_checkpoint
from kdsa.train.init_from import SOURCE_FACTS, source_folder

__all__ = ["Summary", "hf_to_orbax", "orbax_to_hf", "read_hf_config", "config_from_hf"]


@dataclasses.dataclass
class Summary:
    direction: str
    layout: str
    tensors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    peak_rss_delta: int = 0
    bytes_sliced: int = 0  # source bytes this process copied (its devices' slices with a mesh)
    bytes_held: int = 0  # orbax-to-hf: the most source bytes held at once (blocks of chunks)
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
        if self.bytes_held:
            lines.append(f"source blocks held at most {self.bytes_held / 1e6:.1f} MB at once")
        if self.bytes_sliced and jax.process_count() > 1:
            lines.append(f"process {jax.process_index()} of {jax.process_count()} read "
                         f"{self.bytes_sliced} bytes of tensor slices")
        if self.fresh:
            lines.append(f"initialised fresh (not in the source; ready for the dense warm-up): "
                         f"{len(self.fresh)} parameters, e.g. {self.fresh[:3]}")
        if self.ignored:
            lines.append(f"skipped (not part of the text model): {len(self.ignored)} tensors, "
                         f"e.g. {self.ignored[:3]}")
        return "\n".join(lines)


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


# ------------------------------------------------------------------------------ hf -> orbax

def hf_to_orbax(src: str | os.PathLike, dst: str | os.PathLike, *,
                config: ModelConfig | None = None, experts: str | None = None, mesh=None,
                layout: str | None = None, sharding_layout: str = "train",
                dry_run: bool = False, progress: bool = True, seed: int = 0,
                batch_bytes: int = ckpt.DEFAULT_BATCH_BYTES, overwrite: bool = False,
                allow_partial: bool = False) -> Summary:
    """Convert a Hugging Face checkpoint directory into an Orbax checkpoint at ``dst``.

    ``dst`` follows ``kdsa.model.folders.check_destination`` (checked first, dry run too): an
    existing one is replaced only with ``overwrite``. A ``config`` with fewer layers than the
    source is refused unless ``allow_partial`` (then the first layers are converted, with a
    warning on stderr).
    """
    t0, rss0 = time.perf_counter(), _rss_now()
    src = Path(src).absolute()
    dst = check_destination(dst, sources=[src], overwrite=overwrite)
    hf = read_hf_config(src)
    st = SafetensorsCheckpoint(src)
    name = layout or mp.detect_layout(hf, st.names())
    lay = mp.get_layout(name)
    if config is None:
        config = config_from_hf(hf, layout=name, experts=experts)
    elif experts is not None and experts != config.expert_weight_format:
        config = config.replace(expert_weight_format=experts,
                                moe_impl=config.moe_impl if experts == "mxfp4" else "xla")
    normalized = mp.normalize_hf_config(hf, lay)
    source_layers = normalized.get("num_hidden_layers")
    _check_layers(src, config, source_layers, allow_partial)
    mtp = normalized.get("num_nextn_predict_layers") or 0
    if not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 0:
        raise ValueError(f"{src}/config.json: num_nextn_predict_layers must be a non-negative "
                         f"integer, got {mtp!r}")
    params = plan_params(config, lay)
    used, ignored, dtypes = check_source(
        params, lay, config, st, source_layers=source_layers if isinstance(source_layers, int)
        else None, mtp_layers=mtp)
    summary = Summary("hf-to-orbax", name, tensors=len(used), ignored=ignored, dry_run=dry_run,
                      bytes_read=sum(st.info(n).nbytes for n in used),
                      fresh=[p.key for p in params if p.fresh])
    if not dry_run:
        shardings = ckpt.target_shardings(
            nnx.state(ckpt.abstract_model(config)),
            layout_shardings(mesh, sharding_layout))
        fresh_cache: dict = {}
        stats = ReadStats()

        collector = CycleCollector()

        def produce(p: Param) -> jax.Array:
            collector.before(math.prod(p.shape) * p.dtype.itemsize)  # earlier batches' cycles
            sh = shardings[p.key]
            if p.fresh:
                return jax.device_put(fresh_param(p, config, seed, fresh_cache), sh)
            if mesh is None:  # page-aligned host buffer: aliased, not copied, on CPU
                return jax.device_put(host_slice(p, st, lay, config, stats=stats), sh)
            return jax.make_array_from_callback(
                p.shape, sh, lambda idx: host_slice(p, st, lay, config, idx, stats))

        bar = Progress(sum(math.prod(p.shape) * p.dtype.itemsize for p in params), unit="B",
                       unit_scale=True, enabled=progress)
        src_experts = next((p.src_part for p in params if isinstance(p.rule, mp.ExpertRule)),
                           None)
        meta = {"source": {"layout": name, "path": str(src),
                           "experts": {"float": "bf16", "packed": "mxfp4"}.get(src_experts),
                           "hf_config": hf,  # its other fields travel to an export
                           "new_params": summary.fresh},  # what the source did not have
                "hf_dtypes": dtypes, "hf_tails": a_log_tails(params, lay, st),
                "fresh": summary.fresh}
        st.release()
        try:
            ckpt.save_params(dst, config, ((p.key, (lambda p=p: produce(p))) for p in params),
                             metadata=meta, batch_bytes=batch_bytes,
                             on_saved=lambda k, a: bar.update(a.nbytes), overwrite=overwrite,
                             sources=[src], extra_files=ckpt.tokenizer_files(src))
        finally:
            bar.close()
        summary.bytes_written = bar.count
        summary.bytes_sliced = stats.bytes_sliced
    summary.seconds = time.perf_counter() - t0
    summary.peak_rss_delta = max(_peak_rss() - rss0, 0)
    return summary


def _check_layers(src: Path, config: ModelConfig, source_layers, allow_partial: bool) -> None:
    """Fewer layers in ``config`` than in the source would silently drop the last ones."""
    if not isinstance(source_layers, int) or config.num_hidden_layers >= source_layers:
        return
    what = (f"{src}: the config has {config.num_hidden_layers} layers, the source "
            f"{source_layers}")
    if not allow_partial:
        raise ValueError(f"{what}; converting would drop the last "
                         f"{source_layers - config.num_hidden_layers} (pass --allow-partial to "
                         f"convert only the first {config.num_hidden_layers})")
    print(f"warning: {what}; converting only the first {config.num_hidden_layers} "
          f"(--allow-partial)", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ orbax -> hf

def orbax_to_hf(src: str | os.PathLike, dst: str | os.PathLike, *, experts: str | None = None,
                layout: str | None = None, dtype: str | None = None,
                max_shard_bytes: int = 5 * 10**9, dry_run: bool = False,
                progress: bool = True, overwrite: bool = False) -> Summary:
    """Write a kdsa Orbax checkpoint (a model folder, or a training checkpoint:
    ``kdsa.model.folders.locate``) as Hugging Face safetensors shards + index + config. ``dst``
    follows ``kdsa.model.folders.check_destination`` (``overwrite`` to replace one)."""
    t0, rss0 = time.perf_counter(), _rss_now()
    if jax.process_count() > 1:  # each process would write (and rename) the same folder
        raise ValueError("kdsa convert orbax-to-hf writes one folder from one process: run it "
                         "once, on one host, not in a job of several processes")
    src = Path(src).absolute()
    dst = check_destination(dst, sources=[src], overwrite=overwrite)
    config, info = ckpt.read_info(src)
    origin, info = _origin(src, config, info)
    source = info.get("source") or {}
    name = layout or source.get("layout") or "kimi_k3"
    lay = mp.get_layout(name)
    experts = experts or config.expert_weight_format
    if experts not in ("bf16", "mxfp4"):
        raise ValueError(f"experts must be bf16 or mxfp4, got {experts!r}")
    explicit_dtype, dtype = dtype is not None, dtype or config.param_dtype
    if dtype not in NP_OF:
        raise ValueError(f"dtype must be one of {sorted(NP_OF)}, got {dtype!r}")
    same_layout = source.get("layout") == name
    # the source's tensor names and dtypes, whatever the expert format (an expert's recorded
    # dtype names its float part only); an explicit --dtype replaces the source's main float
    # dtype, while its exceptions stay (a bfloat16 checkpoint's float32 routing biases, A_log)
    recorded = dict(info.get("hf_dtypes", {})) if same_layout else {}
    floats = [v for k, v in recorded.items() if k != "__names__" and v in FLOATS]
    if explicit_dtype and floats:
        main = max(set(floats), key=floats.count)
        recorded = {k: HF_NAME_OF[dtype] if v == main else v for k, v in recorded.items()}
    params = plan_params(config, lay)
    loader = Loader(ckpt.locate(src)[0])  # one step, even while a run writes newer ones
    specs = export_specs(params, lay, config, loader, experts, dtype, recorded,
                         info.get("hf_tails", {}) if same_layout else {})
    summary = Summary("orbax-to-hf", name, tensors=len(specs), dry_run=dry_run)
    if not dry_run:
        tmp = dst.parent / f"{dst.name}.kdsa-tmp"
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted run
        tmp.mkdir(parents=True)
        bar = Progress(sum(s.nbytes for s in specs), unit="B", unit_scale=True, enabled=progress)
        try:
            summary.bytes_written = write_checkpoint(
                tmp, specs, max_shard_bytes=max_shard_bytes, metadata={"format": "pt"},
                on_tensor=lambda s: bar.update(s.nbytes))
            hf_json = lay.hf_config(config, experts, dtype)
            if same_layout and isinstance(source.get("hf_config"), dict):
                hf_json = mp.with_source_fields(source["hf_config"], hf_json, config,
                                                new_tensors=bool(source.get("new_params")))
            (tmp / "config.json").write_text(json.dumps(hf_json, indent=2) + "\n")
            for fname, path in ckpt.tokenizer_files(origin).items():  # travel along
                shutil.copy2(path, tmp / fname)
            replace_folder(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            bar.close()
        summary.bytes_read, summary.bytes_held = loader.bytes, loader.peak
    summary.seconds = time.perf_counter() - t0
    summary.peak_rss_delta = max(_peak_rss() - rss0, 0)
    return summary


def _origin(src: Path, config, info: dict) -> tuple[Path, dict]:
    """``(folder, info)`` an export takes its tokenizer files and source facts (layout, tensor
    names and dtypes, config.json fields) from: a model folder's own; for a training checkpoint
    those of the converted folder its run descends from (``init_from`` in its metadata:
    ``train/init_from.py : source_folder``), with a warning line when that cannot be used."""
    folder, training = locate(src)
    if not training:
        return folder, info
    start, first, why = source_folder(src, config)
    if start is None:
        if why:
            print(f"warning: {src}: its start folder {why}; exporting without the source's "
                  f"layout, tensor names and tokenizer", file=sys.stderr, flush=True)
        return folder, info
    return start, dict(info, **{k: first[k] for k in SOURCE_FACTS if k in first})
