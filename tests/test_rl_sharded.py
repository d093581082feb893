"""The RL update on the train layout and PPO/GRPO mini-batches.

* The RL job with its update on 8 host devices, ``fsdp=2,expert=2,tensor=2`` (the train
  rules: FSDP weights, expert-parallel MoE in ``shard_map``, tensor-split heads), equals the
  one-device job step by step (KL to the reference on): rewards equal (the rollouts drew the same tokens), losses and grad norms within 1e-4, parameters
  after the last step within 1e-5; the mesh run logs 8
  ``update_devices`` and the weight-sync seconds. The generation side (compiled once) is
  shared by both runs, so the mesh run's sampler gets its weights by resharding the sharded
  train state.
* Two mini-batches (``rl.minibatches_per_step=2``) equal two updates done by hand with the
  log-probs of the policy before the first; without them the second update's ratio would be 1
  and its result differs.
"""

import jax
import numpy as np

import rl_entry  # noqa: F401  registers test_first_letter
from kdsa.model.overrides import apply_overrides
from kdsa.model.config import get_preset
from kdsa.sharding.mesh import make_mesh
from kdsa.train.config import TrainConfig
from kdsa.train.rl.config import RLConfig
from kdsa.train.rl.loop import run_rl
from kdsa.train.rl.step import (minibatch_updates, policy_logprobs, rl_step_with_options,
                                split_rows)
from kdsa.train.trainer import prepare

FAST = {"xla_backend_optimization_level": 0}
CONFIG = apply_overrides(get_preset("tiny"), ["num_hidden_layers=2",
                                              "linear_attn_config.kda_layers=[1]",
                                              "linear_attn_config.full_attn_layers=[2]"])
ZERO = {"low": 0, "high": 0, "max": 0}
RC = RLConfig(envs=("test_first_letter",), steps=2, prompts_per_step=4, group_size=8,
              seq_len=64, num_slots=32, reasoning_caps=ZERO,
              token_budgets={"low": 2, "high": 2, "max": 2}, truncation_penalty=0.0,
              max_sampling_rounds=1, tis="token", kl_coef=0.01)
# Adam's eps at 1e-4: early Adam steps move a parameter by ~lr * sign(g) wherever |g| >> eps,
# so a gradient of 1e-9 (an embedding row of an unseen token) and its float32 reduction-order
# twin of -1e-9 would move 2 * lr apart; a larger eps makes the update a smooth function of the
# gradient, and what is compared is the sharded gradient, not Adam's sign
TC = TrainConfig(steps=2, learning_rate=1e-3, schedule="constant", warmup_steps=0,
                 weight_decay=0.0, checkpoint_every=100, seed=0, eps=1e-4)


def test_rl_job_on_fsdp_expert_tensor_mesh_equals_one_device(tmp_path):
    kw = dict(progress=False, evaluate_heldout=False, compiler_options=FAST)
    one = run_rl(CONFIG, TC, RC, tmp_path / "one", **kw)
    mesh = make_mesh({"fsdp": 2, "expert": 2, "tensor": 2})
    sharded = run_rl(CONFIG, TC, RC, tmp_path / "mesh", mesh=mesh, sampler=one.sampler, **kw)
    for step in (1, 2):
        a, b = one.metrics[step], sharded.metrics[step]
        assert a["reward"] == b["reward"] and a["kept_groups"] == b["kept_groups"]
        assert a["updated"] == 1.0
        # the losses are sums of O(1) terms that nearly cancel (group-normalised advantages,
        # loss ~1e-3): compared in absolute terms, the grad norm and entropy relatively
        # (measured: loss 4e-7 apart, grad norm 1.2e-5 and entropy 4.5e-5 relative, KL 3e-5)
        for key in ("loss", "pg_loss", "kl"):
            np.testing.assert_allclose(b[key], a[key], rtol=0, atol=1e-4, err_msg=key)
        for key in ("grad_norm", "entropy"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-4, err_msg=key)
        assert a["update_devices"] == 1 and b["update_devices"] == 8
        assert b["sync_seconds"] > 0
    leaf = jax.tree.leaves(sharded.state.params)[0]
    assert leaf.sharding.mesh.size == 8  # the state stayed on the train layout
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(y), np.asarray(x),
                                                         atol=1e-5),
                 one.state.params, sharded.state.params)


def test_two_minibatches_equal_two_updates_by_hand():
    tc = TC.replace(accum_steps=2)
    rc = RC.replace(loss="dapo", tis="none", minibatches_per_step=2)  # TIS x ratio: old cancels
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
    old1 = policy_logprobs(graphdef, state, first, tc=tc)  # both from the policy before
    old2 = policy_logprobs(graphdef, state, second, tc=tc)
    s1, _ = step(graphdef, state, first | {"old_logp": old1}, 0.0, state.params, 1.0, **kw)
    s2, m2 = step(graphdef, s1, second | {"old_logp": old2}, 0.0, state.params, 1.0, **kw)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7),
                 got.params, s2.params)
    np.testing.assert_allclose(float(metrics[1]["pg_loss"]), float(m2["pg_loss"]), rtol=1e-6)
    # the second update's ratio is not 1: with the current policy's log-probs it differs
    s2_ratio1, m_ratio1 = step(graphdef, s1, second, 0.0, state.params, 1.0, **kw)
    assert abs(float(m_ratio1["pg_loss"]) - float(m2["pg_loss"])) > 1e-6
