"""Sequence assembly: pack images per row, run tower + projector, put the features at the
image placeholders.

A prompt holds, for each image, ``num_tokens`` copies of the placeholder token
(``vision_config.media_placeholder_token_id``, ``<|media_pad|>``; the chat formats write them,
``infer/xtml.py``). Those positions take the projected image features instead of token
embeddings; everything after the embedding (KDA, Gated DSA, caches) sees ordinary positions.

:class:`ImageBatch` carries the pixels of a ``[B, T]`` token batch **per row**: row ``b``'s
images, in the order their placeholders appear in row ``b``, packed one after another into
``P`` patch slots (padding at the end, ``segment = 0``). The tower runs on ``[B, P]``; merging
gives ``[B, P / m, D]`` features, and the ``k``-th placeholder of row ``b`` takes feature
``[b, k]`` (:func:`scatter_features`). The host side checks that every row has exactly as many
placeholders as merged image tokens (:func:`pack_images`, :func:`check_placeholders`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kdsa.model.outputs import ImageInputs
from kdsa.model.vision.patching import ImagePatches
from kdsa.model.vision.projector import merge_patches


@struct.dataclass
class ImageBatch:
    patches: jax.Array  # [B, P, 3 p p] float32, merge order
    pos: jax.Array      # [B, P, 2] int32 (row, col) in the patch's image grid
    grid: jax.Array     # [B, P, 2] int32 (gh, gw) of the patch's image (0 on padding)
    segment: jax.Array  # [B, P] int32 image number within the row, from 1; 0 = padding


def pack_images(rows: list[list[ImagePatches]], num_patches: int | None = None,
                feature_size: int | None = None) -> ImageBatch:
    """Per row, its images packed into ``num_patches`` slots (default: the longest row, rounded
    up to a multiple of 8). NumPy arrays (host side). ``feature_size`` (3 p p) is needed only
    when no row has an image."""
    if not rows:
        raise ValueError("pack_images needs at least one row")
    need = max(sum(im.num_patches for im in r) for r in rows)
    p = num_patches if num_patches is not None else max(8, -(-need // 8) * 8)
    if need > p:
        raise ValueError(f"a row's images take {need} patches, more than num_patches={p}")
    feat = next((im.patches.shape[1] for r in rows for im in r), feature_size)
    if feat is None:
        raise ValueError("pack_images: no images in any row and no feature_size")
    b = len(rows)
    out = ImageBatch(np.zeros((b, p, feat), np.float32), np.zeros((b, p, 2), np.int32),
                     np.zeros((b, p, 2), np.int32), np.zeros((b, p), np.int32))
    for i, r in enumerate(rows):
        at = 0
        for j, im in enumerate(r):
            if im.patches.shape[1] != feat:
                raise ValueError(f"row {i} image {j}: patches of {im.patches.shape[1]} values, "
                                 f"others have {feat} (different patch sizes)")
            n = im.num_patches
            out.patches[i, at:at + n] = im.patches
            out.pos[i, at:at + n] = im.pos
            out.grid[i, at:at + n] = im.grid
            out.segment[i, at:at + n] = j + 1
            at += n
    return out


def check_placeholders(ids: np.ndarray, rows: list[list[ImagePatches]], placeholder: int) -> None:
    """Each row of ``ids [B, T]`` holds exactly its images' merged token count of placeholders."""
    ids = np.asarray(ids)
    for b, r in enumerate(rows):
        have, want = int(np.sum(ids[b] == placeholder)), sum(im.num_tokens for im in r)
        if have != want:
            raise ValueError(f"row {b}: {have} image placeholder tokens ({placeholder}) but its "
                             f"{len(r)} image(s) take {want} positions")


def scatter_features(features: jax.Array, mask: jax.Array) -> jax.Array:
    """features [B, N, D]; mask [B, T] (placeholder positions) -> [B, T, D]: the ``k``-th
    placeholder of row ``b`` gets ``features[b, k]`` (zeros elsewhere)."""
    idx = jnp.clip(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0, features.shape[1] - 1)
    out = jnp.take_along_axis(features, idx[..., None], axis=1)           # [B, T, D]
    return jnp.where(mask[..., None], out, jnp.zeros_like(out))


def encode_images(model, images: ImageBatch) -> jax.Array:
    """Tower + merge + projector of a Transformer with a ``vision_config`` -> [B, P / m, D]."""
    vc = model.config.vision_config
    if vc is None:
        raise ValueError("this model has no vision tower (vision_config is None)")
    x = model.vision_tower(images.patches, images.pos, images.grid, images.segment)
    return model.mm_projector(merge_patches(x, vc.merge_size))


BATCH_KEYS = {"patches": "image_patches", "pos": "image_pos", "grid": "image_grid",
              "segment": "image_segment"}


def image_batch(batch: dict) -> ImageBatch | None:
    """The :class:`ImageBatch` of a training batch dict (``image_*`` keys), or None."""
    if "image_patches" not in batch:
        return None
    return ImageBatch(**{f: batch[k] for f, k in BATCH_KEYS.items()})


def batch_arrays(images: ImageBatch) -> dict:
    """The ``image_*`` entries of a training batch dict (inverse of :func:`image_batch`)."""
    return {k: getattr(images, f) for f, k in BATCH_KEYS.items()}


def image_inputs(model, input_ids: jax.Array, images: ImageBatch | None) -> ImageInputs | None:
    """``forward``'s ``images`` for a token batch with images (None without)."""
    if images is None:
        return None
    mask = input_ids == model.config.vision_config.media_placeholder_token_id
    return ImageInputs(embeds=scatter_features(encode_images(model, images), mask), mask=mask)


def batch_image_inputs(model, batch: dict) -> ImageInputs | None:
    """``forward``'s ``images`` for a training batch dict (its ``image_*`` arrays, if any):
    ``model.forward(batch["inputs"], images=batch_image_inputs(model, batch))``."""
    return image_inputs(model, batch["inputs"], image_batch(batch))


def message_images(messages) -> list:
    """The images of chat ``messages`` (``infer/chat.py`` ``Message``), in prompt order."""
    return [im for m in messages for im in m.images]


def row_image_arrays(rows: list[list[ImagePatches]], num_rows: int) -> dict:
    """The ``image_*`` batch entries for ``num_rows`` rows whose first ``len(rows)`` hold these
    images (the rest none); ``{}`` when no row has an image (a text-only batch)."""
    if not any(rows):
        return {}
    return batch_arrays(pack_images(list(rows) + [[]] * (num_rows - len(rows))))
