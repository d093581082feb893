"""One jitted optimizer step for RL (policy loss) and SFT (cross-entropy) on the same shapes.

Both objectives read the per-token log-probabilities ``logp[b, t] = log pi(targets[b, t] |
inputs[b, :t+1])`` of one forward pass, so a single compiled function serves the SFT warm-up
and the RL steps (``sft_weight`` is an array, not a static argument)::

    loss = sft_weight * CE + (1 - sft_weight) * (PG - entropy_coef * H)
    CE   = sum(mask * -logp) / sum(mask)                       (assistant tokens only)
    PG   = rl_losses.policy_loss(cfg, logp_T, old_logp, mask, advantages, sampler_logp)
    H    = sum(mask * entropy_T) / sum(mask)   (entropy of each next-token distribution)

The policy the rollouts sample is the tempered one, ``pi_T = softmax(logits / T)`` with ``T =
cfg.temperature`` (``rl.temperature``), and the engine reports its log-probs
(``SamplingParams.tempered_logprobs``); so PG, its ratios, TIS, the KL to the reference, the
entropy and the mismatch metrics all read ``logp_T`` (as verl and slime divide the trainer's
logits by the rollout temperature). The SFT cross-entropy reads the model's own ``logp``.

The entropy bonus (``cfg.entropy_coef``, default 0) keeps the policy from collapsing onto one
answer per prompt, where a group's rewards stop varying and GRPO has no gradient left; the mean
entropy is logged as ``entropy`` either way. ``update_scale`` multiplies the optimizer's update
(``rl.scale_update_by_kept``: the share of the step's groups that varied, so a batch with one
varied group moves the weights an eighth as far as a full one; Adam alone would normalise it to
a full-size step).

``old_logp = stop_gradient(logp)`` with one update per rollout batch: the trainer's policy
before the update is the current one (ratio 1, the clipped objectives reduce to the policy
gradient; tunix ``use_rollout_logps=False``). With ``rl.minibatches_per_step > 1`` the loop
takes ``old_logp`` once for the whole rollout batch (:func:`policy_logprobs`) and passes it in
the batch, so the second and later mini-batch updates have ratios other than 1 and clipping
acts (PPO / GRPO). The rollout engine's log-probs ``sampler_logp`` enter through
truncated importance sampling (``cfg.tis``) and the mismatch metrics
``mismatch_k1 = mean(old - sampler)``, ``mismatch_k3 = mean(exp(s - o) - (s - o) - 1)``,
``mismatch_abs = mean|old - sampler|`` over the loss tokens (``rl_and_serving.md`` 3).

KL to a reference (``loss_cfg.kl_beta > 0``): ``ref_params`` (the frozen post-SFT weights, same
structure as ``state.params``, with the current routing biases) run a second, gradient-free
forward on the same rows; ``rl_losses.policy_loss`` adds ``kl_beta * kl_kind(logp, ref_logp)``
per token; ``kl`` is its mean over the loss tokens.

The step core is ``train/step.py``'s ``optimizer_step`` (the one the pretraining/SFT step
runs): micro-batches, exact accumulation (the denominators, tokens or sequences, come from the
whole batch first, each micro-batch contributes the gradient of its numerators divided by
them), the optimizer and routing-bias updates, and under ``use_sharding(mesh, "train")`` the
batch rows on the batch axes and the state in the train layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from kdsa.model.outputs import Collect, RoutingReplay
from kdsa.model.vision.assemble import batch_image_inputs
from kdsa.train.config import TrainConfig
from kdsa.train.rl.losses import RLLossConfig, kl_per_token, policy_loss
from kdsa.train.step import (TrainState, _micro_batches, load_balance_metric, optimizer_step,
                             replicated)

# batch: inputs, targets [B, T] int32; loss_mask, sampler_logp [B, T] float32; advantages [B]
# float32; optional segment_ids [B, T] int32 (1: a token, 0: right padding, not counted in the
# expert load that steers the routing biases); optional old_logp [B, T] float32 (mini-batches,
# ``policy_logprobs``);
# image prompts: image_patches / image_pos / image_grid / image_segment (docs/vision.md);
# routing replay: expert_ids [B, T, L_moe, k] int32 (-1: the router chooses)


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


def _target_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``[B, T]`` log-probs of the targets as ``logit - logsumexp``: no ``[B, T, V]``
    log-softmax kept for the backward pass beside the tempered one."""
    x = logits.astype(jnp.float32)
    return jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(x, -1)


def tempered(logits: jax.Array, temperature: float, vocab: int | None = None) -> jax.Array:
    """``logits / T`` (float32), the logits of the policy the rollouts sample at ``T``; ids from
    ``vocab`` on (a model vocabulary padded past its tokenizer's, which the engine never
    samples) get -1e30, so the trained distribution is the sampled one."""
    x = logits if temperature == 1.0 else logits.astype(jnp.float32) / temperature
    if vocab is not None and vocab < x.shape[-1]:
        x = jnp.where(jnp.arange(x.shape[-1]) < vocab, x.astype(jnp.float32), -1e30)
    return x


def _policy_forward(model, mb):
    """The policy's forward on one micro-batch: routing replay and image prompts applied."""
    replay = None if "expert_ids" not in mb else RoutingReplay(  # [B, T, L_moe, k] -> [L_moe, ..]
        expert_ids=jnp.transpose(mb["expert_ids"], (2, 0, 1, 3)))
    return model.forward(mb["inputs"], segment_ids=mb.get("segment_ids"),
                         images=batch_image_inputs(model, mb),
                         collect=Collect(expert_load=True), replay=replay)


def _rl_step(graphdef, state: TrainState, batch, sft_weight, ref_params, update_scale, *,
             tc: TrainConfig, tx: optax.GradientTransformation, loss_cfg: RLLossConfig,
             layout: tuple):
    if loss_cfg.kl_beta > 0 and ref_params is None:
        raise ValueError("rl.kl_coef > 0 needs the reference policy's parameters (ref_params)")
    mask = batch["loss_mask"].astype(jnp.float32)
    ce_den = jnp.maximum(jnp.sum(mask), 1.0)
    pg_den = jnp.maximum(pg_denominator(loss_cfg, mask), 1.0)
    w = jnp.asarray(sft_weight, jnp.float32)

    def objective(model, mb):
        out = _policy_forward(model, mb)
        # [b, T] each: the sampled (tempered) policy's log-probs and entropy
        logp, ent = token_logprobs_and_entropy(
            tempered(out.logits, loss_cfg.temperature, loss_cfg.sampled_vocab), mb["targets"])
        ce_logp = logp if loss_cfg.temperature == 1.0 else _target_logprobs(
            tempered(out.logits, 1.0, loss_cfg.sampled_vocab), mb["targets"])
        mk = mb["loss_mask"].astype(jnp.float32)
        ce_num = jnp.sum(-ce_logp * mk)
        ent_num = jnp.sum(ent * mk)
        # the policy before this update: given (mini-batches: computed once per rollout
        # batch, ``policy_logprobs``) or the current one (one update per batch: ratio 1)
        old = mb["old_logp"] if "old_logp" in mb else jax.lax.stop_gradient(logp)
        ref_logp = None
        if loss_cfg.kl_beta > 0:  # the frozen reference policy on the same tokens
            def reference():
                ref = nnx.merge(graphdef, ref_params, state.rest)
                return token_logprobs(tempered(_policy_forward(ref, mb).logits,
                                               loss_cfg.temperature, loss_cfg.sampled_vocab),
                                      mb["targets"])

            # an SFT step (w = 1) skips the reference's forward: the KL term it feeds has
            # weight 0 there (and the loop passes the policy itself as the reference: KL 0)
            ref_logp = jax.lax.stop_gradient(jax.lax.cond(
                w < 1.0, reference, lambda: jax.lax.stop_gradient(logp)))
        pg_num, _, pm = policy_loss(loss_cfg, logp, old, mk, mb["advantages"],
                                    sampler_logp=mb["sampler_logp"], ref_logp=ref_logp)
        d = (old - mb["sampler_logp"]) * mk
        stats = {"ce_num": ce_num, "pg_num": pg_num, "mis_k1": jnp.sum(d),
                 "mis_abs": jnp.sum(jnp.abs(d)),
                 "mis_k3": jnp.sum(kl_per_token(old, mb["sampler_logp"], "k3", mk)),
                 "tis_num": pm.get("tis_weight_mean", jnp.float32(1.0)) * jnp.sum(mk),
                 "kl_num": pm.get("kl_numerator", jnp.float32(0.0)),
                 **({} if out.stats.replay_agreement is None else  # [2] sum, count
                    {"agree": out.stats.replay_agreement}),
                 # expert parallel: assignments past the dispatch capacity (moe_capacity_factor)
                 **({} if out.stats.moe_dropped is None else
                    {"moe_dropped": jnp.sum(out.stats.moe_dropped).astype(jnp.float32)}),
                 "ent_num": jax.lax.stop_gradient(ent_num)}
        loss = w * ce_num / ce_den + (1.0 - w) * (pg_num / pg_den
                                                  - loss_cfg.entropy_coef * ent_num / ce_den)
        return loss, (stats, out.stats.expert_load)

    new_state, grads, stats, load, lr = optimizer_step(
        graphdef, state, batch, objective, tc=tc, tx=tx, layout=layout,
        update_scale=update_scale)
    metrics = {
        "ce": stats["ce_num"] / ce_den, "pg_loss": stats["pg_num"] / pg_den,
        "grad_norm": optax.tree.norm(grads), "learning_rate": lr, "loss_tokens": jnp.sum(mask),
        "mismatch_k1": stats["mis_k1"] / ce_den, "mismatch_abs": stats["mis_abs"] / ce_den,
        "mismatch_k3": stats["mis_k3"] / ce_den, "tis_weight_mean": stats["tis_num"] / ce_den,
        "kl": stats["kl_num"] / ce_den, "entropy": stats["ent_num"] / ce_den,
        "expert_load_max_over_mean": load_balance_metric(load),
    }
    if "expert_ids" in batch:  # share of replayed experts the training router also picks
        metrics["routing_replay_agreement"] = stats["agree"][0] / jnp.maximum(stats["agree"][1],
                                                                            1.0)
    if "moe_dropped" in stats:
        metrics["moe_dropped"] = stats["moe_dropped"]
    metrics["loss"] = w * metrics["ce"] + (1.0 - w) * (  # the objective optimised
        metrics["pg_loss"] - loss_cfg.entropy_coef * metrics["entropy"])
    return new_state, replicated(metrics)


def _policy_logprobs(graphdef, state: TrainState, batch, *, tc: TrainConfig,
                     temperature: float, vocab: int | None = None):
    """``[B, T]`` log-probs of the batch's targets under the state's policy at ``temperature``,
    micro-batch by micro-batch (no gradient): the ``old_logp`` of mini-batch updates, taken once
    before the first one so the later ones see a ratio other than 1."""
    mbs = _micro_batches({k: v for k, v in batch.items() if k != "old_logp"}, tc.accum_steps)
    model = nnx.merge(graphdef, state.params, state.rest)

    def one(_, mb):
        return None, token_logprobs(tempered(_policy_forward(model, mb).logits, temperature,
                                             vocab), mb["targets"])

    _, logp = jax.lax.scan(one, None, mbs)  # [M, B/M, T]
    return logp.reshape(batch["targets"].shape)


policy_logprobs = jax.jit(_policy_logprobs,
                          static_argnames=("graphdef", "tc", "temperature", "vocab"))


def split_rows(batch: dict, k: int, group: int = 1) -> list[dict]:
    """A host batch ``{name: [R, ...]}`` -> ``k`` mini-batches of ``R / k`` rows, dealt out in
    units of ``group`` rows: mini-batch ``j`` takes units ``j, j + k, j + 2k, ...``. The loop
    passes the group size: a rollout batch holds its kept groups first and padding rows after
    them, so consecutive slices would leave the last mini-batches all padding while dealing
    spreads the groups over all of them, each group whole (a unit of one row when the groups
    do not split into ``k`` equal parts)."""
    rows = len(next(iter(batch.values())))
    if rows % k:
        raise ValueError(f"{rows} rows do not split into {k} mini-batches")
    if rows % (group * k):
        group = 1
    units = rows // group
    order = [u * group + r for j in range(k) for u in range(j, units, k) for r in range(group)]
    n = rows // k
    return [{name: v[order[i * n:(i + 1) * n]] for name, v in batch.items()} for i in range(k)]


def minibatch_updates(graphdef, state: TrainState, minibatches: list[dict], ref_params,
                      update_scale, *, step_fn, tc: TrainConfig,
                      tx: optax.GradientTransformation, loss_cfg: RLLossConfig, layout: tuple,
                      active: list[bool] | None = None):
    """One RL update per mini-batch of one rollout batch, in order; ``(state, [metrics])``.

    With more than one mini-batch, every mini-batch's ``old_logp`` is taken from the policy
    before the first update (:func:`policy_logprobs`), so the later updates see ratios other
    than 1 and the clipped objectives act; one mini-batch is the plain step (ratio 1).
    ``active[i]`` False skips mini-batch ``i`` (no loss tokens: all padding): an optimizer step
    on a zero gradient would still move the weights by Adam's momentum and weight decay. The
    metrics list holds the active mini-batches' only."""
    active = [True] * len(minibatches) if active is None else list(active)
    if len(active) != len(minibatches):
        raise ValueError(f"{len(active)} active flags for {len(minibatches)} mini-batches")
    many = len(minibatches) > 1  # one compiled program whichever mini-batches are active
    minibatches = [mb for mb, on in zip(minibatches, active) if on]
    if many:
        minibatches = [dict(mb, old_logp=policy_logprobs(
            graphdef, state, mb, tc=tc, temperature=loss_cfg.temperature,
            vocab=loss_cfg.sampled_vocab)) for mb in minibatches]
    out = []
    for mb in minibatches:
        state, m = step_fn(graphdef, state, mb, 0.0, ref_params, update_scale, tc=tc, tx=tx,
                           loss_cfg=loss_cfg, layout=layout)
        out.append(m)
    return state, out


@functools.lru_cache(maxsize=4)
def rl_step_with_options(compiler_options: tuple = ()):
    """``rl_step`` compiled with XLA ``compiler_options`` (sorted ``(name, value)`` pairs)."""
    return jax.jit(_rl_step, static_argnames=("graphdef", "tc", "tx", "loss_cfg", "layout"),
                   compiler_options=dict(compiler_options) or None)


rl_step = rl_step_with_options()
rl_step.__doc__ = """``(state, metrics) = rl_step(graphdef, state, batch, sft_weight, ref_params,
update_scale, tc=, tx=, loss_cfg=, layout=)``: compiled once per shapes and static configs;
``sft_weight`` 1.0 is an SFT step, 0.0 an RL step; ``ref_params`` (the reference policy, same
structure as ``state.params``; None without a KL term) is needed when ``loss_cfg.kl_beta > 0``;
``update_scale`` multiplies the optimizer's update. Every argument is passed, positionally, by
every caller: a call with one argument fewer is another cache key, and the whole step compiles
again (SFT steps once did that)."""
