"""The decoder stack: scan vs loop vs an unrolled reference, caches, packing, determinism."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdsa.model.config import get_preset
from kdsa.model.outputs import Collect, layers_of
from kdsa.model.transformer import (Transformer, default_positions, layer_segments,
                                    per_layer_state)

B, T = 2, 24


@pytest.fixture(scope="module")
def tiny_model():
    return Transformer(get_preset("tiny"), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def ids():
    return jax.random.randint(jax.random.key(1), (B, T), 0, get_preset("tiny").vocab_size)


@nnx.jit
def _forward(model, ids):
    return model.forward(ids, collect=Collect(expert_load=True))


def test_layer_segments_cover_every_layer_once():
    for name in ("tiny", "small", "kimi-linear-48b", "k3-2.8t"):
        c = get_preset(name)
        kinds = tuple(zip(c.mixer_kinds, c.ffn_kinds))
        segs = layer_segments(kinds)
        covered = [s + j * p + i for s, p, r in segs for j in range(r) for i in range(p)]
        assert covered == list(range(c.num_hidden_layers))
        for s, p, r in segs:
            for j in range(r):
                assert kinds[s + j * p:s + (j + 1) * p] == kinds[s:s + p]
    k3 = get_preset("k3-2.8t")
    assert layer_segments(tuple(zip(k3.mixer_kinds, k3.ffn_kinds))) == (
        (0, 1, 1), (1, 4, 22), (89, 1, 2), (91, 1, 2))


def test_forward_shapes_finite_deterministic(tiny_model, ids):
    out = _forward(tiny_model, ids)
    cfg = tiny_model.config
    assert out.logits.shape == (B, T, cfg.vocab_size) and out.logits.dtype == jnp.float32
    moe = layers_of(cfg, ffn="moe")
    assert moe == (1, 2, 3)  # the dense first layer has no MoE statistics
    assert out.stats.expert_load.shape == (len(moe), cfg.num_experts)
    assert out.stats.indexer_kl is None and out.stats.expert_ids is None  # not asked for
    assert bool(jnp.isfinite(out.logits).all())
    # every MoE layer routes B*T*k assignments
    loads = np.asarray(out.stats.expert_load).sum(-1)
    assert np.all(loads == B * T * cfg.num_experts_per_token)
    np.testing.assert_array_equal(np.asarray(_forward(tiny_model, ids).logits),
                                  np.asarray(out.logits))
    model2 = Transformer(get_preset("tiny"), rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(_forward(model2, ids).logits),
                                  np.asarray(out.logits))


def test_scan_equals_loop(tiny_model, ids):
    # built abstract (nnx.eval_shape): every weight is overwritten by the scanned model's at once
    looped = nnx.eval_shape(
        lambda: Transformer(get_preset("tiny").replace(scan_layers=False), rngs=nnx.Rngs(0)))
    nnx.update(looped, nnx.state(tiny_model))
    np.testing.assert_allclose(np.asarray(_forward(looped, ids).logits),
                               np.asarray(_forward(tiny_model, ids).logits), atol=1e-5)


def _reference_forward(model, ids):
    """Unrolled: every layer sliced out of the stacks and run in a Python loop with the
    growing-list AttnRes protocol, no scan, no fixed-size buffer."""
    cfg = model.config
    pos = default_positions(ids, None)
    layers = []
    for seg, (s, p, r) in zip(model.segments, model.segment_layout):
        graphdef, state = nnx.split(seg)
        for j in range(r):
            group = nnx.merge(graphdef, jax.tree.map(lambda a: a[j], state))
            layers.extend(group.layers)
    assert len(layers) == cfg.num_hidden_layers

    def mix(prefix, blocks, scorer):
        values = jnp.stack(blocks + [prefix], axis=2)
        normed = values * jax.lax.rsqrt(jnp.mean(values**2, -1, keepdims=True)
                                        + cfg.rms_norm_eps) * scorer.norm[...]
        w = jax.nn.softmax(jnp.einsum("btcd,d->btc", normed, scorer.proj[...],
                                      precision="highest"), axis=-1)
        return jnp.einsum("btc,btcd->btd", w, values, precision="highest")

    def mixer(layer, x):
        if layer.mixer_kind == "kda":
            return layer.self_attn(x)[0]
        return layer.self_attn(x, positions=pos)[0]

    def ffn(layer, x):
        return layer.block_sparse_moe(x)[0] if layer.ffn_kind == "moe" else layer.mlp(x)

    prefix, blocks = model.embed_tokens(ids), []
    for i, layer in enumerate(layers):
        h = mix(prefix, blocks, layer.self_attention_res)
        if i % cfg.attn_res_block_size == 0:
            blocks, prefix = blocks + [prefix], None
        a = mixer(layer, layer.input_layernorm(h))
        prefix = a if prefix is None else prefix + a
        h = mix(prefix, blocks, layer.mlp_res)
        prefix = prefix + ffn(layer, layer.post_attention_layernorm(h))
    h = model.norm(mix(prefix, blocks, model.output_attn_res))
    return model.lm_head(h)


# the reference as one compiled program: op by op it costs ~300 eager compiles (one per op shape)
_reference_forward_jit = nnx.jit(_reference_forward)


def test_scanned_stack_matches_unrolled_reference(tiny_model, ids):
    want = _reference_forward_jit(tiny_model, ids)
    got = _forward(tiny_model, ids).logits
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4, rtol=2e-4)


def test_plain_residual_variant_and_gradients(ids):
    cfg = get_preset("tiny").replace(attn_res_block_size=None, remat_policy="full")
    model = Transformer(cfg, rngs=nnx.Rngs(2))

    def loss(model):
        logits = model(ids[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1))

    val, grads = nnx.jit(nnx.value_and_grad(loss))(model)
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert np.isfinite(float(val))
    leaves = [np.asarray(g) for g in leaves]  # checked in NumPy: no eager compile per leaf shape
    assert all(bool(np.isfinite(g).all()) for g in leaves)
    nonzero = sum(bool(np.any(g != 0)) for g in leaves)
    assert nonzero >= 0.9 * len(leaves)  # gradients reach (nearly) every parameter


def _dsa_stack():
    """tiny with layers 2-4 Gated DSA: one scanned segment of 3 DSA layers, whose caches the
    scan updates in place through ``DSACache.layer``."""
    c = get_preset("tiny")
    lac = dataclasses.replace(c.linear_attn_config, kda_layers=(1,), full_attn_layers=(2, 3, 4))
    return Transformer(c.replace(linear_attn_config=lac), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("stack", ["tiny", "dsa_stack"])
def test_prefill_then_decode_equals_full_forward(tiny_model, ids, stack):
    model = tiny_model if stack == "tiny" else _dsa_stack()
    cfg = model.config
    assert stack == "tiny" or cfg.mixer_kinds == ("kda", "dsa", "dsa", "dsa")
    full = _forward(model, ids).logits
    cache = model.init_cache(B, 32)
    n_prefill = 15  # > index_topk, and not a multiple of the KDA chunk

    @nnx.jit
    def step(model, ids, pos, cache):
        out = model.forward(ids, positions=pos, cache=cache)
        return out.logits, out.cache

    pos = default_positions(ids, None)
    logits, cache = step(model, ids[:, :n_prefill], pos[:, :n_prefill], cache)
    outs = [logits]
    for t in range(n_prefill, T):
        logits, cache = step(model, ids[:, t:t + 1], pos[:, t:t + 1], cache)
        outs.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full),
                               atol=2e-4, rtol=2e-4)
    assert cfg.index_topk < T  # the sparse path was exercised


def test_packed_segments_equal_separate_rows(tiny_model):
    cfg = tiny_model.config
    a = jax.random.randint(jax.random.key(3), (1, 10), 0, cfg.vocab_size)
    b = jax.random.randint(jax.random.key(4), (1, 14), 0, cfg.vocab_size)
    packed = jnp.concatenate([a, b], 1)
    seg = jnp.concatenate([jnp.ones((1, 10), jnp.int32), 2 * jnp.ones((1, 14), jnp.int32)], 1)
    got = nnx.jit(lambda m, x, s: m.forward(x, segment_ids=s).logits)(tiny_model, packed, seg)
    # each document alone at the start of its own row, right-padded to the (B, T) = (2, 24) the
    # other tests compiled already: causal, so its logits do not see the padding after it
    assert (B, T) == (2, 24)
    rows = jnp.concatenate([jnp.pad(a, ((0, 0), (0, T - 10))), jnp.pad(b, ((0, 0), (0, T - 14)))])
    alone = _forward(tiny_model, rows).logits
    np.testing.assert_allclose(np.asarray(got[:, :10]), np.asarray(alone[:1, :10]), atol=2e-4)
    np.testing.assert_allclose(np.asarray(got[:, 10:]), np.asarray(alone[1:, :14]), atol=2e-4)


def test_bad_inputs():
    model = Transformer(get_preset("tiny"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="batch, seq"):
        model.forward(jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="positions are required"):
        model.forward(jnp.zeros((1, 2), jnp.int32), cache=model.init_cache(1, 8))
    rope = Transformer(get_preset("tiny").replace(mla_use_nope=False), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="max_position_embeddings=1024 .*RoPE"):
        rope.init_cache(1, 10**6)
    # NoPE (every preset): nothing encodes positions, so the context is not capped by them
    assert model.config.context_limit is None and rope.config.context_limit == 1024
    assert jax.eval_shape(lambda: model.init_cache(1, 4096))[-1][0].kv_latent.shape[2] == 4096


def test_scanned_dsa_caches_are_updated_in_place():
    """The decode step of a scanned segment of 3 DSA layers writes the stacked dense-slot
    caches in place: no copy, broadcast or dynamic-update-slice of a whole stacked buffer in
    the compiled step (before ``DSACache.layer`` each step zeroed a new stack and wrote each
    layer's whole cache into it)."""
    import re

    model = _dsa_stack()
    graphdef, state = nnx.split(model)
    cache = model.init_cache(2, 512)
    stacked = [a.shape for a in jax.tree.leaves(cache) if a.ndim == 4 and a.shape[0] == 3
               and a.shape[-1] > 0]
    assert stacked, "the DSA segment's caches are stacked over its 3 repeats"

    def step(state, cache, ids, pos):
        out = nnx.merge(graphdef, state).forward(ids, positions=pos, cache=cache)
        return out.logits, out.cache

    ids, pos = jnp.ones((2, 1), jnp.int32), jnp.full((2, 1), 7, jnp.int32)
    hlo = jax.jit(step, donate_argnums=(1,)).lower(state, cache, ids, pos).compile().as_text()
    names = "|".join(re.escape(",".join(map(str, sh))) for sh in stacked)
    whole = [line.strip()[:120] for line in hlo.splitlines()
             if re.search(rf"= f32\[({names})\]\S* (copy|broadcast|dynamic-update-slice|fusion)\(",
                          line)
             and re.search(r"copy|broadcast|dynamic-update-slice", line.split("(")[0])]
    assert not whole, whole


def test_per_layer_state_equals_stacked_and_slices_no_weights():
    """``per_layer_state`` (the CPU runner's decode weights): prefill + decode give the
    same logits and caches as the stacked state, and the compiled decode step slices no
    weight out of a stacked array (with the stacked state XLA:CPU copies each repeated layer's
    weights every step: a dynamic-slice per weight of tiny's 2-repeat KDA + MoE segment)."""
    import re

    model = _dsa_stack()  # segments: KDA, then 3 x Gated DSA (+ MoE)
    graphdef, state = nnx.split(model)
    per_layer = per_layer_state(state, model.segment_layout)
    w1 = [v.shape for p, v in nnx.to_flat_state(state)
          if p[0] == "segments" and p[-2:] == ("experts", "w1")]
    assert any(sh[0] == 3 for sh in w1), w1

    def run(state, ids, pos, cache):
        out = nnx.merge(graphdef, state).forward(ids, positions=pos, cache=cache)
        return out.logits, out.cache

    ids = jax.random.randint(jax.random.key(3), (2, 9), 0, model.config.vocab_size)
    pos = default_positions(ids, None)
    shape = ",".join(map(str, w1[0][1:]))  # one layer's routed-expert w1
    outs, sliced = [], []
    for st in (state, per_layer):
        logits, cache = jax.jit(run)(st, ids[:, :8], pos[:, :8], model.init_cache(2, 16))
        decode = jax.jit(run).lower(st, ids[:, 8:], pos[:, 8:], cache).compile()
        step, cache = decode(st, ids[:, 8:], pos[:, 8:], cache)
        outs.append((logits, step, cache))
        sliced.append([ln for ln in decode.as_text().splitlines() if re.search(
            rf"= f32\[{shape}\]\S* (fusion|dynamic-slice|slice|copy)\(", ln)])
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-6)
    assert sliced[0]  # the stacked weights are copied per layer
    assert not sliced[1]


def test_a_cache_refuses_left_padding(tiny_model):
    """With a cache, segment ids mark right padding only (a KDA layer keeps each row's conv
    window and state up to its last token): a left-padded batch is refused before anything
    runs, naming the rows; right padding and no padding pass the check."""
    from kdsa.model.transformer import _check_right_padding

    cache = tiny_model.init_cache(2, 16)
    ids = jnp.ones((2, 4), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (2, 4))
    left = jnp.asarray([[1, 1, 1, 1], [0, 0, 1, 1]], jnp.int32)
    with pytest.raises(ValueError, match=r"rows \[1\] have tokens after padding"):
        tiny_model.forward(ids, pos, cache, segment_ids=left)
    for ok in ([[1, 1, 0, 0], [1, 1, 1, 1]], [[0, 0, 0, 0], [1, 0, 0, 0]]):
        _check_right_padding(jnp.asarray(ok, jnp.int32))  # no error
    _check_right_padding(None)
