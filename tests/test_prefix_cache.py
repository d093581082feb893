"""Exact prefix caching (``infer/prefix_cache.py``): with a hit, greedy tokens and log-probs
equal those without one, for prompts sharing nothing, part of a page, exactly N pages and a
whole history (resumed from the last turn's end-of-request snapshot, inside a page), for
concurrent requests resuming from one snapshot (the partial page and the KDA state copied on
write), and under eviction (no page leaked)."""

import jax
import numpy as np
import pytest
from flax import nnx

from kdsa.infer.engine import Engine, GenerationError, Request
from kdsa.infer.prefix_cache import PrefixCache, page_keys
from kdsa.infer.page_pool import PagePool
from kdsa.infer.runner import ModelRunner
from kdsa.infer.sampling import SamplingParams
from kdsa.infer.tokenizer import ByteTokenizer
from kdsa.model.config import get_preset
from kdsa.model.overrides import apply_overrides
from kdsa.model.transformer import Transformer

P = 64
CFG = apply_overrides(get_preset("tiny"), ["num_hidden_layers=2",
                                            "linear_attn_config.kda_layers=[1]",
                                            "linear_attn_config.full_attn_layers=[2]"])


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
    depth, got, shared, partial = pc.lookup(ka, a)
    assert (depth, got, shared, partial) == (2 * P, slot, pages[:2], None)
    pc.release(shared)
    assert pc.allocate(4) is not None  # evicts the idle pages (LRU) to make room
    assert pc.lookup(ka, a) == (0, None, [], None)  # the snapshot's pages are gone


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def _engine(model, cache: bool, num_pages=24, snapshots=4, every=1):
    runner = ModelRunner(model, num_slots=2, max_len=6 * P, prefill_chunk=48, min_bucket=16,
                         num_pages=num_pages, num_snapshots=snapshots if cache else 0)
    return Engine(runner, ByteTokenizer(CFG.vocab_size), max_top_logprobs=0,
                  prefix_snapshot_every=every)


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
    cached, plain = _engine(model, True, snapshots=6), _engine(model, False)
    hits = []
    for prompts in turns:
        _same(_run(cached, prompts), _run(plain, prompts))
        hits.append(cached.metrics()["prefix_cache"]["hit_tokens"])
    assert hits == [0, 0, 128, 128 + 64, 128 + 64 + 2 * 128], hits
    # a whole history: the last turn's prompt and output, then a new message; the turn ended
    # inside its fourth page, so the next one resumes from its end-of-request snapshot there:
    # everything it fed (220 prompt tokens and 5 of its 6 outputs; the last was never fed)
    first = system + tok(70)
    (out, _), = _run(cached, [first])
    before = cached.metrics()["prefix_cache"]["hit_tokens"]
    history = first + out + tok(40)
    _same(_run(cached, [history]), _run(plain, [history]))
    fed = len(first) + len(out) - 1
    assert cached.metrics()["prefix_cache"]["hit_tokens"] - before == fed
    # two requests resume from that one snapshot at once and diverge: each writes its own
    # copy of the partial page (copy-on-write) and of the KDA state
    before = cached.metrics()["prefix_cache"]["hit_tokens"]
    forks = [first + out + tok(3), first + out + tok(50)]
    _same(_run(cached, forks), _run(plain, forks))
    assert cached.metrics()["prefix_cache"]["hit_tokens"] - before == 2 * fed
    assert cached.metrics()["prefix_cache"]["end_snapshots"] >= 1


def test_a_request_preempted_before_its_first_token_counts_its_prompt_once(model):
    """A request preempted while still prefilling (as ``_grow_pages`` does to the latest one
    when a decode needs a page) is admitted again later: its prompt counts as queried once,
    and resuming from the snapshots of its own first prefill is no hit; the outputs stay those
    without a cache."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, n).tolist() for n in (62, 250)]

    def run(snapshots):
        runner = ModelRunner(model, num_slots=2, max_len=6 * P, prefill_chunk=48, min_bucket=16,
                             num_pages=24, num_snapshots=snapshots)
        engine = Engine(runner, ByteTokenizer(CFG.vocab_size), max_top_logprobs=0,
                        prefix_snapshot_every=1, prefill_tokens_per_step=48)
        prefill = engine._prefill_some

        def prefill_then_preempt():  # the long prompt, once, two thirds through its prefill
            did = prefill()
            for i, a in enumerate(engine.slots):
                if a is not None and not a.preemptions and 160 <= a.prefilled < len(a.feed):
                    assert not a.tokens
                    engine._preempt(i, a)
            return did
        engine._prefill_some = prefill_then_preempt
        return engine, _run(engine, prompts, max_tokens=8)

    cached, got = run(4)
    plain, want = run(0)
    _same(got, want)
    for engine in (cached, plain):
        assert engine.metrics()["preemptions"] == 1
    st = cached.metrics()["prefix_cache"]
    assert st["queried_tokens"] == sum(map(len, prompts))
    assert st["hit_tokens"] == 0


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
    # nothing leaked: every page is free, cached and idle, or held by an end snapshot
    pc = cached.prefix
    assert pc.pool.free + len(pc.idle) + len(pc.partial) == pc.pool.num_pages
    assert not pc.refs.keys() - {page for _, _, page in pc.partial.values()}


def test_end_of_request_snapshot_holds_its_partial_page_until_evicted():
    """The bookkeeping alone: a finished request's state after 100 fed tokens is found by a
    prompt continuing them (1 shared page + the partial page to copy); it gives its partial
    page back when evicted, and is dropped for its page when the pool runs short."""
    fed = list(range(100))
    pc = PrefixCache(PagePool(4), num_snapshots=1, snapshot_every=1)
    pages = pc.allocate(2)
    slot = pc.add_end_snapshot(page_keys(fed), fed, pages)
    pc.release(pages)  # the request is done: page 0 cached (idle), page 1 held by the snapshot
    assert (pc.pool.free, len(pc.idle), pc.usage()["end_snapshots"]) == (2, 1, 1)
    prompt = fed + [7, 8]
    assert pc.lookup(page_keys(prompt), prompt) == (100, slot, pages[:1], pages[1])
    pc.release(pages)
    assert pc.lookup(page_keys(fed[:99] + [1, 2]), fed[:99] + [1, 2])[0] == 0  # diverged inside
    assert pc.add_end_snapshot(page_keys(fed), fed, pages) is None  # the same state: kept once
    assert pc.allocate(4) is not None  # short of pages: the end snapshot goes, and its page
    assert pc.usage()["end_snapshots"] == 0 and pc.pool.free == 0


def test_snapshot_ranks_keep_what_is_reused():
    """Eviction takes the least recently used snapshot of the lowest rank; a speculative
    (interval) snapshot never pushes out a higher-ranked one; at most 3/4 of the slots
    (here 1) stay confirmed; a branch point is where a prompt's cached pages end past its snapshot."""
    from kdsa.infer.prefix_cache import CONFIRMED, END, SPECULATIVE

    a = list(range(4 * P))
    ka = page_keys(a)
    pc = PrefixCache(PagePool(8), num_snapshots=2, snapshot_every=1)
    pages = pc.allocate(4)
    for k, p in zip(ka, pages):
        pc.register(k, p)
    s1, s2 = pc.add_snapshot(ka[0]), pc.add_snapshot(ka[1])
    assert pc.lookup(ka, a)[:2] == (2 * P, s2)  # a hit confirms the snapshot at page 2
    assert pc.rank == {ka[0]: SPECULATIVE, ka[1]: CONFIRMED}
    assert pc.add_snapshot(ka[2], END) == s1  # the speculative one goes first
    assert pc.add_snapshot(ka[3]) is None  # not at the cost of higher ranks: not taken
    assert pc.add_snapshot(ka[0], CONFIRMED) == s1  # the end one goes before the confirmed
    assert pc.rank == {ka[1]: END, ka[0]: CONFIRMED}  # one confirmed at most: ka[1] demoted
    # the four pages are cached, with snapshots at pages 1 and 2: resuming at 0, a prompt
    # continuing them (and more) snapshots at page 4
    assert pc.branch_point(ka, 0, 5 * P) == 4
    assert pc.branch_point(ka, 0, 4 * P) is None  # nothing left to feed past it
    assert pc.branch_point(ka[:2], 0, 5 * P) is None  # ka[1] has its snapshot already
    assert pc.branch_point(ka, 4 * P, 5 * P) is None  # resumed there already


def test_branch_point_snapshot_serves_the_next_request(model):
    """No interval snapshots inside the prompts (every 100 pages): the first request leaves
    only pages; the second, finding 3 of its pages cached, snapshots the KDA state there (the
    branch point); the third resumes from it. Outputs equal those without a cache."""
    rng = np.random.default_rng(2)
    system = rng.integers(0, 256, 3 * P + 20).tolist()
    prompts = [system + rng.integers(0, 256, n).tolist() for n in (30, 7, 50)]
    cached, plain = _engine(model, True, snapshots=2, every=100), _engine(model, False)
    hits = []
    for p in prompts:
        _same(_run(cached, [p]), _run(plain, [p]))
        hits.append(cached.metrics()["prefix_cache"]["hit_tokens"])
    assert hits == [0, 0, 3 * P], hits
    assert cached.metrics()["prefix_cache"]["confirmed_snapshots"] == 1


def test_a_runner_that_places_its_cache_on_one_device_gives_the_same_outputs(model,
                                                                             monkeypatch):
    """On one TPU device without a mesh the runner places its cache itself
    (``infer/cache_layout.py``: the DSA pools row-major as ``Format``s) and every step that
    returns the cache returns it so: prefill, batched prefill, decode, page copies and KDA
    snapshots. Run here by treating the CPU device as one that needs placing (row-major is
    CPU's default layout, so what this checks is the wiring): the engine's greedy tokens and
    log-probs, with prefix-cache hits, copy-on-write pages and batched prompts, equal those of
    the default placement (prompts one at a time: batched prefill equals that,
    tests/test_batched_prefill.py)."""
    from kdsa.infer import cache_layout
    from kdsa.infer import runner_steps

    rng = np.random.default_rng(3)
    first = rng.integers(0, 256, 130).tolist()
    forks = [rng.integers(0, 256, n).tolist() for n in (4, 45)]
    copies = []
    copy_page = ModelRunner.copy_page
    monkeypatch.setattr(ModelRunner, "copy_page", lambda self, *a, **k: (
        copies.append(a), copy_page(self, *a, **k))[1])

    def run(batch: bool):  # batched prefill only where placed: the plain runner then shares
        runner = ModelRunner(  # the compiled steps of the tests above (_engine's sizes)
            model, num_slots=2, max_len=6 * P, prefill_chunk=48, min_bucket=16, num_pages=24,
            num_snapshots=4, batch_prefill=batch)
        engine = Engine(runner, ByteTokenizer(CFG.vocab_size), max_top_logprobs=0,
                        prefix_snapshot_every=1, prefill_tokens_per_step=96)
        (out, _), = done = _run(engine, [first])
        # the turn ended mid-page: both forks resume from its end and copy that page
        return runner, engine, done + _run(engine, [first + out + f for f in forks])

    _, plain, want = run(batch=False)
    n_copies = len(copies)
    monkeypatch.setattr(cache_layout, "places_one_device", lambda device: True)
    runner, placed, got = run(batch=True)
    assert runner._copy_page is not runner_steps.copy_page_jit  # its own, placing jits
    _same(got, want)
    m = placed.metrics()
    assert m["prefix_cache"]["hit_tokens"] > 0 and m["batched_prefill_steps"] > 0, m
    assert m["prefix_cache"] == plain.metrics()["prefix_cache"]
    assert plain.metrics()["batched_prefill_steps"] == 0
    assert n_copies > 0 and len(copies) == 2 * n_copies, copies


def test_a_failed_state_copy_fails_one_request_and_leaks_nothing(model):
    """A snapshot whose state copy fails is given up (no later request resumes from a stale
    state); a resume whose copy fails fails that request only, with its pages released; the
    requests after both are exact."""
    rng = np.random.default_rng(2)
    system = rng.integers(0, 256, 140).tolist()
    prompts = [system + rng.integers(0, 256, n).tolist() for n in (10, 20, 30)]
    cached, plain = _engine(model, True), _engine(model, False)
    runner, calls = cached.runner, []

    def failing(name):
        real = getattr(runner, name)

        def once(*args, **kw):
            calls.append(name)
            if calls.count(name) == 1:
                raise RuntimeError(f"injected {name} failure")
            return real(*args, **kw)
        return once

    runner.save_state = failing("save_state")  # the first snapshot of prompt 0
    _same(_run(cached, prompts[:1]), _run(plain, prompts[:1]))
    assert "save_state" in calls
    pc = cached.prefix
    assert len(pc.snap_of) + len(pc.free_snaps) == pc.num_snapshots  # no slot lost
    runner.restore_state = failing("restore_state")  # prompt 1 resumes: its copy fails
    with pytest.raises(GenerationError, match="injected restore_state failure"):
        cached.generate([Request(prompts[1], SamplingParams(temperature=0.0, max_tokens=4))])
    assert not pc.refs.keys() - {page for _, _, page in pc.partial.values()}  # none held
    assert cached.healthy
    _same(_run(cached, prompts[1:]), _run(plain, prompts[1:]))  # resumes, exact
    assert cached.metrics()["prefix_cache"]["hit_tokens"] > 0


@pytest.mark.parametrize("step", ["_prefill", "_decode"])
def test_a_step_that_fails_after_consuming_the_cache_does_not_stop_the_engine(model, step):
    """A compiled step deletes the cache donated to it once it runs, whether or not it
    finishes (a device out of memory mid-step; here the real step runs, then an error is
    raised). The engine went on with a deleted cache: every later step failed ("Array has been
    deleted") until it declared itself dead. Now the runner rebuilds its buffers empty, the
    running requests are aborted, the prefix cache is emptied, and later requests are exact."""
    rng = np.random.default_rng(3)
    system = rng.integers(0, 256, 140).tolist()
    prompts = [system + rng.integers(0, 256, n).tolist() for n in (10, 20, 30)]
    cached, plain = _engine(model, True), _engine(model, False)
    _run(cached, prompts[:1])  # pages and snapshots cached
    runner, real, calls = cached.runner, getattr(cached.runner, step), []

    def once(*args, **kw):
        out = real(*args, **kw)  # the donated cache is consumed here
        calls.append(1)
        if len(calls) == 1:
            jax.block_until_ready(out)
            raise RuntimeError("injected failure after the step ran")
        return out

    setattr(runner, step, once)
    reqs = [Request(q, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            for q in prompts[1:]]
    with pytest.raises(GenerationError, match="injected failure|lost the cache"):
        cached.generate(reqs)
    assert cached.healthy and calls
    usage = cached.prefix.usage()
    assert usage["cached_pages"] == usage["snapshots"] == 0 and usage["queried_tokens"] > 0
    assert cached.pools[0].free == cached.pools[0].num_pages
    _same(_run(cached, prompts), _run(plain, prompts))  # the engine goes on, exact
    assert cached.healthy


def test_end_snapshots_give_way_to_a_waiting_request_while_another_runs(model):
    """Six finished requests leave end-of-request snapshots holding six of 12 pages; a long
    request L runs in one slot. A new request H fits if those snapshots are dropped: it used to
    wait (with its slot empty) until L finished, as admission counted only free and idle pages
    while anything ran; now it runs beside L."""
    eng = _engine(model, True, num_pages=12, snapshots=6, every=4)
    sp = lambda m: SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)  # noqa: E731
    eng.generate([Request([k] * 70, sp(1)) for k in range(6)])
    assert len(eng.prefix.partial) == 6
    done = []
    on_event = lambda ev: ev.completion and done.append(ev.request_id)  # noqa: E731
    eng.submit(Request([9] * 10, sp(300), request_id="L", on_event=on_event))
    for _ in range(120):
        eng.step()
    eng.submit(Request([8] * 250, sp(2), request_id="H", on_event=on_event))
    for _ in range(10):
        eng.step()
    assert done == ["H"], (done, eng.prefix.usage())
    while eng.has_work():
        eng.step()
    assert done == ["H", "L"] and eng.healthy


def test_warmup_compiles_the_prefix_cache_copies(model, monkeypatch):
    """``ModelRunner.warmup`` (``kdsa serve`` runs it before listening) compiles the state and
    page copies the engine makes while admitting a request, so the first prefix-cache hit
    does not compile them (the steps' own compiles are left out here: tested elsewhere)."""
    runner = _engine(model, True).runner
    for name in ("prefill", "prefill_batch", "decode"):
        monkeypatch.setattr(runner, name, lambda *a, **k: None)
    copies = (runner._save, runner._restore, runner._copy_page)
    for f in copies:  # the other tests' runners compiled the same copies
        f.clear_cache()
    assert [f._cache_size() for f in copies] == [0, 0, 0]
    runner.warmup()
    assert [f._cache_size() for f in copies] == [1, 1, 1]
    runner.save_state(1, 3)  # what the engine does next compiles nothing more
    runner.restore_state(3, 1)
    runner.copy_page(2, 5, slot=1)
    assert [f._cache_size() for f in copies] == [1, 1, 1]
    runner.set_pages(0, [0, 1])  # a runner in use: warmup would write into its pages
    with pytest.raises(RuntimeError, match="before any request holds pages"):
        runner.warmup()


@pytest.mark.parametrize("every", [1, 8], ids=["prefill-snapshot", "end-snapshot"])
def test_an_interrupt_in_a_snapshot_copy_drops_it_and_the_engine_goes_on(model, every):
    """Ctrl-C (or the RL loop's stop signal) landing in a snapshot's state copy, in prefill
    (every page) or at the request's end (``every=8``: no snapshot in prefill): the snapshot,
    whose key was filed first, is dropped (a later hit would resume from another sequence's
    state), the interrupted batch is aborted with its pages back (a finishing request's in a
    ``finally``), and the next requests are exact."""
    rng = np.random.default_rng(4)
    system = rng.integers(0, 256, 140).tolist()
    prompts = [system + rng.integers(0, 256, n).tolist() for n in (10, 20)]
    cached, plain = _engine(model, True, every=every), _engine(model, False)
    runner, real, calls = cached.runner, cached.runner.save_state, []

    def interrupted_once(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(*args, **kw)

    runner.save_state = interrupted_once
    with pytest.raises(KeyboardInterrupt):
        _run(cached, prompts[:1])
    pc = cached.prefix
    assert len(pc.snap_of) + len(pc.free_snaps) == pc.num_snapshots  # the slot came back
    assert not cached.has_work() and cached.healthy
    assert not pc.refs.keys() - {page for _, _, page in pc.partial.values()}  # none held
    assert pc.pool.free + len(pc.idle) + len(pc.partial) == pc.pool.num_pages
    _same(_run(cached, prompts), _run(plain, prompts))


def test_routing_records_and_the_prefix_cache_are_refused_together(model):
    """A hit runs none of the cached tokens, so their routing would be missing from a
    completion's record (prompt, then every sampled token)."""
    runner = ModelRunner(model, num_slots=2, max_len=6 * P, prefill_chunk=48, min_bucket=16,
                         num_pages=24, num_snapshots=4, record_routing=True)
    with pytest.raises(ValueError, match="record_routing .* prefix-cache hit"):
        Engine(runner, ByteTokenizer(CFG.vocab_size))
    assert not Engine(runner, ByteTokenizer(CFG.vocab_size), prefix_cache=False).prefixes
