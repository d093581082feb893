"""One jitted optimizer step for RL (policy loss) and SFT (cross-entropy) on the same shapes.

Both objectives read the per-token log-probabilities ``logp[b, t] = log pi(targets[b, t] |
inputs[b, :t+1])`` of one forward pass, so a single compiled function serves the SFT warm-up
and the RL steps (``sft_weight`` is an array, not a static argument)::

    loss = sft_weight * CE + (1 - sft_weight) * (PG - entropy_coef * H)
    CE   = sum(mask * -logp) / sum(mask)                       (assistant tokens only)
    PG   = rl_losses.policy_loss(cfg, logp, old_logp, mask, advantages, sampler_logp)
    H    = sum(mask * entropy) / sum(mask)     (entropy of each next-token distribution)

The entropy bonus (``cfg.entropy_coef``, default 0) keeps the policy from collapsing onto one
answer per prompt, where a group's rewards stop varying and GRPO has no gradient left; the mean
entropy is logged as ``entropy`` either way. ``update_scale`` multiplies the optimizer's update
(``rl.scale_update_by_kept``: the share of the step's groups that varied, so a batch with one
varied group moves the weights an eighth as far as a full one; Adam alone would normalise it to
a full-size step).

``old_logp = stop_gradient(logp)``: one update per rollout batch, so the trainer's policy before
the update is the current one (ratio 1, the clipped objectives reduce to the policy gradient;
tunix ``use_rollout_logps=False``). The rollout engine's log-probs ``sampler_logp`` enter through
truncated importance sampling (``cfg.tis``) and the mismatch metrics
``mismatch_k1 = mean(old - sampler)``, ``mismatch_k3 = mean(exp(s - o) - (s - o) - 1)``,
``mismatch_abs = mean|old - sampler|`` over the loss tokens (``rl_and_serving.md`` 3).

KL to a reference (``loss_cfg.kl_beta > 0``): ``ref_params`` (the frozen post-SFT weights, same
structure as ``state.params``, with the current routing biases) run a second, gradient-free
forward on the same rows; ``rl_losses.policy_loss`` adds ``kl_beta * kl_kind(logp, ref_logp)``
per token; ``kl`` is its mean over the loss tokens.

Accumulation is exact as in ``train/step.py``: the denominators (tokens or sequences) come from
the whole batch first, each micro-batch contributes the gradient of its numerators divided by
them, and the sums are the large-batch gradient. MoE expert loads and the routing-bias update
follow ``train/step.py`` (same helpers).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from kdsa.model.moe import max_load_ratio
from kdsa.model.vision.assemble import image_kwargs
from kdsa.train.config import TrainConfig
from kdsa.train.rl_losses import RLLossConfig, policy_loss
from kdsa.train.step import TrainState, _micro_batches, _schedule_of, update_routing_biases

# batch: inputs, targets [B, T] int32; mask, sampler_logp [B, T] float32; advantages [B] f32;
# image prompts: image_patches / image_pos / image_grid / image_segment (docs/vision.md);
# routing replay: expert_ids [B, T, L, k] int32 (-1: the router chooses)


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``[B, T, V]`` logits, ``[B, T]`` targets -> ``[B, T]`` float32 log-probs of the targets."""
    return token_logprobs_and_entropy(logits, targets)[0]


def token_logprobs_and_entropy(logits: jax.Array, targets: jax.Array
                               ) -> tuple[jax.Array, jax.Array]:
    """``[B, T, V]`` logits -> ``([B, T]`` log-probs of ``targets``, ``[B, T]`` entropy
    ``-sum_v p_v log p_v`` of each next-token distribution), float32."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ent = -jnp.sum(jnp.exp(lp) * lp, axis=-1)
    return jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0], ent


def pg_denominator(cfg: RLLossConfig, mask: jax.Array) -> jax.Array:
    """The policy loss's denominator over the whole batch (see ``rl_losses.aggregate``)."""
    m = mask.astype(jnp.float32)
    if cfg.loss != "kimi" and cfg.aggregation == "token":
        return jnp.sum(m)
    return jnp.sum((jnp.sum(m, axis=-1) > 0).astype(jnp.float32))


def _rl_step(graphdef, state: TrainState, batch, sft_weight, ref_params=None, update_scale=1.0,
             *,
             tc: TrainConfig, tx: optax.GradientTransformation, loss_cfg: RLLossConfig,
             layout: tuple):
    if loss_cfg.kl_beta > 0 and ref_params is None:
        raise ValueError("rl.kl_coef > 0 needs the reference policy's parameters (ref_params)")
    m = tc.accum_steps
    mbs = _micro_batches(batch, m)
    mask = batch["mask"].astype(jnp.float32)
    ce_den = jnp.maximum(jnp.sum(mask), 1.0)
    pg_den = jnp.maximum(pg_denominator(loss_cfg, mask), 1.0)
    w = jnp.asarray(sft_weight, jnp.float32)

    def objective(params, mb):
        model = nnx.merge(graphdef, params, state.rest)
        replay = {} if "expert_ids" not in mb else {  # routing replay: [B, T, L, k] -> [L, ...]
            "expert_ids": jnp.transpose(mb["expert_ids"], (2, 0, 1, 3))}
        out = model.forward(mb["inputs"], **image_kwargs(model, mb),  # image_*: image prompts
                            **replay)
        logp, ent = token_logprobs_and_entropy(out.logits, mb["targets"])  # [b, T] each
        mk = mb["mask"].astype(jnp.float32)
        ce_num = jnp.sum(-logp * mk)
        ent_num = jnp.sum(ent * mk)
        old = jax.lax.stop_gradient(logp)
        ref_logp = None
        if loss_cfg.kl_beta > 0:  # the frozen reference policy on the same tokens
            ref = nnx.merge(graphdef, ref_params, state.rest)
            ref_logp = jax.lax.stop_gradient(
                token_logprobs(ref.forward(mb["inputs"], **image_kwargs(ref, mb)).logits,
                               mb["targets"]))
        pg_num, _, pm = policy_loss(loss_cfg, logp, old, mk, mb["advantages"],
                                    sampler_logp=mb["sampler_logp"], ref_logp=ref_logp)
        d = (old - mb["sampler_logp"]) * mk
        stats = {"ce_num": ce_num, "pg_num": pg_num, "mis_k1": jnp.sum(d),
                 "mis_abs": jnp.sum(jnp.abs(d)),
                 "mis_k3": jnp.sum((jnp.exp(-d) + d - 1.0) * mk),
                 "tis_num": pm.get("tis_weight_mean", jnp.float32(1.0)) * jnp.sum(mk),
                 "kl_num": pm.get("kl_numerator", jnp.float32(0.0)),
                 "agree": out.replay_agreement,  # [2] sum, count (zeros without replay)
                 "ent_num": jax.lax.stop_gradient(ent_num)}
        loss = w * ce_num / ce_den + (1.0 - w) * (pg_num / pg_den
                                                  - loss_cfg.entropy_coef * ent_num / ce_den)
        return loss, (stats, out.expert_load)

    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def body(acc, mb):
        (_, aux), g = grad_fn(state.params, mb)
        return jax.tree.map(jnp.add, acc, g), aux

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, (stats, loads) = jax.lax.scan(body, zeros, mbs)
    stats = jax.tree.map(lambda a: jnp.sum(a, axis=0), stats)  # over micro-batches

    lr = _schedule_of(tc)(state.step)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    updates = jax.tree.map(lambda u: u * jnp.asarray(update_scale, u.dtype), updates)
    params = optax.apply_updates(state.params, updates)
    load = jnp.sum(loads, axis=0)  # [L, E]
    rest = state.rest
    if tc.bias_update_rate > 0:
        rest = update_routing_biases(rest, load, layout, tc.bias_update_rate)
    rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0])
    moe = jnp.sum(load, axis=-1) > 0
    metrics = {
        "ce": stats["ce_num"] / ce_den, "pg_loss": stats["pg_num"] / pg_den,
        "grad_norm": optax.tree.norm(grads), "learning_rate": lr, "loss_tokens": jnp.sum(mask),
        "mismatch_k1": stats["mis_k1"] / ce_den, "mismatch_abs": stats["mis_abs"] / ce_den,
        "mismatch_k3": stats["mis_k3"] / ce_den, "tis_weight_mean": stats["tis_num"] / ce_den,
        "kl": stats["kl_num"] / ce_den, "entropy": stats["ent_num"] / ce_den,
        "expert_load_max_over_mean": jnp.max(jnp.where(moe, jax.vmap(max_load_ratio)(load),
                                                       0.0)),
    }
    if "expert_ids" in batch:  # share of replayed experts the training router also picks
        metrics["routing_replay_agreement"] = stats["agree"][0] / jnp.maximum(stats["agree"][1],
                                                                            1.0)
    metrics["loss"] = w * metrics["ce"] + (1.0 - w) * metrics["pg_loss"]
    return TrainState(params=params, rest=rest, opt_state=opt_state, step=state.step + 1,
                      rng=rng), metrics


@functools.lru_cache(maxsize=4)
def rl_step_with_options(compiler_options: tuple = ()):
    """``rl_step`` compiled with XLA ``compiler_options`` (sorted ``(name, value)`` pairs)."""
    return jax.jit(_rl_step, static_argnames=("graphdef", "tc", "tx", "loss_cfg", "layout"),
                   compiler_options=dict(compiler_options) or None)


rl_step = rl_step_with_options()
rl_step.__doc__ = """``(state, metrics) = rl_step(graphdef, state, batch, sft_weight, ref_params,
tc=, tx=, loss_cfg=, layout=)``: compiled once per shapes and static configs; ``sft_weight`` 1.0
is an SFT step, 0.0 an RL step; ``ref_params`` (the reference policy, same structure as
``state.params``) is needed when ``loss_cfg.kl_beta > 0``."""
