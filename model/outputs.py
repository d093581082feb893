"""What ``Transformer.forward`` takes beside token ids, and what it returns.

The forward is small: ``forward(ids, positions, cache, segment_ids, images) -> Output(logits,
cache)``. Everything else is asked for explicitly:

* :class:`Collect` (static): the statistics a training or rollout step wants. They come back
  in ``Output.stats``, which is None when nothing was asked for.
* :class:`RoutingReplay`: MoE routing replay (RL). Each MoE layer uses the recorded experts
  instead of its router's top-k, and ``stats.replay_agreement`` says how often the router
  agreed.
* :class:`ImageInputs`: image features placed at the prompt's image placeholders
  (``model/vision/assemble.py : image_inputs``).

Statistics are stacked over the layers that produce them, in layer order: ``indexer_kl`` over
the Gated DSA layers, the MoE statistics over the MoE layers (:func:`layers_of`). Nothing is
zero-filled for layers that do not have a statistic.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
from flax import struct

INDEXER_LOSSES = ("none", "dense", "sparse")


@dataclasses.dataclass(frozen=True)
class Collect:
    """Which statistics ``forward`` returns (a static, hashable argument).

    ``indexer_kl``: the DSA indexer's KL to the attention it imitates (DeepSeek-V3.2-Exp paper
    section 2.1): "dense" over the full visible set (warm-up stage), "sparse" over the selected
    top-k (sparse stage); "none" skips it. Only without a cache (training).
    ``expert_load``: per MoE layer, the assignments of valid tokens to each expert (the
    balancing-bias update), and under expert parallelism the assignments dropped over capacity.
    ``routing``: per MoE layer, the experts each token used (the rollout's routing record).
    """
    indexer_kl: Literal["none", "dense", "sparse"] = "none"
    expert_load: bool = False
    routing: bool = False

    def __post_init__(self):
        if self.indexer_kl not in INDEXER_LOSSES:
            raise ValueError(f"Collect.indexer_kl must be one of {INDEXER_LOSSES}, got "
                             f"{self.indexer_kl!r}")
        for name in ("expert_load", "routing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Collect.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def anything(self) -> bool:
        return self.indexer_kl != "none" or self.expert_load or self.routing


@struct.dataclass
class RoutingReplay:
    """The experts every MoE layer uses instead of its router's top-k.

    ``expert_ids`` ``[L_moe, B, T, k]`` int32, MoE layers in layer order. A token whose row
    holds a -1 keeps its router's choice (a prompt token the rollout did not record). The
    gate weights still come from the current router, so gradients reach it.
    """
    expert_ids: jax.Array


@struct.dataclass
class ImageInputs:
    """Image features that replace the token embeddings at the image placeholders."""
    embeds: jax.Array  # [B, T, D]
    mask: jax.Array  # [B, T] bool: where ``embeds`` replace the token embedding


@struct.dataclass
class Stats:
    """The statistics of one forward; a field is None unless :class:`Collect` or a
    :class:`RoutingReplay` asked for it."""
    indexer_kl: jax.Array | None = None  # [L_dsa] f32: mean over valid queries, per DSA layer
    expert_load: jax.Array | None = None  # [L_moe, E] f32: assignments of valid tokens
    moe_dropped: jax.Array | None = None  # [L_moe] int32: over capacity (expert parallel only)
    expert_ids: jax.Array | None = None  # [L_moe, B, T, k] int32: the experts each token used
    replay_agreement: jax.Array | None = None  # [2] f32: (agreeing share summed, tokens)


@struct.dataclass
class Output:
    logits: jax.Array  # [B, T, V] float32
    cache: tuple | None = None  # per segment, per period position: stacked layer caches
    stats: Stats | None = None


def layers_of(config, *, mixer: str | None = None, ffn: str | None = None) -> tuple[int, ...]:
    """The indices of the layers with this mixer and/or FFN kind, in order: the rows of the
    statistics stacked over such layers (``layers_of(cfg, ffn="moe")``: ``expert_load``)."""
    return tuple(i for i, (m, f) in enumerate(zip(config.mixer_kinds, config.ffn_kinds))
                 if (mixer is None or m == mixer) and (ffn is None or f == ffn))
