"""Reading a Hugging Face checkpoint into our parameters with bounded host memory.

Where copies came from (measured with ``bench/bench_convert.py``, peak RSS over the largest
stacked parameter: 4.98x hf -> orbax, 4.34x orbax -> hf before this module) and how each is cut:

* memory-mapped source pages: a parameter assembled from memmap views touched every page of
  its tensors, and all of them stayed in our RSS until the parameter was done (1x). Now each
  tensor is copied in chunks of :data:`CHUNK_BYTES` along its outermost memory axis and its
  pages are dropped (``MADV_DONTNEED``) after every chunk: at most one chunk is resident.
* host buffer -> ``jax.Array``: ``jax.device_put`` of a NumPy array copies on CPU unless the
  buffer is 64-byte aligned, when it aliases it (measured: same pointer, no new RSS). Every
  assembled parameter lands in a page-aligned buffer (:func:`aligned_empty`), so on CPU hosts
  the Orbax writer gets the very buffer we filled (1x).
* MXFP4 quantisation of float experts runs over row chunks (:func:`quantize_rows`: blocks run
  along a row, rows are independent), so the float32 working copies are bounded by a chunk.

With a mesh, ``jax.make_array_from_callback`` asks :func:`host_slice` for each addressable
device's index only, and only the source bytes under that index are touched: a process of a
multi-host job reads just the slices its devices hold. :class:`ReadStats` counts the source bytes
this process copied (``Summary.bytes_sliced``).
"""

from __future__ import annotations

import dataclasses
import gc

import jax
import numpy as np
from flax import nnx

from kdsa.model import checkpoint as ckpt
from kdsa.model.config import ModelConfig
from kdsa.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from kdsa.train.convert import mappings as mp
from kdsa.train.convert.plan import Param
from kdsa.train.convert.safetensors_io import SafetensorsCheckpoint

CHUNK_BYTES = 32 << 20     # source bytes resident at a time while copying one tensor
_ALIGN = 4096              # page alignment (XLA:CPU aliases host buffers aligned to >= 64 B)
_quantize = jax.jit(lambda w: quantize_mxfp4(w, check=False))               # one compile per shape
_dequantize = jax.jit(lambda b, s: dequantize_mxfp4(b, s, jax.numpy.float32, check=False))


class CycleCollector:
    """``gc.collect()`` once at least ``threshold`` bytes were handed to Orbax since the last
    one: its saves and restores leave reference cycles holding the arrays, which the cyclic GC
    frees only when object counts (not bytes) trigger it. A collection costs 0.1-0.3 s in a
    process full of JAX objects, so small parameters do not pay it each."""

    def __init__(self, threshold: int = 64 << 20):
        self.threshold, self.pending = threshold, 0

    def before(self, nbytes: int) -> None:
        """Call before materialising ``nbytes`` more."""
        self.pending += nbytes
        if self.pending >= self.threshold:
            gc.collect()
            self.pending = nbytes


@dataclasses.dataclass
class ReadStats:
    bytes_sliced: int = 0   # source tensor bytes this process copied out of the memmaps


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """``np.empty`` whose data starts on a page boundary (so ``device_put`` on CPU aliases it
    instead of copying)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + _ALIGN, np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    return raw[off:off + n].view(dtype).reshape(shape)


def copy_chunked(dst: np.ndarray, src: np.ndarray, release, stats: ReadStats | None = None,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
    """``dst[...] = src`` (casting) in chunks along ``src``'s outermost memory axis (largest
    stride), calling ``release()`` after each chunk so at most one chunk of a memory-mapped
    ``src`` stays resident."""
    if stats is not None:
        stats.bytes_sliced += src.nbytes
    if src.ndim == 0 or src.nbytes <= chunk_bytes:
        dst[...] = src
        release()
        return
    axis = int(np.argmax([abs(s) if n > 1 else 0 for s, n in zip(src.strides, src.shape)]))
    n = src.shape[axis]
    step = max(1, n * chunk_bytes // src.nbytes)
    for start in range(0, n, step):
        sl = (slice(None),) * axis + (slice(start, start + step),)
        dst[sl] = src[sl]
        release()


def finite_f32(w: np.ndarray, name: str) -> np.ndarray:
    """``w`` as float32, or ``ValueError`` naming the tensor if it holds NaN/Inf."""
    w = np.asarray(w, np.float32)
    if not np.isfinite(w).all():
        raise ValueError(f"{name}: NaN or Inf values cannot be quantised to MXFP4")
    return w


def quantize_rows(w: np.ndarray, name: str, chunk_bytes: int = CHUNK_BYTES
                  ) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 of ``w [N, K]`` (blocks along K) -> ``(packed [N, K/2], scales [N, K/32])`` uint8,
    quantised ``rows`` rows at a time (float32 copies bounded by ``chunk_bytes``)."""
    n, k = w.shape
    rows = max(1, min(n, chunk_bytes // (4 * k)))
    packed, scales = np.empty((n, k // 2), np.uint8), np.empty((n, k // 32), np.uint8)
    for s in range(0, n, rows):
        blocks, sc = _quantize(finite_f32(w[s:s + rows], name))       # [r, K/32, 16], [r, K/32]
        packed[s:s + rows] = np.asarray(blocks).reshape(blocks.shape[0], -1)
        scales[s:s + rows] = np.asarray(sc)
    return packed, scales


def dequantize_rows(packed: np.ndarray, scale: np.ndarray, dtype,
                    chunk_bytes: int = CHUNK_BYTES) -> np.ndarray:
    """Exact dequantisation of ``packed [N, K/2]`` / ``scale [N, K/32]`` -> ``[N, K]`` ``dtype``,
    row chunk by row chunk."""
    n, k = packed.shape[0], packed.shape[1] * 2
    rows = max(1, min(n, chunk_bytes // (4 * k)))
    out = np.empty((n, k), dtype)
    for s in range(0, n, rows):
        p = np.asarray(packed[s:s + rows])
        out[s:s + rows] = np.asarray(_dequantize(p.reshape(p.shape[0], -1, 16),
                                                 np.asarray(scale[s:s + rows])))
    return out


# ------------------------------------------------------------------------------ one tensor

def _one(p: Param, src: SafetensorsCheckpoint, layout: mp.Layout, r: int | None,
         e: int | None) -> tuple[np.ndarray, list[str]]:
    """One layer's (one expert's) tensor in our layout, and the source tensors it reads. Plain
    rules give lazy memmap views; expert format changes compute (bounded by one expert)."""
    row_shape = p.shape[1:] if p.layers is not None else p.shape
    if isinstance(p.rule, mp.Rule):
        name = (layout.top_name(p.template) if r is None
                else layout.layer_prefix(p.layers[r]) + p.template)
        return mp.to_ours(p.rule.kind, src.tensor(name), row_shape), [name]
    base = layout.layer_prefix(p.layers[r]) + p.rule.hf.format(e=e)
    if p.src_part == "float":
        w = src.tensor(base + ".weight")                                   # [N, K]
        if p.part == "float":
            return w.T, [base + ".weight"]
        packed, scales = quantize_rows(w, base + ".weight")
        return (packed if p.part == "packed" else scales), [base + ".weight"]
    names = [base + ".weight_packed", base + ".weight_scale"]
    packed, scale = src.tensor(names[0]), src.tensor(names[1])
    scale = scale.view(np.uint8) if scale.dtype != np.uint8 else scale  # F8_E8M0: same bytes
    nan = np.argwhere(np.asarray(scale) == 0xFF) if p.part != "packed" else ()  # (1/16 of
    if len(nan):  # the packed bytes)
        row, block = nan[0]
        raise ValueError(f"{names[1]}: E8M0 scale 0xFF (NaN) in row {row}, block {block}: "
                         f"every token routed to this expert would get NaN")
    if p.part != "float":
        return (packed, names[:1]) if p.part == "packed" else (scale, names[1:])
    return dequantize_rows(packed, scale, np.float32).T, names          # [K, N]


def host_slice(p: Param, src: SafetensorsCheckpoint, layout: mp.Layout, config: ModelConfig,
               index: tuple = (), stats: ReadStats | None = None) -> np.ndarray:
    """``param[index]`` assembled in a page-aligned host buffer from the source tensors it
    covers (only those, and only the bytes under ``index``)."""
    idx = tuple(index) + (slice(None),) * (len(p.shape) - len(index))
    sizes = [len(range(*s.indices(n))) if isinstance(s, slice) else 1
             for s, n in zip(idx, p.shape)]
    out = aligned_empty(tuple(sizes), p.dtype)

    def fill(dst, r, e, rest):
        view, names = _one(p, src, layout, r, e)
        copy_chunked(dst, view[rest], lambda: src.release(names), stats)

    if p.layers is None:
        fill(out, None, None, idx)
        return out
    rows = range(*idx[0].indices(p.shape[0]))
    experts = isinstance(p.rule, mp.ExpertRule)
    es = range(*idx[1].indices(p.shape[1])) if experts else [None]
    rest = idx[2:] if experts else idx[1:]
    for j, r in enumerate(rows):
        for k, e in enumerate(es):
            fill(out[j, k] if experts else out[j], r, e, rest)
    return out


def a_log_tails(params: list[Param], layout: mp.Layout, src: SafetensorsCheckpoint
                ) -> dict[str, list[float]]:
    """``{HF name: values past the first H}`` of ``a_log_heads`` tensors (K3 stores 128 values
    for 96 heads; we compute with the first H and keep the rest for a byte-identical export)."""
    tails = {}
    for p in params:
        if p.fresh or not isinstance(p.rule, mp.Rule) or p.rule.kind != "a_log_heads":
            continue
        h = p.shape[-1]
        for i in p.layers if p.layers is not None else [None]:
            name = (layout.prefix if i is None else layout.layer_prefix(i)) + p.template
            a = np.asarray(src.tensor(name), np.float32)
            if a.shape[0] > h:
                tails[name] = [float(v) for v in a[h:]]
    return tails


def fresh_param(p: Param, config: ModelConfig, seed: int, cache: dict) -> np.ndarray:
    """A newly initialised indexer parameter, stacked over its layers (seed + layer index)."""
    from kdsa.model.indexer import LightningIndexer

    sub = p.local.split("self_attn.indexer.", 1)[1]
    out = aligned_empty(p.shape, p.dtype)
    for j, i in enumerate(p.layers):
        if i not in cache:
            mod = LightningIndexer(config, rngs=nnx.Rngs(seed + i))
            cache[i] = {ckpt.flat_key(k): v[...] for k, v in nnx.to_flat_state(nnx.state(mod))}
        out[j] = np.asarray(cache[i][sub])
    return out
