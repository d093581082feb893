"""Paged caches on a mesh (``model/paged_attention.py``): the pool split over the generate
layout's batch device groups, each group serving its own slots from its own pages, gives what
one device gives; the engine keeps a pool and a prefix cache per group."""

import jax
import numpy as np
import pytest
from flax import nnx

from kdsa.infer.engine import Engine, Request
from kdsa.infer.runner import ModelRunner
from kdsa.infer.sampling import SamplingParams
from kdsa.infer.tokenizer import ByteTokenizer
from kdsa.model import paged_cache as pc
from kdsa.model.config import get_preset
from kdsa.model.kda_layer import KDACache
from kdsa.model.overrides import apply_overrides
from kdsa.model.transformer import Transformer

P = pc.PAGE_SIZE
# tiny with 2 layers (KDA, Gated DSA + MoE), top-k 8 < context, room for 3 pages per row
CFG = apply_overrides(get_preset("tiny"), ["num_hidden_layers=2",
                                            "linear_attn_config.kda_layers=[1]",
                                            "linear_attn_config.full_attn_layers=[2]",
                                            "max_position_embeddings=192"])
AXES = "data=2,expert=2,tensor=2"  # batch device groups: data x expert = 4


@pytest.fixture(scope="module")
def mesh():
    from kdsa.sharding.mesh import make_mesh
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 host devices (conftest)")
    return make_mesh(AXES)


def _model(cfg=CFG):
    return Transformer(cfg, rngs=nnx.Rngs(0))


def _requests(prompts, max_tokens):
    return [Request(list(p), SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                            ignore_eos=True)) for p in prompts]


def _runner(mesh=None, cfg=CFG, **kw):
    return ModelRunner(_model(cfg), max_len=3 * P, prefill_chunk=32, min_bucket=32, mesh=mesh,
                       **kw)


@pytest.fixture(scope="module")
def runners(mesh):
    """One mesh runner and one one-device runner alike: 8 slots (2 per device group on the
    mesh), 12 pages (3 per group), 8 KDA snapshots (2 per group)."""
    return [_runner(where, num_slots=8, num_pages=12, num_snapshots=8) for where in (mesh, None)]


def _engine(runner, **kw):
    return Engine(runner, ByteTokenizer(CFG.vocab_size), max_top_logprobs=0, **kw)


def _steps_equal(runners):
    """Prefill chunks and decode steps of four requests (slot 2g, pages 1 and 0 of group g's
    partition) on the mesh runner and the one-device runner: the same logits. Returns the
    random generator that drew the prompts."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n) for n in (40, 70, 20, 100)]
    logits = []
    for r in runners:
        got = []
        for g, p in enumerate(prompts):  # slot 2g: the first of group g; one device: the
            local = [1, 0]               # same global pages (a dense-slot runner: no pages)
            if r.num_pages is not None:
                r.set_pages(2 * g, local if r.partitions > 1 else [3 * g + x for x in local])
            got += [np.asarray(r.prefill(2 * g, p[i:i + 32], i)) for i in range(0, len(p), 32)]
        toks, pos = np.zeros(8, np.int32), np.zeros(8, np.int32)
        pos[::2] = [len(p) for p in prompts]
        for k in range(3):
            active = np.zeros(8, bool)
            active[::2] = [1, 1, k < 2, 1]
            got.append(np.asarray(r.decode(toks, pos + k, active))[::2])
            toks = np.repeat(got[-1].argmax(-1).astype(np.int32), 2)
        logits.append(got)
    for other in logits[1:]:
        for a, b in zip(logits[0], other):
            np.testing.assert_allclose(a, b, atol=2e-5)
    return rng


def test_runner_steps_on_a_mesh_equal_one_device(mesh, runners):
    """Prefill chunks and decode steps over pages of four partitions give one device's logits
    for the same pages; each device holds a quarter of the pool. Engines on the two runners
    without the prefix cache (five requests, a pool per group) give the same outputs."""
    rng = _steps_equal(runners)
    r = runners[0]
    assert r.partitions == 4 and r.pages_per_partition == 3
    pool = jax.tree.leaves(r.cache, is_leaf=lambda x: isinstance(x, pc.PagedDSACache))
    pool = next(x for x in pool if isinstance(x, pc.PagedDSACache)).kv_latent
    assert pool.shape[1] == 4 * (3 * P + pc.SCRATCH_ROWS)  # scratch rows per partition
    assert pool.sharding.shard_shape(pool.shape)[1] == 3 * P + pc.SCRATCH_ROWS
    assert len(pool.sharding.device_set) == 8
    # the KDA recurrent states [R, slots, H, K, V] and conv windows [R, slots, W-1, 3, H*K]:
    # slots over the groups, heads over tensor
    states = [x for x in jax.tree.leaves(r.cache, is_leaf=lambda x: isinstance(x, KDACache))
              if isinstance(x, KDACache)]
    assert states
    for x in states:
        rec, conv = x.recurrent_state, x.conv_state
        assert rec.sharding.shard_shape(rec.shape)[1:3] == (2, rec.shape[2] // 2)
        assert conv.sharding.shard_shape(conv.shape)[1:] == (2, *conv.shape[2:4],
                                                             conv.shape[4] // 2)
    with pytest.raises(ValueError, match="outside the 3 of a partition"):
        r.set_pages(0, [3])
    with pytest.raises(ValueError, match="num_pages=6 must be a multiple of the mesh's 4"):
        _runner(mesh, num_slots=4, num_pages=6)
    prompts = [rng.integers(0, 256, n).tolist() for n in (30, 90, 50, 10, 70)]
    got, want = (_engine(r, prefix_cache=False).generate(_requests(prompts, 20))
                 for r in runners)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)


def _turns(eng, ref, rng, sessions, reverse_second=False):
    """Two turns of each session (the second: the first's prompt and output and 20 new
    tokens), through ``eng`` and ``ref``: outputs equal; returns the prefix-cache hits of the
    second turn."""
    prompts = [rng.integers(0, 256, 60).tolist() for _ in range(sessions)]
    for turn in range(2):
        hits = eng.metrics()["prefix_cache"]["hit_tokens"]
        order = prompts[::-1] if turn and reverse_second else prompts
        got = eng.generate(_requests(order, 30))
        want = ref.generate(_requests(order, 30))
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
        prompts = [p + g.token_ids + rng.integers(0, 256, 20).tolist()
                   for p, g in zip(order, got)]
    return eng.metrics()["prefix_cache"]["hit_tokens"] - hits


def test_a_stack_of_dsa_layers_on_a_mesh_equals_one_device(mesh):
    """Two Gated DSA layers in one scan: each reads and writes its own rows of
    its stack's pools in every partition (``PagedDSACache.stacked``), as the dense-slot cache
    on one device gives; and so does the dense-slot cache on the mesh, with XLA attention and
    with the Pallas kernel, which reads each device's slots of a stack ``[2, B', L, D]`` as
    rows (``sequence_parallel._in_stack``, in a ``shard_map``)."""
    cfg = apply_overrides(CFG, ["linear_attn_config.kda_layers=[]", "first_k_dense_replace=0",
                                "linear_attn_config.full_attn_layers=[1, 2]"])
    runners = [_runner(None, cfg, num_slots=8), _runner(mesh, cfg, num_slots=8, num_pages=12),
               _runner(mesh, cfg.replace(attention_impl="pallas"), num_slots=8),
               _runner(mesh, cfg, num_slots=8)]  # dense slots with XLA: the RL sampler's
    pools = [x for x in jax.tree.leaves(runners[1].cache, is_leaf=lambda x: isinstance(
        x, pc.PagedDSACache)) if isinstance(x, pc.PagedDSACache)]
    assert [p.kv_latent.shape[0] for p in pools] == [2]
    dense = [a for a in jax.tree.leaves(runners[2].cache) if a.ndim == 4 and a.shape[0] == 2]
    assert dense and all(a.sharding.shard_shape(a.shape)[1] == 2 for a in dense)  # 2 slots each
    _steps_equal(runners)


def test_engine_on_a_mesh_with_prefix_cache_equals_one_device(runners):
    """8 slots (2 per device group), 3 pages per group, the prefix cache: greedy tokens and
    log-probs equal the one-device engine's. Six sessions: two share a group, whose pages run
    out: they wait or are preempted, with the same outputs. Then four sessions: each second
    turn (sent in reverse order) goes to the group holding its first turn and resumes where it
    ended (60 prompt + 29 fed output tokens)."""
    rng = np.random.default_rng(1)
    eng, ref = (_engine(r) for r in runners)
    _turns(eng, ref, rng, 6)
    assert eng.metrics()["preemptions"] >= 1
    assert _turns(eng, ref, rng, 4, reverse_second=True) == 4 * 89
    m = eng.metrics()
    assert m["cache"]["partitions"] == 4 and m["queue_length"] == 0
    assert sum(p.pool.free + len(p.idle) + len(p.partial) for p in eng.prefixes) == 12
