"""Routing of a mixture-of-experts layer: the sigmoid router with a selection-only bias, its
group limit, routing replay, and the load statistics behind the aux-loss-free bias update.

(Kimi K3 / DeepSeek-V3 ``noaux_tc``; ``docs/reference/kimi_k3.md`` sections 1-3, the DeepSeek-V3
report section 2.1.2)::

    scores  = sigmoid(x @ gate.weight)                  [N, E]  float32, full hidden x
    chosen  = top_k(scores + e_score_correction_bias)   [N, k]  bias only chooses
    weights = scores[chosen] / sum(scores[chosen]) * routed_scaling_factor

The bias is not trained by the optimizer: it lives in a :class:`RoutingBias` variable and the
trainer applies :func:`update_routing_bias` with the per-call :func:`expert_load`. The experts
themselves are ``kdsa.model.moe``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kdsa.model.config import ModelConfig
from kdsa.model.layers import dtype_of, lecun_init, param


class RoutingBias(nnx.Variable):
    """Non-trainable selection bias (``e_score_correction_bias``); not an ``nnx.Param``."""


# ---------------------------------------------------------------------------------------------
# Router
# ---------------------------------------------------------------------------------------------

def route(x: jax.Array, router_weight: jax.Array, bias: jax.Array, config: ModelConfig,
          expert_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k routing with a selection-only bias (DeepSeek-V3 ``noaux_tc``).

    Args:
      x: ``[N, D]`` full hidden states. router_weight: ``[D, E]``. bias: ``[E]``.
    Returns:
      ``topk_idx [N, k]`` int32 (descending biased score), ``topk_weight [N, k]`` float32,
      ``scores [N, E]`` float32 (unbiased sigmoid or softmax of the logits).

    Group limit (``use_grouped_topk`` with ``num_expert_group`` G > 1): experts are split into G
    contiguous groups, a group scores the sum of its top-2 biased scores, experts outside the
    best ``topk_group`` groups are masked to -inf before the top-k (vLLM masks with -inf; the
    HF DeepSeek code masks with 0, which differs only when biased scores go negative).
    Ties go to the lower expert index (``lax.top_k``).

    ``expert_ids [N, k]`` (MoE routing replay in RL: the experts the rollout engine chose)
    replace the top-k choice; the weights are still gathered from the current ``scores`` at
    those ids (renormalised and scaled the same way), so gradients reach the router. A row
    with a negative id (no record for that token) keeps the router's own choice.
    """
    n, d = x.shape
    e = config.num_experts
    if router_weight.shape != (d, e):
        raise ValueError(f"router_weight must be [D={d}, E={e}], got {router_weight.shape}")
    if bias.shape != (e,):
        raise ValueError(f"routing bias must be [E={e}], got {bias.shape}")
    logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), router_weight.astype(jnp.float32))
    if config.moe_router_activation_func == "sigmoid":
        scores = jax.nn.sigmoid(logits)  # [N, E]
    else:
        scores = jax.nn.softmax(logits, axis=-1)  # [N, E]
    if expert_ids is not None and expert_ids.shape != (n, config.num_experts_per_token):
        raise ValueError(f"expert_ids must be [N={n}, k={config.num_experts_per_token}], got "
                         f"{expert_ids.shape}")
    topk_idx = router_topk(scores, bias, config)  # [N, k]
    if expert_ids is not None:
        expert_ids = expert_ids.astype(jnp.int32)
        topk_idx = jnp.where(replayed_rows(expert_ids)[:, None], expert_ids, topk_idx)
    topk_weight = jnp.take_along_axis(scores, topk_idx, axis=-1)  # [N, k]
    if config.moe_renormalize:
        topk_weight = topk_weight / (jnp.sum(topk_weight, axis=-1, keepdims=True) + 1e-20)
    topk_weight = topk_weight * config.routed_scaling_factor
    return topk_idx.astype(jnp.int32), topk_weight, scores


def replayed_rows(expert_ids: jax.Array) -> jax.Array:
    """``[N]`` bool: the rows of ``expert_ids [N, k]`` that replay, those whose every id is an
    expert (a -1 anywhere: no record, the router's own choice)."""
    return jnp.all(expert_ids >= 0, axis=-1)


def router_topk(scores: jax.Array, bias: jax.Array, config: ModelConfig) -> jax.Array:
    """The router's own choice ``[N, k]``: top-k of the biased ``scores [N, E]`` (no gradient),
    within the best groups when group-limited (see :func:`route`)."""
    choice = jax.lax.stop_gradient(scores + bias.astype(jnp.float32)[None, :])  # [N, E]
    if config.use_grouped_topk and config.num_expert_group > 1:
        choice = _limit_to_top_groups(choice, config.num_expert_group, config.topk_group)
    return jax.lax.top_k(choice, config.num_experts_per_token)[1]


def replay_agreement(replayed: jax.Array, own: jax.Array) -> jax.Array:
    """Per token, the share of the replayed experts ``[N, k]`` that the router's own top-k
    ``[N, k]`` also picks, in [0, 1] (1: replay changes nothing)."""
    hit = jnp.any(replayed[:, :, None] == own[:, None, :], axis=-1)  # [N, k]
    return jnp.mean(hit.astype(jnp.float32), axis=-1)


def _limit_to_top_groups(choice: jax.Array, num_groups: int, topk_group: int) -> jax.Array:
    """Mask (-inf) the experts outside each token's best ``topk_group`` groups."""
    n, e = choice.shape
    per_group = e // num_groups
    grouped = choice.reshape(n, num_groups, per_group)  # [N, G, E/G]
    group_score = jnp.sum(jax.lax.top_k(grouped, min(2, per_group))[0], axis=-1)  # [N, G]
    _, top_groups = jax.lax.top_k(group_score, topk_group)  # [N, topk_group]
    keep = jnp.sum(jax.nn.one_hot(top_groups, num_groups, dtype=jnp.int32), axis=1) > 0  # [N, G]
    keep = jnp.repeat(keep, per_group, axis=-1)  # [N, E]
    return jnp.where(keep, choice, -jnp.inf)


# ---------------------------------------------------------------------------------------------
# Load statistics and the aux-loss-free bias update
# ---------------------------------------------------------------------------------------------

def expert_load(topk_idx: jax.Array, num_experts: int,
                token_mask: jax.Array | None = None) -> jax.Array:
    """``[E]`` float32: assignments per expert, counting only tokens where ``token_mask``."""
    n, k = topk_idx.shape
    valid = jnp.ones((n, k), jnp.float32)
    if token_mask is not None:
        if token_mask.shape != (n,):
            raise ValueError(f"token_mask must be [N={n}], got {token_mask.shape}")
        valid = valid * token_mask.astype(jnp.float32)[:, None]
    return jax.ops.segment_sum(valid.reshape(-1), topk_idx.reshape(-1), num_segments=num_experts)


def max_load_ratio(load: jax.Array) -> jax.Array:
    """``max(load) / mean(load)`` (1 = perfectly balanced; 0 when nothing was routed)."""
    mean = jnp.mean(load)
    return jnp.where(mean > 0, jnp.max(load) / jnp.maximum(mean, 1e-30), 0.0)


def update_routing_bias(bias: jax.Array, expert_load: jax.Array, rate: float) -> jax.Array:
    """``bias + rate * sign(mean(load) - load)``: overloaded experts become less likely.

    DeepSeek-V3 aux-loss-free balancing (report section 2.1.2, ``gamma`` = bias update speed);
    MaxText ``calculate_load_balance_updates`` applies the same sign rule. Applied by the
    trainer between steps, never by the optimizer.
    """
    if bias.ndim != 1 or bias.shape != expert_load.shape:
        raise ValueError(f"bias {bias.shape} and expert_load {expert_load.shape} must both be [E]")
    if isinstance(rate, (int, float)) and rate < 0:
        raise ValueError(f"bias update rate must be >= 0, got {rate}")
    load = expert_load.astype(jnp.float32)
    return (bias.astype(jnp.float32) + rate * jnp.sign(jnp.mean(load) - load)).astype(bias.dtype)


# ---------------------------------------------------------------------------------------------
# Module
# ---------------------------------------------------------------------------------------------

class Router(nnx.Module):
    """``gate``: ``weight [D, E]`` and the non-trainable ``e_score_correction_bias [E]``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.weight = param(rngs, lecun_init(), (config.hidden_size, config.num_experts),
                            ("embed", None), dtype_of(config.param_dtype))
        self.e_score_correction_bias = RoutingBias(jnp.zeros((config.num_experts,), jnp.float32),
                                                   axes=(None,))

    def __call__(self, x: jax.Array, expert_ids: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        return route(x, self.weight[...], self.e_score_correction_bias[...], self.config,
                     expert_ids)
