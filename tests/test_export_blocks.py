"""``kdsa convert orbax-to-hf`` in bounded memory (``train/convert/export.py : Loader``): a
stacked parameter is read a block of whole storage chunks at a time around the part being
written, each chunk once, whatever the chunk layout; model folders store a large stack one
expert of one layer row per chunk (``kdsa.model.checkpoint.CHUNK_BYTES``)."""

import numpy as np
import pytest

from kdsa.model import checkpoint as ckpt
from kdsa.train import convert
from kdsa.train.convert.export import Loader
from model_fixtures import MICRO, random_params

KEY = "segments.1.layers.0.block_sparse_moe.experts.w1"  # [R, E, De, I]


def _files(path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _whole(sp: ckpt.StoredParam) -> np.ndarray:
    return sp.read((slice(None),) * len(sp.shape))


@pytest.mark.parametrize("chunk", [(1, 1, 3, 4), (1, 4, 3, 4), (2, 4, 3, 2), (2, 8, 3, 4),
                                   (1, 8, 1, 4)])
def test_each_chunk_is_read_once_in_the_exports_order(monkeypatch, chunk):
    """Rows, then experts (the export's walk) over a ``[2, 8, 3, 4]`` stack in chunks of
    ``chunk``: every ``[r, e]`` right, every stored byte read exactly once (a block spanning
    rows but splitting experts would otherwise be read again for every row), and no more held
    than the block of chunks around the part; a row read as ``get(key, r)`` too."""
    stack = np.arange(2 * 8 * 3 * 4, dtype=np.float32).reshape(2, 8, 3, 4)
    reads = []

    class Stored:  # a stored parameter in chunks of `chunk`
        def __init__(self, path, key):
            self.shape, self.chunk = stack.shape, chunk

        def read(self, index):
            reads.append(stack[index].nbytes)
            return stack[index].copy()

    monkeypatch.setattr(ckpt, "StoredParam", Stored)
    loader = Loader("folder")
    for r, e in np.ndindex(2, 8):
        np.testing.assert_array_equal(loader.get("w", r, e), stack[r, e])
    assert sum(reads) == stack.nbytes, reads
    rows, experts = chunk[0], (8 if chunk[0] > 1 else chunk[1])
    assert loader.peak == rows * experts * 3 * 4 * 4
    np.testing.assert_array_equal(loader.get("w", 1), stack[1])  # another index length


def test_export_of_small_chunks_equals_whole_chunks_and_holds_one_expert(tmp_path, monkeypatch):
    """The micro K3 model stored whole (one chunk per array) and in 2 KB chunks: the chunked
    folder restores the same arrays through Orbax, exports the same files reading the same
    bytes while holding one expert of one row of the stack at a time; MXFP4 experts
    dequantised to bf16 (packed bytes and scales read in step) export alike from both."""
    src = ckpt.save_params(tmp_path / "whole", MICRO, random_params(MICRO, 0))
    whole = ckpt.StoredParam(src, KEY)
    assert whole.chunk == whole.shape
    big = convert.orbax_to_hf(src, tmp_path / "whole_hf", layout="kimi_k3", progress=False)
    monkeypatch.setattr(ckpt, "CHUNK_BYTES", 2048)
    small = ckpt.save_params(tmp_path / "chunks", MICRO, random_params(MICRO, 0))
    part = ckpt.StoredParam(small, KEY)
    assert part.chunk[:2] == (1, 1) and part.shape == whole.shape  # one expert of one row
    for (k, a), (_, b) in zip(ckpt.iter_params(src, MICRO), ckpt.iter_params(small, MICRO)):
        np.testing.assert_array_equal(a, b, err_msg=k)  # Orbax restores the chunked layout
    got = convert.orbax_to_hf(small, tmp_path / "chunks_hf", layout="kimi_k3", progress=False)
    assert _files(tmp_path / "chunks_hf") == _files(tmp_path / "whole_hf")
    assert got.bytes_read == big.bytes_read  # each chunk once (the summary's bytes_held is the
    # embedding here, unstacked and larger than the micro stack: the loader below)
    loader, want = Loader(small), _whole(whole)
    for r, e in np.ndindex(*whole.shape[:2]):
        np.testing.assert_array_equal(loader.get(KEY, r, e), want[r, e])
    assert loader.peak == want[0, 0].nbytes < want.nbytes
    hf = tmp_path / "whole_hf"
    q, q_whole = tmp_path / "q_chunks", tmp_path / "q_whole"
    convert.hf_to_orbax(hf, q, experts="mxfp4", progress=False)
    monkeypatch.setattr(ckpt, "CHUNK_BYTES", 1 << 40)
    convert.hf_to_orbax(hf, q_whole, experts="mxfp4", progress=False)
    packed = KEY + "_packed"
    assert ckpt.StoredParam(q, packed).chunk[1] < ckpt.StoredParam(q_whole, packed).chunk[1]
    for folder in (q, q_whole):
        convert.orbax_to_hf(folder, tmp_path / f"{folder.name}_bf16", experts="bf16",
                            progress=False)
    assert _files(tmp_path / "q_chunks_bf16") == _files(tmp_path / "q_whole_bf16")
