"""Safetensors read (memory-mapped, one tensor at a time) and streaming write, in plain NumPy.

File format (huggingface/safetensors ``README``, "Format"): 8 bytes little-endian ``u64`` N, then
N bytes of UTF-8 JSON ``{name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]},
"__metadata__": {str: str}}``, then the data buffer; offsets are relative to the buffer, tensors
are C-contiguous little-endian, contiguous and non-overlapping. Our writer pads the header with
spaces to a multiple of 8 bytes (as the reference writer does) so every tensor is 8-byte aligned.

Reading never loads a file: :meth:`SafetensorsFile.tensor` returns a read-only view into one
``np.memmap`` per file, so a tensor costs memory only for the pages actually touched. A header
that is truncated, not JSON, or whose offsets disagree with the shapes or the file size raises
:class:`SafetensorsError` (a ``ValueError``) naming the file and the tensor.

A checkpoint directory (:class:`SafetensorsCheckpoint`) is ``*.safetensors`` shards, with or
without ``model.safetensors.index.json``; with an index, every tensor it names must be in the shard
it names, and no shard may hold tensors the index does not name.

This is the only safetensors implementation in the library. The ``safetensors`` package is not
used here (tests use it as an independent reader/writer): with one open per file it keeps every
page it read mapped until the file is closed, it has no way to drop those pages, its bounded
variants are slower, and ``save_file`` takes a whole shard at once. Measured numbers:
``docs/conversion.md``, "Safetensors: our reader and writer, not the ``safetensors`` package".
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # the reference implementation's limit

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsError(ValueError):
    """A safetensors file or directory that cannot be read as such."""


def dtype_name(dtype) -> str:
    """Safetensors dtype string of a NumPy/JAX dtype (``float32`` -> ``"F32"``)."""
    try:
        return _NAMES[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no safetensors name") from None


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    file: Path
    begin: int  # absolute byte offset in the file
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


# ----------------------------------------------------------------------------------- reading

def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate the header of one ``.safetensors`` file -> (tensors, metadata)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: truncated safetensors file ({size} bytes, no header "
                                   f"length)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise SafetensorsError(f"{path}: corrupt or truncated safetensors header (header "
                                   f"length {n} bytes, file has {size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: corrupt safetensors header (not UTF-8 JSON: {e})"
                               ) from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    data_start, data_len = 8 + n, size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        tensors[name] = info = _parse_entry(path, name, entry, data_start)
        rel = info.begin - data_start
        if rel + info.nbytes > data_len:
            raise SafetensorsError(
                f"{path}: truncated: tensor {name!r} needs bytes [{rel}, {rel + info.nbytes}) of "
                f"the data buffer, which has {data_len} bytes")
        spans.append((rel, rel + info.nbytes, name))
    spans.sort()
    for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise SafetensorsError(f"{path}: corrupt header: tensors {n0!r} and {n1!r} overlap")
    return tensors, metadata


def _parse_entry(path: Path, name: str, entry, data_start: int) -> TensorInfo:
    bad = f"{path}: corrupt safetensors header entry for tensor {name!r}"
    if not isinstance(entry, dict) or {"dtype", "shape", "data_offsets"} - entry.keys():
        raise SafetensorsError(f"{bad}: {entry!r}")
    dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise SafetensorsError(f"{bad}: unknown dtype {dtype!r}")
    if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
            or not isinstance(offs, list) or len(offs) != 2
            or not all(isinstance(o, int) and o >= 0 for o in offs) or offs[1] < offs[0]):
        raise SafetensorsError(f"{bad}: shape {shape!r}, data_offsets {offs!r}")
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if offs[1] - offs[0] != nbytes:
        raise SafetensorsError(f"{bad}: shape {shape} of {dtype} needs {nbytes} bytes, "
                               f"data_offsets {offs} span {offs[1] - offs[0]}")
    return TensorInfo(name, dtype, tuple(shape), path, data_start + offs[0], nbytes)


class SafetensorsFile:
    """One file: validated header plus a lazily opened read-only memmap."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.tensors, self.metadata = read_header(self.path)
        self._map: np.memmap | None = None

    def tensor(self, name: str) -> np.ndarray:
        """Read-only view of ``name`` (no copy; pages are read when touched)."""
        info = self.tensors[name]
        if info.nbytes == 0:
            return np.zeros(info.shape, info.np_dtype)
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        flat = self._map[info.begin:info.begin + info.nbytes]
        return flat.view(info.np_dtype).reshape(info.shape)

    def release(self, name: str | None = None) -> None:
        """Drop this file's pages (``name``'s only, when given) from the process
        (``MADV_DONTNEED`` on the read-only map): the bytes stay in the page cache, but no longer
        count in our RSS. Views stay valid (pages are re-read on access)."""
        if self._map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        if name is None:
            self._map._mmap.madvise(mmap.MADV_DONTNEED)
            return
        info = self.tensors[name]
        start = info.begin // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(info.begin + info.nbytes, len(self._map))
        if end > start:
            self._map._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        self._map = None


class SafetensorsCheckpoint:
    """A Hugging Face checkpoint directory: ``*.safetensors`` shards, optional index."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise SafetensorsError(f"{self.directory}: no such directory")
        index_path = self.directory / INDEX_FILE
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
                if not isinstance(weight_map, dict) or not all(
                        isinstance(v, str) for v in weight_map.values()):
                    raise TypeError("weight_map is not an object of file names")
                outside = [v for v in weight_map.values()
                           if Path(v).name != v or v in ("", ".", "..")]
                if outside:  # a shard is a file of this folder, not a path out of it
                    raise TypeError(f"shard {outside[0]!r} is not a file name in this folder")
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise SafetensorsError(f"{index_path}: not a safetensors index ({e!r})") from None
            shard_names = sorted(set(weight_map.values()))
        else:
            weight_map = None
            shard_names = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not shard_names:
            raise SafetensorsError(f"{self.directory}: no *.safetensors files")
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}  # tensor name -> shard file name
        for shard in shard_names:
            if not (self.directory / shard).is_file():
                raise SafetensorsError(f"{index_path}: shard {shard!r} is missing")
            f = self.files[shard] = SafetensorsFile(self.directory / shard)
            for name in f.tensors:
                if name in self.where:
                    raise SafetensorsError(f"{self.directory}: tensor {name!r} is in both "
                                           f"{self.where[name]} and {shard}")
                self.where[name] = shard
        if weight_map is not None:
            for name, shard in weight_map.items():
                if self.where.get(name) != shard:
                    raise SafetensorsError(f"{index_path}: tensor {name!r} is listed in {shard} "
                                           f"but {shard} does not hold it")
            extra = sorted(set(self.where) - set(weight_map))
            if extra:
                raise SafetensorsError(f"{index_path}: shards hold tensors the index does not "
                                       f"list: {extra[:5]}")

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return sorted(self.where)

    def info(self, name: str) -> TensorInfo:
        return self.files[self.where[name]].tensors[name]

    def tensor(self, name: str) -> np.ndarray:
        return self.files[self.where[name]].tensor(name)

    def release(self, names: list[str] | None = None) -> None:
        """:meth:`SafetensorsFile.release` of the named tensors' pages, or of every shard."""
        if names is None:
            for f in self.files.values():
                f.release()
            return
        for n in names:
            self.files[self.where[n]].release(n)

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for f in self.files.values() for i in f.tensors.values())


# ----------------------------------------------------------------------------------- writing

@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: its bytes come from ``produce()`` when its turn comes."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def encode_header(specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None) -> bytes:
    """``u64 length || JSON`` with offsets in the order given, padded with spaces to 8 bytes."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": dtype_name(s.dtype), "shape": list(s.shape),
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_file(path: str | os.PathLike, specs: list[TensorSpec],
               metadata: Mapping[str, str] | None = None,
               on_tensor: Callable[[TensorSpec], None] | None = None) -> int:
    """Write one file, producing and writing one tensor at a time; returns bytes written.

    Each produced array must match its spec's dtype and shape exactly (``ValueError`` otherwise).
    """
    path = Path(path)
    written = 0
    with open(path, "wb") as f:
        head = encode_header(specs, metadata)
        f.write(head)
        written += len(head)
        for s in specs:
            a = np.asarray(s.produce())
            if a.dtype != np.dtype(s.dtype) or tuple(a.shape) != tuple(s.shape):
                raise ValueError(f"tensor {s.name!r}: produced {a.dtype}{list(a.shape)}, "
                                 f"expected {np.dtype(s.dtype)}{list(s.shape)}")
            f.write(np.ascontiguousarray(a).view(np.uint8).reshape(-1).data)
            written += a.nbytes
            del a                  # not alive while the next tensor is produced
            if on_tensor is not None:
                on_tensor(s)
    return written


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy split in order: a shard closes before the tensor that would push it past the cap
    (a single tensor larger than the cap gets a shard of its own)."""
    if max_shard_bytes < 1:
        raise ValueError(f"max shard size must be positive, got {max_shard_bytes}")
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def shard_file_names(n: int) -> list[str]:
    """``model.safetensors`` for one shard, else ``model-00001-of-0000N.safetensors``."""
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_checkpoint(directory: str | os.PathLike, specs: list[TensorSpec], *,
                     max_shard_bytes: int, metadata: Mapping[str, str] | None = None,
                     on_tensor: Callable[[TensorSpec], None] | None = None) -> int:
    """Shards plus ``model.safetensors.index.json`` into an existing ``directory``; returns the
    bytes written. Tensor names must be unique."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate tensor names: {dup[:5]}")
    directory = Path(directory)
    shards = plan_shards(specs, max_shard_bytes)
    files = shard_file_names(len(shards))
    total = 0
    weight_map = {}
    for fname, shard in zip(files, shards):
        total += write_file(directory / fname, shard, metadata, on_tensor)
        weight_map.update({s.name: fname for s in shard})
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
             "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return total
