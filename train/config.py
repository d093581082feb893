"""Training-job configuration: one frozen, validated dataclass, overridable by ``key=value``.

``TrainConfig`` holds everything about a run that is not the model: optimizer, schedule, batch
shape, gradient accumulation, clipping, the MoE routing-bias rate, the DSA indexer stage,
checkpoint cadence and the seed. It is validated when built, so a bad value is reported before
anything compiles. ``kdsa train`` sets fields with ``--train-set key=value`` (value parsed as
JSON, else a bare string), see :func:`apply_train_overrides`.

Indexer stages (DeepSeek-V3.2-Exp paper section 2.1; ``docs/reference/dsa.md`` section 2):

| ``indexer_stage`` | model ``indexer_loss`` | trained parameters (optimizer ``wrt``) |
|---|---|---|
| ``none`` | ``"none"`` (no KL) | every ``nnx.Param`` |
| ``dense_warmup`` | ``"dense"`` (dense attention, KL over the full causal set) | the indexer only |
| ``sparse`` | ``"sparse"`` (top-k attention, KL over the selected set, indexer input detached) | every ``nnx.Param`` |
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from kdsa.model.overrides import apply_overrides

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "constant")
INDEXER_STAGES = ("none", "dense_warmup", "sparse")
_INDEXER_LOSS = {"none": "none", "dense_warmup": "dense", "sparse": "sparse"}
_FLOAT_FIELDS = ("learning_rate", "min_lr_ratio", "b1", "b2", "eps", "weight_decay",
                 "muon_beta", "muon_consistent_rms", "clip_norm", "bias_update_rate",
                 "indexer_loss_weight", "peak_flops")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A training run (not the model). Hashable: it is static data of the jitted step."""

    # ---- length, batch ----
    steps: int = 100  # optimizer steps of the run
    batch_size: int = 8  # sequences per optimizer step (all micro-batches together)
    seq_len: int = 128  # tokens per sequence fed to the model
    accum_steps: int = 1  # micro-batches per optimizer step (batch_size % accum_steps == 0)
    seed: int = 0
    # ---- optimizer and schedule ----
    optimizer: str = "adamw"  # "adamw" | "muon" (Muon on matrices, AdamW on the rest)
    learning_rate: float = 3e-4  # peak
    schedule: str = "cosine"  # linear warm-up then cosine decay to min_lr_ratio * peak
    warmup_steps: int | None = None  # None: fitted to the run, min(10, steps // 10)
    decay_steps: int | None = None  # cosine length incl. warm-up; None = steps
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    muon_beta: float = 0.95
    muon_ns_steps: int = 5
    muon_consistent_rms: float | None = 0.2  # Moonlight: match AdamW's update RMS
    clip_norm: float = 1.0  # global-norm clipping; 0 = off
    # ---- MoE, DSA ----
    bias_update_rate: float = 1e-3  # DeepSeek-V3 gamma for e_score_correction_bias
    # expert-parallel dispatch buffers on a mesh: rows per device = this x the mean (tokens past
    # it dropped and counted); None = dropless, sized for the worst case (docs/sharding.md)
    moe_capacity_factor: float | None = None
    indexer_stage: str = "none"
    indexer_loss_weight: float = 1.0
    # ---- checkpoints, logging ----
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    peak_flops: float = 0.0  # per-device peak FLOP/s for the MFU estimate; 0 = not reported

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "accum_steps", "muon_ns_steps",
                     "checkpoint_every", "keep_checkpoints"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"train.{name} must be a positive integer, got {v!r}")
        for name in ("seed", "warmup_steps"):
            v = getattr(self, name)
            if v is None and name == "warmup_steps":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"train.{name} must be a non-negative integer, got {v!r}")
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if v is None and name == "muon_consistent_rms":
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"train.{name} must be a finite number, got {v!r}")
        if self.batch_size % self.accum_steps:
            raise ValueError(f"train.batch_size={self.batch_size} is not divisible by "
                             f"train.accum_steps={self.accum_steps}")
        for name, allowed in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES),
                              ("indexer_stage", INDEXER_STAGES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"train.{name} must be one of {allowed}, "
                                 f"got {getattr(self, name)!r}")
        if not self.learning_rate > 0:
            raise ValueError(f"train.learning_rate must be > 0, got {self.learning_rate}")
        if self.decay_steps is not None and (not isinstance(self.decay_steps, int)
                                             or isinstance(self.decay_steps, bool)
                                             or self.decay_steps <= self.warmup):
            raise ValueError(f"train.decay_steps={self.decay_steps} must be an integer > "
                             f"warmup_steps={self.warmup}")
        if self.decay_steps is None and self.schedule == "cosine" and self.steps <= self.warmup:
            raise ValueError(f"train.steps={self.steps} must exceed warmup_steps="
                             f"{self.warmup} for the cosine schedule (or set decay_steps, or "
                             f"leave warmup_steps unset to fit it to the run)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("b1", "b2", "muon_beta"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"train.{name} must be in [0, 1), got {getattr(self, name)}")
        cf = self.moe_capacity_factor
        if cf is not None and (not isinstance(cf, (int, float)) or isinstance(cf, bool)
                               or not 0 < cf < math.inf):
            raise ValueError(f"train.moe_capacity_factor must be a number > 0 or null "
                             f"(dropless), got {cf!r}")
        for name in ("eps", "weight_decay", "clip_norm", "bias_update_rate",
                     "indexer_loss_weight", "peak_flops"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def warmup(self) -> int:
        """Warm-up steps in effect: ``warmup_steps``, or when unset ``min(10, steps // 10)``
        (so ``--steps 3`` trains without warm-up and 100+ steps warm up over 10)."""
        return self.warmup_steps if self.warmup_steps is not None else min(10, self.steps // 10)

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.accum_steps

    @property
    def indexer_loss(self) -> str:
        """The model's ``Collect(indexer_kl=...)`` for this stage (``model/outputs.py``)."""
        return _INDEXER_LOSS[self.indexer_stage]

    @property
    def total_decay_steps(self) -> int:
        return self.decay_steps if self.decay_steps is not None else self.steps

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def apply_train_overrides(tc: TrainConfig, overrides: list[str]) -> TrainConfig:
    """``["lr=..."]``-style ``key=value`` strings applied to ``tc`` (``--train-set``)."""
    return apply_overrides(tc, overrides, flag="--train-set", prefix="train.", what="train")
