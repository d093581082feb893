"""GatedDSA layer: against a NumPy MHA-form reference, decode vs forward, masking, loss gradients."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from kdsa.model.config import YarnConfig, get_preset
from kdsa.model.dsa_cache import DSACache, dsa_cache_bytes_per_token, init_dsa_cache
from kdsa.model.dsa_layer import MLA_LATENT_NORM_EPS, GatedDSA
from kdsa.model.rope import rope_inv_freq
from numpy_refs import np_rotate  # the NumPy RoPE reference (complex multiplication)

TINY = get_preset("tiny")  # NoPE, gate, q_lora 32, topk 8, query chunk 16
ROPE = TINY.replace(mla_use_nope=False, rope_theta=500.0, rope_scaling=YarnConfig(
    factor=4.0, original_max_position_embeddings=12, beta_fast=8.0, beta_slow=1.0,
    mscale=1.0, mscale_all_dim=1.0))
NOLORA = TINY.replace(q_lora_rank=None, mla_use_nope=False, mla_use_output_gate=False,
                      index_topk=5)
DENSE = TINY.replace(index_n_heads=None, index_head_dim=None, index_topk=None)
BF16_INDEX = TINY.replace(index_dtype="bfloat16")  # index queries and keys rounded to bfloat16
CONFIGS = {"tiny": TINY, "rope_yarn": ROPE, "no_qlora": NOLORA, "dense": DENSE,
           "bf16_index": BF16_INDEX}
B, T = 2, 24  # T > topk and > one query chunk


# ---------------------------------------------------------------------------------------------
# helpers: one compiled function per (config, loss), randomised parameters
# ---------------------------------------------------------------------------------------------

@functools.cache
def _graphdef(cfg):
    return nnx.split(nnx.eval_shape(lambda: GatedDSA(cfg, rngs=nnx.Rngs(0))))[0]


@functools.cache
def make_state(cfg, seed=0):
    """Parameters with every norm weight/bias perturbed (so a misused norm shows)."""
    state = nnx.state(GatedDSA(cfg, rngs=nnx.Rngs(seed)))
    keys = iter(jax.random.split(jax.random.key(seed + 100), 64))

    def perturb(path, a):
        if a.ndim != 1:
            return a
        base = 0.0 if "bias" in jax.tree_util.keystr(path) else 1.0
        return base + 0.2 * jax.random.normal(next(keys), a.shape, a.dtype)

    return jax.tree_util.tree_map_with_path(perturb, state)


@functools.cache
def forward(cfg, loss="none"):
    gd = _graphdef(cfg)

    @jax.jit
    def f(state, x, positions, segment_ids=None, cache=None):
        return nnx.merge(gd, state)(x, positions=positions, segment_ids=segment_ids, cache=cache,
                                    indexer_loss=loss)
    return f


def pure(state):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(state))


def inputs(seed=1, b=B, t=T):
    x = jax.random.normal(jax.random.key(seed), (b, t, 64), jnp.float32)
    return x, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


# ---------------------------------------------------------------------------------------------
# NumPy reference: MHA form, explicit [T, S] masks, float64
# ---------------------------------------------------------------------------------------------



def np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def np_layer(cfg, p, x, pos, seg=None):
    """Returns (y, kl_dense, kl_sparse) for one batch, MHA form; causal by token order."""
    x, pos = np.asarray(x, np.float64), np.asarray(pos, np.float64)
    b, t, _ = x.shape
    n, nope, r, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, \
        cfg.v_head_dim
    seg = np.ones((b, t)) if seg is None else np.asarray(seg)
    if cfg.q_lora_rank:
        cq = np_rms(x @ p["q_a_proj"]["kernel"], p["q_a_layernorm"]["weight"],
                    MLA_LATENT_NORM_EPS)
        q = cq @ p["q_b_proj"]["kernel"]
    else:
        cq, q = x, x @ p["q_proj"]["kernel"]
    q = q.reshape(b, t, n, nope + r)
    kva = x @ p["kv_a_proj_with_mqa"]["kernel"]
    ckv = np_rms(kva[..., :cfg.kv_lora_rank], p["kv_a_layernorm"]["weight"], MLA_LATENT_NORM_EPS)
    kpe = kva[..., cfg.kv_lora_rank:]
    qpe = q[..., nope:]
    if not cfg.mla_use_nope:
        inv = rope_inv_freq(r, cfg.rope_theta, cfg.rope_scaling)
        qpe, kpe = np_rotate(qpe, pos, inv, "interleaved"), np_rotate(kpe, pos, inv, "interleaved")
    kvb = (ckv @ p["kv_b_proj"]["kernel"]).reshape(b, t, n, nope + v)
    scale = (nope + r) ** -0.5
    if cfg.rope_scaling:
        scale *= (0.1 * cfg.rope_scaling.mscale_all_dim * math.log(cfg.rope_scaling.factor) + 1) ** 2
    logits = (np.einsum("bthd,bshd->bhts", q[..., :nope], kvb[..., :nope])
              + np.einsum("bthd,bsd->bhts", qpe, kpe)) * scale
    ar = np.arange(t)
    mask = (ar[None, :, None] >= ar[None, None, :]) & (seg[:, :, None] == seg[:, None, :])
    kl_dense = kl_sparse = None
    if cfg.index_topk:
        ip = p["indexer"]
        j, di = cfg.index_n_heads, cfg.index_head_dim
        iq = (cq @ ip["wq_b"]["kernel"]).reshape(b, t, j, di)
        ik = x @ ip["wk"]["kernel"]
        ik = (ik - ik.mean(-1, keepdims=True)) / np.sqrt(ik.var(-1, keepdims=True) + 1e-6)
        ik = ik * ip["k_norm"]["weight"] + ip["k_norm"]["bias"]
        if not cfg.mla_use_nope:
            iq[..., :r] = np_rotate(iq[..., :r], pos, inv, "half")
            ik[..., :r] = np_rotate(ik[..., :r], pos, inv, "half")
        if cfg.index_dtype == "bfloat16":  # rounded from float32 as the model does; the
            iq, ik = (a.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
                      for a in (iq, ik))  # products and their sums stay exact (float64 here)
        w = (x @ ip["weights_proj"]["kernel"]) / math.sqrt(j * di)
        score = np.einsum("btj,btjs->bts", w, np.maximum(np.einsum("btjd,bsd->btjs", iq, ik), 0))
        sel = np.zeros_like(mask)
        for bi in range(b):
            for ti in range(t):
                cand = np.flatnonzero(mask[bi, ti])
                order = cand[np.argsort(-score[bi, ti, cand], kind="stable")]
                if len(order) > cfg.index_topk:  # the fixture must not sit on a near-tie
                    s_sorted = score[bi, ti, order]
                    k = cfg.index_topk
                    margin = 2e-5 if cfg.index_dtype else 1e-4
                    assert s_sorted[k - 1] - s_sorted[k] > margin or s_sorted[k - 1] == s_sorted[k]
                sel[bi, ti, order[:cfg.index_topk]] = True
        kl_dense = np_kl(logits, score, mask, seg)
        kl_sparse = np_kl(logits, score, sel, seg)
        mask = sel
    logits = np.where(mask[:, None], logits, -np.inf)
    prob = np.exp(logits - logits.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    o = np.einsum("bhts,bshd->bthd", prob, kvb[..., nope:])
    if cfg.mla_use_output_gate:
        o = o / (1 + np.exp(-(x @ p["g_proj"]["kernel"]).reshape(b, t, n, v)))
    return o.reshape(b, t, n * v) @ p["o_proj"]["kernel"], kl_dense, kl_sparse


def np_kl(logits, score, mask, seg):
    """Mean over valid queries of KL(head-summed softmax || softmax(score)) within ``mask``."""
    a = np.where(mask[:, None], logits, -np.inf)
    pa = np.exp(a - a.max(-1, keepdims=True))
    pt = (pa / pa.sum(-1, keepdims=True)).sum(1)
    pt /= pt.sum(-1, keepdims=True)
    s = np.where(mask, score, -np.inf)
    log_q = s - s.max(-1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
    kl = np.where(mask, pt * (np.log(np.where(mask, pt, 1)) - np.where(mask, log_q, 0)), 0).sum(-1)
    valid = seg != 0
    return (kl * valid).sum() / valid.sum()


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------

def test_parameter_names_shapes_axes():
    abstract = nnx.eval_shape(lambda: GatedDSA(TINY, rngs=nnx.Rngs(0)))
    shapes = {"/".join(str(k) for k in path): (v.get_value().shape, v.axes)
              for path, v in nnx.to_flat_state(nnx.state(abstract))}
    assert shapes == {
        "q_a_proj/kernel": ((64, 32), ("embed", "q_lora")),
        "q_a_layernorm/weight": ((32,), (None,)),
        "q_b_proj/kernel": ((32, 4 * 24), ("q_lora", "heads")),
        "kv_a_proj_with_mqa/kernel": ((64, 32 + 8), ("embed", None)),
        "kv_a_layernorm/weight": ((32,), (None,)),
        "kv_b_proj/kernel": ((32, 4 * 32), ("kv_lora", "heads")),
        "g_proj/kernel": ((64, 64), ("embed", "heads")),
        "o_proj/kernel": ((64, 64), ("heads", "embed")),
        "indexer/wq_b/kernel": ((32, 64), ("q_lora", "index_heads")),
        "indexer/wk/kernel": ((64, 16), ("embed", None)),
        "indexer/k_norm/weight": ((16,), (None,)),
        "indexer/k_norm/bias": ((16,), (None,)),
        "indexer/weights_proj/kernel": ((64, 4), ("embed", None)),
    }
    no_lora_dense = NOLORA.replace(index_topk=None, index_n_heads=None, index_head_dim=None)
    names = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(
        nnx.eval_shape(lambda: GatedDSA(no_lora_dense, rngs=nnx.Rngs(0)))))}
    assert names == {"q_proj/kernel", "kv_a_proj_with_mqa/kernel", "kv_a_layernorm/weight",
                     "kv_b_proj/kernel", "o_proj/kernel"}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_matches_numpy_reference(name):
    """Full forward (sparse top-k, RoPE+YaRN, no q-LoRA, dense) vs the float64 MHA reference."""
    cfg = CONFIGS[name]
    state = make_state(cfg)
    x, pos = inputs()
    y, cache, aux = forward(cfg)(state, x, pos)
    want, _, _ = np_layer(cfg, pure(state), x, pos)
    assert cache is None and y.shape == (B, T, 64) and float(aux["indexer_kl"]) == 0.0
    np.testing.assert_allclose(y, want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("name", ["tiny", "bf16_index"])
@pytest.mark.parametrize("loss", ["dense", "sparse"])
def test_indexer_losses_match_numpy_reference(loss, name):
    cfg = CONFIGS[name]  # bf16_index: the KL follows the rounded scores (rtol 1e-4 sees it)
    state = make_state(cfg)
    x, pos = inputs()
    seg = jnp.asarray(np.r_[[1] * T, [1] * 9 + [2] * 11 + [0] * 4].reshape(2, T), jnp.int32)
    y, _, aux = forward(cfg, loss)(state, x, pos, seg)
    want_y, kl_dense, kl_sparse = np_layer(cfg, pure(state), x, pos, seg)
    if loss == "dense":  # the warm-up attends densely
        want_y, _, _ = np_layer(DENSE, pure(state), x, pos, seg)
    np.testing.assert_allclose(aux["indexer_kl"], kl_dense if loss == "dense" else kl_sparse,
                               rtol=1e-4)
    valid = np.asarray(seg != 0)
    np.testing.assert_allclose(np.asarray(y)[valid], want_y[valid], rtol=2e-4, atol=2e-5)


def test_short_sequence_equals_dense_mla():
    """T <= index_topk: every visible token is selected, so Gated DSA == dense gated MLA."""
    state = make_state(TINY)
    dense_state = nnx.state(nnx.eval_shape(lambda: GatedDSA(DENSE, rngs=nnx.Rngs(0))))
    shared = {k: v for k, v in nnx.to_pure_dict(state).items() if k != "indexer"}
    nnx.replace_by_pure_dict(dense_state, shared)
    x, pos = inputs(t=8)
    y_sparse, _, _ = forward(TINY)(state, x, pos)
    y_dense, _, _ = forward(DENSE)(dense_state, x, pos)
    np.testing.assert_allclose(y_sparse, y_dense, rtol=1e-5, atol=2e-6)


def test_causality():
    """Changing token 15 leaves outputs 0..14 unchanged (no future token is ever selected)."""
    state = make_state(TINY)
    x, pos = inputs()
    x2 = x.at[:, 15].add(3.0)
    y1, _, _ = forward(TINY)(state, x, pos)
    y2, _, _ = forward(TINY)(state, x2, pos)
    np.testing.assert_array_equal(np.asarray(y1)[:, :15], np.asarray(y2)[:, :15])
    assert np.abs(np.asarray(y1)[:, 15:] - np.asarray(y2)[:, 15:]).max() > 1e-3


@pytest.mark.parametrize("name", ["tiny", "rope_yarn", "dense", "bf16_index"])
def test_prefill_then_decode_equals_forward(name):
    """Right-padded prefill (row 1: 7 of 10 tokens, padding at position 0) then 14 absorbed decode
    steps at per-row positions equal the full forward of each row."""
    cfg = CONFIGS[name]
    state = make_state(cfg)
    x, _ = inputs(seed=3)
    lens, prefill, steps = [10, 7], 10, 14
    pos_p = jnp.asarray([list(range(10)), list(range(7)) + [0, 0, 0]], jnp.int32)
    seg_p = jnp.asarray([[1] * 10, [1] * 7 + [0] * 3], jnp.int32)
    cache = init_dsa_cache(cfg, B, 32)
    y_p, cache, _ = forward(cfg)(state, x[:, :prefill], pos_p, seg_p, cache)
    rows = [[np.asarray(y_p[i, :lens[i]])] for i in range(B)]
    ones = jnp.ones((B, 1), jnp.int32)
    for s in range(steps):
        cur = [lens[i] + s for i in range(B)]
        x_s = jnp.stack([x[i, cur[i]] for i in range(B)])[:, None]
        y_s, cache, _ = forward(cfg)(state, x_s, jnp.asarray(cur, jnp.int32)[:, None], ones, cache)
        for i in range(B):
            rows[i].append(np.asarray(y_s[i]))
    seg_full = jnp.asarray([[1] * T, [1] * 21 + [0] * 3], jnp.int32)
    y_full, _, _ = forward(cfg)(state, x, inputs()[1], seg_full)
    for i in range(B):
        n = lens[i] + steps
        np.testing.assert_allclose(np.concatenate(rows[i]), y_full[i, :n], rtol=1e-4, atol=1e-5)
    # the padded full forward equals each row alone (float64 reference)
    want, _, _ = np_layer(cfg, pure(state), x[1:, :21], inputs(b=1, t=21)[1])
    np.testing.assert_allclose(y_full[1, :21], want[0], rtol=2e-4, atol=2e-5)


def test_packed_segments_equal_separate_documents():
    state = make_state(ROPE)
    x, _ = inputs(seed=5, b=1)
    pos = jnp.asarray([list(range(10)) + list(range(14))], jnp.int32)
    seg = jnp.asarray([[1] * 10 + [2] * 14], jnp.int32)
    # a batch of two identical rows reuses the compiled [2, 24] forward
    y, _, _ = forward(ROPE)(state, jnp.concatenate([x, x]), jnp.concatenate([pos, pos]),
                            jnp.concatenate([seg, seg]))
    p = pure(state)
    first, _, _ = np_layer(ROPE, p, x[:, :10], pos[:, :10])
    second, _, _ = np_layer(ROPE, p, x[:, 10:], pos[:, 10:])
    np.testing.assert_allclose(y[0], np.concatenate([first[0], second[0]]), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("loss", ["dense", "sparse"])
def test_loss_gradients_reach_only_intended_parameters(loss):
    gd = _graphdef(TINY)
    state = make_state(TINY)
    x, pos = inputs(t=12)  # > topk 8, one query chunk (the chunk loop's grads: test_dsa.py)
    r = jax.random.normal(jax.random.key(9), (B, 12, 64))

    @jax.jit
    def grads(state, x):
        def f(state, x, which):
            y, _, aux = nnx.merge(gd, state)(x, positions=pos, indexer_loss=loss)
            return aux["indexer_kl"] if which == "kl" else jnp.sum(y * r)
        return (jax.grad(f, (0, 1))(state, x, "kl"), jax.grad(f, (0, 1))(state, x, "lm"))

    (g_kl, gx_kl), (g_lm, _) = grads(state, x)
    assert float(jnp.abs(gx_kl).max()) == 0.0  # the indexer reads detached inputs
    for path, g in nnx.to_flat_state(g_kl):
        in_indexer = path[0] == "indexer"
        assert (float(jnp.abs(g[...]).max()) > 0) == in_indexer, (loss, path)
    for path, g in nnx.to_flat_state(g_lm):
        assert (float(jnp.abs(g[...]).max()) > 0) != (path[0] == "indexer"), (loss, path)


def test_indexer_outputs_are_in_index_dtype():
    x, pos = inputs()
    q_latent = jnp.ones((B, T, BF16_INDEX.q_lora_rank))
    q, k, w = GatedDSA(BF16_INDEX, rngs=nnx.Rngs(0)).indexer(x, q_latent, pos)
    assert (q.dtype, k.dtype, w.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
    q, k, w = GatedDSA(TINY, rngs=nnx.Rngs(0)).indexer(x, q_latent, pos)
    assert (q.dtype, k.dtype, w.dtype) == (jnp.float32,) * 3


def test_cache_helpers():
    cache = init_dsa_cache(TINY, 3, 20)
    assert isinstance(cache, DSACache) and cache.max_len == 20
    assert (cache.kv_latent.shape, cache.k_rope.shape, cache.index_keys.shape) == \
        ((3, 20, 32), (3, 20, 8), (3, 20, 16))
    assert init_dsa_cache(DENSE, 1, 4).index_keys.shape == (1, 4, 0)
    assert dsa_cache_bytes_per_token(TINY) == (32 + 8 + 16) * 4
    assert dsa_cache_bytes_per_token(get_preset("k3-2.8t")) == (512 + 64 + 128) * 2
    assert dsa_cache_bytes_per_token(get_preset("kimi-linear-48b")) == (512 + 64) * 2
    assert init_dsa_cache(BF16_INDEX, 1, 4).index_keys.dtype == jnp.bfloat16
    assert init_dsa_cache(BF16_INDEX, 1, 4).kv_latent.dtype == jnp.float32
    assert dsa_cache_bytes_per_token(BF16_INDEX) == (32 + 8) * 4 + 16 * 2
    assert dsa_cache_bytes_per_token(get_preset("k3-slice")) == (512 + 64) * 4 + 128 * 2
    # on TPU (128 lanes): every row as laid out in HBM, each width a multiple of 128 lanes
    assert dsa_cache_bytes_per_token(TINY, 128) == 3 * 128 * 4
    assert dsa_cache_bytes_per_token(get_preset("k3-2.8t"), 128) == (512 + 128 + 128) * 2
    assert dsa_cache_bytes_per_token(DENSE, 128) == (128 + 128) * 4


def test_bad_inputs_raise():
    layer = GatedDSA(TINY, rngs=nnx.Rngs(0))
    x, pos = inputs(t=4)
    with pytest.raises(ValueError, match="indexer_loss"):
        layer(x, positions=pos, indexer_loss="kl")
    with pytest.raises(ValueError, match="hidden_size"):
        layer(x[..., :8], positions=pos)
    with pytest.raises(ValueError, match="positions"):
        layer(x, positions=pos[:, :3])
    with pytest.raises(ValueError, match="segment_ids"):
        layer(x, positions=pos, segment_ids=pos[:1])
    with pytest.raises(ValueError, match="training without a cache"):
        layer(x, positions=pos, cache=init_dsa_cache(TINY, B, 8), indexer_loss="sparse")
    with pytest.raises(ValueError, match="cache.kv_latent"):
        layer(x, positions=pos, cache=init_dsa_cache(TINY, 3, 8))
