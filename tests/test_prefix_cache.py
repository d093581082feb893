"""Exact prefix caching (``infer/prefix_cache.py``): with a hit, greedy tokens and log-probs
equal those without one, for prompts sharing nothing, part of a page, exactly N pages and a
whole history, for concurrent requests resuming from one snapshot, and under eviction."""

import numpy as np
import pytest
from flax import nnx

from kdsa.infer.engine import Engine, Request
from kdsa.infer.prefix_cache import PrefixCache, page_keys
from kdsa.infer.page_pool import PagePool
from kdsa.infer.runner import ModelRunner
from kdsa.infer.sampling import SamplingParams
from kdsa.infer.tokenizer import ByteTokenizer
from kdsa.model.config import get_preset
from kdsa.model.overrides import apply_overrides
from kdsa.model.transformer import Transformer

P = 64
CFG = apply_overrides(get_preset("tiny"), ["num_hidden_layers=3",
                                            "linear_attn_config.kda_layers=[1, 2]",
                                            "linear_attn_config.full_attn_layers=[3]"])


def test_page_keys_chain_and_lru_eviction():
    a, b = list(range(200)), list(range(64)) + [7] * 136
    ka, kb = page_keys(a), page_keys(b)
    assert len(ka) == 3 and ka[0] == kb[0] and ka[1] != kb[1]  # same first page only
    pc = PrefixCache(PagePool(4), num_snapshots=1, snapshot_every=1)
    pages = pc.allocate(3)
    for k, p in zip(ka, pages):
        pc.register(k, p)
    slot = pc.add_snapshot(ka[1])
    pc.release(pages)  # idle, still cached
    j, got, shared = pc.lookup(ka, len(a))
    assert (j, got, shared) == (2, slot, pages[:2])
    pc.release(shared)
    assert pc.allocate(4) is not None  # evicts the idle pages (LRU) to make room
    assert pc.lookup(ka, len(a)) == (0, None, [])  # the snapshot's pages are gone


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def _engine(model, cache: bool, num_pages=24, snapshots=4):
    runner = ModelRunner(model, num_slots=2, max_len=6 * P, prefill_chunk=48, min_bucket=16,
                         num_pages=num_pages, num_snapshots=snapshots if cache else 0)
    return Engine(runner, ByteTokenizer(CFG.vocab_size), max_top_logprobs=0,
                  prefix_snapshot_every=1)


def _run(engine, prompts, max_tokens=6):
    reqs = [Request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            for p in prompts]
    return [(c.token_ids, np.asarray(c.logprobs)) for c in engine.generate(reqs)]


def _same(got, want):
    for (gt, gl), (wt, wl) in zip(got, want):
        assert gt == wt
        np.testing.assert_allclose(gl, wl, atol=1e-5)


def test_hits_give_the_outputs_of_no_hit(model):
    rng = np.random.default_rng(0)
    tok = lambda n: rng.integers(0, 256, n).tolist()  # noqa: E731
    system = tok(150)  # two full pages and part of a third
    turns = [
        [tok(90)],                                    # shares nothing (fills the cache)
        [system + tok(20)],                           # snapshots at 64 and 128
        [system + tok(9)],                            # part of a page shared: resumes at 128
        [system[:128]],                               # exactly 2 pages: resumes at 64
        [system + tok(5), system + tok(30)],          # concurrent, diverging mid-page
    ]
    cached, plain = _engine(model, True), _engine(model, False)
    hits = []
    for prompts in turns:
        _same(_run(cached, prompts), _run(plain, prompts))
        hits.append(cached.metrics()["prefix_cache"]["hit_tokens"])
    assert hits == [0, 0, 128, 128 + 64, 128 + 64 + 2 * 128], hits
    # a whole history: the last turn's prompt and output, then a new message
    first = system + tok(70)
    (out, _), = _run(cached, [first])
    before = cached.metrics()["prefix_cache"]["hit_tokens"]
    history = first + out + tok(40)
    _same(_run(cached, [history]), _run(plain, [history]))
    assert cached.metrics()["prefix_cache"]["hit_tokens"] - before == 3 * P  # first's pages


def test_eviction_under_memory_pressure_stays_exact(model):
    """A pool that holds one request at a time: cached pages are evicted for new requests and
    snapshots whose pages are gone are not used; outputs stay those without a cache."""
    rng = np.random.default_rng(1)
    system = rng.integers(0, 256, 140).tolist()
    prompts = [system + rng.integers(0, 256, n).tolist() for n in (10, 60, 5)]
    others = [rng.integers(0, 256, 200).tolist()]
    cached, plain = _engine(model, True, num_pages=4), _engine(model, False, num_pages=4)
    for batch in ([prompts[0]], others, [prompts[1]], [prompts[2]]):
        _same(_run(cached, batch), _run(plain, batch))
    st = cached.metrics()["prefix_cache"]
    assert st["queried_tokens"] == sum(len(p) for p in prompts) + 200
    assert st["hit_tokens"] in (0, 128, 256)  # whatever survived eviction was exact
