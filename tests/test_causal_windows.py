"""Causal key windows (``model/query_chunks.py : map_query_chunks``): a long causal prefill
scores each group of query chunks against only the keys its last query can see; the outputs
equal the full-width call, in the math functions, in the layer's three attention paths
(sequence, dense slots, paged pool) and in gradients. A call whose promise does not hold (a padded chunk past
the cache) takes the full width."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdsa.model import dsa, query_chunks
from kdsa.model import dsa_cache_attention
from kdsa.model.config import get_preset
from kdsa.model.overrides import apply_overrides
from kdsa.model.transformer import Transformer


def _inputs(seed=0, b=2, t=200, s=230, n=4, d=24, j=3, di=8, starts=(30, 23)):
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    vis = dict(q_pos=jnp.asarray(np.asarray(starts)[:, None] + np.arange(t), jnp.int32),
               kv_pos=jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
               q_seg=jnp.asarray(rng.integers(1, 3, (b, t)), jnp.int32),  # packed segments
               kv_seg=jnp.asarray(rng.integers(1, 3, (b, s)), jnp.int32), chunk_size=16)
    return vis, f(b, t, n, d), f(b, s, 1, d), (f(b, t, j, di), f(b, s, di), f(b, t, j))


@pytest.mark.parametrize("windows", [2, 3, 4, 50])
def test_windows_equal_the_full_width(windows):
    """Rows starting at or below ``S - T`` (the promise): the same outputs and indices, top-k
    wider than a group's window included (its -1 columns padded back)."""
    vis, q, kv, (iq, ik, iw) = _inputs()
    slack = kv.shape[1] - q.shape[1]
    chunk = vis.pop("chunk_size")

    @jax.jit  # one program per case (op by op: an eager compile per window's shapes)
    def both(q, kv, iq, ik, iw, vis):
        kw = dict(vis, chunk_size=chunk)
        full = [dsa.dense_attention(q, kv, kv[..., :10], 0.3, **kw)]
        part = [dsa.dense_attention(q, kv, kv[..., :10], 0.3, **kw, windows=windows,
                                    key_slack=slack)]
        for k in (16, 64):
            full.append(dsa.indexer_topk(iq, ik, iw, k, **kw))
            part.append(dsa.indexer_topk(iq, ik, iw, k, **kw, windows=windows,
                                         key_slack=slack))
        return full, part

    full, part = both(q, kv, iq, ik, iw, vis)
    (out, lse), (got, got_lse) = full[0], part[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(out), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(lse), rtol=1e-6, atol=1e-6)
    for want, idx in zip(full[1:], part[1:]):
        assert idx.shape == want.shape
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(want))


def test_a_broken_promise_changes_the_outputs():
    """The windows really drop keys: a row starting one position past ``S - T`` loses the
    last key of each group's last query."""
    vis, q, kv, (iq, ik, iw) = _inputs(starts=(31, 23))
    slack = kv.shape[1] - q.shape[1]
    out, _ = dsa.dense_attention(q, kv, kv[..., :10], 0.3, **vis)
    got, _ = dsa.dense_attention(q, kv, kv[..., :10], 0.3, **vis, windows=4, key_slack=slack)
    assert np.abs(np.asarray(got - out))[0].max() > 1e-3
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(out[1]), rtol=1e-6, atol=1e-6)
    want = dsa.indexer_topk(iq, ik, iw, 16, **vis)
    idx = dsa.indexer_topk(iq, ik, iw, 16, **vis, windows=4, key_slack=slack)
    assert (np.asarray(idx[0]) != np.asarray(want[0])).any()


def test_the_layer_checks_the_promise_at_run_time(monkeypatch):
    """``windowed`` takes the windows only when every real query fits its chunk, and builds no
    second branch where they would save little (``S - T >= T``, no query below top-k)."""
    monkeypatch.setattr(query_chunks, "CAUSAL_WINDOWS_FROM", 8)

    def which(num_keys, pos, seg, topk=None):  # windows * 1000 + key_slack of the call taken
        return int(jax.jit(lambda pos, seg: dsa_cache_attention.windowed(
            lambda windows=1, key_slack=0: jnp.int32(windows * 1000 + key_slack), num_keys,
            q_pos=pos, q_seg=seg, chunk_size=8, topk=topk))(pos, seg))

    pos = jnp.arange(32, dtype=jnp.int32)[None]
    seg = jnp.ones((1, 32), jnp.int32)
    pad = seg.at[:, 24:].set(0)  # the last 8 queries padding
    win = query_chunks.causal_windows(32, 8) * 1000
    assert win == 4000
    assert which(48, pos + 16, seg) == win + 16  # fits: windows
    assert which(48, pos + 17, seg) == 1000  # a chunk one past the cache: full width
    assert which(48, pos + 24, pad) == 1000  # its real queries past S - T too
    assert which(48, (pos + 16).at[:, 24:].set(99), pad) == win + 16  # padding does not count
    assert which(64, pos, seg) == 1000  # S - T >= T: not worth a second branch
    assert which(64, pos, seg, topk=40) == win + 32  # unless queries see at most top-k keys
    assert which(64, pos, seg, topk=39) == 1000


# one Gated DSA layer (tiny's widths, a dense FFN): the layer under test, compiled quickly
CFG = apply_overrides(get_preset("tiny"), ["num_hidden_layers=1",
                                            "linear_attn_config.kda_layers=[]",
                                            "linear_attn_config.full_attn_layers=[1]",
                                            "max_position_embeddings=192"])
# top-k 40 over query chunks of 8: a prefill from the cache's start has 40 queries that see
# at most top-k keys (they attend densely) before the indexer's queries
WIDE = CFG.replace(index_topk=40, dsa_query_chunk_size=8)
DENSE = CFG.replace(index_n_heads=None, index_head_dim=None, index_topk=None)


# chunks (tokens, real tokens) into a 128-token cache: the last ending exactly at the cache's
# end (no room to spare in the windows), 32 real tokens padded 32 past it (the full width), or
# one chunk filling it (its first queries see at most top-k keys); the chunk shapes (64, 32,
# 128) compile once for all three
TIGHT, PAST = ((64, 64), (32, 32), (32, 32)), ((32, 32), (32, 32), (32, 32), (64, 32))
FULL = ((128, 128),)


def _prefills(model, paged: bool):
    """For each of TIGHT, PAST and FULL, into a fresh cache: logits of the chunks' real tokens,
    then a decode step if there is room. (A fresh jit each call: the windows are chosen at
    trace time.)"""

    @nnx.jit
    def _step(model, ids, pos, seg, cache):
        out = model.forward(ids, pos, cache, segment_ids=seg)
        return out.logits, out.cache

    rng = np.random.default_rng(3)
    b, max_len = 2, 128
    outs = []
    for chunks in (TIGHT, PAST, FULL):
        if paged:
            from kdsa.model.paged_cache import PAGE_SIZE

            per = max_len // PAGE_SIZE
            cache = model.init_paged_cache(b, b * per, per)
            cache = cache.replace(block_table=jnp.asarray(
                rng.permutation(b * per).reshape(b, per), jnp.int32))
        else:
            cache = model.init_cache(b, max_len)
        start = 0
        for t, real in chunks:
            ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (b, t)), jnp.int32)
            pos = jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32), (b, t))
            seg = jnp.asarray((np.arange(t) < real)[None].repeat(b, 0), jnp.int32)
            logits, cache = _step(model, ids, pos, seg, cache)
            outs.append(np.asarray(logits)[:, :real])
            start += real
        if start < max_len:
            logits, cache = _step(model, jnp.ones((b, 1), jnp.int32),
                                  jnp.full((b, 1), start, jnp.int32),
                                  jnp.ones((b, 1), jnp.int32), cache)
            outs.append(np.asarray(logits))
    return np.concatenate([o.reshape(-1) for o in outs])


@pytest.mark.parametrize("cfg", [WIDE, DENSE], ids=["dsa", "dense_mla"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense_slots", "paged"])
def test_cached_prefill_with_windows_equals_without(cfg, paged, monkeypatch):
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    monkeypatch.setattr(query_chunks, "CAUSAL_WINDOWS_FROM", 1 << 30)
    want = _prefills(model, paged)
    monkeypatch.setattr(query_chunks, "CAUSAL_WINDOWS_FROM", 16)
    got = _prefills(model, paged)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("starts", [(0, 24), (0, 40)], ids=["both_fit", "one_past_s_minus_t"])
def test_rows_starting_apart(starts, monkeypatch):
    """A batched prefill's rows at different starts (S - T = 32): windows when every row fits,
    the full width when one starts past S - T; the same logits either way."""
    model = Transformer(WIDE, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(6)
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 96)), jnp.int32)
    pos = jnp.asarray(np.asarray(starts)[:, None] + np.arange(96), jnp.int32)

    def run():
        step = nnx.jit(lambda m, ids, pos, cache: m.forward(ids, pos, cache).logits)
        return np.asarray(step(model, ids, pos, model.init_cache(2, 128)))

    monkeypatch.setattr(query_chunks, "CAUSAL_WINDOWS_FROM", 1 << 30)
    want = run()
    monkeypatch.setattr(query_chunks, "CAUSAL_WINDOWS_FROM", 16)
    np.testing.assert_allclose(run(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", [CFG, DENSE], ids=["dsa", "dense_mla"])
def test_training_forward_and_gradients_with_windows_equal_without(cfg, monkeypatch):
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(4)
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 96)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * 50 + [2] * 40 + [0] * 6], 2, 0), jnp.int32)  # packed

    def loss(model):
        out = model.forward(ids, jnp.broadcast_to(jnp.arange(96, dtype=jnp.int32), (2, 96)),
                            segment_ids=seg)
        return jnp.mean(out.logits ** 2)

    def run():
        value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
        return float(value), jax.tree.leaves(nnx.state(grads))

    monkeypatch.setattr(query_chunks, "CAUSAL_WINDOWS_FROM", 1 << 30)
    want, want_g = run()
    monkeypatch.setattr(query_chunks, "CAUSAL_WINDOWS_FROM", 16)
    got, got_g = run()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
