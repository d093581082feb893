"""RL policy losses: GRPO, DAPO, GSPO, the Kimi K1.5/K2 objective; KL to a reference; TIS.

Sources: ``docs/reference/rl_and_serving.md`` sections 1.2 (tunix formulas) and 2.1 (Kimi).
Shapes: ``B`` sequences (a group of ``K`` samples per prompt laid out consecutively), ``T``
completion tokens. Inputs are per-token log-probabilities of the sampled tokens.

* ratio ``r_t = exp(clip(logp_t - old_logp_t, -20, 20))`` (float32).
* GRPO / DAPO per token: ``max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high))``; dual clip
  (``dual_clip = c``) caps the loss at ``c * |A|`` for ``A < 0``. DAPO = clip-higher
  (``eps_high = 0.28``) with token-level aggregation and no KL.
* GSPO: the same clipped form with the sequence ratio ``s = exp(mean_t(logp_t - old_t))`` carried
  per token as ``sg(log s) + logp_t - sg(logp_t)`` (sequence value, per-token gradient; the
  "GSPO-token" form of tunix), clamped at ``+-10`` in log space.
* Kimi K1.5 (section 2.3) / K2: ``(r - mean_group(r) - tau * log(pi/pi_old)(y))^2`` per sequence,
  ``log(pi/pi_old)(y) = sum_t (logp_t - old_t)``; no clipping; anchored to the rollout policy.
* KL to a reference per token (``kl_kind``): ``k1 = logp - ref``, ``k2 = (logp - ref)^2 / 2``,
  ``k3 = exp(ref - logp) - (ref - logp) - 1``; added as ``beta * kl`` to the per-token loss.
* Truncated importance sampling for the rollout/training mismatch: per-token weights
  ``min(exp(old_t - sampler_t), cap)`` or one sequence weight ``min(exp(sum_t(old - sampler)),
  cap)``, detached, multiplying the per-token loss (Kimi: the sequence term, by the mean weight
  of its tokens).

Aggregation returns ``(numerator, denominator)``; the caller divides last, after summing both
over micro-batches and devices, so a global mean is exact under gradient accumulation:
``"token"`` = sum over valid tokens / number of valid tokens (DAPO); ``"sequence"`` = sum over
sequences of the per-sequence token mean / number of sequences with a valid token (GRPO).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

AGGREGATIONS = ("token", "sequence")
KL_KINDS = ("k1", "k2", "k3")
LOSSES = ("grpo", "dapo", "gspo", "kimi")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLLossConfig:
    loss: str = "grpo"
    eps_low: float = 0.2
    eps_high: float = 0.2  # DAPO clip-higher: 0.28
    dual_clip: float | None = None  # c > 1
    aggregation: str = "sequence"
    kl_beta: float = 0.0
    kl_kind: str = "k3"
    tau: float = 0.1  # Kimi objective temperature
    tis: str = "none"  # "none" | "token" | "sequence"
    tis_cap: float = 2.0
    entropy_coef: float = 0.0  # RL steps: loss -= coef * mean token entropy (train/rl/step.py)
    temperature: float = 1.0  # the rollouts': the policy trained is softmax(logits / T)
    # ids the sampler can emit: the tokenizer's, when the model's vocabulary is padded past it
    # (the engine samples over those only, so the trained policy leaves the rest out too)
    sampled_vocab: int | None = None

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"rl loss must be one of {LOSSES}, got {self.loss!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.kl_kind not in KL_KINDS:
            raise ValueError(f"kl_kind must be one of {KL_KINDS}, got {self.kl_kind!r}")
        if self.tis not in ("none", "token", "sequence"):
            raise ValueError(f"tis must be 'none', 'token' or 'sequence', got {self.tis!r}")
        if self.eps_low < 0 or self.eps_high < 0 or self.tau <= 0 or self.tis_cap <= 0:
            raise ValueError("eps_low, eps_high must be >= 0 and tau, tis_cap > 0")
        if not isinstance(self.entropy_coef, (int, float)) or self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if self.sampled_vocab is not None and (isinstance(self.sampled_vocab, bool) or not
                                               isinstance(self.sampled_vocab, int)
                                               or self.sampled_vocab < 1):
            raise ValueError(f"sampled_vocab must be a positive integer, got "
                             f"{self.sampled_vocab!r}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")


def group_advantages(rewards: jax.Array, group_size: int, *, normalize_std: bool = True,
                     eps: float = 1e-6) -> jax.Array:
    """``[B]`` rewards (groups of ``group_size`` consecutive samples) -> advantages ``[B]``.

    GRPO: ``(r - mean_g) / (std_g + eps)``; ``normalize_std=False``: ``r - mean_g`` (Dr.GRPO,
    and the Kimi baseline). ``std`` is the population std of the group.
    """
    if rewards.ndim != 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards must be [B] with B divisible by group_size={group_size}, got "
                         f"{rewards.shape}")
    r = rewards.astype(jnp.float32).reshape(-1, group_size)  # [G, K]
    a = r - jnp.mean(r, axis=1, keepdims=True)
    if normalize_std:
        a = a / (jnp.std(r, axis=1, keepdims=True) + eps)
    return a.reshape(-1)


def aggregate(per_token: jax.Array, mask: jax.Array, mode: str) -> tuple[jax.Array, jax.Array]:
    """``(numerator, denominator)`` of the loss; divide last (see module docstring)."""
    m = mask.astype(jnp.float32)
    if mode == "token":
        return jnp.sum(per_token * m), jnp.sum(m)
    if mode == "sequence":
        n = jnp.sum(m, axis=-1)  # [B]
        seq_mean = jnp.sum(per_token * m, axis=-1) / jnp.maximum(n, 1.0)
        return jnp.sum(seq_mean), jnp.sum((n > 0).astype(jnp.float32))
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")


def finalize(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    return numerator / jnp.maximum(denominator, 1.0)


def kl_per_token(logp: jax.Array, ref_logp: jax.Array, kind: str = "k3",
                 mask: jax.Array | None = None) -> jax.Array:
    """Per-token estimate of KL(policy || reference) from ``d = logp - ref_logp``; 0 outside
    ``mask``. k3 (``exp(-d) + d - 1``, Schulman's low-variance estimator) takes ``d`` at least
    -20: a position the loss never counts (a prompt token, padding) with the policy 89 nats
    below the reference made ``exp`` overflow, and ``inf x 0`` spoiled the step with NaN; a
    counted one gets a finite value (at most e^20) and no gradient below -20. Above the
    reference k3 is about ``d - 1``: finite, and its gradient is kept."""
    d = logp.astype(jnp.float32) - ref_logp.astype(jnp.float32)
    if mask is not None:
        d = jnp.where(mask > 0, d, 0.0)  # before exp: a masked inf would be NaN in the gradient
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        d = jnp.maximum(d, -20.0)
        return jnp.exp(-d) + d - 1.0
    raise ValueError(f"kl_kind must be one of {KL_KINDS}, got {kind!r}")


def tis_weights(old_logp: jax.Array, sampler_logp: jax.Array, mask: jax.Array, *,
                level: str = "token", cap: float = 2.0) -> jax.Array:
    """Detached truncated importance weights ``[B, T]`` (trainer's old policy / sampler)."""
    d = (old_logp.astype(jnp.float32) - sampler_logp.astype(jnp.float32)) * mask
    if level == "token":
        w = jnp.minimum(jnp.exp(jnp.clip(d, -20.0, 20.0)), cap)
    elif level == "sequence":
        seq = jnp.clip(jnp.sum(d, axis=-1, keepdims=True), -20.0, 20.0)
        w = jnp.broadcast_to(jnp.minimum(jnp.exp(seq), cap), d.shape)
    else:
        raise ValueError(f"TIS level must be 'token' or 'sequence', got {level!r}")
    return jax.lax.stop_gradient(w)


def clipped_surrogate(log_ratio: jax.Array, adv: jax.Array, eps_low: float, eps_high: float,
                      dual_clip: float | None = None) -> jax.Array:
    """Per-token PPO-style loss from ``log_ratio [B, T]`` and advantages ``[B]``."""
    r = jnp.exp(jnp.clip(log_ratio, -20.0, 20.0))
    a = adv.astype(jnp.float32)[:, None]
    loss = jnp.maximum(-a * r, -a * jnp.clip(r, 1.0 - eps_low, 1.0 + eps_high))
    if dual_clip is not None:
        loss = jnp.where(a < 0, jnp.minimum(loss, -dual_clip * a), loss)
    return loss


def gspo_log_ratio(logp: jax.Array, old_logp: jax.Array, mask: jax.Array) -> jax.Array:
    """``[B, T]``: value ``log s`` (sequence mean log-ratio), gradient of ``logp_t`` per token."""
    m = mask.astype(jnp.float32)
    d = (logp - old_logp) * m
    seq = jnp.sum(d, axis=-1, keepdims=True) / jnp.maximum(jnp.sum(m, -1, keepdims=True), 1.0)
    seq = jnp.clip(jax.lax.stop_gradient(seq), -10.0, 10.0)
    return seq + logp - jax.lax.stop_gradient(logp)


def kimi_per_sequence(logp: jax.Array, old_logp: jax.Array, mask: jax.Array, adv: jax.Array,
                      tau: float) -> jax.Array:
    """``[B]``: ``(A - tau * sum_t(logp_t - old_t))^2`` with ``A = r - mean_group(r)``."""
    log_ratio = jnp.sum((logp - old_logp) * mask.astype(jnp.float32), axis=-1)
    return jnp.square(adv.astype(jnp.float32) - tau * log_ratio)


def policy_loss(cfg: RLLossConfig, logp: jax.Array, old_logp: jax.Array, mask: jax.Array,
                advantages: jax.Array, *, ref_logp: jax.Array | None = None,
                sampler_logp: jax.Array | None = None) -> tuple[jax.Array, jax.Array, dict]:
    """``(numerator, denominator, metrics)`` for one micro-batch; loss = num / den (summed first).

    logp [B, T] (current policy, differentiable), old_logp [B, T] (the policy that produced the
    rollout, as the trainer computes it), mask [B, T], advantages [B] (for ``kimi``: ``r -
    mean_group(r)``, see :func:`group_advantages`). ``sampler_logp`` [B, T]: the rollout engine's
    log-probs, for TIS. ``ref_logp`` [B, T]: reference policy, for the KL term.
    """
    if logp.ndim != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(f"logp {logp.shape}, old_logp {old_logp.shape} and mask {mask.shape} "
                         "must all be [B, T]")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B={logp.shape[0]}], got {advantages.shape}")
    logp, old_logp = logp.astype(jnp.float32), old_logp.astype(jnp.float32)
    m = mask.astype(jnp.float32)
    metrics = {}
    w = None
    if cfg.tis != "none":
        if sampler_logp is None:
            raise ValueError(f"tis={cfg.tis!r} needs sampler_logp")
        w = tis_weights(old_logp, sampler_logp, m, level=cfg.tis, cap=cfg.tis_cap)  # [B, T]
        metrics["tis_weight_mean"] = jnp.sum(w * m) / jnp.maximum(jnp.sum(m), 1.0)
    kl = None
    if cfg.kl_beta > 0:
        if ref_logp is None:
            raise ValueError("kl_beta > 0 needs ref_logp")
        kl = kl_per_token(logp, ref_logp, cfg.kl_kind, m)
        metrics["kl_numerator"] = jnp.sum(kl * m)
    if cfg.loss == "kimi":  # one term per sequence; TIS by the mean weight of its tokens
        per_seq = kimi_per_sequence(logp, old_logp, m, advantages, cfg.tau)  # [B]
        n = jnp.sum(m, axis=-1)
        if w is not None:
            per_seq = per_seq * jnp.sum(w * m, axis=-1) / jnp.maximum(n, 1.0)
        if kl is not None:
            per_seq = per_seq + cfg.kl_beta * jnp.sum(kl * m, axis=-1) / jnp.maximum(n, 1.0)
        valid = (n > 0).astype(jnp.float32)
        return jnp.sum(per_seq * valid), jnp.sum(valid), metrics
    log_ratio = gspo_log_ratio(logp, old_logp, m) if cfg.loss == "gspo" else logp - old_logp
    per_token = clipped_surrogate(log_ratio, advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
    if w is not None:
        per_token = per_token * w
    if kl is not None:
        per_token = per_token + cfg.kl_beta * kl
    num, den = aggregate(per_token, m, cfg.aggregation)
    return num, den, metrics


def dapo_config(**kw) -> RLLossConfig:
    """DAPO defaults: clip-higher ``eps_high=0.28``, token-level aggregation, no KL."""
    return RLLossConfig(**{"loss": "dapo", "eps_low": 0.2, "eps_high": 0.28,
                           "aggregation": "token", **kw})
