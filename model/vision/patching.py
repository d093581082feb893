"""Native-resolution patching: an RGB image -> 14 x 14 patches in 2 x 2 merge order.

No resize to a square (MoonViT / Kimi-VL "native resolution", ``kimi_k3.md`` 5). The rule is the
K2.5 / K3 processor's (``navit_resize_image`` in the checkpoint's ``media_utils.py``, read via
its ports; ``docs/vision.md`` "checked against"):

1. **Downscale only when over a limit**, keeping the aspect ratio: with ``p`` the patch size,
   ``scale = min(1, sqrt(L / (max(1, W // p) * max(1, H // p))), S * p / W, S * p / H)`` where
   ``L = max_patches`` (the processor's ``in_patch_limit``; K3 65536) and ``S =
   max_patches_per_side`` (``patch_limit_on_one_side``, 512); the new size is
   ``min(max(1, int(W * scale)), S * p)`` (same for ``H``), resampled bicubically (PIL
   ``BICUBIC``, as the processor).
2. **Pad right and bottom with black** (pixel value 0, i.e. -1 after normalisation) to the next
   multiple of ``patch_size * merge`` pixels: ``gh = merge_h * ceil(H' / (p * merge_h))``,
   likewise ``gw``, so every patch grid divides into whole merge windows.
3. **Normalise** ``(x / 255 - 0.5) / 0.5`` (image mean and std 0.5 per channel).

A patch is flattened in ``(channel, row, col)`` order, the order of the checkpoint's conv weight
``patch_embed.proj.weight [D, 3, 14, 14]``. Patches are listed in **merge order**: merge windows
row-major over the ``gh/mh x gw/mw`` window grid, and inside each window its ``mh x mw`` patches
row-major, so merging is one reshape (vLLM ``tpool_patch_merger`` for ``t = 1``). ``size`` keeps
the original ``W x H`` (the prompt's ``image WxH``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

IMAGE_MEAN = 0.5
IMAGE_STD = 0.5


@dataclasses.dataclass(frozen=True, eq=False)
class ImagePatches:
    """One image, patched. ``patches [P, 3 * ps * ps]`` float32 in merge order; ``pos [P, 2]``
    (row, col) of each patch in its grid; ``grid`` = (gh, gw); ``size`` = (width, height) px."""

    patches: np.ndarray
    pos: np.ndarray
    grid: tuple[int, int]
    size: tuple[int, int]
    merge_size: int

    @property
    def num_patches(self) -> int:
        return int(self.patches.shape[0])

    @property
    def num_tokens(self) -> int:
        """Sequence positions the image takes after merging (placeholders in the prompt)."""
        return self.num_patches // self.merge_size


def patch_grid(height: int, width: int, patch_size: int,
               merge_kernel_size: tuple[int, int] = (2, 2)) -> tuple[int, int]:
    """``(gh, gw)``: the patch grid of an ``H x W`` image, whole merge windows (module doc)."""
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    mh, mw = merge_kernel_size
    return mh * -(-height // (patch_size * mh)), mw * -(-width // (patch_size * mw))


def merge_order(gh: int, gw: int, merge_kernel_size: tuple[int, int] = (2, 2)) -> np.ndarray:
    """``[gh * gw, 2]`` (row, col) of the patches in merge order."""
    mh, mw = merge_kernel_size
    r, c = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")  # [gh, gw]
    rc = np.stack([r, c], -1).reshape(gh // mh, mh, gw // mw, mw, 2).transpose(0, 2, 1, 3, 4)
    return rc.reshape(-1, 2).astype(np.int32)


def resized_size(width: int, height: int, vision) -> tuple[int, int]:
    """``(W', H')`` after the processor's downscale rule (module doc, step 1)."""
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    p, side, limit = vision.patch_size, vision.max_patches_per_side, vision.max_patches
    scale = min(1.0, math.sqrt(limit / (max(1.0, width // p) * max(1.0, height // p))),
                side * p / width, side * p / height)
    if scale >= 1.0:
        return width, height
    return (min(max(1, int(width * scale)), side * p), min(max(1, int(height * scale)), side * p))


def _resize(x: np.ndarray, width: int, height: int) -> np.ndarray:
    """Bicubic resize (PIL) of ``[H, W, 3]`` uint8 (as RGB) or float (per channel, mode F)."""
    from PIL import Image

    if x.dtype == np.uint8:
        return np.asarray(Image.fromarray(x, "RGB").resize((width, height), Image.BICUBIC))
    chans = [np.asarray(Image.fromarray(np.ascontiguousarray(x[..., c], np.float32), "F")
                        .resize((width, height), Image.BICUBIC)) for c in range(3)]
    return np.clip(np.stack(chans, -1), 0.0, 255.0)


def patchify(pixels: np.ndarray, vision) -> ImagePatches:
    """``pixels [H, W, 3]`` uint8 (or floats in [0, 255]) -> :class:`ImagePatches` for the
    ``VisionConfig`` ``vision`` (module doc: downscale over the limits, pad, normalise)."""
    pixels = np.asarray(pixels)
    if pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"an image must be [height, width, 3] RGB, got shape {pixels.shape}")
    if not (np.issubdtype(pixels.dtype, np.integer) or np.issubdtype(pixels.dtype, np.floating)):
        raise ValueError(f"image pixels must be numbers, got dtype {pixels.dtype}")
    h, w, _ = pixels.shape
    if h < 1 or w < 1:
        raise ValueError(f"image size must be positive, got {w}x{h}")
    x = pixels if pixels.dtype == np.uint8 else pixels.astype(np.float32)
    if x.dtype != np.uint8 and (not np.all(np.isfinite(x)) or x.min() < 0 or x.max() > 255):
        raise ValueError("image pixels must be finite values in [0, 255]")
    nw, nh = resized_size(w, h, vision)
    if (nw, nh) != (w, h):
        x = _resize(x, nw, nh)
    ps, (mh, mw) = vision.patch_size, vision.merge_kernel_size
    gh, gw = patch_grid(nh, nw, ps, (mh, mw))
    canvas = np.zeros((gh * ps, gw * ps, 3), np.float32)        # black padding (pixel 0)
    canvas[:nh, :nw] = x
    canvas = (canvas / 255.0 - IMAGE_MEAN) / IMAGE_STD
    grid = canvas.reshape(gh, ps, gw, ps, 3).transpose(0, 2, 4, 1, 3)  # [gh, gw, C, ps, ps]
    grid = grid.reshape(gh, gw, 3 * ps * ps)
    pos = merge_order(gh, gw, (mh, mw))
    return ImagePatches(patches=grid[pos[:, 0], pos[:, 1]], pos=pos, grid=(gh, gw),
                        size=(w, h), merge_size=mh * mw)
