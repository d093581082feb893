"""PPO/GRPO mini-batches of the RL update. (The RL job on the train layout,
``fsdp=2,expert=2,tensor=2``, equal to the one-device job is ``tests/test_rl_multihost.py``.)

* Two mini-batches (``rl.minibatches_per_step=2``) equal two updates done by hand with the
  log-probs of the policy before the first; without them the second update's ratio would be 1
  and its result differs.
"""

import jax
import numpy as np

from kdsa.model.overrides import apply_overrides
from kdsa.model.config import get_preset
from kdsa.train.config import TrainConfig
from kdsa.train.rl.config import RLConfig
from kdsa.train.rl.step import (minibatch_updates, policy_logprobs, rl_step_with_options,
                                split_rows)
from kdsa.train.trainer import prepare

FAST = {"xla_backend_optimization_level": 0}
CONFIG = apply_overrides(get_preset("tiny"), ["num_hidden_layers=2",
                                              "linear_attn_config.kda_layers=[1]",
                                              "linear_attn_config.full_attn_layers=[2]"])
RC = RLConfig(envs=("rg:basic_arithmetic",), loss="dapo", tis="none",  # TIS x ratio: old cancels
              minibatches_per_step=2, temperature=0.7)  # old_logp: the tempered policy's
TC = TrainConfig(steps=2, learning_rate=1e-3, schedule="constant", warmup_steps=0,
                 weight_decay=0.0, checkpoint_every=100, seed=0, eps=1e-4)


def test_two_minibatches_equal_two_updates_by_hand():
    tc, rc = TC.replace(accum_steps=2), RC
    abstract, graphdef, tx, build = prepare(CONFIG, tc)
    state = build()
    rng = np.random.default_rng(3)
    b, t = 8, 12
    toks = rng.integers(0, 256, (b, t + 1)).astype(np.int32)
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:],
             "loss_mask": (rng.random((b, t)) < 0.8).astype(np.float32),
             "sampler_logp": np.full((b, t), -5.0, np.float32),
             "advantages": rng.normal(size=b).astype(np.float32)}
    step = rl_step_with_options(tuple(FAST.items()))
    kw = dict(tc=tc, tx=tx, loss_cfg=rc.loss_config(), layout=abstract.segment_layout)
    first, second = split_rows(batch, 2)
    got, metrics = minibatch_updates(graphdef, state, [first, second], state.params, 1.0,
                                     step_fn=step, **kw)
    assert len(metrics) == 2
    old1 = policy_logprobs(graphdef, state, first, tc=tc, temperature=0.7)  # both from the
    old2 = policy_logprobs(graphdef, state, second, tc=tc, temperature=0.7)  # policy before
    s1, _ = step(graphdef, state, first | {"old_logp": old1}, 0.0, state.params, 1.0, **kw)
    s2, m2 = step(graphdef, s1, second | {"old_logp": old2}, 0.0, state.params, 1.0, **kw)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7),
                 got.params, s2.params)
    np.testing.assert_allclose(float(metrics[1]["pg_loss"]), float(m2["pg_loss"]), rtol=1e-6)
    # the cross-entropy reads the untempered policy (the tempered one: the policy loss)
    raw = np.asarray(policy_logprobs(graphdef, state, first, tc=tc, temperature=1.0))
    mask = first["loss_mask"]
    np.testing.assert_allclose(float(metrics[0]["ce"]), -(raw * mask).sum() / mask.sum(),
                               rtol=1e-5)
    # the second update's ratio is not 1: with the current policy's log-probs it differs
    now = policy_logprobs(graphdef, s1, second, tc=tc, temperature=0.7)
    _, m_ratio1 = step(graphdef, s1, second | {"old_logp": now}, 0.0, state.params, 1.0, **kw)
    assert abs(float(m_ratio1["pg_loss"]) - float(m2["pg_loss"])) > 1e-6
    # an inactive mini-batch (all padding) takes no optimizer step: Adam's momentum and the
    # weight decay would move the weights on its zero gradient
    only, ms = minibatch_updates(graphdef, state, [first, second], state.params, 1.0,
                                 step_fn=step, **kw, active=[True, False])
    assert len(ms) == 1
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), only.params, s1.params)


def test_split_rows_deals_whole_groups_to_every_minibatch():
    """A rollout batch holds its kept groups first, padding after: 3 groups of 2 in 12 rows
    split into 2 mini-batches give groups 0 and 2 to the first, group 1 to the second (both
    train), where consecutive slices gave all three to the first and padding to the second."""
    rows = np.arange(12)
    mask = (rows < 6).astype(np.float32)[:, None]  # 3 kept groups of 2 rows
    first, second = split_rows({"row": rows, "loss_mask": mask}, 2, group=2)
    assert first["row"].tolist() == [0, 1, 4, 5, 8, 9]
    assert second["row"].tolist() == [2, 3, 6, 7, 10, 11]
    assert first["loss_mask"].any() and second["loss_mask"].any()
    # groups that do not split evenly into the mini-batches are dealt row by row
    odd = split_rows({"row": np.arange(6)}, 2, group=2)
    assert [m["row"].tolist() for m in odd] == [[0, 2, 4], [1, 3, 5]]
