"""Block AttnRes: the fixed-buffer mix and push against a NumPy transcription of the
growing-list protocol (sglang-jax ``kimi_k3_residual.py`` / vLLM ``kimi_k3``)."""

import jax
import jax.numpy as jnp
import numpy as np

from kdsa.model.attn_res import attn_res_mix, initial_residual, push_block


def np_mix(prefix, blocks, norm_w, proj, eps):
    """values = [*blocks, prefix]; softmax over proj . rmsnorm(v); weighted sum (float64)."""
    values = np.stack(list(blocks) + [prefix], axis=-2).astype(np.float64)
    normed = values / np.sqrt(np.mean(values**2, -1, keepdims=True) + eps) * norm_w
    s = normed @ proj
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return (w[..., None] * values).sum(-2)


def test_mix_matches_reference_for_every_count():
    rng = np.random.default_rng(0)
    b, t, nb, d = 2, 3, 4, 8
    blocks = rng.normal(size=(b, t, nb, d)).astype(np.float32)
    prefix = rng.normal(size=(b, t, d)).astype(np.float32)
    norm_w, proj = rng.normal(size=d) + 1, rng.normal(size=d)
    for n in range(nb + 1):
        got = attn_res_mix(jnp.asarray(prefix), jnp.asarray(blocks), jnp.int32(n),
                           jnp.asarray(norm_w, jnp.float32), jnp.asarray(proj, jnp.float32), 1e-5)
        want = np_mix(prefix, [blocks[:, :, i] for i in range(n)], norm_w, proj, 1e-5)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # one candidate: the mix is the prefix itself (layer 0 sees only the embedding)
    got = attn_res_mix(jnp.asarray(prefix), jnp.asarray(blocks), jnp.int32(0),
                       jnp.ones(d), jnp.asarray(proj, jnp.float32), 1e-5)
    np.testing.assert_allclose(np.asarray(got), prefix, rtol=1e-6)


def test_protocol_over_depth_matches_growing_list():
    """Drive the buffer through 7 layers of block size 3 with fake sublayers and compare every
    sublayer input with the list protocol (prefix restarts at each checkpoint)."""
    rng = np.random.default_rng(1)
    b, t, d, n_layers, bs = 1, 2, 4, 7, 3
    nb = -(-n_layers // bs)
    emb = rng.normal(size=(b, t, d)).astype(np.float32)
    outs = rng.normal(size=(n_layers, 2, b, t, d)).astype(np.float32)  # attn, mlp outputs
    w = [(rng.normal(size=d) + 1, rng.normal(size=d)) for _ in range(2 * n_layers)]

    # reference: growing list
    blocks, prefix, ref_inputs = [], emb.astype(np.float64), []
    for i in range(n_layers):
        ref_inputs.append(np_mix(prefix, blocks, *w[2 * i], 1e-5))
        if i % bs == 0:
            blocks, prefix = blocks + [prefix], None
        prefix = outs[i, 0] if prefix is None else prefix + outs[i, 0]
        ref_inputs.append(np_mix(prefix, blocks, *w[2 * i + 1], 1e-5))
        prefix = prefix + outs[i, 1]

    res = initial_residual(jnp.asarray(emb), nb)
    got_inputs = []
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    for i in range(n_layers):
        got_inputs.append(attn_res_mix(res.hidden, res.blocks, res.n_blocks, *map(f32, w[2 * i]),
                                       1e-5))
        res = push_block(res, jnp.asarray(i % bs == 0))
        res = res.replace(hidden=res.hidden + outs[i, 0])
        got_inputs.append(attn_res_mix(res.hidden, res.blocks, res.n_blocks,
                                       *map(f32, w[2 * i + 1]), 1e-5))
        res = res.replace(hidden=res.hidden + outs[i, 1])
    assert int(res.n_blocks) == nb
    for got, want in zip(got_inputs, ref_inputs):
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_mix_gradients_finite_with_masked_slots():
    b, t, nb, d = 1, 2, 3, 4
    key = jax.random.key(0)
    blocks = jax.random.normal(key, (b, t, nb, d))
    prefix = jax.random.normal(jax.random.key(1), (b, t, d))

    def f(prefix, blocks, proj):
        return attn_res_mix(prefix, blocks, jnp.int32(1), jnp.ones(d), proj, 1e-5).sum()

    g = jax.grad(f, argnums=(0, 1, 2))(prefix, blocks, jnp.ones(d))
    assert all(bool(jnp.isfinite(x).all()) for x in g)
    assert float(jnp.abs(g[1][:, :, 1:]).max()) == 0.0  # unused slots get no gradient
