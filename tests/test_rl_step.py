"""The RL update's optional terms (``train/rl/step.py``): the entropy bonus and the update scale.

* ``entropy`` (metric) is the mean over loss tokens of ``-sum_v p log p`` of the next-token
  distributions, checked against NumPy on the model's logits;
* with zero advantages the policy-gradient term vanishes, so a step with ``entropy_coef > 0``
  moves the policy toward higher entropy and a step without it leaves the entropy as it was
  (up to Adam's zero-gradient update);
* ``update_scale`` multiplies the optimizer's update: 0 leaves the parameters, 0.5 moves them
  half as far as 1.

Every step here runs one of two compiled programs (an RL step compiles in about 10 s here): a
KL term to the step-0 policy is on in both, the entropy bonus in one, and every batch carries
``segment_ids``. The KL term's value and gradient are 0 at the step-0 parameters, so it moves
nothing the tests measure: its gradient there is rounding noise (~1e-9), which Adam's eps of 1e-4
keeps from becoming a step of ``lr * sign(g)``."""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from kdsa.model.overrides import apply_overrides
from kdsa.model.config import get_preset
from kdsa.train.config import TrainConfig
from kdsa.train.rl.config import RLConfig, apply_rl_overrides
from kdsa.train.rl.step import rl_step_with_options
from kdsa.train.trainer import prepare

CFG = apply_overrides(get_preset("tiny").replace(param_dtype="float32", compute_dtype="float32"),
                      ["num_hidden_layers=2", "linear_attn_config.kda_layers=[1]",
                       "linear_attn_config.full_attn_layers=[2]"])
TC = TrainConfig(steps=2, learning_rate=1e-2, schedule="constant", warmup_steps=0,
                 weight_decay=0.0, seed=0, eps=1e-4)  # Adam's eps: see the docstring
STEP = rl_step_with_options((("xla_backend_optimization_level", 0),))
B, T = 8, 10


@pytest.fixture(scope="module")
def setup():
    abstract, graphdef, tx, build = prepare(CFG, TC)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 256, (B, T + 1)).astype(np.int32)
    mask = np.ones((B, T), np.float32)
    mask[:, :3] = 0  # a prompt part
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "loss_mask": mask,
             "sampler_logp": np.zeros((B, T), np.float32),
             "advantages": np.zeros((B,), np.float32), "segment_ids": np.ones((B, T), np.int32)}
    return graphdef, build(), tx, abstract.segment_layout, batch


# the two programs: a KL term to the step-0 policy in both, the entropy bonus in one
PLAIN = RLConfig(envs=("rg:basic_arithmetic",), kl_coef=0.1)
BONUS = PLAIN.replace(entropy_coef=0.5)


def _step(setup, rc: RLConfig, scale=1.0, state=None, batch=None, ref=None):
    graphdef, state0, tx, layout, batch0 = setup
    return STEP(graphdef, state0 if state is None else state, batch0 if batch is None else batch,
                0.0, state0.params if ref is None else ref, scale, tc=TC, tx=tx,
                loss_cfg=rc.loss_config(), layout=layout)


def test_entropy_metric_and_bonus(setup):
    graphdef, state0, _, _, batch = setup
    # the reference forward as one compiled program (op by op: an eager compile per op shape)
    logits = np.asarray(nnx.jit(lambda m, x: m.forward(x).logits)(
        nnx.merge(graphdef, state0.params, state0.rest), batch["inputs"]), np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ent = -(p * np.log(p)).sum(-1)
    want = (ent * batch["loss_mask"]).sum() / batch["loss_mask"].sum()

    s1, m1 = _step(setup, PLAIN)
    np.testing.assert_allclose(float(m1["entropy"]), want, rtol=1e-5)
    assert "routing_replay_agreement" not in m1  # no expert ids replayed, none reported
    s2, m2 = _step(setup, BONUS)
    np.testing.assert_allclose(float(m2["entropy"]), want, rtol=1e-5)  # measured before
    # the logged loss is the objective, the entropy bonus included (it was left out)
    np.testing.assert_allclose(float(m2["loss"]), float(m2["pg_loss"]) - 0.5 * want, rtol=1e-5)
    after_plain = float(_step(setup, PLAIN, state=s1)[1]["entropy"])
    after_bonus = float(_step(setup, PLAIN, state=s2)[1]["entropy"])
    print(f"entropy {want:.5f}: after a plain step {after_plain:.5f}, after a bonus step "
          f"{after_bonus:.5f}")
    assert after_bonus > want + 1e-3 and abs(after_plain - want) < 1e-3


def test_update_scale(setup):
    _, state0, _, _, _ = setup
    full, _ = _step(setup, BONUS, 1.0)  # the bonus: a nonzero gradient
    half, _ = _step(setup, BONUS, 0.5)
    none, _ = _step(setup, BONUS, 0.0)
    d = lambda s: jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), s.params,  # noqa
                               state0.params)
    # atol: float32 rounding of parameters of O(1) (moves of ~1e-4 where Adam's eps damps them)
    jax.tree.map(lambda f, h: np.testing.assert_allclose(h, 0.5 * f, rtol=1e-4, atol=3e-7),
                 d(full), d(half))
    jax.tree.map(lambda z: np.testing.assert_array_equal(z, 0), d(none))
    assert max(float(np.abs(x).max()) for x in jax.tree.leaves(d(full))) > 1e-3


def test_sft_steps_skip_the_reference_forward(setup):
    """With a KL term, an SFT step (``sft_weight`` 1) does not run the reference policy (its
    term has weight 0 there): reference parameters of NaN leave it finite, while an RL step of
    the same compiled program reads them (NaN loss)."""
    graphdef, state0, tx, layout, batch = setup
    nan_ref = jax.tree.map(lambda a: np.full(a.shape, np.nan, a.dtype), state0.params)
    kw = dict(tc=TC, tx=tx, loss_cfg=PLAIN.loss_config(), layout=layout)
    _, sft = STEP(graphdef, state0, batch, 1.0, nan_ref, 1.0, **kw)
    _, rl = STEP(graphdef, state0, batch, 0.0, nan_ref, 1.0, **kw)
    assert np.isfinite(float(sft["loss"])) and float(sft["kl"]) == 0.0, sft
    assert np.isnan(float(rl["loss"])), rl


def test_padding_does_not_steer_the_routing_biases(setup):
    """RL batches mark their right padding with ``segment_ids`` 0, so the MoE's expert load,
    which updates the routing biases, counts real tokens only: two batches that differ only in
    their padding's token ids update the biases alike (without the marks they do not)."""
    graphdef, state0, tx, layout, batch = setup
    seg = np.ones((B, T), np.int32)
    seg[B // 2:, 4:] = 0  # the last rows end at 4 tokens
    mask = batch["loss_mask"] * seg
    other = np.where(seg == 1, batch["inputs"], 0)  # padded with token 0, as rollouts are

    def biases(inputs, segment_ids):  # segment ids all 1: no padding marked
        b = dict(batch, inputs=inputs, loss_mask=mask, segment_ids=segment_ids)
        new, _ = _step(setup, BONUS, batch=b)
        got = {k: np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(new.rest)
               if "e_score_correction_bias" in jax.tree_util.keystr(k)}
        assert got
        return got

    marked, marked_other = biases(batch["inputs"], seg), biases(other, seg)
    for k in marked:
        np.testing.assert_array_equal(marked[k], marked_other[k], err_msg=str(k))
    unmarked = np.ones_like(seg)
    plain, plain_other = biases(batch["inputs"], unmarked), biases(other, unmarked)
    assert any(not np.array_equal(plain[k], plain_other[k]) for k in plain)


def test_bad_values():
    with pytest.raises(ValueError, match="entropy_coef must be >= 0"):
        RLConfig(entropy_coef=-0.1)
    # ``--rl-set`` parses JSON, else a string: each a clear error, not a truthy string or a
    # TypeError
    for override, says in (("normalize_std=False", "rl.normalize_std must be true or false"),
                           ("temperature=hot", "rl.temperature must be a number"),
                           ("tis_cap=null", "rl.tis_cap must be a number"),
                           ('length_penalty={"low": "x", "high": 0, "max": 0}',
                            "rl.length_penalty['low'] must be a number")):
        with pytest.raises(ValueError, match=re.escape(says)):
            apply_rl_overrides(RLConfig(), [override])
    rc = RLConfig(sft_steps=3, steps=10, minibatches_per_step=2)
    assert rc.optimizer_steps == 23  # the schedule's length: every mini-batch a step
    with pytest.raises(ValueError, match="rl.scale_update_by_kept must be true or false"):
        RLConfig(scale_update_by_kept=1)
