"""MoE routing replay (RL): ``MoE(x, expert_ids=...)`` trains with the experts the rollout chose.

With the router's own choice replayed the layer is unchanged (values and gradients); other ids
change it exactly as the dense one-hot reference with those experts and the gate weights
gathered from the current router scores (independent NumPy computation of the weights);
gradients still reach the router; bad shapes are errors naming the shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdsa.model import moe as moe_lib
from kdsa.model.config import get_preset

CFG = get_preset("tiny").replace(param_dtype="float32", compute_dtype="float32")
B, T = 2, 5


@pytest.fixture(scope="module")
def layer():
    m = moe_lib.MoE(CFG, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (B, T, CFG.hidden_size), jnp.float32)
    ids, _, _ = m.gate(x.reshape(B * T, -1))
    return m, x, np.asarray(ids).reshape(B, T, -1)


def test_replaying_the_computed_experts_changes_nothing(layer):
    m, x, ids = layer
    y0, s0 = m(x)
    y1, s1 = m(x, expert_ids=jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(y0), np.asarray(y1))
    np.testing.assert_array_equal(np.asarray(s0["expert_load"]), np.asarray(s1["expert_load"]))

    @nnx.jit
    def grads(model):
        def loss(model, e):
            return jnp.sum(model(x, expert_ids=e)[0] ** 2)
        return nnx.grad(loss)(model, None), nnx.grad(loss)(model, jnp.asarray(ids))

    g0, g1 = grads(m)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), g0, g1)
    assert float(jnp.abs(g1["gate"]["weight"][...]).max()) > 0  # the router still learns


def test_other_experts_follow_the_reference(layer):
    m, x, ids = layer
    other = (ids + 1) % CFG.num_experts  # [B, T, k], still k distinct experts per token
    y, stats = m(x, expert_ids=jnp.asarray(other))
    assert not np.allclose(np.asarray(y), np.asarray(m(x)[0]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(y), np.asarray(m.reference(
        x, expert_ids=jnp.asarray(other))[0]), rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(stats["expert_load"]),
                                  np.bincount(other.reshape(-1), minlength=CFG.num_experts))
    # the gate weights: current sigmoid scores at the replayed ids, renormalised, scaled
    xf = np.asarray(x, np.float64).reshape(B * T, -1)
    scores = 1 / (1 + np.exp(-xf @ np.asarray(m.gate.weight[...], np.float64)))
    w = np.take_along_axis(scores, other.reshape(B * T, -1), axis=-1)
    w = w / w.sum(-1, keepdims=True) * CFG.routed_scaling_factor
    _, got, _ = m.gate(jnp.asarray(xf, jnp.float32), jnp.asarray(other.reshape(B * T, -1)))
    np.testing.assert_allclose(np.asarray(got), w, rtol=1e-5)


def test_a_row_with_any_missing_id_keeps_the_routers_choice(layer):
    """-1 marks a token without a record: a row replays only when all its ids are experts (a
    -1 in a later slot once went on into the dispatch as an expert id)."""
    m, x, ids = layer
    other = (ids + 1) % CFG.num_experts
    partial = other.copy()
    partial[0, 1, 1] = -1  # token (0, 1): its first id recorded, its second not
    want = other.copy()
    want[0, 1] = ids[0, 1]
    _, got, _ = m.gate(x.reshape(B * T, -1), jnp.asarray(partial.reshape(B * T, -1)))
    _, ref, _ = m.gate(x.reshape(B * T, -1), jnp.asarray(want.reshape(B * T, -1)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    idx, _, _ = m.gate(x.reshape(B * T, -1), jnp.asarray(partial.reshape(B * T, -1)))
    np.testing.assert_array_equal(np.asarray(idx), want.reshape(B * T, -1))
    _, stats = m(x, expert_ids=jnp.asarray(partial))  # agreement over the rows that replayed
    assert float(stats["replay_agreement"][1]) == B * T - 1


def test_bad_expert_ids_shape(layer):
    m, x, ids = layer
    with pytest.raises(ValueError, match=r"expert_ids must be \[B=2, T=5, k=2\]"):
        m(x, expert_ids=jnp.asarray(ids[:, :3]))


# ---- routing replay through the stack: engine record -> batch -> RL step -> loop ----

from kdsa.model.overrides import apply_overrides  # noqa: E402
from kdsa.infer.engine import Engine, Request  # noqa: E402
from kdsa.infer.runner import ModelRunner  # noqa: E402
from kdsa.infer.sampling import SamplingParams  # noqa: E402
from kdsa.infer.tokenizer import ByteTokenizer  # noqa: E402
from kdsa.model.transformer import Transformer  # noqa: E402
from kdsa.model.outputs import Collect, layers_of  # noqa: E402
from kdsa.train.config import TrainConfig  # noqa: E402
from kdsa.train.rl.config import RLConfig  # noqa: E402

FAST = {"xla_backend_optimization_level": 0}
SMALL = apply_overrides(CFG, ["num_hidden_layers=3", "linear_attn_config.kda_layers=[1, 2]",
                              "linear_attn_config.full_attn_layers=[3]"])  # dense, moe, moe


@pytest.fixture(scope="module")
def small_model():
    return Transformer(SMALL, rngs=nnx.Rngs(0))


# the full forward's routing as one compiled program (op by op, an eager forward compiles
# every op of every shape)
_routing = nnx.jit(lambda m, ids: m.forward(ids, collect=Collect(routing=True)).stats.expert_ids)


def test_engine_records_the_routing_of_the_full_forward(small_model):
    """Chunked prefill + decode record, per token the model ran, the experts an uncached full
    forward over the same tokens picks, for every MoE layer."""
    runner = ModelRunner(small_model, num_slots=2, max_len=64, prefill_chunk=8, min_bucket=8,
                         record_routing=True)
    eng = Engine(runner, ByteTokenizer(SMALL.vocab_size), max_top_logprobs=0)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (5, 13, 9)]  # 13: 2 chunks
    outs = eng.generate([Request(p, SamplingParams(temperature=0.0, max_tokens=4,
                                                   ignore_eos=True)) for p in prompts])
    seqs = [p + c.token_ids[:-1] for p, c in zip(prompts, outs)]  # the last sampled token
    # was never run; one full forward of every sequence, right-padded (causal: the padding
    # changes no earlier position), instead of one slow eager forward each
    ids = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, seq in enumerate(seqs):
        ids[i, :len(seq)] = seq
    full = np.asarray(_routing(small_model, jnp.asarray(ids)))            # [L_moe, B, T, k]
    moe = layers_of(SMALL, ffn="moe")
    assert moe == tuple(range(1, SMALL.num_hidden_layers))  # layer 0: dense FFN
    for i, (seq, c) in enumerate(zip(seqs, outs)):
        assert c.routing.shape == (len(seq), len(moe), SMALL.num_experts_per_token)
        want = np.transpose(full[:, i, :len(seq)], (1, 0, 2))            # [T, L_moe, k]
        assert (want >= 0).all()
        np.testing.assert_array_equal(c.routing, want)


def test_rl_step_trains_with_the_replayed_experts(small_model):
    """Replaying the training router's own choice changes nothing (agreement 1) against
    replaying nothing (every row -1: the router's choice); other experts change the loss and
    lower the agreement. One compiled step: every batch has ``expert_ids``. (Without them, no
    agreement is reported: ``tests/test_rl_step.py``.) The KL reference (the same weights here)
    replays the same experts: its KL stays 0 with other experts (it routed with its own router,
    so the term measured routing disagreement instead of the policy's drift)."""
    from kdsa.train.rl.step import rl_step_with_options
    from kdsa.train.trainer import prepare

    tc = TrainConfig(steps=1, learning_rate=1e-2, schedule="constant", warmup_steps=0, seed=0)
    rc = RLConfig(envs=("rg:basic_arithmetic",), kl_coef=0.1)
    abstract, graphdef, tx, build = prepare(SMALL, tc)
    state = build()
    b, t = 8, 12
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 256, (b, t + 1)).astype(np.int32)
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:],
             "loss_mask": np.ones((b, t), np.float32), "sampler_logp": np.zeros((b, t), np.float32),
             "advantages": rng.normal(size=b).astype(np.float32)}
    model = nnx.merge(graphdef, state.params, state.rest)
    own = np.transpose(np.asarray(_routing(model, jnp.asarray(batch["inputs"]))),
                       (1, 2, 0, 3))                                  # [B, T, L_moe, k]
    step = rl_step_with_options(tuple(FAST.items()))
    kw = dict(tc=tc, tx=tx, loss_cfg=rc.loss_config(), layout=abstract.segment_layout)
    none = np.full_like(own, -1)  # no record anywhere: the router's own choice
    ref = state.params
    s0, m0 = step(graphdef, state, batch | {"expert_ids": none}, 0.0, ref, 1.0, **kw)
    s1, m1 = step(graphdef, state, batch | {"expert_ids": own}, 0.0, ref, 1.0, **kw)
    assert float(m1["routing_replay_agreement"]) == 1.0
    np.testing.assert_allclose(float(m1["pg_loss"]), float(m0["pg_loss"]), rtol=1e-6)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7),
                 s0.params, s1.params)
    other = np.where(own >= 0, (own + 1) % SMALL.num_experts, -1)
    _, m2 = step(graphdef, state, batch | {"expert_ids": other}, 0.0, ref, 1.0, **kw)
    assert float(m2["routing_replay_agreement"]) < 0.9
    assert abs(float(m2["ce"]) - float(m0["ce"])) > 1e-4
    assert max(abs(float(m["kl"])) for m in (m0, m1, m2)) < 1e-6
