"""Training data: synthetic token streams and JSONL documents packed into fixed-length rows.

Every source is a pure function of the batch index (``batch(i)``), so the iterator position is
one integer: the number of batches consumed, saved in checkpoints for an exact resume.

A batch is a dict of ``[B, T]`` arrays::

    inputs      int32   tokens fed to the model
    targets     int32   the next tokens
    loss_mask   float32 1 where the target is a real next token of the same document
    segment_ids int32   packed document id per position, 0 = padding (JSONL only)

Packing (JSONL): documents (``{"tokens": [...]}`` or ``{"text": "..."}``, text as UTF-8 bytes,
ids 0..255, ``eos_id`` appended) are laid greedily into rows of ``T + 1`` tokens; a document
longer than a row is cut into row-sized pieces. Segment ids count documents within a row from 1;
the model restarts positions and masks attention at segment boundaries. The target of the last
token of a document is not trained (``loss_mask`` 0), nor is padding. Rows are shuffled with the
seed, a fresh permutation per epoch.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from kdsa.infer.jsonl import read_records


class SyntheticData:
    """Learnable synthetic rows: ``x_t = (a + b * t) mod V`` with random ``a, b`` per row.

    The next token is determined by the previous two, so the loss falls quickly.
    """

    def __init__(self, vocab_size: int, batch_size: int, seq_len: int, seed: int):
        if vocab_size < 2:
            raise ValueError(f"synthetic data needs vocab_size >= 2, got {vocab_size}")
        self.vocab_size, self.batch_size, self.seq_len, self.seed = (
            vocab_size, batch_size, seq_len, seed)

    fingerprint = "synthetic"  # what a checkpoint records of its data (``data_fingerprint``)

    def batch(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, index])
        a = rng.integers(0, self.vocab_size, (self.batch_size, 1))
        b = rng.integers(1, min(self.vocab_size, 17), (self.batch_size, 1))
        rows = (a + b * np.arange(self.seq_len + 1)) % self.vocab_size  # [B, T+1]
        return _from_rows(rows.astype(np.int32), None)


class PackedJsonlData:
    """Documents from a JSONL file packed into rows of ``seq_len + 1`` tokens."""

    def __init__(self, path: str | Path, batch_size: int, seq_len: int, seed: int, *,
                 vocab_size: int, eos_id: int | None = None, pad_id: int = 0,
                 tokenizer=None):
        """``tokenizer`` (``infer.tokenizer``; the model's own, ``--init-from``) encodes
        ``text`` documents; without one text is UTF-8 bytes (ids 0..255)."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"--data {path}: no such file")
        docs = list(_read_jsonl(path, eos_id, tokenizer))
        for n, doc in enumerate(docs):
            if doc.size and (doc.min() < 0 or doc.max() >= vocab_size):
                raise ValueError(f"{path}: document {n} has token ids outside [0, {vocab_size})")
        self.tokens, self.segments = pack_documents(docs, seq_len + 1, pad_id)
        if len(self.tokens) < batch_size:
            raise ValueError(f"{path}: {len(self.tokens)} packed rows of {seq_len + 1} tokens, "
                             f"fewer than batch_size={batch_size}")
        self.batch_size, self.seed = batch_size, seed
        self.batches_per_epoch = len(self.tokens) // batch_size
        self.fingerprint = data_fingerprint("jsonl", self.tokens, self.segments)

    def batch(self, index: int) -> dict[str, np.ndarray]:
        epoch, k = divmod(index, self.batches_per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.tokens))
        rows = perm[k * self.batch_size:(k + 1) * self.batch_size]
        return _from_rows(self.tokens[rows], self.segments[rows])


def data_fingerprint(kind: str, *arrays: np.ndarray) -> str:
    """``"KIND rows=N sha256=..."`` of a data source's packed rows: what a checkpoint records so
    that ``--resume`` refuses other data (an edited or regenerated file, another tokenizer, a
    forgotten ``--data``), whose rows the checkpoint's data index would point into elsewhere.
    Content, not the path: a moved file resumes."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return f"{kind} rows={len(arrays[0])} sha256={h.hexdigest()[:16]}"


def _read_jsonl(path: Path, eos_id: int | None, tokenizer=None):
    for n, rec in read_records(path):
        if not isinstance(rec, dict) or not ("tokens" in rec or "text" in rec):
            raise ValueError(f"{path}:{n}: expected an object with 'tokens' or 'text'")
        if "tokens" in rec:
            ids = rec["tokens"]
            if not isinstance(ids, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"{path}:{n}: 'tokens' must be a list of integers, got "
                                 f"{_short(ids)}")
            ids = list(ids)
        else:
            if not isinstance(rec["text"], str):
                raise ValueError(f"{path}:{n}: 'text' must be a string, got "
                                 f"{_short(rec['text'])}")
            ids = (list(rec["text"].encode("utf-8")) if tokenizer is None
                   else list(tokenizer.encode(rec["text"])))
        if eos_id is not None:
            ids.append(eos_id)
        yield np.asarray(ids, np.int64)


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def pack_documents(docs: list[np.ndarray], row_len: int, pad_id: int = 0
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Greedy packing: ``(tokens [R, row_len] int32, segment_ids [R, row_len] int32)``.

    Documents go in order into the current row while they fit; a document that does not fit
    starts a new row; one longer than a row is split into row-sized pieces (each its own
    segment). Segment ids are 1, 2, ... within a row, 0 on padding.
    """
    if row_len < 2:
        raise ValueError(f"rows need at least 2 tokens, got {row_len}")
    pieces = [d[i:i + row_len] for d in docs for i in range(0, len(d), row_len) if len(d)]
    rows_tok: list[list[int]] = []
    rows_seg: list[list[int]] = []
    cur_tok: list[int] = []
    cur_seg: list[int] = []
    for p in pieces:
        if len(cur_tok) + len(p) > row_len:
            rows_tok.append(cur_tok)
            rows_seg.append(cur_seg)
            cur_tok, cur_seg = [], []
        seg = (cur_seg[-1] + 1) if cur_seg else 1
        cur_tok += p.tolist()
        cur_seg += [seg] * len(p)
    if cur_tok:
        rows_tok.append(cur_tok)
        rows_seg.append(cur_seg)
    tok = np.full((len(rows_tok), row_len), pad_id, np.int32)
    seg = np.zeros((len(rows_tok), row_len), np.int32)
    for r, (t, s) in enumerate(zip(rows_tok, rows_seg)):
        tok[r, :len(t)], seg[r, :len(s)] = t, s
    return tok, seg


def _from_rows(rows: np.ndarray, segments: np.ndarray | None) -> dict[str, np.ndarray]:
    """``[B, T+1]`` rows -> the batch dict (inputs / targets shifted by one)."""
    out = {"inputs": rows[:, :-1], "targets": rows[:, 1:]}
    if segments is None:
        out["loss_mask"] = np.ones(out["inputs"].shape, np.float32)
        return out
    s_in, s_tg = segments[:, :-1], segments[:, 1:]
    out["loss_mask"] = ((s_in == s_tg) & (s_in > 0)).astype(np.float32)
    out["segment_ids"] = s_in.astype(np.int32)
    return out


def make_data(vocab_size: int, batch_size: int, seq_len: int, seed: int,
              path: str | Path | None = None, *, eos_id: int | None = None,
              pad_id: int | None = None):
    """Synthetic data, or packed JSONL when ``path`` is given. ``path`` may also be a data
    source the caller built (an object with ``batch(i)``; ``kdsa train`` builds chat SFT data,
    ``train/vision_data.py``), used as it is."""
    if hasattr(path, "batch"):
        return path
    if path is None:
        return SyntheticData(vocab_size, batch_size, seq_len, seed)
    return PackedJsonlData(path, batch_size, seq_len, seed, vocab_size=vocab_size, eos_id=eos_id,
                           pad_id=0 if pad_id is None else pad_id)
