"""Activations, DenseFFN and MoE (router, ragged dispatch, latent MoE, bias update).

References are independent code paths: NumPy float64 transcriptions of the formulas (SiTU, the
router with a brute-force group/top-k search, a per-token loop over the whole MoE layer) and
the dense one-hot expert computation for the ragged dispatch (values and gradients).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdsa.model import moe as moe_lib
from kdsa.model import routing
from kdsa.model.activations import gated_activation, silu, situ_gate, situ_up
from kdsa.model.config import get_preset
from kdsa.model.ffn import DenseFFN

TINY = get_preset("tiny")  # latent + norm, SiTU (4, 25), 1 shared, grouped top-k with 1 group
NON_LATENT = TINY.replace(  # full-width experts, SiLU, softmax, no renorm, scaled, 4 groups
    routed_expert_hidden_size=None, latent_moe_use_norm=False, hidden_act="silu",
    num_shared_experts=0, moe_router_activation_func="softmax", moe_renormalize=False,
    routed_scaling_factor=2.5, num_expert_group=4, topk_group=2, num_experts_per_token=3)
LATENT_NO_NORM = TINY.replace(  # latent without norm, SiTU with unclipped up, 2 shared, top-4
    latent_moe_use_norm=False, activation_situ_linear_beta=None, num_shared_experts=2,
    num_experts_per_token=4)
CONFIGS = {"tiny": TINY, "non_latent": NON_LATENT, "latent_no_norm": LATENT_NO_NORM}


# ---------------------------------------------------------------------------------------------
# NumPy references
# ---------------------------------------------------------------------------------------------

def np_sigmoid(x):
    x = np.asarray(x, np.float64)
    return np.exp(-np.logaddexp(0.0, -x))


def np_act(g, u, c):
    g, u = np.asarray(g, np.float64), np.asarray(u, np.float64)
    if c.hidden_act == "silu":
        return g * np_sigmoid(g) * u
    up = u if c.activation_situ_linear_beta is None else (
        c.activation_situ_linear_beta * np.tanh(u / c.activation_situ_linear_beta))
    return c.activation_situ_beta * np.tanh(g / c.activation_situ_beta) * np_sigmoid(g) * up


def np_route(x, w, bias, c):
    """Brute force: best groups by enumeration, best k-subset by enumeration. Returns
    (chosen expert sets, {expert: weight} per token, scores)."""
    logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    if c.moe_router_activation_func == "sigmoid":
        scores = np_sigmoid(logits)
    else:
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    choice = scores + np.asarray(bias, np.float64)
    e, g, k = c.num_experts, c.num_expert_group, c.num_experts_per_token
    per = e // g
    sets, weights = [], []
    for n in range(x.shape[0]):
        allowed = list(range(e))
        if c.use_grouped_topk and g > 1:
            gscore = [np.sort(choice[n, i * per:(i + 1) * per])[-2:].sum() for i in range(g)]
            groups = max(itertools.combinations(range(g), c.topk_group),
                         key=lambda gs: sum(gscore[i] for i in gs))
            allowed = [i * per + j for i in groups for j in range(per)]
        best = max(itertools.combinations(allowed, k), key=lambda s: choice[n, list(s)].sum())
        wts = scores[n, list(best)]
        if c.moe_renormalize:
            wts = wts / wts.sum()
        sets.append(sorted(best))
        weights.append(dict(zip(best, wts * c.routed_scaling_factor)))
    return sets, weights, scores


def np_moe(m, x, c):
    """Per-token loop over the whole MoE layer in float64 (routing from ``np_route``)."""
    p = lambda v: np.asarray(v[...], np.float64)  # noqa: E731
    xf = np.asarray(x, np.float64).reshape(-1, c.hidden_size)
    _, weights, _ = np_route(xf, p(m.gate.weight), p(m.gate.e_score_correction_bias), c)
    w1, w3, w2 = p(m.experts.w1), p(m.experts.w3), p(m.experts.w2)
    out = []
    for n, xn in enumerate(xf):
        z = xn @ p(m.routed_expert_down_proj.kernel) if m.routed_expert_down_proj else xn
        r = sum(wt * (np_act(z @ w1[e], z @ w3[e], c) @ w2[e]) for e, wt in weights[n].items())
        if m.routed_expert_norm is not None:
            r = r / np.sqrt(np.mean(r * r) + c.rms_norm_eps) * p(m.routed_expert_norm.weight)
        if m.routed_expert_up_proj is not None:
            r = r @ p(m.routed_expert_up_proj.kernel)
        if m.shared_experts is not None:
            s = m.shared_experts
            r = r + np_act(xn @ p(s.gate_proj.kernel), xn @ p(s.up_proj.kernel), c) @ p(
                s.down_proj.kernel)
        out.append(r)
    return np.stack(out).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# Shared compiled functions (one compile per config and path)
# ---------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(graphdef, path, state, x, token_mask):
    m = nnx.merge(graphdef, state)
    return (m if path == "ragged" else m.reference)(x, token_mask=token_mask)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _grads(graphdef, path, params, rest, x, probe):
    def loss(params, x):
        m = nnx.merge(graphdef, params, rest)
        y, _ = (m if path == "ragged" else m.reference)(x)
        return jnp.sum(y * probe)
    return jax.grad(loss, argnums=(0, 1))(params, x)


def make_moe(c, seed=0):
    m = moe_lib.MoE(c, rngs=nnx.Rngs(seed))
    bias = jax.random.uniform(jax.random.key(seed + 1), (c.num_experts,), minval=-0.1, maxval=0.1)
    m.gate.e_score_correction_bias[...] = bias
    return m


def inputs(c, b=2, t=7, seed=3):
    kx, km, kp = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (b, t, c.hidden_size), dtype=jnp.float32)
    mask = jax.random.bernoulli(km, 0.7, (b, t))
    probe = jax.random.normal(kp, (b, t, c.hidden_size), dtype=jnp.float32)
    return x, mask, probe


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12)


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------

G_VALUES = np.array([-1e4, -300.0, -40.0, -5.0, -1.0, -1e-3, 0.0, 1e-3, 0.7, 4.0, 40.0, 300.0,
                     1e4], np.float32)


@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_situ_matches_numpy_including_saturation(linear_beta):
    c = TINY.replace(activation_situ_linear_beta=linear_beta)
    g = np.concatenate([G_VALUES, np.random.default_rng(0).normal(0, 8, 51).astype(np.float32)])
    u = np.roll(g, 5) * 3.0
    got = np.asarray(jax.jit(gated_activation, static_argnums=2)(g, u, c))
    want = np_act(g, u, c)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    # saturation: the gate half tends to +beta for large g and to 0 for very negative g
    np.testing.assert_allclose(np.asarray(situ_gate(jnp.float32(1e4), 4.0)), 4.0, rtol=1e-6)
    assert abs(float(situ_gate(jnp.float32(-1e4), 4.0))) < 1e-30
    up = np.asarray(situ_up(jnp.asarray(u), linear_beta))
    if linear_beta is None:
        np.testing.assert_array_equal(up, u)
    else:
        assert np.all(np.abs(up) <= linear_beta) and np.any(np.abs(u) > linear_beta)
    dg = jax.grad(lambda g: jnp.sum(gated_activation(g, jnp.asarray(u), c)))(jnp.asarray(g))
    assert np.all(np.isfinite(np.asarray(dg)))


def test_silu_and_dtype_cast_back():
    x = jnp.asarray(G_VALUES[2:-2])
    np.testing.assert_allclose(np.asarray(silu(x)), x * np_sigmoid(x), rtol=2e-6, atol=1e-6)
    c = TINY.replace(hidden_act="silu")
    gb = jnp.asarray(G_VALUES[2:-2], jnp.bfloat16)
    out = gated_activation(gb, gb, c)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float64),
                               np_act(np.asarray(gb, np.float64), np.asarray(gb, np.float64), c),
                               rtol=1e-2)
    with pytest.raises(ValueError, match="same shape"):
        gated_activation(jnp.ones((2, 3)), jnp.ones((2, 4)), c)


# ---------------------------------------------------------------------------------------------
# DenseFFN
# ---------------------------------------------------------------------------------------------

def test_dense_ffn_shapes_axes_and_values():
    ffn = DenseFFN(TINY, TINY.intermediate_size, rngs=nnx.Rngs(0))
    assert ffn.gate_proj.kernel.shape == (64, 96) and ffn.gate_proj.kernel.axes == ("embed", "mlp")
    assert ffn.down_proj.kernel.shape == (96, 64) and ffn.down_proj.kernel.axes == ("mlp", "embed")
    x = jax.random.normal(jax.random.key(0), (2, 3, 64))
    y = ffn(x)
    assert y.shape == (2, 3, 64)
    k = lambda lin: np.asarray(lin.kernel[...], np.float64)  # noqa: E731
    xn = np.asarray(x, np.float64)
    want = np_act(xn @ k(ffn.gate_proj), xn @ k(ffn.up_proj), TINY) @ k(ffn.down_proj)
    assert rel_err(y, want) < 1e-5
    narrow = DenseFFN(TINY, 16, rngs=nnx.Rngs(1), hidden_size=32)
    assert narrow(jnp.ones((5, 32))).shape == (5, 32)
    with pytest.raises(ValueError, match="intermediate_size"):
        DenseFFN(TINY, 0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="expects"):
        narrow(jnp.ones((5, 64)))


# ---------------------------------------------------------------------------------------------
# Router
# ---------------------------------------------------------------------------------------------

_route = jax.jit(routing.route, static_argnums=3)


def router_inputs(c, n=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, c.hidden_size)).astype(np.float32)
    w = (rng.normal(size=(c.hidden_size, c.num_experts)) * 0.2).astype(np.float32)
    bias = (rng.normal(size=(c.num_experts,)) * 0.1).astype(np.float32)
    return x, w, bias


def assert_route_matches(c, x, w, bias):
    idx, wt, scores = map(np.asarray, _route(x, w, bias, c))
    sets, weights, np_scores = np_route(x, w, bias, c)
    np.testing.assert_allclose(scores, np_scores, rtol=1e-5, atol=1e-7)
    assert idx.dtype == np.int32 and wt.dtype == np.float32
    for n in range(x.shape[0]):
        assert sorted(idx[n].tolist()) == sets[n], n
        np.testing.assert_allclose(wt[n], [weights[n][e] for e in idx[n]], rtol=1e-5, atol=1e-7)
    return idx, wt


@pytest.mark.parametrize("name,changes,bias_shift", [
    ("plain_top_k_one_group", dict(), 0.0),
    ("groups_4_keep_2", dict(num_experts=16, num_expert_group=4, topk_group=2,
                             num_experts_per_token=3), 0.0),
    ("groups_4_keep_2_negative_bias", dict(num_experts=16, num_expert_group=4, topk_group=2,
                                           num_experts_per_token=3), -2.0),
    ("groups_8_keep_3_softmax", dict(num_experts=16, num_expert_group=8, topk_group=3,
                                     num_experts_per_token=4,
                                     moe_router_activation_func="softmax"), 0.0),
    ("greedy_ignores_groups", dict(num_experts=16, num_expert_group=4, topk_group=1,
                                   use_grouped_topk=False, num_experts_per_token=4), 0.0),
    ("softmax_unnormalised_scaled", dict(moe_router_activation_func="softmax",
                                         moe_renormalize=False, routed_scaling_factor=2.446), 0.0),
])
def test_route_matches_bruteforce(name, changes, bias_shift):
    """``bias_shift`` < -1 makes every biased score negative: masked groups must lose anyway."""
    c = TINY.replace(**changes)
    x, w, bias = router_inputs(c)
    assert_route_matches(c, x, w, bias + np.float32(bias_shift))


def test_bias_chooses_but_weights_come_from_unbiased_scores():
    c = TINY.replace(routed_scaling_factor=2.0)
    x, w, _ = router_inputs(c)
    zero = np.zeros(c.num_experts, np.float32)
    idx0, _ = assert_route_matches(c, x, w, zero)
    counts = np.bincount(idx0.ravel(), minlength=c.num_experts)
    rare = int(np.argmin(counts))
    bias = zero.copy()
    bias[rare] = 5.0  # larger than any sigmoid gap: every token now picks `rare`
    idx1, wt1 = assert_route_matches(c, x, w, bias)
    assert np.all(np.any(idx1 == rare, axis=1)) and counts[rare] < x.shape[0]
    _, _, scores = _route(x, w, bias, c)
    scores = np.asarray(scores)
    chosen = np.take_along_axis(scores, idx1, axis=1)
    np.testing.assert_allclose(wt1, 2.0 * chosen / chosen.sum(1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(wt1.sum(1), 2.0, rtol=1e-5)  # renormalised, times the scale
    assert np.all(wt1[idx1 == rare] < 2.0 * 0.99)  # not the biased score, which exceeds 5


def test_route_rejects_bad_shapes():
    x, w, bias = router_inputs(TINY)
    with pytest.raises(ValueError, match="router_weight"):
        routing.route(x, w[:, :4], bias, TINY)
    with pytest.raises(ValueError, match="routing bias"):
        routing.route(x, w, bias[:4], TINY)


# ---------------------------------------------------------------------------------------------
# MoE layer: ragged dispatch vs one-hot reference vs NumPy loop
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_moe_ragged_matches_one_hot_and_numpy(name):
    c = CONFIGS[name]
    m = make_moe(c)
    x, mask, probe = inputs(c)
    graphdef, state = nnx.split(m)
    y, met = _forward(graphdef, "ragged", state, x, mask)
    y_ref, met_ref = _forward(graphdef, "one_hot", state, x, mask)
    assert y.shape == x.shape and y.dtype == jnp.float32
    assert rel_err(y, y_ref) < 1e-5
    assert rel_err(y, np_moe(m, x, c)) < 1e-4
    np.testing.assert_array_equal(met["expert_load"], met_ref["expert_load"])

    graphdef, params, rest = nnx.split(m, nnx.Param, ...)
    gp, gx = _grads(graphdef, "ragged", params, rest, x, probe)
    gp_ref, gx_ref = _grads(graphdef, "one_hot", params, rest, x, probe)
    assert rel_err(gx, gx_ref) < 1e-5
    flat, flat_ref = nnx.to_flat_state(gp), dict(nnx.to_flat_state(gp_ref))
    names = {".".join(map(str, path)) for path, _ in flat}
    assert {"gate.weight", "experts.w1", "experts.w2", "experts.w3"} <= names
    assert "gate.e_score_correction_bias" not in names  # the bias is not trained
    assert ("routed_expert_down_proj.kernel" in names) == (c.routed_expert_hidden_size is not None)
    assert ("shared_experts.gate_proj.kernel" in names) == (c.num_shared_experts > 0)
    for path, g in flat:
        g, g_ref = np.asarray(g[...]), np.asarray(flat_ref[path][...])
        assert np.max(np.abs(g_ref)) > 0, path
        assert rel_err(g, g_ref) < 1e-5, (path, rel_err(g, g_ref))


def test_moe_bfloat16_runs_close_to_reference():
    c = TINY.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    m = make_moe(c)
    x, mask, _ = inputs(c)
    graphdef, state = nnx.split(m)
    y, _ = _forward(graphdef, "ragged", state, x, mask)
    y_ref, _ = _forward(graphdef, "one_hot", state, x, mask)
    assert y.dtype == jnp.bfloat16 and m.experts.w1[...].dtype == jnp.bfloat16
    assert m.gate.e_score_correction_bias[...].dtype == jnp.float32
    assert rel_err(y, y_ref) < 3e-2


def test_expert_load_counts_and_token_mask():
    c = TINY
    m = make_moe(c)
    x, mask, _ = inputs(c)
    graphdef, state = nnx.split(m)
    y, met = _forward(graphdef, "ragged", state, x, mask)
    xf = np.asarray(x).reshape(-1, c.hidden_size)
    sets, _, _ = np_route(xf, m.gate.weight[...], m.gate.e_score_correction_bias[...], c)
    chosen = np.array(sets)[np.asarray(mask).reshape(-1)]
    want = np.bincount(chosen.ravel(), minlength=c.num_experts).astype(np.float32)
    np.testing.assert_array_equal(met["expert_load"], want)
    assert met["expert_load"].dtype == jnp.float32
    assert float(met["max_load_ratio"]) == pytest.approx(want.max() / want.mean(), rel=1e-6)
    assert 0 < want.sum() < xf.shape[0] * c.num_experts_per_token  # some tokens were masked

    none = jnp.zeros_like(mask)
    y0, met0 = _forward(graphdef, "ragged", state, x, none)
    np.testing.assert_array_equal(met0["expert_load"], np.zeros(c.num_experts))
    assert float(met0["max_load_ratio"]) == 0.0
    np.testing.assert_array_equal(y0, y)  # masked tokens are still computed
    _, met_all = m(x)
    assert float(jnp.sum(met_all["expert_load"])) == xf.shape[0] * c.num_experts_per_token


def test_moe_parameter_tree_and_errors():
    m = make_moe(TINY)
    assert isinstance(m.gate.e_score_correction_bias, routing.RoutingBias)
    assert not isinstance(m.gate.e_score_correction_bias, nnx.Param)
    assert m.gate.weight.axes == ("embed", None)
    assert m.experts.w1.axes == ("experts", "expert_embed", "expert_mlp")
    assert m.experts.w2.axes == ("experts", "expert_mlp", "expert_embed")
    params = nnx.state(m, nnx.Param)
    assert "e_score_correction_bias" not in params["gate"]
    x, mask, _ = inputs(TINY)
    with pytest.raises(ValueError, match=r"x \[B, T, D"):
        m(x[0])
    with pytest.raises(ValueError, match="token_mask"):
        m(x, token_mask=mask[:, :3])
    with pytest.raises(ValueError, match="num_experts"):
        moe_lib.MoE(TINY.replace(num_experts=0), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("preset,latent", [("k3-2.8t", True), ("kimi-linear-48b", False)])
def test_full_size_shapes_abstract(preset, latent):
    c = get_preset(preset)
    m = nnx.eval_shape(lambda: moe_lib.MoE(c, rngs=nnx.Rngs(0)))
    e, d, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
    de = c.expert_hidden_size
    assert m.gate.weight.shape == (d, e) and m.gate.weight.dtype == jnp.bfloat16
    assert m.gate.e_score_correction_bias.shape == (e,)
    assert m.experts.w1.shape == m.experts.w3.shape == (e, de, i)
    assert m.experts.w2.shape == (e, i, de)
    assert m.shared_experts.gate_proj.kernel.shape == (d, i * c.num_shared_experts)
    if latent:  # K3 inventory, transposed: down [3584, 7168], norm [3584], up [7168, 3584]
        assert (e, de, i, d) == (896, 3584, 3072, 7168)
        assert m.routed_expert_down_proj.kernel.shape == (7168, 3584)
        assert m.routed_expert_norm.weight.shape == (3584,)
        assert m.routed_expert_up_proj.kernel.shape == (3584, 7168)
        assert m.shared_experts.down_proj.kernel.shape == (6144, 7168)
    else:
        assert m.routed_expert_down_proj is None and m.routed_expert_norm is None


# ---------------------------------------------------------------------------------------------
# Aux-loss-free bias update
# ---------------------------------------------------------------------------------------------

def test_update_routing_bias_sign_rule():
    bias = jnp.array([0.5, 0.0, -0.25, 0.0], jnp.float32)
    load = jnp.array([4.0, 0.0, 2.0, 2.0])  # mean 2
    new = routing.update_routing_bias(bias, load, 0.1)
    np.testing.assert_allclose(new, [0.4, 0.1, -0.25, 0.0], rtol=1e-6)
    with pytest.raises(ValueError, match="must both be"):
        routing.update_routing_bias(bias, load[:3], 0.1)
    with pytest.raises(ValueError, match="rate"):
        routing.update_routing_bias(bias, load, -0.1)


def test_bias_update_balances_a_skewed_load():
    c = TINY.replace(num_experts=8, num_experts_per_token=2)
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(256, c.hidden_size)) + 1.0).astype(np.float32)
    w = (0.1 * rng.normal(size=(c.hidden_size, c.num_experts))).astype(np.float32)
    w[:, :2] += 0.05  # experts 0 and 1 attract every token

    @jax.jit
    def simulate(bias):
        def step(b, _):
            idx, _, _ = routing.route(x, w, b, c)
            load = routing.expert_load(idx, c.num_experts)
            return routing.update_routing_bias(b, load, 0.02), routing.max_load_ratio(load)
        return jax.lax.scan(step, bias, None, length=30)

    bias, ratios = simulate(jnp.zeros(c.num_experts, jnp.float32))
    ratios = np.asarray(ratios)
    assert ratios[0] > 3.5  # nearly all assignments on two of eight experts
    assert ratios[-5:].max() < 2.0 and ratios[-1] < ratios[0] / 2
    assert float(bias[0]) < 0 and float(bias[1]) < 0  # the overloaded experts were pushed down
