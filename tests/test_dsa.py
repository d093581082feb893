"""DSA maths (``kdsa.model.dsa``) and RoPE (``kdsa.model.rope``) against NumPy references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdsa.kernels_pallas.common import compile_target
from kdsa.kernels_pallas.sparse_mla.ref import dense_masked_mla_attention
from kdsa.model import dsa, rope, topk
from kdsa.model.config import YarnConfig, get_preset
from numpy_refs import np_rotate

RNG = np.random.default_rng(0)


def randn(*shape, scale=1.0):
    return (scale * RNG.standard_normal(shape)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# NumPy references (float64, loops / complex numbers: paths unlike the JAX code)
# ---------------------------------------------------------------------------------------------

def np_yarn_inv_freq(dim, base, factor, orig, beta_fast, beta_slow):
    """Hugging Face-style YaRN: blend of extrapolated and interpolated frequencies."""
    pos_freqs = base ** (np.arange(0, dim, 2) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def corr(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 1e-3), 0, 1)
    extra_factor = 1 - ramp
    return interpolation * (1 - extra_factor) + extrapolation * extra_factor


def np_visible(q_pos, kv_pos, q_seg, kv_seg):
    b, t, s = q_pos.shape[0], q_pos.shape[1], kv_pos.shape[1]
    out = np.zeros((b, t, s), bool)
    for i in range(b):
        for j in range(t):
            for k in range(s):
                out[i, j, k] = kv_pos[i, k] <= q_pos[i, j] and kv_seg[i, k] == q_seg[i, j]
    return out


def np_index_scores(q, k, w):
    b, t, j, _ = q.shape
    out = np.zeros((b, t, k.shape[1]))
    for h in range(j):
        dots = np.einsum("btd,bsd->bts", q[:, :, h].astype(np.float64), k.astype(np.float64))
        out += w[:, :, h, None] * np.maximum(dots, 0.0)
    return out


def np_sparse_attention(q, kv, idx, scale, v_dim):
    """Loop over slots: each valid slot is one softmax term (duplicates count twice)."""
    q, kv = q.astype(np.float64), kv.astype(np.float64)
    b, t, n, _ = q.shape
    out, lse = np.zeros((b, t, n, v_dim)), np.full((b, t, n), -np.inf)
    for i in range(b):
        for j in range(t):
            sel = [s for s in idx[i, j] if 0 <= s < kv.shape[1]]
            if not sel:
                continue
            rows = kv[i, sel]  # [K', Dk]
            logits = q[i, j] @ rows.T * scale  # [N, K']
            m = logits.max(-1, keepdims=True)
            e = np.exp(logits - m)
            out[i, j] = e @ rows[:, :v_dim] / e.sum(-1, keepdims=True)
            lse[i, j] = m[:, 0] + np.log(e.sum(-1))
    return out, lse


def np_kl(attn_logits, index_logits, mask):
    """KL(p || softmax(I)) per query; attn [B,T,N,S], index [B,T,S], mask [B,T,S]."""
    b, t = mask.shape[:2]
    out = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            m = mask[i, j]
            if not m.any():
                continue
            a = attn_logits[i, j][:, m]
            pa = np.exp(a - a.max(-1, keepdims=True))
            p = (pa / pa.sum(-1, keepdims=True)).sum(0)
            p /= p.sum()
            s = index_logits[i, j][m]
            log_q = s - s.max() - np.log(np.exp(s - s.max()).sum())
            out[i, j] = np.sum(p * (np.log(p) - log_q))
    return out


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rope_layouts_match_numpy(layout):
    fn = rope.rope_interleaved if layout == "interleaved" else rope.rope_half_split
    inv = rope.rope_inv_freq(8, 10000.0)
    pos = RNG.integers(0, 3000, (2, 5)).astype(np.int32)
    for shape in [(2, 5, 8), (2, 5, 3, 8)]:
        x = randn(*shape)
        got = fn(jnp.asarray(x), jnp.asarray(pos), inv)
        np.testing.assert_allclose(got, np_rotate(x, pos, inv, layout), atol=2e-5)
    # the two layouts differ (a swapped layout would pass neither test)
    other = rope.rope_half_split if layout == "interleaved" else rope.rope_interleaved
    x = randn(2, 5, 8)
    assert np.abs(np.asarray(fn(x, pos, inv)) - np.asarray(other(x, pos, inv))).max() > 1e-2


@pytest.mark.parametrize("fn", [rope.rope_interleaved, rope.rope_half_split])
def test_rope_is_relative(fn):
    """<R(m) q, R(n) k> depends only on m - n; rotation preserves norms."""
    inv = rope.rope_inv_freq(16, 10000.0)
    q, k = randn(1, 1, 16), randn(1, 1, 16)
    dot = lambda m, n: float(jnp.sum(fn(q, jnp.full((1, 1), m), inv)  # noqa: E731
                                     * fn(k, jnp.full((1, 1), n), inv)))
    assert dot(7, 3) == pytest.approx(dot(107, 103), rel=1e-4, abs=1e-4)
    assert dot(7, 3) != pytest.approx(dot(7, 4), rel=1e-3)
    np.testing.assert_allclose(np.linalg.norm(fn(q, jnp.full((1, 1), 55), inv)),
                               np.linalg.norm(q), rtol=1e-5)


def test_inv_freq_plain_and_yarn():
    np.testing.assert_allclose(rope.rope_inv_freq(64, 1e4), 1e4 ** (-np.arange(0, 64, 2) / 64),
                               rtol=1e-6)
    y = YarnConfig(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                   beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    got = rope.rope_inv_freq(64, 1e4, y)
    np.testing.assert_allclose(got, np_yarn_inv_freq(64, 1e4, 40.0, 4096, 32.0, 1.0), rtol=1e-6)
    plain = rope.rope_inv_freq(64, 1e4)
    np.testing.assert_allclose(got[:10], plain[:10], rtol=1e-6)  # fast pairs kept
    np.testing.assert_allclose(got[23:], plain[23:] / 40.0, rtol=1e-6)  # slow pairs interpolated
    mid, mid_plain = got[11:23], plain[11:23]  # the ramp: strictly between the two
    assert np.all((mid < mid_plain * 0.999) & (mid > mid_plain / 40.0 * 1.001))
    with pytest.raises(ValueError, match="even"):
        rope.rope_inv_freq(7, 1e4)


def test_mscale_and_softmax_scale():
    assert rope.yarn_get_mscale(40.0, 1.0) == pytest.approx(1 + 0.1 * math.log(40.0))
    assert rope.yarn_get_mscale(1.0, 1.0) == 1.0
    cfg = get_preset("tiny")
    assert rope.mla_softmax_scale(cfg) == pytest.approx(24 ** -0.5)
    y = YarnConfig(factor=40.0, original_max_position_embeddings=64, mscale_all_dim=1.0)
    cfg = cfg.replace(mla_use_nope=False, rope_scaling=y)
    assert rope.mla_softmax_scale(cfg) == pytest.approx(24 ** -0.5 * 1.3688879 ** 2, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# indexer and top-k
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("t,j", [(5, 3), (1, 3), (1, 32)])  # t = 1: a decode step's forms
def test_indexer_scores_match_loops(t, j):
    q, k, w = randn(2, t, j, 4), randn(2, 7, 4), randn(2, t, j)
    np.testing.assert_allclose(dsa.indexer_scores(q, k, w), np_index_scores(q, k, w),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="indexer_scores"):
        dsa.indexer_scores(q, k[..., :3], w)


def _causal_packed(b, t):
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    seg = np.ones((b, t), np.int32)
    seg[1, 6:] = 2  # row 1: two documents
    seg[1, 11:] = 0  # then padding
    return pos, seg


def test_indexer_topk_sets_match_numpy():
    """Selected sets equal NumPy's (continuous random inputs: no ties), chunked with padding."""
    b, t, k_top = 2, 13, 4
    q, k, w = randn(b, t, 3, 4), randn(b, t, 4), randn(b, t, 3)
    pos, seg = _causal_packed(b, t)
    idx = np.asarray(dsa.indexer_topk(q, k, w, k_top, q_pos=pos, kv_pos=pos, q_seg=seg,
                                      kv_seg=seg, chunk_size=5))
    assert idx.shape == (b, t, k_top) and idx.dtype == np.int32
    scores, vis = np_index_scores(q, k, w), np_visible(pos, pos, seg, seg)
    for i in range(b):
        for j in range(t):
            cand = np.flatnonzero(vis[i, j])
            want = cand[np.argsort(-scores[i, j, cand])][:k_top]
            got = idx[i, j][idx[i, j] >= 0]
            assert sorted(got) == sorted(want), (i, j)
            assert np.sum(idx[i, j] < 0) == k_top - len(want)  # short rows padded with -1
            assert np.all(got <= j)  # never a future token


@pytest.mark.parametrize("pool_rows", [40, 100])  # <= 2 S and one query: the pool scored whole
@pytest.mark.parametrize("t", [1, 13])
def test_indexer_topk_through_key_rows_equals_gathered_keys(pool_rows, t):
    """Keys in a pool [R, D] reached through key_rows [B, S] select what the gathered keys do."""
    b, s, k_top = 2, 20, 4
    rng = np.random.default_rng(3)
    pool = randn(pool_rows, 4)
    key_rows = np.stack([rng.choice(pool_rows, s, replace=False) for _ in range(b)]).astype(
        np.int32)
    q, w = randn(b, t, 3, 4), randn(b, t, 3)
    q_pos = np.broadcast_to(np.arange(s - t, s, dtype=np.int32), (b, t))
    kv_pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    vis = dict(q_pos=q_pos, kv_pos=kv_pos, q_seg=np.ones((b, t), np.int32),
               kv_seg=np.ones((b, s), np.int32), chunk_size=5)
    want = np.asarray(dsa.indexer_topk(q, pool[key_rows], w, k_top, **vis))
    got = np.asarray(dsa.indexer_topk(q, pool, w, k_top, key_rows=key_rows, **vis))
    np.testing.assert_array_equal(np.sort(got, -1), np.sort(want, -1))


def test_select_topk_wider_than_keys():
    """topk > S: width S; every visible key selected; a row with nothing visible is all -1."""
    scores = jnp.asarray(randn(1, 3, 3))
    vis = jnp.asarray(np.tril(np.ones((3, 3), bool))[None] & np.array([1, 1, 0], bool)[None, :,
                                                                                      None])
    idx = np.asarray(dsa.select_topk(scores, vis, 8))
    assert idx.shape == (1, 3, 3)
    assert sorted(idx[0, 0]) == [-1, -1, 0] and sorted(idx[0, 1]) == [-1, 0, 1]
    assert list(idx[0, 2]) == [-1, -1, -1]


@pytest.mark.parametrize("k,block", [(5, 4), (3, 8), (1, 16)])
def test_blockwise_top_k_is_lax_top_k_exactly(k, block):
    """The two-stage top-k returns ``lax.top_k``'s values and indices, tie order included:
    scores on 4 levels (many ties), masked entries, a row with fewer than k visible entries, a
    row with none, and a length that is no multiple of the block."""
    x = RNG.integers(0, 4, (2, 4, 103)).astype(np.float32)
    x[RNG.random(x.shape) < 0.3] = -np.inf
    x[0, 1, 3:] = -np.inf  # 3 entries at most visible
    x[1, 2] = -np.inf      # nothing visible
    x = np.where(x == 0, 0.0, x)  # what select_topk hands it: one zero
    want_v, want_i = jax.lax.top_k(jnp.asarray(x), k)
    got_v, got_i = topk.blockwise_top_k(jnp.asarray(x), k, block)
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    finite = np.isfinite(np.asarray(want_v))  # -inf slots are -1 after select_topk either way
    np.testing.assert_array_equal(np.asarray(got_i)[finite], np.asarray(want_i)[finite])


def test_select_topk_takes_the_blockwise_path_on_long_rows(monkeypatch):
    scores, vis = jnp.asarray(randn(2, 3, 300)), jnp.asarray(RNG.random((2, 3, 300)) < 0.8)
    want = np.asarray(dsa.select_topk(scores, vis, 4))
    called = []
    monkeypatch.setattr(topk, "TOPK_BLOCK", 8)
    real = topk.blockwise_top_k
    monkeypatch.setattr(topk, "blockwise_top_k", lambda *a: called.append(a[1:]) or real(*a))
    np.testing.assert_array_equal(np.asarray(dsa.select_topk(scores, vis, 4)), want)
    assert called == [(4, 8)]


def _threshold_cases(k: int, stride: int, s: int) -> np.ndarray:
    """Rows for the sampled threshold: random, 4 levels (ties), rising with the position, fewer
    than k visible, between k and 2k visible, none visible, and a row whose largest entries sit
    exactly on the sampled positions (the threshold then leaves fewer than k: the plain top-k)."""
    rng = np.random.default_rng(7)
    rows = [rng.standard_normal(s), rng.integers(0, 4, s).astype(np.float64),
            rng.standard_normal(s) + np.linspace(0, 3, s)]
    for visible in (k - 3, k + 5, 0):
        row = np.full(s, -np.inf)
        row[rng.choice(s, visible, replace=False)] = rng.standard_normal(visible)
        rows.append(row)
    row = rng.standard_normal(s)
    row[::stride] = 100.0 + np.arange(len(row[::stride]))
    rows.append(row)
    x = np.stack(rows).astype(np.float32)
    return np.where(x == 0, 0.0, x)  # what select_topk hands it: one zero


@pytest.mark.parametrize("k,stride", [(8, 4), (5, 16)])
def test_thresholded_top_k_is_lax_top_k_exactly(k, stride):
    """Values and indices equal ``lax.top_k``'s, tie order and -inf slots included, on every
    kind of row; the last row takes the plain top-k (a thresholded one would lose entries)."""
    x = jnp.asarray(_threshold_cases(k, stride, 16 * k * 2 + 3))
    want_v, want_i = jax.lax.top_k(x, k)
    sample = np.asarray(x)[:, ::stride]
    lo = -np.sort(-sample, axis=1)[:, min(max(1, 2 * k // stride), sample.shape[1]) - 1]
    kept = (np.asarray(x) >= lo[:, None]).sum(axis=1)
    assert (kept[:-1] >= k).all() and kept[-1] < k  # all rows but the last take the threshold
    for rows in (x, x[:-1], x[-1:]):  # with and without the row that needs the plain top-k
        got_v, got_i = topk.thresholded_top_k(rows, k, stride)
        n = rows.shape[0]
        sel = slice(0, n) if n > 1 else slice(-1, None)
        np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v[sel]))
        np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i[sel]))


def test_select_topk_takes_the_threshold_on_cpu_and_not_for_tpu(monkeypatch):
    scores = jnp.asarray(randn(2, 3, 300))
    vis = jnp.asarray(RNG.random((2, 3, 300)) < 0.8)
    monkeypatch.setattr(topk, "TOPK_SAMPLE_FROM", 10**9)
    want = np.asarray(dsa.select_topk(scores, vis, 4))
    monkeypatch.setattr(topk, "TOPK_SAMPLE_FROM", 16)
    monkeypatch.setattr(topk, "TOPK_SAMPLE_MIN_K", 4)
    called = []
    real = topk.thresholded_top_k
    monkeypatch.setattr(topk, "thresholded_top_k",
                        lambda *a: called.append(a[1:]) or real(*a))
    np.testing.assert_array_equal(np.asarray(dsa.select_topk(scores, vis, 4)), want)
    assert called == [(4, topk.TOPK_SAMPLE_STRIDE)]
    monkeypatch.setattr(topk, "compile_platform", lambda: "tpu")
    np.testing.assert_array_equal(np.asarray(dsa.select_topk(scores, vis, 4)), want)
    assert len(called) == 1


# ---------------------------------------------------------------------------------------------
# sparse attention
# ---------------------------------------------------------------------------------------------

def _sparse_case():
    b, t, n, s, dk, v, k = 2, 11, 4, 13, 12, 8, 6
    q, kv = randn(b, t, n, dk), randn(b, s, dk)
    idx = RNG.integers(-1, s, (b, t, k)).astype(np.int32)
    idx[0, 3] = -1  # a row with no valid index
    idx[1, 2] = [5, 5, 5, 2, -1, 7]  # duplicates
    idx[1, 4, 0] = s + 3  # out of range counts as invalid
    return q, kv, idx, 0.37, v


def test_sparse_attention_matches_references():
    q, kv, idx, scale, v = _sparse_case()
    out, lse = dsa.sparse_mla_attention(q, kv, idx, scale, v, chunk_size=4)
    ref_out, ref_lse = dense_masked_mla_attention(q, kv, idx, scale, v)
    np_out, np_lse = np_sparse_attention(q, kv, idx, scale, v)
    assert out.dtype == jnp.float32 and out.shape == (2, 11, 4, 8) and lse.shape == (2, 11, 4)
    for o, l in ((ref_out, ref_lse), (np_out, np_lse)):
        np.testing.assert_allclose(out, o, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse, l, rtol=1e-5, atol=1e-6)  # -inf rows compare equal
    assert np.all(np.asarray(out)[0, 3] == 0) and np.all(np.isneginf(np.asarray(lse)[0, 3]))
    # duplicates count twice: [5,5,5,2,7] is not the same as {2,5,7}
    dedup = np.array([[[5, 2, 7, -1, -1, -1]]], np.int32)
    o_dedup, _ = dsa.sparse_mla_attention(q[1:2, 2:3], kv[1:2], dedup, scale, v)
    assert np.abs(np.asarray(o_dedup)[0, 0] - np.asarray(out)[1, 2]).max() > 1e-3


def test_sparse_attention_gradients_match_dense_reference():
    q, kv, idx, scale, v = _sparse_case()
    r_out, r_lse = randn(2, 11, 4, 8), randn(2, 11, 4)

    def loss(fn):
        def f(q, kv):
            out, lse = fn(q, kv)
            return jnp.sum(out * r_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * r_lse)
        return jax.jit(jax.grad(f, argnums=(0, 1)))(jnp.asarray(q), jnp.asarray(kv))

    gs = loss(lambda q, kv: dsa.sparse_mla_attention(q, kv, idx, scale, v, chunk_size=4))
    gd = loss(lambda q, kv: dense_masked_mla_attention(q, kv, idx, scale, v))
    for a, b in zip(gs, gd):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(gs[0])[0, 3] == 0)  # the empty row gets no gradient


def test_key_parts_equal_one_array():
    """kv given as (latent, rope) parts (the cache layout) == the concatenated array."""
    q, kv, idx, scale, v = _sparse_case()
    whole = dsa.sparse_mla_attention(q, kv, idx, scale, v, chunk_size=4)
    split = dsa.sparse_mla_attention(q, (kv[..., :9], kv[..., 9:]), idx, scale, v, chunk_size=4)
    for a, b in zip(whole, split):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    pos, seg = _causal_packed(2, 11)
    kv11 = kv[:, :11, None]
    vis = dict(q_pos=pos, kv_pos=pos, q_seg=seg, kv_seg=seg, chunk_size=4)
    whole = dsa.dense_attention(q, kv11, kv11[..., :v], scale, **vis)
    split = dsa.dense_attention(q, (kv11[..., :9], kv11[..., 9:]), kv11[..., :v], scale, **vis)
    for a, b in zip(whole, split):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="add up to"):
        dsa.sparse_mla_attention(q, (kv[..., :9], kv[..., 10:]), idx, scale, v)
    with pytest.raises(ValueError, match="add up to"):
        dsa.dense_attention(q, (kv11[..., :9],), kv11[..., :v], scale, **vis)


def test_sparse_attention_rejects_bad_shapes():
    q, kv, idx, scale, v = _sparse_case()
    with pytest.raises(ValueError, match="kv must be"):
        dsa.sparse_mla_attention(q, kv[..., :5], idx, scale, v)
    with pytest.raises(ValueError, match="indices must be"):
        dsa.sparse_mla_attention(q, kv, idx[:, :3], scale, v)
    with pytest.raises(ValueError, match="v_dim"):
        dsa.sparse_mla_attention(q, kv, idx, scale, 99)


# ---------------------------------------------------------------------------------------------
# dense attention (MHA and MQA forms)
# ---------------------------------------------------------------------------------------------

def test_dense_attention_mqa_equals_sparse_with_all_visible_indices():
    """Absorbed MQA dense path == dense-masked reference fed every visible key, grads too."""
    b, t, n, dk, v = 2, 9, 4, 10, 6
    q, kv = randn(b, t, n, dk), randn(b, t, dk)
    pos, seg = _causal_packed(b, t)
    vis = np_visible(pos, pos, seg, seg)
    idx = np.where(vis, np.arange(t)[None, None], -1).astype(np.int32)

    def dense(q, kv):
        return dsa.dense_attention(q, kv[:, :, None], kv[:, :, None, :v], 0.3, q_pos=pos,
                                   kv_pos=pos, q_seg=seg, kv_seg=seg, chunk_size=4)

    ref = lambda q, kv: dense_masked_mla_attention(q, kv, idx, 0.3, v)  # noqa: E731
    for a, b_ in zip(dense(q, kv), ref(q, kv)):
        np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-6)

    def f(fn):
        return jax.jit(jax.grad(lambda q, kv: jnp.sum(fn(q, kv)[0] ** 2), (0, 1)))(q, kv)

    for a, b_ in zip(f(dense), f(ref)):
        np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-5)


def test_dense_attention_mha_matches_numpy():
    b, t, n, d, v = 2, 9, 2, 5, 3
    q, k, vv = randn(b, t, n, d), randn(b, t, n, d), randn(b, t, n, v)
    pos, seg = _causal_packed(b, t)
    out, lse = dsa.dense_attention(q, k, vv, 0.5, q_pos=pos, kv_pos=pos, q_seg=seg, kv_seg=seg,
                                   chunk_size=3)
    vis = np_visible(pos, pos, seg, seg)
    for i in range(b):
        for j in range(t):
            for h in range(n):
                lg = q[i, j, h].astype(np.float64) @ k[i, :, h].T * 0.5
                lg = np.where(vis[i, j], lg, -np.inf)
                p = np.exp(lg - lg.max())
                np.testing.assert_allclose(out[i, j, h], p @ vv[i, :, h] / p.sum(), rtol=1e-5,
                                           atol=1e-6)
                assert lse[i, j, h] == pytest.approx(lg.max() + np.log(p.sum()), rel=1e-5)
    with pytest.raises(ValueError, match="q_pos"):
        dsa.dense_attention(q, k, vv, 0.5, q_pos=pos[:, :3], kv_pos=pos, q_seg=seg, kv_seg=seg,
                            chunk_size=3)


@pytest.mark.parametrize("groups", [1, 2, 4])  # 1: MLA's absorbed decode (keys without heads)
def test_dense_attention_one_query_matches_numpy(groups):
    """The one-query (decode) path, keys-major, against NumPy: GQA groups, key parts, a row
    that sees nothing (out 0, lse -inf), a row that sees part of the keys."""
    b, s, n, v = 3, 11, 4, 3
    q = randn(b, 1, n, 7)
    k = (randn(b, s, groups, 5), randn(b, s, groups, 2))
    vv = randn(b, s, groups, v)
    kv_pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    q_pos = np.array([[s - 1], [4], [s - 1]], np.int32)
    kv_seg = np.ones((b, s), np.int32)
    q_seg = np.array([[1], [1], [0]], np.int32)  # row 2: a segment no key has
    out, lse = dsa.dense_attention(q, k, vv, 0.5, q_pos=q_pos, kv_pos=kv_pos, q_seg=q_seg,
                                   kv_seg=kv_seg, chunk_size=4)
    keys = np.concatenate(k, -1).astype(np.float64)
    for i in range(b):
        for h in range(n):
            gi = h // (n // groups)
            lg = keys[i, :, gi] @ q[i, 0, h].astype(np.float64) * 0.5
            seen = (kv_pos[i] <= q_pos[i, 0]) & (kv_seg[i] == q_seg[i, 0])
            if not seen.any():
                assert np.all(out[i, 0, h] == 0) and lse[i, 0, h] == -np.inf
                continue
            lg = np.where(seen, lg, -np.inf)
            p = np.exp(lg - lg.max())
            np.testing.assert_allclose(out[i, 0, h], p @ vv[i, :, gi] / p.sum(), rtol=1e-5,
                                       atol=1e-6)
            assert lse[i, 0, h] == pytest.approx(lg.max() + np.log(p.sum()), rel=1e-5)


# ---------------------------------------------------------------------------------------------
# indexer KL losses
# ---------------------------------------------------------------------------------------------

def test_kl_dense_matches_numpy_and_grads_only_reach_indexer():
    b, t, n, d, j, di = 2, 9, 3, 5, 2, 4
    q, k = randn(b, t, n, d), randn(b, t, n, d)
    iq, ik, iw = randn(b, t, j, di), randn(b, t, di), randn(b, t, j)
    pos, seg = _causal_packed(b, t)
    vis = dict(q_pos=pos, kv_pos=pos, q_seg=seg, kv_seg=seg, chunk_size=4)
    kl = dsa.indexer_kl_dense(q, k, 0.4, iq, ik, iw, **vis)
    attn = np.einsum("btnd,bsnd->btns", q.astype(np.float64), k) * 0.4
    want = np_kl(attn, np_index_scores(iq, ik, iw), np_visible(pos, pos, seg, seg))
    np.testing.assert_allclose(kl, want, rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(kl) >= -1e-6) and np.asarray(kl).max() > 0.01
    g = jax.jit(jax.grad(lambda q, k, iq, ik, iw: jnp.sum(
        dsa.indexer_kl_dense(q, k, 0.4, iq, ik, iw, **vis)), argnums=(0, 1, 2, 3, 4)))(
            q, k, iq, ik, iw)
    assert np.all(np.asarray(g[0]) == 0) and np.all(np.asarray(g[1]) == 0)  # target detached
    assert all(np.abs(np.asarray(x)).max() > 0 for x in g[2:])


def test_kl_sparse_matches_numpy_on_selected_set():
    b, t, n, dk, j, di, s = 2, 7, 3, 6, 2, 4, 10
    q, kv = randn(b, t, n, dk), randn(b, s, dk)
    iq, ik, iw = randn(b, t, j, di), randn(b, s, di), randn(b, t, j)
    idx = np.stack([RNG.permutation(s)[:4] for _ in range(b * t)]).reshape(b, t, 4)
    idx = idx.astype(np.int32)
    idx[0, 1, 2:] = -1
    idx[1, 3] = -1  # empty row: KL 0
    kl = dsa.indexer_kl_sparse(q, kv, idx, 0.4, iq, ik, iw, chunk_size=3)
    mask = np.zeros((b, t, s), bool)
    for i in range(b):
        for tt in range(t):
            mask[i, tt, idx[i, tt][idx[i, tt] >= 0]] = True
    attn = np.einsum("btnd,bsd->btns", q.astype(np.float64), kv) * 0.4
    want = np_kl(attn, np_index_scores(iq, ik, iw), mask)
    np.testing.assert_allclose(kl, want, rtol=1e-4, atol=1e-6)
    assert float(kl[1, 3]) == 0.0


def test_cpu_gather_chunks_fit_the_cache(monkeypatch):
    """On CPU a gather's query chunk is sized so its rows stay in cache: one query at K3's widths
    (top-2048 rows of 576 floats), the caller's chunk at tiny widths and for a TPU compile; the
    outputs and gradients do not depend on it."""
    assert dsa.gather_chunk(256, 2048, 576) == 1
    assert dsa.gather_chunk(256, 8 * 512, 576) == 1  # a batch of 8 rows gathers 8x the rows
    assert dsa.gather_chunk(256, 512, 576) == 4
    assert dsa.gather_chunk(256, 8, 40) == 256
    with compile_target("tpu"):
        assert dsa.gather_chunk(256, 2048, 576) == 256
    q, kv, idx, scale, v = _sparse_case()  # T 11, K 6, Dk 12, B 2

    def run():
        out = dsa.sparse_mla_attention(q, kv, idx, scale, v, chunk_size=16)
        grads = jax.grad(lambda q, kv: dsa.sparse_mla_attention(
            q, kv, idx, scale, v, chunk_size=16)[0].sum(), argnums=(0, 1))(q, kv)
        return out, grads

    whole = run()  # one chunk of 11 queries
    monkeypatch.setattr(dsa, "CPU_GATHER_BYTES", 4 * (2 * 6) * 12 * 3)  # three queries' rows
    assert dsa.gather_chunk(16, 2 * 6, 12) == 2
    chunked = run()  # six chunks of 2, the last one padded
    # one row's rows fit, the batch's do not: the two rows become one of 22 queries (indices
    # offset into the joined keys; -1, out-of-range and duplicated indices in _sparse_case)
    monkeypatch.setattr(dsa, "CPU_GATHER_BYTES", 4 * 6 * 12)
    assert dsa._rows_outgrow_cpu_cache(2 * 6, 12) and not dsa._rows_outgrow_cpu_cache(6, 12)
    joined = run()
    for got in (chunked, joined):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(whole)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t,j,d", [(1, 4, 16), (1, 32, 16), (1, 4, 128), (5, 4, 16)])
def test_indexer_scores_of_bfloat16_inputs_accumulate_in_float32(t, j, d):
    """bfloat16 queries and keys (``index_dtype``) multiply exactly and sum in float32, on every
    product path (decode keys-major, fused, query-major; prefill)."""
    q, k, w = randn(2, t, j, d), randn(2, 50, d), randn(2, t, j)
    qb, kb = jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16)
    got = dsa.indexer_scores(qb, kb, w)
    assert got.dtype == jnp.float32
    want = np_index_scores(np.asarray(qb, np.float64), np.asarray(kb, np.float64), w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(got) - np_index_scores(q, k, w)).max() > 1e-4  # rounded inputs
