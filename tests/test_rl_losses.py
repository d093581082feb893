"""RL losses against hand-computed NumPy values from the formulas (not the code under test)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdsa.train.rl.losses import (RLLossConfig, dapo_config, finalize, group_advantages,
                                  kl_per_token, policy_loss, tis_weights)

# B = 4 sequences (2 groups of 2), T = 3 tokens; the last token of sequence 1 is padding.
LOGP = np.array([[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7], [-0.9, -0.1, -1.5], [-2.2, -0.4, -0.6]],
                np.float32)
OLD = np.array([[-1.2, -0.5, -1.0], [-0.3, -1.0, -0.2], [-0.2, -0.3, -1.5], [-2.0, -0.9, -0.6]],
               np.float32)
MASK = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]], np.float32)
ADV = np.array([1.0, -1.0, 0.5, -2.0], np.float32)


def _np_clipped(logp, old, adv, lo, hi, dual=None):
    r = np.exp(logp - old)
    a = adv[:, None]
    loss = np.maximum(-a * r, -a * np.clip(r, 1 - lo, 1 + hi))
    if dual is not None:
        loss = np.where(a < 0, np.minimum(loss, -dual * a), loss)
    return loss


def _call(cfg, logp=LOGP, **kw):
    num, den, _ = policy_loss(cfg, jnp.asarray(logp), jnp.asarray(OLD), jnp.asarray(MASK),
                              jnp.asarray(ADV), **kw)
    return float(num), float(den)


def test_group_advantages():
    r = np.array([1.0, 0.0, 3.0, 3.0], np.float32)
    a = np.asarray(group_advantages(jnp.asarray(r), 2))
    np.testing.assert_allclose(a, [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(group_advantages(jnp.asarray(r), 2, normalize_std=False),
                               [0.5, -0.5, 0.0, 0.0])
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(jnp.ones(5), 2)


def test_grpo_sequence_mean():
    per = _np_clipped(LOGP, OLD, ADV, 0.2, 0.2)
    seq = (per * MASK).sum(1) / MASK.sum(1)
    num, den = _call(RLLossConfig(loss="grpo"))
    assert den == 4.0
    np.testing.assert_allclose(num, seq.sum(), rtol=1e-6)


def test_clipping_values_by_hand():
    # token (0, 2): r = e^{-1} = 0.3679, A = 1: max(-0.3679, -max(0.3679, 0.8)) = -0.3679
    # token (1, 2) is masked; token (2, 0): r = e^{-0.7} = 0.4966, A = 0.5: -0.2483
    # token (1, 1): r = e^{-0.2} = 0.8187, A = -1: max(0.8187, clip -> 0.8187) = 0.8187
    per = _np_clipped(LOGP, OLD, ADV, 0.2, 0.2)
    np.testing.assert_allclose(per[0, 2], -np.exp(-1.0), rtol=1e-6)
    np.testing.assert_allclose(per[1, 1], np.exp(-0.2), rtol=1e-6)
    # ratio above 1 + eps with A > 0 is clipped: (0, 0) r = e^{0.2} = 1.2214 -> -1.2
    np.testing.assert_allclose(per[0, 0], -1.2, rtol=1e-6)


def test_dapo_clip_higher_token_level_and_dual_clip():
    cfg = dapo_config(dual_clip=3.0)
    per = _np_clipped(LOGP, OLD, ADV, 0.2, 0.28, dual=3.0)
    num, den = _call(cfg)
    assert den == MASK.sum() == 11.0
    np.testing.assert_allclose(num, (per * MASK).sum(), rtol=1e-6)
    # clip-higher: (0, 0) r = 1.2214 < 1.28 is not clipped (GRPO would clip it to 1.2)
    assert per[0, 0] == pytest.approx(-np.exp(0.2), rel=1e-6)
    # dual clip binds for A = -2 and r = e^{-0.2}? no: 2 * 0.8187 < 6; r = e^{0.5} at (3, 1):
    assert per[3, 1] == pytest.approx(2 * np.exp(0.5), rel=1e-6)  # 3.30 < dual cap 6
    big = LOGP.copy()
    big[3, 1] = OLD[3, 1] + 2.0  # r = e^2 = 7.39, A = -2: 14.8 capped at 3 * 2 = 6
    per_big = _np_clipped(big, OLD, ADV, 0.2, 0.28, dual=3.0)
    assert per_big[3, 1] == 6.0
    np.testing.assert_allclose(_call(cfg, logp=big)[0], (per_big * MASK).sum(), rtol=1e-6)


def test_token_level_accumulation_is_exact():
    cfg = dapo_config()
    full = finalize(*_call(cfg))
    parts = []
    for rows in (slice(0, 1), slice(1, 4)):  # unequal token counts: 3 vs 8
        num, den, _ = policy_loss(cfg, jnp.asarray(LOGP[rows]), jnp.asarray(OLD[rows]),
                                  jnp.asarray(MASK[rows]), jnp.asarray(ADV[rows]))
        parts.append((num, den))
    acc = finalize(sum(p[0] for p in parts), sum(p[1] for p in parts))
    np.testing.assert_allclose(acc, full, rtol=1e-6)
    mean_of_means = np.mean([float(finalize(*p)) for p in parts])
    assert abs(mean_of_means - float(full)) > 1e-3  # dividing early would be wrong

    def grad_full(lp):
        return finalize(*policy_loss(cfg, lp, jnp.asarray(OLD), jnp.asarray(MASK),
                                     jnp.asarray(ADV))[:2])

    def num_part(lp, rows):
        return policy_loss(cfg, lp, jnp.asarray(OLD[rows]), jnp.asarray(MASK[rows]),
                           jnp.asarray(ADV[rows]))[0]

    g_full = jax.grad(grad_full)(jnp.asarray(LOGP))
    g_acc = jnp.concatenate([jax.grad(num_part)(jnp.asarray(LOGP[r]), r)
                             for r in (slice(0, 1), slice(1, 4))]) / MASK.sum()
    np.testing.assert_allclose(g_acc, g_full, rtol=1e-6, atol=1e-7)


def test_gspo_sequence_ratio_and_gradient():
    cfg = RLLossConfig(loss="gspo", eps_low=3e-4, eps_high=4e-4)
    d = (LOGP - OLD) * MASK
    s = np.exp(d.sum(1) / MASK.sum(1))  # sequence ratio
    a = ADV
    per_seq = np.maximum(-a * s, -a * np.clip(s, 1 - 3e-4, 1 + 4e-4))  # same on every token
    num, den = _call(cfg)
    np.testing.assert_allclose(num, per_seq.sum(), rtol=1e-5)
    assert den == 4.0
    # gradient: unclipped sequences get d/dlogp_t = -A * s / |y| on valid tokens, clipped get 0
    g = jax.grad(lambda lp: policy_loss(cfg, lp, jnp.asarray(OLD), jnp.asarray(MASK),
                                        jnp.asarray(ADV))[0])(jnp.asarray(LOGP))
    unclipped = np.abs(np.clip(s, 1 - 3e-4, 1 + 4e-4) - s) < 1e-12
    clipped_wins = (-a * np.clip(s, 1 - 3e-4, 1 + 4e-4)) > (-a * s)
    active = unclipped | ~clipped_wins
    want = np.where(active[:, None], -a[:, None] * s[:, None] / MASK.sum(1, keepdims=True), 0.0)
    np.testing.assert_allclose(np.asarray(g), want * MASK, rtol=1e-5, atol=1e-7)


def test_kimi_objective_value_and_gradient():
    tau = 0.5
    cfg = RLLossConfig(loss="kimi", tau=tau)
    lr = ((LOGP - OLD) * MASK).sum(1)  # log pi/pi_old per sequence
    per = (ADV - tau * lr) ** 2
    num, den = _call(cfg)
    assert den == 4.0
    np.testing.assert_allclose(num, per.sum(), rtol=1e-6)
    # K1.5 gradient: d/dlogp_t (A - tau*lr)^2 = -2 tau (A - tau*lr) on each valid token
    g = jax.grad(lambda lp: policy_loss(cfg, lp, jnp.asarray(OLD), jnp.asarray(MASK),
                                        jnp.asarray(ADV))[0])(jnp.asarray(LOGP))
    np.testing.assert_allclose(g, -2 * tau * (ADV - tau * lr)[:, None] * MASK, rtol=1e-5)


def test_kl_estimators_and_penalty():
    ref = OLD
    d = LOGP.astype(np.float64) - ref  # f32 cancellation in exp(-d) + d - 1: atol 1e-6
    np.testing.assert_allclose(kl_per_token(jnp.asarray(LOGP), jnp.asarray(ref), "k3"),
                               np.exp(-d) + d - 1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kl_per_token(jnp.asarray(LOGP), jnp.asarray(ref), "k2"),
                               0.5 * d * d, rtol=1e-6)
    cfg = RLLossConfig(loss="grpo", kl_beta=0.04)
    per = _np_clipped(LOGP, OLD, ADV, 0.2, 0.2) + 0.04 * (np.exp(-d) + d - 1)
    num, _ = _call(cfg, ref_logp=jnp.asarray(ref))
    np.testing.assert_allclose(num, ((per * MASK).sum(1) / MASK.sum(1)).sum(), rtol=1e-6)


def test_kl_penalty_stays_finite_where_the_policy_is_far_below_the_reference():
    """A position outside the mask (here [1, 2]) with the policy 100 nats below the reference:
    the loss and its gradient stay finite and equal those with that position at the reference
    (k3's exp used to overflow there, and inf x 0 made the step NaN); a counted position that
    far below gets a finite penalty."""
    cfg = RLLossConfig(loss="grpo", kl_beta=0.04)
    far = LOGP.copy()
    far[1, 2] = OLD[1, 2] - 100.0  # masked out
    loss = lambda lp: policy_loss(cfg, lp, jnp.asarray(OLD), jnp.asarray(MASK),  # noqa: E731
                                  jnp.asarray(ADV), ref_logp=jnp.asarray(OLD))[0]
    g_far, g_near = (jax.grad(loss)(jnp.asarray(x)) for x in (far, LOGP))
    assert np.isfinite(float(loss(jnp.asarray(far)))) and np.isfinite(np.asarray(g_far)).all()
    np.testing.assert_allclose(float(loss(jnp.asarray(far))), float(loss(jnp.asarray(LOGP))),
                               rtol=1e-6)
    np.testing.assert_allclose(g_far, g_near, rtol=1e-6)
    k3 = kl_per_token(jnp.asarray([-100.0]), jnp.asarray([0.0]), "k3")
    assert np.isfinite(float(k3[0])) and float(k3[0]) > 1e8


def test_truncated_importance_sampling():
    sampler = OLD + np.array([[0.1, -1.0, 0.0], [0.5, 0.0, 9.0], [0.0, 0.0, 0.0],
                              [-0.2, 0.3, 0.1]], np.float32)
    w_tok = np.minimum(np.exp(OLD - sampler), 2.0)
    np.testing.assert_allclose(tis_weights(jnp.asarray(OLD), jnp.asarray(sampler),
                                           jnp.asarray(MASK)) * MASK, w_tok * MASK, rtol=1e-6)
    assert w_tok[0, 1] == 2.0  # exp(1) truncated at the cap
    w_seq = np.minimum(np.exp(((OLD - sampler) * MASK).sum(1)), 2.0)
    np.testing.assert_allclose(tis_weights(jnp.asarray(OLD), jnp.asarray(sampler),
                                           jnp.asarray(MASK), level="sequence")[:, 0],
                               w_seq, rtol=1e-6)
    cfg = RLLossConfig(loss="dapo", eps_high=0.28, aggregation="token", tis="token")
    per = _np_clipped(LOGP, OLD, ADV, 0.2, 0.28) * w_tok
    num, den = _call(cfg, sampler_logp=jnp.asarray(sampler))
    np.testing.assert_allclose(num, (per * MASK).sum(), rtol=1e-6)
    with pytest.raises(ValueError, match="sampler_logp"):
        _call(cfg)


def test_config_errors():
    with pytest.raises(ValueError, match="rl loss"):
        RLLossConfig(loss="ppo2")
    with pytest.raises(ValueError, match="aggregation"):
        RLLossConfig(aggregation="seq")
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(RLLossConfig(), jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((2, 3)),
                    jnp.zeros(3))


def test_sequence_tis_in_the_loss():
    """``tis="sequence"``: each sequence's per-token loss times one detached weight
    ``min(exp(sum_t (old - sampler)), cap)`` (GRPO sequence mean and the Kimi objective)."""
    sampler = OLD + np.array([[0.1, -0.2, 0.0], [-0.5, 0.1, 7.0], [0.3, 0.0, 0.1],
                              [-0.6, -0.4, 0.2]], np.float32)
    w = np.minimum(np.exp(((OLD - sampler) * MASK).sum(1)), 1.5)  # [B]
    assert w[3] == 1.5 and w[0] < 1.5  # one sequence capped; padding (7.0) ignored
    cfg = RLLossConfig(tis="sequence", tis_cap=1.5)
    per = _np_clipped(LOGP, OLD, ADV, 0.2, 0.2) * w[:, None]
    num, den = _call(cfg, sampler_logp=jnp.asarray(sampler))
    np.testing.assert_allclose(num, ((per * MASK).sum(1) / MASK.sum(1)).sum(), rtol=1e-6)
    assert den == 4
    kimi = RLLossConfig(loss="kimi", tau=0.5, tis="sequence", tis_cap=1.5)
    lr = ((LOGP - OLD) * MASK).sum(1)
    num, _ = _call(kimi, sampler_logp=jnp.asarray(sampler))
    np.testing.assert_allclose(num, (np.square(ADV - 0.5 * lr) * w).sum(), rtol=1e-6)
    # detached: the gradient is the unweighted one times w
    g = jax.grad(lambda lp: policy_loss(cfg, lp, jnp.asarray(OLD), jnp.asarray(MASK),
                                        jnp.asarray(ADV), sampler_logp=jnp.asarray(sampler))[0])
    g0 = jax.grad(lambda lp: policy_loss(RLLossConfig(), lp, jnp.asarray(OLD),
                                         jnp.asarray(MASK), jnp.asarray(ADV))[0])
    np.testing.assert_allclose(g(jnp.asarray(LOGP)), g0(jnp.asarray(LOGP)) * w[:, None],
                               rtol=1e-6)


def test_trained_policy_leaves_out_ids_the_sampler_cannot_emit():
    """A model vocabulary padded past its tokenizer's: the engine samples over the tokenizer's
    ids only, so the trainer's log-probs and entropy are those of the same distribution (they
    were over the whole padded vocabulary: log-probs lower by log(1 - p_pad), TIS below 1)."""
    from kdsa.train.rl.step import tempered, token_logprobs_and_entropy

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 3, 10)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 7, (2, 3)), jnp.int32)
    for temp in (1.0, 0.7):
        lp, ent = token_logprobs_and_entropy(tempered(logits, temp, 7), targets)
        x = np.asarray(logits, np.float64)[..., :7] / temp
        ref = x - np.log(np.exp(x).sum(-1, keepdims=True))
        np.testing.assert_allclose(lp, np.take_along_axis(ref, np.asarray(targets)[..., None],
                                                          -1)[..., 0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ent, -(np.exp(ref) * ref).sum(-1), rtol=1e-5)
    assert tempered(logits, 1.0, 10) is logits and tempered(logits, 1.0) is logits
    with pytest.raises(ValueError, match="sampled_vocab must be a positive integer"):
        RLLossConfig(sampled_vocab=0)
