"""Image inputs: files and OpenAI ``image_url`` data URLs, decoded with Pillow, with limits.

Every failure is a ``ValueError`` that names the image (``where``) and the problem: an unknown
URL scheme, bad base64, bytes Pillow cannot identify or that are truncated, too many pixels,
too many images. The pixel limit is checked from the header before the pixels are decoded
(so a decompression bomb is refused cheaply); Pillow's own bomb check is turned into the same
error. Decoded images are RGB ``uint8 [H, W, 3]`` (palettes expanded, EXIF orientation not
applied). An image with transparency is composited onto K3's background, a chessboard of 8-px
squares, white (255) at the top left and gray (180) (the checkpoint's ``transparent_bg_config``
as recorded by the sglang K3 processor and its ports; K2.5 dropped the alpha channel instead):
``rgb' = round(rgb * a + bg * (1 - a))``, ``a = alpha / 255``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import re
import warnings
from pathlib import Path

import numpy as np

_DATA_URL = re.compile(r"^data:(image/[A-Za-z0-9.+\-]+)?(;[^,]*)?,(.*)$", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    max_images: int = 8  # per request / example
    max_pixels: int = 4096 * 4096  # per image, width x height
    max_bytes: int = 16 * 2**20  # encoded size per image

    def __post_init__(self):
        for f in ("max_images", "max_pixels", "max_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"image limit {f} must be a positive integer, got {v!r}")

    def check_count(self, n: int, where: str = "request") -> None:
        if n > self.max_images:
            raise ValueError(f"{where} has {n} images; the limit is {self.max_images}")


# the formats a request's image may be in (the APIs' own list): Pillow's other plugins (EPS runs
# Ghostscript, for one) are never reached by a request's bytes
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


def decode_image(data: bytes, where: str = "image", limits: ImageLimits = ImageLimits(),
                 formats: tuple[str, ...] | None = None) -> np.ndarray:
    """Encoded bytes -> RGB ``uint8 [H, W, 3]``; ``formats``: the only Pillow formats tried
    (a request's data URL: :data:`IMAGE_FORMATS`; None: any, for local files)."""
    from PIL import Image

    if len(data) > limits.max_bytes:
        raise ValueError(f"{where}: {len(data)} bytes; the limit is {limits.max_bytes}")
    if not data:
        raise ValueError(f"{where}: empty image data")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=formats)
            w, h = im.size
            if w * h > limits.max_pixels:
                raise ValueError(f"{where}: {w}x{h} = {w * h} pixels; the limit is "
                                 f"{limits.max_pixels}")
            im.load()
            rgb = flatten_alpha(im)
    except ValueError as e:  # ours name the image; Pillow's (e.g. a text chunk too large) do not
        if str(e).startswith(where):
            raise
        raise ValueError(f"{where}: cannot decode the image ({e})") from None
    except (OSError, SyntaxError, EOFError, Image.DecompressionBombError,
            Image.DecompressionBombWarning, Image.UnidentifiedImageError) as e:
        raise ValueError(f"{where}: cannot decode the image ({type(e).__name__}: {e})") from None
    if rgb.ndim != 3 or rgb.shape[2] != 3 or min(rgb.shape[:2]) < 1:
        raise ValueError(f"{where}: decoded to an unusable shape {rgb.shape}")
    return rgb


CHESSBOARD = (8, 255, 180)  # square size, white (top left), gray


def chessboard(height: int, width: int) -> np.ndarray:
    """``[H, W]`` uint8 background of transparent pixels (module doc)."""
    size, white, gray = CHESSBOARD
    y, x = np.meshgrid(np.arange(height) // size, np.arange(width) // size, indexing="ij")
    return np.where((y + x) % 2 == 0, white, gray).astype(np.uint8)


# Pillow's 16-bit grayscale modes (a 16-bit PNG or TIFF): ``convert("RGB")`` clips their values
# at 255 instead of scaling them, so a mid-gray 16-bit image came out white
WIDE_GRAY = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def eight_bit_gray(im):
    """A 16-bit grayscale PIL image -> ``L`` (``LA`` when a gray value is transparent), values
    scaled by 255 / 65535 and rounded."""
    from PIL import Image

    x = np.asarray(im).astype(np.float64)
    gray = np.clip(np.round(x / 257.0), 0, 255).astype(np.uint8)
    t = im.info.get("transparency")
    if isinstance(t, int):
        alpha = np.where(x == t, 0, 255).astype(np.uint8)
        return Image.fromarray(np.stack([gray, alpha], -1), "LA")
    return Image.fromarray(gray, "L")


def flatten_alpha(im) -> np.ndarray:
    """A PIL image -> RGB ``uint8 [H, W, 3]``; transparency composited onto :func:`chessboard`;
    16-bit grayscale scaled to 8 bits; float images (mode ``F``) refused."""
    if im.mode in WIDE_GRAY:
        im = eight_bit_gray(im)
    elif im.mode == "F":
        raise ValueError("32-bit float pixels (mode F) are not supported; save the image with "
                         "8 or 16 bits per channel")
    has_alpha = im.mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in im.info
    if not has_alpha:
        return np.asarray(im.convert("RGB"), dtype=np.uint8)
    rgba = np.asarray(im.convert("RGBA"), dtype=np.float32)
    a = rgba[..., 3:] / 255.0
    bg = chessboard(*rgba.shape[:2]).astype(np.float32)[..., None]
    return np.round(rgba[..., :3] * a + bg * (1.0 - a)).astype(np.uint8)


def image_from_url(url, where: str = "image_url", limits: ImageLimits = ImageLimits()
                   ) -> np.ndarray:
    """An OpenAI ``image_url.url``: only ``data:image/...;base64,...`` URLs (a server does not
    fetch from the network)."""
    if not isinstance(url, str):
        raise ValueError(f"{where} must be a string data URL, got {type(url).__name__}")
    m = _DATA_URL.match(url)
    if m is None:
        scheme = url.split(":", 1)[0] if ":" in url else url[:16]
        raise ValueError(f"{where}: only base64 data URLs (data:image/png;base64,...) are "
                         f"accepted, got {scheme!r}...")
    if ";base64" not in (m.group(2) or ""):
        raise ValueError(f"{where}: the data URL is not base64-encoded")
    payload = m.group(3)
    if len(payload) > limits.max_bytes * 4 // 3 + 4:
        raise ValueError(f"{where}: more than {limits.max_bytes} bytes of image data")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}: invalid base64 ({e})") from None
    return decode_image(data, where, limits, IMAGE_FORMATS)


def image_from_file(path, where: str | None = None, limits: ImageLimits = ImageLimits()
                    ) -> np.ndarray:
    p = Path(path)
    where = where or str(p)
    if not p.is_file():
        raise ValueError(f"{where}: no such image file {str(p)!r}")
    if p.stat().st_size > limits.max_bytes:
        raise ValueError(f"{where}: {p.stat().st_size} bytes; the limit is {limits.max_bytes}")
    return decode_image(p.read_bytes(), where, limits)


def to_data_url(pixels: np.ndarray, fmt: str = "PNG") -> str:
    """RGB ``uint8 [H, W, 3]`` -> ``data:image/png;base64,...`` (tests, clients)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.asarray(pixels, np.uint8), "RGB").save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def make_image_loader(vision, limits: ImageLimits = ImageLimits(), base_dir=None):
    """``load(url, where) -> patched image`` for ``messages_from_openai``: data URLs, and with
    ``base_dir`` also image files (paths relative to it; a server passes none, so requests can
    not read local files). Counts the images it loads against ``limits.max_images``."""
    from kdsa.model.vision.patching import patchify

    seen = []

    def load(url, where):
        seen.append(where)
        limits.check_count(len(seen), "the request")
        if base_dir is not None and isinstance(url, str) and not url.startswith("data:"):
            pixels = image_from_file(Path(base_dir) / url, where, limits)
        else:
            pixels = image_from_url(url, where, limits)
        try:
            return patchify(pixels, vision)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    return load


def file_parts(messages: list) -> list:
    """Message JSON with ``{"type": "image", "path": p}`` parts (JSONL files for ``kdsa
    generate`` and SFT) turned into ``image_url`` parts whose url is the path."""
    out = []
    for m in messages:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, list):
            c = [{"type": "image_url", "image_url": {"url": p.get("path")}}
                 if isinstance(p, dict) and p.get("type") == "image" else p for p in c]
            m = dict(m, content=c)
        out.append(m)
    return out
