"""RL-job configuration: one frozen, validated dataclass, overridable by ``--rl-set key=value``.

The optimizer, schedule, accumulation and checkpoint cadence stay in ``TrainConfig``
(``--train-set``); ``RLConfig`` holds what is RL-specific: the environment mix, rollout shape,
thinking budgets, rewards, the policy loss, the SFT warm-up and the held-out evaluation.

Thinking budgets (``rl_and_serving.md`` 2.2-2.4): every prompt draws an effort level from
``effort_weights``; the level is in the prompt (the chat format's ``thinking_effort`` turn), caps
the reasoning span (``reasoning_caps``: the engine forces the end of thinking, ``budget.py``) and
the whole episode's generated tokens (``token_budgets``: over budget the rollout is truncated,
judged as it stands, and ``truncation_penalty`` is subtracted), and weighs the group length
penalty (``length_penalty``, Kimi K1.5: ``lambda = 0.5 - (len - min_len) / (max_len -
min_len)`` over the group, added as ``w * lambda`` to correct and ``w * min(0, lambda)`` to
incorrect answers).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from kdsa.infer.budget import EFFORTS
from kdsa.train.rl.losses import AGGREGATIONS, LOSSES


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvSpec:
    name: str  # registered name or rg:FAMILY
    weight: float = 1.0
    options: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def parse(cls, raw, where: str) -> "EnvSpec":
        if isinstance(raw, EnvSpec):
            return raw
        if isinstance(raw, str):
            return cls(name=raw)
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise ValueError(f"{where} must be a name or {{'name': ..., 'weight': ..., "
                             f"'options': {{...}}}}, got {raw!r}")
        extra = set(raw) - {"name", "weight", "options"}
        if extra:
            raise ValueError(f"{where}: unknown keys {sorted(extra)}")
        w = raw.get("weight", 1.0)
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0 < w < math.inf:
            raise ValueError(f"{where}.weight must be a finite number > 0, got {w!r}")
        opts = raw.get("options", {})
        if not isinstance(opts, dict):
            raise ValueError(f"{where}.options must be an object")
        for key in ("seed", "family"):  # given by the run's seed and by the name rg:FAMILY
            if key in opts:
                raise ValueError(f"{where}.options: no {key!r} here (the environments' seed "
                                 f"is the run's; rg:FAMILY names the family)")
        return cls(name=raw["name"], weight=float(w), options=dict(opts))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
    envs: tuple = ("rg:basic_arithmetic",)  # EnvSpec (or name / dict) per domain
    # ---- rollouts ----
    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 8  # samples per prompt
    temperature: float = 1.0
    seq_len: int = 96  # prompt + all turns, tokens per training row
    num_slots: int = 64  # engine slots (rows decoded together)
    generate_devices: int = 1  # local devices of the generate mesh (weights resharded there)
    chat_format: str = "k2"
    # ---- thinking budgets and rewards ----
    effort_weights: dict = dataclasses.field(
        default_factory=lambda: {"low": 1.0, "high": 1.0, "max": 1.0})
    reasoning_caps: dict = dataclasses.field(
        default_factory=lambda: {"low": 2, "high": 8, "max": 16})
    token_budgets: dict = dataclasses.field(
        default_factory=lambda: {"low": 12, "high": 24, "max": 40})
    length_penalty: dict = dataclasses.field(
        default_factory=lambda: {"low": 0.2, "high": 0.05, "max": 0.0})
    truncation_penalty: float = 0.5
    dynamic_sampling: bool = True
    max_sampling_rounds: int = 2  # rollout rounds per step to fill the batch with varied groups
    # ---- partial rollouts (Kimi K1.5): 0 = off ----
    partial_rollout_tokens: int = 0  # tokens an episode may generate per step; unfinished: kept
    max_staleness: int = 1  # steps a cut episode may be continued for, then its group is dropped
    # ---- policy loss (train/rl/losses.py) ----
    loss: str = "grpo"
    aggregation: str = "sequence"
    eps_low: float = 0.2
    eps_high: float = 0.28
    tau: float = 0.1
    tis: str = "token"
    tis_cap: float = 2.0
    normalize_std: bool = True  # GRPO advantages; False: r - mean (Dr.GRPO's advantage;
    # its loss also needs aggregation="token"); kimi: never
    kl_coef: float = 0.0  # KL to the reference policy (the weights after SFT); 0: off
    kl_estimator: str = "k3"  # k1 | k2 | k3 (rl_losses.kl_per_token)
    entropy_coef: float = 0.0  # entropy bonus: loss -= coef * mean entropy of the loss tokens
    scale_update_by_kept: bool = False  # update * kept groups / prompts_per_step (see step.py)
    minibatches_per_step: int = 1  # optimizer updates per rollout batch (PPO/GRPO mini-batches)
    # ---- MoE routing replay: train each token with the experts the rollout engine used ----
    routing_replay: bool = False
    # ---- SFT warm-up (demonstrations of the same environments) ----
    sft_steps: int = 0  # rows per SFT step = rollouts_per_step, in the RL micro-batches' size
    # ---- held-out evaluation ----
    heldout_tasks: int = 32  # per environment
    heldout_samples: int = 4  # per task, at the rollout temperature

    def __post_init__(self):
        _check_types(self)
        envs = self.envs if isinstance(self.envs, (list, tuple)) else (self.envs,)
        if not envs:
            raise ValueError("rl.envs must name at least one environment")
        object.__setattr__(self, "envs", tuple(EnvSpec.parse(e, f"rl.envs[{i}]")
                                               for i, e in enumerate(envs)))
        for name in ("steps", "prompts_per_step", "group_size", "seq_len", "num_slots",
                     "generate_devices", "max_sampling_rounds", "max_staleness",
                     "minibatches_per_step",
                     "heldout_tasks", "heldout_samples"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"rl.{name} must be a positive integer, got {v!r}")
        for name in ("sft_steps", "partial_rollout_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"rl.{name} must be a non-negative integer, got {v!r}")
        if not isinstance(self.sft_steps, int) or self.sft_steps < 0:
            raise ValueError(f"rl.sft_steps must be a non-negative integer, got "
                             f"{self.sft_steps!r}")
        if self.group_size < 2:
            raise ValueError(f"rl.group_size must be >= 2 (advantages are group-relative), "
                             f"got {self.group_size}")
        if not 0 < self.temperature <= 10:
            raise ValueError(f"rl.temperature must be in (0, 10], got {self.temperature}")
        for name in ("effort_weights", "reasoning_caps", "token_budgets", "length_penalty"):
            d = getattr(self, name)
            if not isinstance(d, dict) or set(d) != set(EFFORTS):
                raise ValueError(f"rl.{name} must map exactly {EFFORTS}, got {d!r}")
        if any(not isinstance(w, (int, float)) or w < 0 for w in self.effort_weights.values()) \
                or sum(self.effort_weights.values()) <= 0:
            raise ValueError(f"rl.effort_weights must be >= 0 with a positive sum, got "
                             f"{self.effort_weights}")
        for k, v in self.length_penalty.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ValueError(f"rl.length_penalty[{k!r}] must be a number, got {v!r}")
        for name in ("reasoning_caps", "token_budgets"):
            for k, v in getattr(self, name).items():
                if not isinstance(v, int) or v < (0 if name == "reasoning_caps" else 1):
                    raise ValueError(f"rl.{name}[{k!r}] must be an integer "
                                     f"{'>= 0' if name == 'reasoning_caps' else '>= 1'}, "
                                     f"got {v!r}")
        if self.truncation_penalty < 0:
            raise ValueError(f"rl.truncation_penalty must be >= 0, got "
                             f"{self.truncation_penalty}")
        if self.loss not in LOSSES:
            raise ValueError(f"rl.loss must be one of {LOSSES}, got {self.loss!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"rl.aggregation must be one of {AGGREGATIONS}, got "
                             f"{self.aggregation!r}")
        if not isinstance(self.kl_coef, (int, float)) or self.kl_coef < 0:
            raise ValueError(f"rl.kl_coef must be >= 0, got {self.kl_coef!r}")
        if not isinstance(self.scale_update_by_kept, bool):
            raise ValueError(f"rl.scale_update_by_kept must be true or false, got "
                             f"{self.scale_update_by_kept!r}")
        if not isinstance(self.routing_replay, bool):
            raise ValueError(f"rl.routing_replay must be true or false, got "
                             f"{self.routing_replay!r}")
        if self.chat_format not in ("k2", "xtml"):
            raise ValueError(f"rl.chat_format must be 'k2' or 'xtml', got {self.chat_format!r}")
        self.loss_config()  # validates the loss fields

    @property
    def optimizer_steps(self) -> int:
        """The job's optimizer steps, the learning-rate schedule's length (``train.steps``):
        one per SFT step and ``minibatches_per_step`` per RL step (fewer when a step keeps no
        varied group, or a mini-batch gets none of them: those take no step)."""
        return self.sft_steps + self.minibatches_per_step * self.steps

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    def rows_per_micro_batch(self, accum_steps: int) -> int:
        """Rows of one micro-batch: the rollout batch split into ``minibatches_per_step``
        updates of ``accum_steps`` micro-batches each (a ValueError unless it divides)."""
        n = self.minibatches_per_step * accum_steps
        if self.rollouts_per_step % n:
            raise ValueError(f"rl.prompts_per_step * rl.group_size = {self.rollouts_per_step} "
                             f"rows do not split into rl.minibatches_per_step="
                             f"{self.minibatches_per_step} x train.accum_steps={accum_steps} "
                             f"micro-batches")
        return self.rollouts_per_step // n

    def loss_config(self):
        from kdsa.train.rl.losses import RLLossConfig

        agg = "token" if self.loss == "dapo" else self.aggregation
        try:
            return RLLossConfig(loss=self.loss, eps_low=self.eps_low, eps_high=self.eps_high,
                                aggregation=agg, tau=self.tau, tis=self.tis,
                                tis_cap=self.tis_cap, kl_beta=float(self.kl_coef),
                                kl_kind=self.kl_estimator,
                                entropy_coef=self.entropy_coef, temperature=self.temperature)
        except ValueError as e:
            raise ValueError(f"rl: {e}") from None

    def replace(self, **changes) -> "RLConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return d


# a field's annotation -> the JSON values it accepts (``--rl-set`` parses JSON, else a string:
# ``normalize_std=False`` would be the string "False", which is truthy)
_TYPES = {"int": ((int,), "an integer"), "float": ((int, float), "a number"),
          "bool": ((bool,), "true or false"), "str": ((str,), "a string"),
          "dict": ((dict,), "an object")}


def _check_types(rc: RLConfig) -> None:
    for f in dataclasses.fields(rc):
        v = getattr(rc, f.name)
        # every number finite, and no true/false where a number goes (NaN passed every "< 0"
        # check; a NaN penalty or weight made rewards and losses NaN)
        for x in v.values() if isinstance(v, dict) else (v,):
            if isinstance(x, float) and not math.isfinite(x) or (
                    isinstance(v, dict) and isinstance(x, bool)):
                raise ValueError(f"rl.{f.name} must hold finite numbers, got {v!r}")
        want = _TYPES.get(f.type if isinstance(f.type, str) else f.type.__name__)
        if want is None:
            continue
        if not isinstance(v, want[0]) or (f.type != "bool" and isinstance(v, bool)):
            raise ValueError(f"rl.{f.name} must be {want[1]}, got {v!r}")


def apply_rl_overrides(rc: RLConfig, overrides: list[str]) -> RLConfig:
    """``key=value`` strings (value parsed as JSON, else a bare string) applied to ``rc``."""
    from kdsa.model.overrides import apply_overrides

    return apply_overrides(rc, overrides, flag="--rl-set", prefix="rl.", what="RL")
