"""Native-resolution patching: an RGB image -> 14 x 14 patches in 2 x 2 merge order.

No resize to a square (MoonViT / Kimi-VL "native resolution", ``kimi_k3.md`` 5): an image of
``W x H`` pixels is padded on the right and bottom to the next multiple of
``patch_size * merge`` pixels and cut into a ``gh x gw`` grid of patches,

    gh = merge_h * ceil(H / (patch_size * merge_h)),  gw = merge_w * ceil(W / (patch_size * merge_w)),

so every patch grid divides into whole merge windows. Pixels are scaled to [-1, 1]
(``(x / 255 - 0.5) / 0.5``, Kimi-VL's image mean and std); padding is 0 (mid-gray). A patch is
flattened in ``(channel, row, col)`` order, the order of the checkpoint's conv weight
``patch_embed.proj.weight [D, 3, 14, 14]``. Patches are listed in **merge order**: merge windows
row-major over the ``gh/mh x gw/mw`` window grid, and inside each window its ``mh x mw`` patches
row-major, so merging is one reshape (vLLM ``tpool_patch_merger`` for ``t = 1``). An image that
needs more than ``max_patches`` patches is refused with a ``ValueError`` naming its size.
"""

from __future__ import annotations

import dataclasses

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


def patchify(pixels: np.ndarray, vision) -> ImagePatches:
    """``pixels [H, W, 3]`` uint8 (or floats in [0, 255]) -> :class:`ImagePatches` for the
    ``VisionConfig`` ``vision``."""
    pixels = np.asarray(pixels)
    if pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"an image must be [height, width, 3] RGB, got shape {pixels.shape}")
    if not (np.issubdtype(pixels.dtype, np.integer) or np.issubdtype(pixels.dtype, np.floating)):
        raise ValueError(f"image pixels must be numbers, got dtype {pixels.dtype}")
    h, w, _ = pixels.shape
    ps, (mh, mw) = vision.patch_size, vision.merge_kernel_size
    gh, gw = patch_grid(h, w, ps, (mh, mw))
    if gh * gw > vision.max_patches:
        raise ValueError(f"an image of {w}x{h} px needs {gh}x{gw} = {gh * gw} patches of {ps} px; "
                         f"the limit is max_patches={vision.max_patches}")
    x = pixels.astype(np.float32)
    if not np.all(np.isfinite(x)) or x.min() < 0 or x.max() > 255:
        raise ValueError("image pixels must be finite values in [0, 255]")
    x = (x / 255.0 - IMAGE_MEAN) / IMAGE_STD
    canvas = np.zeros((gh * ps, gw * ps, 3), np.float32)
    canvas[:h, :w] = x
    grid = canvas.reshape(gh, ps, gw, ps, 3).transpose(0, 2, 4, 1, 3)  # [gh, gw, C, ps, ps]
    grid = grid.reshape(gh, gw, 3 * ps * ps)
    pos = merge_order(gh, gw, (mh, mw))
    return ImagePatches(patches=grid[pos[:, 0], pos[:, 1]], pos=pos, grid=(gh, gw),
                        size=(w, h), merge_size=mh * mw)
