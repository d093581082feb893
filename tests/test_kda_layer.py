"""The KDA layer (``kdsa.model.kda_layer``) against a NumPy float64 transcription of its equations.

Two configurations cover both forget gates and both output gates: ``tiny`` (K3: lower-bound gate,
full-rank ``g_proj``) and a Kimi-Linear variant (softplus gate, low-rank ``g_a_proj``/``g_b_proj``).
Few shapes, so each jitted path compiles once or twice.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdsa.model.kda_layer import (KDA, KDACache, causal_depthwise_conv, init_kda_cache,
                                  kda_cache_bytes_per_sequence)
from kdsa.model.presets import tiny

K3 = tiny()
KIMI_LINEAR = K3.replace(linear_attn_config=dataclasses.replace(
    K3.linear_attn_config, use_full_rank_gate=False, gate_lower_bound=None))
CONFIGS = {"k3": K3, "kimi_linear": KIMI_LINEAR}
T = 40


@nnx.jit
def forward(layer, x, segment_ids, cache):
    return layer(x, segment_ids=segment_ids, cache=cache)


def build(name, seed=0):
    layer = KDA(CONFIGS[name], rngs=nnx.Rngs(seed))
    # make the gates matter: A_log away from its lower-bound zero init, o_norm away from ones
    r = np.random.default_rng(seed)
    layer.A_log[...] = jnp.asarray(r.uniform(-1.0, 1.0, layer.A_log.shape), jnp.float32)
    layer.o_norm.weight[...] = jnp.asarray(r.uniform(0.5, 1.5, layer.o_norm.weight.shape),
                                           jnp.float32)
    return layer


def inputs(b, t, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((b, t, K3.hidden_size)),
                       jnp.float32)


def numpy_layer(layer, x, conv_hist=None, state=None):
    """One row x [T, D] in float64, token by token; returns (y, last W-1 conv inputs, state)."""
    p = {".".join(map(str, path)): np.asarray(v[...], np.float64)
         for path, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    cfg = layer.config.linear_attn_config
    h, dk, w = cfg.num_heads, cfg.head_dim, cfg.short_conv_kernel_size
    x = np.asarray(x, np.float64)
    sig = lambda z: 1.0 / (1.0 + np.exp(-z))  # noqa: E731
    proj = np.concatenate([x @ p[f"{n}_proj.kernel"] for n in "qkv"], axis=-1)   # [T, 3HK]
    wconv = np.concatenate([p[f"{n}_conv1d"] for n in "qkv"])                    # [3HK, W]
    hist = list(np.zeros((w - 1, 3 * h * dk)) if conv_hist is None else np.asarray(conv_hist))
    s = np.zeros((h, dk, dk)) if state is None else np.asarray(state, np.float64).copy()
    a = np.exp(p["A_log"])
    ys = []
    for t in range(x.shape[0]):
        hist.append(proj[t])
        window = np.stack(hist[-w:])                                            # [W, 3HK]
        c = np.einsum("wc,cw->c", window, wconv)
        c = (c * sig(c)).reshape(3, h, dk)
        q = c[0] / np.sqrt((c[0] ** 2).sum(-1, keepdims=True) + 1e-6)
        k = c[1] / np.sqrt((c[1] ** 2).sum(-1, keepdims=True) + 1e-6)
        raw = (x[t] @ p["f_a_proj.kernel"] @ p["f_b_proj.kernel"] + p["dt_bias"]).reshape(h, dk)
        lb = cfg.gate_lower_bound
        g = (-a[:, None] * np.logaddexp(0.0, raw) if lb is None
             else lb * sig(a[:, None] * raw))
        beta = sig(x[t] @ p["b_proj.kernel"])
        gate = (x[t] @ p["g_proj.kernel"] if cfg.use_full_rank_gate
                else x[t] @ p["g_a_proj.kernel"] @ p["g_b_proj.kernel"]).reshape(h, dk)
        o = np.zeros((h, dk))
        for hi in range(h):
            s[hi] = np.exp(g[hi])[:, None] * s[hi]
            s[hi] += beta[hi] * np.outer(k[hi], c[2, hi] - s[hi].T @ k[hi])
            o[hi] = s[hi].T @ (dk ** -0.5 * q[hi])
        o = o / np.sqrt((o ** 2).mean(-1, keepdims=True) + layer.config.rms_norm_eps)
        o = o * p["o_norm.weight"] * sig(gate)
        ys.append(o.reshape(-1) @ p["o_proj.kernel"])
    return np.stack(ys), np.stack(hist[-(w - 1):]), s


def flat_window(conv_state):
    """A row's conv window [W-1, 3, H*K] as the reference keeps it: q|k|v concatenated."""
    return conv_state.reshape(conv_state.shape[0], -1)


def err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ---- the full forward -------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_matches_numpy_reference(name):
    layer, x = build(name), inputs(2, T)
    y, cache = forward(layer, x, None, None)
    assert cache is None and y.shape == x.shape and y.dtype == jnp.float32
    for row in range(2):
        y_ref, _, _ = numpy_layer(layer, x[row])
        assert err(y[row], y_ref) <= 1e-4 * max(1.0, float(np.max(np.abs(y_ref)))), row


def test_parameters_mirror_the_checkpoint():
    for name, cfg in CONFIGS.items():
        layer = nnx.eval_shape(lambda cfg=cfg: KDA(cfg, rngs=nnx.Rngs(0)))
        h, dk, w, d = 2, 16, 4, cfg.hidden_size
        shapes = {".".join(map(str, k)): (v.shape, v.dtype, v.get_metadata()["axes"])
                  for k, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
        assert shapes["q_conv1d"] == ((h * dk, w), jnp.float32, ("heads", None))
        assert shapes["A_log"][:2] == ((h,), jnp.float32)
        assert shapes["dt_bias"][:2] == ((h * dk,), jnp.float32)
        assert shapes["f_a_proj.kernel"] == ((d, dk), jnp.float32, ("embed", None))
        assert shapes["o_proj.kernel"][0] == (h * dk, d) and shapes["o_norm.weight"][0] == (dk,)
        gates = {"g_proj.kernel"} if name == "k3" else {"g_a_proj.kernel", "g_b_proj.kernel"}
        assert gates <= set(shapes) and not ({"g_proj.kernel", "g_a_proj.kernel"} - gates) & set(
            shapes)


def test_bfloat16_compute_dtype_and_shapes():
    cfg = K3.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    layer = nnx.eval_shape(lambda: KDA(cfg, rngs=nnx.Rngs(0)))
    x = jax.ShapeDtypeStruct((3, 5, cfg.hidden_size), jnp.bfloat16)
    y, c = nnx.eval_shape(lambda m, x: m(x, cache=init_kda_cache(cfg, 3)), layer, x)
    assert y.shape == (3, 5, cfg.hidden_size) and y.dtype == jnp.bfloat16
    assert c.conv_state.shape == (3, 3, 3, 2 * 16) and c.conv_state.dtype == jnp.bfloat16
    assert c.recurrent_state.shape == (3, 2, 16, 16) and c.recurrent_state.dtype == jnp.float32
    assert kda_cache_bytes_per_sequence(cfg) == 3 * 96 * 2 + 2 * 16 * 16 * 4


# ---- cache: prefill, chunked prefill, decode --------------------------------------------------

def test_prefill_then_decode_equals_full_forward():
    layer, x = build("k3"), inputs(2, T)
    y_full, _ = forward(layer, x, None, None)
    half = T // 2
    y1, cache = forward(layer, x[:, :half], None, init_kda_cache(layer.config, 2))  # prefill
    y2, _ = forward(layer, x[:, half:], None, cache)                     # chunked continuation
    assert err(jnp.concatenate([y1, y2], axis=1), y_full) <= 1e-5
    ys = [y1]
    for t in range(half, T):                                             # token-by-token decode
        y_t, cache = forward(layer, x[:, t:t + 1], None, cache)
        ys.append(y_t)
    assert err(jnp.concatenate(ys, axis=1), y_full) <= 1e-5
    _, conv_ref, state_ref = numpy_layer(layer, x[1])
    assert err(flat_window(cache.conv_state[1]), conv_ref) <= 1e-5
    assert err(cache.recurrent_state[1], state_ref) <= 1e-5


def test_right_padded_batch_equals_each_row_alone():
    layer, x = build("kimi_linear"), inputs(2, T // 2, seed=2)
    lengths = (T // 2, 7)
    ids = jnp.asarray([[1] * n + [0] * (T // 2 - n) for n in lengths], jnp.int32)
    y, cache = forward(layer, x, ids, init_kda_cache(layer.config, 2))
    steps = [inputs(2, 1, seed=3 + i) for i in range(3)]
    ys = []
    for i, x_t in enumerate(steps):                  # row 1 has finished: padded decode steps
        y_t, cache = forward(layer, x_t, jnp.asarray([[1], [0]], jnp.int32), cache)
        ys.append(y_t)
    row0 = jnp.concatenate([x[0]] + [s[0] for s in steps])
    y_ref, conv_ref, s_ref = numpy_layer(layer, row0)
    assert err(jnp.concatenate([y[0]] + [s[0] for s in ys]), y_ref) <= 1e-4
    assert err(flat_window(cache.conv_state[0]), conv_ref) <= 1e-5
    assert err(cache.recurrent_state[0], s_ref) <= 1e-5
    y_ref, conv_ref, s_ref = numpy_layer(layer, x[1, :lengths[1]])
    assert err(y[1, :lengths[1]], y_ref) <= 1e-4
    assert float(jnp.max(jnp.abs(y[1, lengths[1]:]))) == 0.0 and float(
        jnp.max(jnp.abs(jnp.concatenate([s[1] for s in ys])))) == 0.0
    assert err(flat_window(cache.conv_state[1]), conv_ref) <= 1e-5
    assert err(cache.recurrent_state[1], s_ref) <= 1e-5


def test_packed_documents_equal_separate_documents():
    layer, x = build("k3"), inputs(2, T, seed=4)
    ids = np.zeros((2, T), np.int32)
    ids[0, :13], ids[0, 13:34] = 1, 2                 # two documents then padding
    ids[1, :] = 5                                     # one document, no reset
    y, _ = forward(layer, x, jnp.asarray(ids), None)
    for row, sl in ((0, slice(0, 13)), (0, slice(13, 34)), (1, slice(0, T))):
        y_ref, _, _ = numpy_layer(layer, x[row, sl])  # each document from a fresh state and conv
        assert err(y[row, sl], y_ref) <= 1e-4, (row, sl)
    assert float(jnp.max(jnp.abs(y[0, 34:]))) == 0.0


def test_packed_documents_shorter_than_the_conv_window():
    """Sequences of T < W - 1 tokens (T = 1 and 2 for W = 4) with packed documents: each
    one-token document equals that token alone (the conv taps reach back further than T)."""
    layer = build("k3")
    for t, ids in ((1, [[3]]), (2, [[1, 2]]), (2, [[4, 4]])):
        x = inputs(1, t, seed=6 + t)
        y, _ = forward(layer, x, jnp.asarray(ids, jnp.int32), None)
        starts = [i for i in range(t) if i == 0 or ids[0][i] != ids[0][i - 1]] + [t]
        for a, b in zip(starts, starts[1:]):
            y_ref, _, _ = numpy_layer(layer, x[0, a:b])
            assert err(y[0, a:b], y_ref) <= 1e-4, (t, ids, a)


# ---- gradients and bad input ------------------------------------------------------------------

def test_gradients_finite_and_nonzero():
    layer, x = build("kimi_linear"), inputs(2, T, seed=5)

    @nnx.jit
    def grads(layer, x):
        return nnx.grad(lambda m, x: jnp.sum(m(x)[0] ** 2), argnums=(0, 1))(layer, x)

    g_layer, g_x = grads(layer, x)
    for path, v in nnx.to_flat_state(g_layer):
        assert bool(jnp.all(jnp.isfinite(v[...]))) and float(jnp.max(jnp.abs(v[...]))) > 0, path
    assert bool(jnp.all(jnp.isfinite(g_x)))


def test_bad_input_raises():
    layer = build("k3")
    with pytest.raises(ValueError, match="hidden_size"):
        layer(jnp.zeros((1, 4, 7)))
    with pytest.raises(ValueError, match="segment_ids"):
        layer(inputs(1, 4), segment_ids=jnp.ones((1, 5), jnp.int32))
    with pytest.raises(ValueError, match="KDACache"):
        layer(inputs(2, 4), cache=init_kda_cache(layer.config, 1))
    assert isinstance(init_kda_cache(layer.config, 1), KDACache)
    x, w = jnp.zeros((1, 4, 3)), jnp.zeros((3, 4))
    with pytest.raises(ValueError, match="history .* or seg .*, not both"):
        causal_depthwise_conv(x, w, history=jnp.zeros((1, 3, 3)), seg=jnp.ones((1, 4), jnp.int32))
