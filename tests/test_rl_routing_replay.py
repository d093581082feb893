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


def test_bad_expert_ids_shape(layer):
    m, x, ids = layer
    with pytest.raises(ValueError, match=r"expert_ids must be \[B=2, T=5, k=2\]"):
        m(x, expert_ids=jnp.asarray(ids[:, :3]))
