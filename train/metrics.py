"""Per-step metrics: ``metrics.jsonl`` and a TensorBoard event file, no TensorFlow needed.

``metrics.jsonl``: one JSON object per step (``step``, ``loss``, ``grad_norm``,
``learning_rate``, ``tokens``, ``tokens_per_s``, ``mfu`` when a peak is given,
``expert_load_max_over_mean``, ``indexer_kl``, ``step_time_s``). Written by process 0 only.
A resumed run passes ``resume_step`` (the step it restored): the lines of later steps, written
before the interruption and about to be written again, are dropped first (the file is rewritten
atomically: temporary file, then rename), as is a torn last line; so every step appears once.

TensorBoard: ``events.out.tfevents.<time>.kdsa`` holds scalar summaries. The format is a
TFRecord stream (``uint64 length, uint32 masked crc32c(length), data, uint32 masked
crc32c(data)``, little-endian) of ``tensorflow.Event`` protos (``wall_time`` = 1 double,
``step`` = 2 int64, ``file_version`` = 3 string, ``summary`` = 5 with repeated ``value`` = 1 of
``tag`` = 1 string, ``simple_value`` = 2 float), encoded by hand below (field numbers from
``tensorflow/core/util/event.proto`` and ``framework/summary.proto``). CRC32C is the Castagnoli
polynomial (reflected 0x82F63B78); the mask is ``rotr(crc, 15) + 0xa282ead8``.

MFU estimate: ``6 * active_params * tokens / step_time / (peak_flops * devices)``, the usual
dense-equivalent count (forward 2, backward 4 FLOPs per active parameter per token; attention
score FLOPs are not counted), with ``active_params`` from ``kdsa.model.count``.

On resume the new event file starts with a ``SessionLog`` START event at ``resume_step + 1``
(``Event`` field 7 ``session_log``, its ``status`` = 1 START): TensorBoard's signal to drop the
events of the older files from that step on.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from pathlib import Path

import jax

_CRC_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _CRC_TABLE.append(_c)


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _len_field(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def event_bytes(wall_time: float, step: int, *, scalars: dict[str, float] | None = None,
                file_version: str | None = None, session_start: bool = False) -> bytes:
    """One serialized ``Event`` proto (``session_start``: a ``SessionLog`` START)."""
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3) + _varint(step)
    if file_version is not None:
        out += _len_field(3, file_version.encode())
    if session_start:
        out += _len_field(7, _varint(1 << 3) + _varint(1))  # session_log {status: START}
    if scalars:
        values = b"".join(
            _len_field(1, _len_field(1, tag.encode()) + _varint(2 << 3 | 5)
                       + struct.pack("<f", float(v)))
            for tag, v in scalars.items())
        out += _len_field(5, values)
    return out


def tfrecord(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return (header + struct.pack("<I", masked_crc32c(header)) + data
            + struct.pack("<I", masked_crc32c(data)))


class MetricsWriter:
    """Appends per-step metrics to ``run_dir/metrics.jsonl`` and a TensorBoard event file.

    ``resume_step``: the step a resumed run restarts from; lines of later steps are dropped
    (:func:`truncate_metrics`) and TensorBoard is told to drop them too.
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True,
                 resume_step: int | None = None):
        self.enabled = jax.process_index() == 0
        self.run_dir = Path(run_dir)
        self._jsonl = self._tb = None
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        if resume_step is not None:
            truncate_metrics(path, resume_step)
        self._jsonl = open(path, "a")
        if tensorboard:
            now = time.time()
            self._tb = open(self.run_dir / f"events.out.tfevents.{int(now)}.kdsa", "ab")
            self._tb.write(tfrecord(event_bytes(now, 0, file_version="brain.Event:2")))
            if resume_step is not None:
                self._tb.write(tfrecord(event_bytes(now, resume_step + 1, session_start=True)))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        rec = {"step": int(step), **{k: _num(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(rec) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            scalars = {f"train/{k}": v for k, v in rec.items()
                       if k != "step" and v is not None and math.isfinite(v)}
            self._tb.write(tfrecord(event_bytes(time.time(), step, scalars=scalars)))
            self._tb.flush()

    def close(self) -> None:
        for f in (self._jsonl, self._tb):
            if f is not None:
                f.close()


def truncate_metrics(path: str | Path, last_step: int) -> int:
    """Keep only the lines of ``path`` (a ``metrics.jsonl``) whose step is at most
    ``last_step`` (dropping lines that do not parse, e.g. one torn by a crash); the file is
    replaced atomically. Returns the number of lines dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            ok = int(json.loads(line)["step"]) <= last_step
        except (ValueError, KeyError, TypeError):
            ok = False
        if ok:
            keep.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
    return dropped


def _num(v) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None


def mfu(active_params: int, tokens: float, seconds: float, peak_flops: float,
        devices: int = 1) -> float:
    """Model FLOP utilisation estimate (see module docstring); 0 when no peak is given."""
    if peak_flops <= 0 or seconds <= 0:
        return 0.0
    return 6.0 * active_params * tokens / seconds / (peak_flops * devices)


def progress_bar(total: int, initial: int, enabled: bool, show):
    """A tqdm bar on stderr, or a no-op when not ``enabled``. ``bar(step, payload)`` moves it to
    ``step`` and calls ``show(tqdm_bar, payload)`` to write the payload (loss, reward, ...);
    ``bar(None, None)`` closes it."""
    if not enabled:
        return lambda step, payload: None
    import sys

    from tqdm import tqdm

    bar = tqdm(total=total, initial=initial, file=sys.stderr, unit="step", dynamic_ncols=True)

    def update(step, payload):
        if step is None:
            bar.close()
            return
        bar.update(step - bar.n)
        show(bar, payload)

    return update
