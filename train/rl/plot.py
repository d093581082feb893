"""A line plot written as a PNG with ``zlib`` and ``struct`` only (no plotting dependency).

``line_plot(path, series, y_range)``: each series ``(values, rgb)`` is drawn over its index
(x from the first to the last step), on a white canvas with a frame and horizontal grid lines
at every quarter of ``y_range``. PNG layout (ISO/IEC 15948): signature, ``IHDR`` (width,
height, bit depth 8, colour type 2 = RGB), one ``IDAT`` of zlib-compressed scanlines each
prefixed by filter byte 0, ``IEND``; every chunk is ``length, type, data, crc32(type + data)``.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(
        ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(img: np.ndarray) -> bytes:
    """``[H, W, 3]`` uint8 -> PNG bytes."""
    if img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
        raise ValueError(f"image must be [H, W, 3] uint8, got {img.shape} {img.dtype}")
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b""))


def decode_png(data: bytes) -> np.ndarray:
    """Inverse of :func:`encode_png` (filter 0 only), for tests."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w, h = 8, b"", 0, 0
    while pos < len(data):
        n, = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    rows = [raw[y * (3 * w + 1) + 1:(y + 1) * (3 * w + 1)] for y in range(h)]
    return np.frombuffer(b"".join(rows), np.uint8).reshape(h, w, 3)


def _line(img, x0, y0, x1, y1, rgb, thick=1):
    n = int(max(abs(x1 - x0), abs(y1 - y0), 1))
    for t in np.linspace(0.0, 1.0, 2 * n + 1):
        x, y = int(round(x0 + (x1 - x0) * t)), int(round(y0 + (y1 - y0) * t))
        img[max(y - thick + 1, 0):y + thick, max(x - thick + 1, 0):x + thick] = rgb


def line_plot(path: str | Path, series: list[tuple[list[float], tuple[int, int, int]]], *,
              y_range: tuple[float, float] = (0.0, 1.0), size: tuple[int, int] = (480, 320),
              margin: int = 24) -> Path:
    w, h = size
    lo, hi = y_range
    img = np.full((h, w, 3), 255, np.uint8)
    x0, x1, y0, y1 = margin, w - margin, margin, h - margin
    for q in range(5):  # grid at quarters of the range
        y = int(round(y1 - (y1 - y0) * q / 4))
        img[y, x0:x1 + 1] = (225, 225, 225)
    for a, b, c, d in ((x0, y0, x1, y0), (x0, y1, x1, y1), (x0, y0, x0, y1), (x1, y0, x1, y1)):
        _line(img, a, b, c, d, (0, 0, 0))
    n = max((len(v) for v, _ in series), default=1)
    for values, rgb in series:
        pts = [(x0 + (x1 - x0) * (i / max(n - 1, 1)),
                y1 - (y1 - y0) * (min(max(v, lo), hi) - lo) / (hi - lo))
               for i, v in enumerate(values)]
        for (a, b), (c, d) in zip(pts, pts[1:]):
            _line(img, a, b, c, d, rgb, thick=2)
        if len(pts) == 1:
            _line(img, pts[0][0], pts[0][1], pts[0][0], pts[0][1], rgb, thick=3)
    path = Path(path)
    path.write_bytes(encode_png(img))
    return path
