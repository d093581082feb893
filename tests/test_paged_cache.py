"""Paged DSA caches (``model/paged_cache.py``): the same tokens through pages scattered over a
shared pool give what the dense-slot cache gives, prefill and decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdsa.model import paged_cache as pc
from kdsa.model.config import get_preset
from kdsa.model.overrides import apply_overrides
from kdsa.infer.prefix_cache import page_keys as pc_page_keys
from kdsa.model.transformer import Transformer

P = pc.PAGE_SIZE


def test_slots_follow_the_block_table():
    table = jnp.asarray([[5, 2, -1], [7, -1, -1]], jnp.int32)
    pos = jnp.asarray([[0, 63, 64, 130, 200], [3, 64, -1, 0, 1]], jnp.int32)
    got = np.asarray(pc.token_slots(table, pos, 999))
    want = [[5 * P, 5 * P + 63, 2 * P, 999, 999], [7 * P + 3, 999, 999, 7 * P, 7 * P + 1]]
    np.testing.assert_array_equal(got, want)
    rows, backed = pc.context_slots(table)
    assert rows.shape == backed.shape == (2, 3 * P)
    np.testing.assert_array_equal(np.asarray(rows[0, P:P + 2]), [2 * P, 2 * P + 1])
    assert bool(backed[0, 2 * P - 1]) and not bool(backed[0, 2 * P]) and not bool(backed[1, P])
    idx = jnp.asarray([[[0, -1, 65]]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(pc.positions_to_slots(idx, table[:1])),
                                  [[[5 * P, -1, 2 * P + 1]]])


# tiny with 2 layers (KDA, Gated DSA + MoE), top-k 8 < context, and room for 3 pages per row
CFG = apply_overrides(get_preset("tiny"), ["num_hidden_layers=2",
                                            "linear_attn_config.kda_layers=[1]",
                                            "linear_attn_config.full_attn_layers=[2]",
                                            "max_position_embeddings=192"])


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def _forward(model, ids, pos, seg, cache):
    out = model.forward(ids, pos, cache, segment_ids=seg)
    return out.logits, out.cache


_step = nnx.jit(_forward)


def _run(model, cache, prompts, steps=3, whole_prefill=False, step=_step):
    """Prefill both rows (right-padded), then greedy-free decode of fixed tokens; with
    ``whole_prefill`` the prefill's logits at every position, padding included."""
    b, t = len(prompts), max(len(p) for p in prompts)
    ids = np.zeros((b, t), np.int32)
    seg = np.zeros((b, t), np.int32)
    for r, p in enumerate(prompts):
        ids[r, :len(p)], seg[r, :len(p)] = p, 1
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    logits, cache = step(model, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg), cache)
    if whole_prefill:
        return np.asarray(logits)
    outs = [np.asarray(logits)[r, len(p) - 1] for r, p in enumerate(prompts)]
    cur = np.asarray([len(p) for p in prompts], np.int32)
    for s in range(steps):
        tok = np.asarray([[(7 * s + r) % CFG.vocab_size] for r in range(b)], np.int32)
        logits, cache = step(model, jnp.asarray(tok), jnp.asarray(cur[:, None]),
                             jnp.ones((b, 1), jnp.int32), cache)
        outs.append(np.asarray(logits)[:, 0])
        cur = cur + 1
    return np.concatenate([o.reshape(-1) for o in outs])


@pytest.mark.parametrize("index_dtype", [None, "bfloat16"], ids=["index-f32", "index-bf16"])
def test_paged_prefill_and_decode_equal_the_dense_slot_cache(model, index_dtype):
    if index_dtype:  # bfloat16 index keys in both caches (the pool's rows gathered as they are)
        model = Transformer(CFG.replace(index_dtype=index_dtype), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CFG.vocab_size, 70).tolist(),  # crosses a page boundary
               rng.integers(0, CFG.vocab_size, 5).tolist()]
    want = _run(model, model.init_cache(2, 3 * P), prompts)
    paged = model.init_paged_cache(2, num_pages=9, max_pages=3)
    # scattered, out-of-order pages; row 1 has one page only (its context fits in it)
    table = jnp.asarray([[6, 1, 4], [3, -1, -1]], jnp.int32)
    paged = paged.replace(block_table=table)
    pools = [x for x in jax.tree.leaves(paged.layers, is_leaf=lambda x: isinstance(
        x, pc.PagedDSACache)) if isinstance(x, pc.PagedDSACache)]
    assert pools and all(p.index_keys.dtype == (index_dtype or "float32") for p in pools)
    got = _run(model, paged, prompts)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

def test_padding_queries_see_nothing_in_the_pool():
    """Dense MLA (no indexer) over the pool: a padding query sees nothing, as with dense slots;
    it once saw the positions without a page, read from pool row 0 (here noise, in a server
    another request's), so the padding rows' outputs differed between the two caches."""
    model = Transformer(CFG.replace(index_topk=None, index_n_heads=None, index_head_dim=None),
                        rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CFG.vocab_size, 70).tolist(),
               rng.integers(0, CFG.vocab_size, 5).tolist()]  # row 1: one page, 70 positions
    paged = model.init_paged_cache(2, num_pages=9, max_pages=3).replace(
        block_table=jnp.asarray([[6, 1, 4], [3, -1, -1]], jnp.int32))
    noisy = paged.replace(layers=jax.tree.map(lambda a: a + 3.0 if a.ndim == 3 else a,
                                              paged.layers))
    np.testing.assert_allclose(_run(model, noisy, prompts, whole_prefill=True),
                               _run(model, model.init_cache(2, 3 * P), prompts,
                                    whole_prefill=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("index_backend", ["triton", "mosaic"])
def test_paged_steps_with_the_pallas_kernels_equal_xla(model, monkeypatch, index_backend):
    """``attention_impl="pallas"``: the sparse MLA kernel, and in decode steps the paged index
    kernel reading index keys through the block table (``kernels_pallas/paged_index``, the GPU
    or the TPU version; all in interpret mode), give the XLA path's logits over the same
    scattered pages."""
    from kdsa.model import paged_attention

    calls = []

    def counted(*a, **k):
        calls.append(a[0].shape)
        return real(*a, backend=index_backend, **k)

    real = paged_attention.paged_index_scores
    monkeypatch.setattr(paged_attention, "paged_index_scores", counted)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, CFG.vocab_size, 70).tolist(),
               rng.integers(0, CFG.vocab_size, 5).tolist()]
    table = jnp.asarray([[6, 1, 4], [3, -1, -1]], jnp.int32)
    want = _run(model, model.init_paged_cache(2, num_pages=9, max_pages=3).replace(
        block_table=table), prompts, step=nnx.jit(_forward))  # traced here: it calls no kernel
    assert not calls
    kernels = Transformer(CFG.replace(attention_impl="pallas"), rngs=nnx.Rngs(0))
    # a jit of its own: the other backend's run compiled the same steps, trace them again
    got = _run(kernels, kernels.init_paged_cache(2, num_pages=9, max_pages=3).replace(
        block_table=table), prompts, step=nnx.jit(_forward))
    assert calls and all(c[1] == 1 for c in calls)  # traced for the decode step only
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_stack_of_dsa_layers_reads_and_writes_its_own_rows():
    """Two Gated DSA + MoE layers share one scan, so their pools are one ``[2, R, D]`` stack
    that each layer reads and writes as ``[2 * R, D]`` at its own rows (``PagedDSACache.stacked``): the paged
    steps equal the dense-slot cache's with XLA, and so do the paged and the dense-slot steps
    with the Pallas kernels (whose page ids, or slots, are offset to the layer's rows; the
    dense-slot stacks ``[2, B, L, D]`` are read as rows too, ``sequence_parallel._in_stack``).
    All but the reference keep their RoPE keys in 128 columns, as the engine does on TPU.
    ``tests/test_transformer.py`` checks the dense-slot stack against the full forward."""

    cfg = apply_overrides(CFG, ["linear_attn_config.kda_layers=[]", "first_k_dense_replace=0",
                                "linear_attn_config.full_attn_layers=[1, 2]"])
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, 70).tolist(),
               rng.integers(0, cfg.vocab_size, 5).tolist()]
    table = jnp.asarray([[6, 1, 4], [3, -1, -1]], jnp.int32)
    want = None
    for impl in ("xla", "pallas"):
        model = Transformer(cfg.replace(attention_impl=impl), rngs=nnx.Rngs(0))
        # the RoPE keys in 128 columns, as on TPU (dsa_cache.rope_cache_width), but for the
        # reference: the zero columns change no score
        paged = model.init_paged_cache(2, num_pages=9, max_pages=3, rope_lanes=128).replace(
            block_table=table)
        stacks = [x.k_rope.shape for x in jax.tree.leaves(paged.layers, is_leaf=lambda x:
                  isinstance(x, pc.PagedDSACache)) if isinstance(x, pc.PagedDSACache)]
        assert [(r, d) for r, _, d in stacks] == [(2, 128)], stacks
        dense = _run(model, model.init_cache(2, 3 * P, None if want is None else 128), prompts)
        if want is None:  # XLA's dense slots (checked against the paged steps, which read
            want = dense  # through attend_pool, not _in_stack), and the same padded
            np.testing.assert_allclose(_run(model, model.init_cache(2, 3 * P, 128), prompts),
                                       want, rtol=1e-5, atol=1e-5)
        else:  # the Pallas kernel over the dense-slot stacks
            np.testing.assert_allclose(dense, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(_run(model, paged, prompts), want, rtol=1e-5, atol=1e-5)


def test_other_requests_pages_are_never_read(model):
    """Garbage in every pool row (the pages no row owns, the other row's pages, a row's own
    rows past its tokens) changes nothing: the shapes and pages of the dense-slot comparison
    above, so its compiled steps serve."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, CFG.vocab_size, 70).tolist(),
               rng.integers(0, CFG.vocab_size, 5).tolist()]
    clean = model.init_paged_cache(2, num_pages=9, max_pages=3).replace(
        block_table=jnp.asarray([[6, 1, 4], [3, -1, -1]], jnp.int32))
    noisy = clean.replace(layers=jax.tree.map(
        lambda a: a + 3.0 if a.ndim == 3 else a, clean.layers))  # every DSA pool row (R, rows, D)
    np.testing.assert_allclose(_run(model, noisy, prompts), _run(model, clean, prompts),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("paged", [False, True], ids=["dense-slots", "paged"])
def test_prefill_reads_only_the_context_width_in_use(model, monkeypatch, paged):
    """A prefill chunk reads the DSA caches up to the width its end needs (64 pages, then all
    65), and so does a decode step (the first 64 columns of the block table,
    ``ModelRunner.table_width``): the logits of a runner that always reads its whole cache, for
    chunks inside the first width, a decode step there (crossing into the row's second page),
    a chunk crossing into the next width, a decode step after it, then a batched prefill of
    two fresh rows inside the first width (one of them reusing the long row: its old keys past
    the width stay behind the causal mask) and a decode step of both."""
    from kdsa.infer import runner as runner_mod, runner_pages

    rng = np.random.default_rng(5)
    prompt = rng.integers(0, CFG.vocab_size, 70).tolist()
    tail = rng.integers(0, CFG.vocab_size, 32).tolist()

    def run():
        runner = runner_mod.ModelRunner(model, num_slots=2, max_len=65 * P, prefill_chunk=32,
                                        min_bucket=32, batch_prefill=True,
                                        **({"num_pages": 66} if paged else {}))
        if paged:
            pages = rng.permutation(66).tolist()
            runner.set_pages(1, pages[:65])
            runner.set_pages(0, pages[65:])
        for start in range(0, len(prompt), 32):
            first = runner.prefill(1, prompt[start:start + 32], start)
        inside = runner.decode(np.asarray([0, 5]), np.asarray([0, 70]),
                               np.asarray([False, True]))[1:]
        crossing = runner.prefill(1, tail, 64 * P - 16)  # positions 4080..4111
        step = runner.decode(np.asarray([0, 9]), np.asarray([0, 64 * P + 16]),
                             np.asarray([False, True]))[1:]
        both = runner.prefill_batch([0, 1], [prompt[:20], tail[:30]], [0, 0])
        step2 = runner.decode(np.asarray([3, 4]), np.asarray([20, 30]), np.ones(2, bool))
        return runner, np.concatenate([np.asarray(x).reshape(-1) for x in (
            first, inside, crossing, step, both, step2)])

    runner, got = run()
    table, width = runner._context(70)
    if paged:
        assert table.shape[1] == 64 and width is None
        assert runner.table_widths == (64, 65)
        assert (runner.table_width(2), runner.table_width(64), runner.table_width(65)) == (
            64, 64, 65)
    else:
        assert table is None and width == 64 * P
    assert runner._context(64 * P + 16)[1] is None  # past 64 pages: the whole cache
    rng = np.random.default_rng(5)  # the same pages for the runner that reads everything
    rng.integers(0, CFG.vocab_size, 70), rng.integers(0, CFG.vocab_size, 32)
    monkeypatch.setattr(runner_pages, "MIN_TABLE_PAGES", 1 << 20)
    _, want = run()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ---- the engine on a paged cache --------------------------------------------------------------

def _engine(model, **kw):
    from kdsa.infer.engine import Engine
    from kdsa.infer.runner import ModelRunner
    from kdsa.infer.tokenizer import ByteTokenizer

    # 4 slots and chunk 32, as tests/test_batched_prefill.py: the same model shapes compile the
    # same prefill and decode programs, which the suite's persistent compile cache shares
    runner = ModelRunner(model, num_slots=4, max_len=3 * P, prefill_chunk=32, min_bucket=32,
                         **kw)
    return Engine(runner, ByteTokenizer(CFG.vocab_size), max_top_logprobs=0)


def _requests(prompts, max_tokens):
    from kdsa.infer.engine import Request
    from kdsa.infer.sampling import SamplingParams

    return [Request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            for p in prompts]


def test_engine_paged_equals_dense_slots_and_waits_for_pages(model):
    """Greedy tokens and log-probs of a paged engine equal the dense-slot engine's; with a pool
    too small for all requests at once, the rest wait in the queue and still finish alike."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n).tolist() for n in (70, 5, 40, 100)]
    want = _engine(model).generate(_requests(prompts, 12))
    for pages in (12, 3):  # room for all; room for one request of 2 pages at a time
        eng = _engine(model, num_pages=pages)
        got = eng.generate(_requests(prompts, 12))
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
        cache = eng.metrics()["cache"]
        assert 2 <= cache.pop("pages_peak") <= pages  # (the 100-token prompt holds 2)
        assert cache == {"kind": "paged", "partitions": 1, "page_size": P, "pages_total": pages,
                         "pages_used": 0, "pages_free": pages}  # all returned


def test_engine_preempts_when_the_pool_runs_out_and_outputs_stay_exact(model, monkeypatch):
    """Pages are taken as requests grow; when decode finds none free, the latest admitted
    request is preempted and later recomputed (with the prefix cache: resumed from the
    snapshot it left), and every output equals a dense-slot engine's. A waiting request's
    page keys are hashed once per length it waits at, not at every step."""
    from kdsa.infer import engine_pages

    hashed = []
    monkeypatch.setattr(engine_pages, "page_keys",
                        lambda items: hashed.append(len(items)) or pc_page_keys(items))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, 60).tolist() for _ in range(3)]  # 60 + 80: 3 pages each
    want = _engine(model).generate(_requests(prompts, 80))
    for snapshots in (0, 4):  # recompute from scratch; resume from the preemption snapshot
        eng = _engine(model, num_pages=3, num_snapshots=snapshots)  # compiled above
        got = eng.generate(_requests(prompts, 80))
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
        assert eng.metrics()["preemptions"] >= 1
        if snapshots:
            pc = eng.prefix
            assert pc.pool.free + len(pc.idle) + len(pc.partial) == 3  # nothing leaked
            m = eng.metrics()  # admission and end per request and preemption, no more
            assert len(hashed) <= 2 * (len(prompts) + m["preemptions"]), (hashed, m)
            assert m["decode_steps"] > 2 * len(hashed)  # (the waits took many steps)
        else:
            assert eng.pages.free == 3


def test_engine_refuses_a_request_larger_than_the_pool(model):
    eng = _engine(model, num_pages=2)
    with pytest.raises(ValueError, match=r"needs 3 cache pages of 64 tokens .* pool has 2"):
        eng.submit(_requests([[1] * 100], 40)[0])


def test_cache_memory_sizes_the_pool():
    from kdsa.infer.page_pool import page_bytes, pages_in, pages_needed
    from kdsa.model.dsa_cache import dsa_cache_bytes_per_token

    per = page_bytes(CFG)
    assert per == 1 * P * dsa_cache_bytes_per_token(CFG)  # one DSA layer
    assert pages_in(11 * per + per // 2, CFG) == 10  # and the scratch page
    # the pool also holds a scratch page per DSA layer: 10 pages need that much more
    scratch = pc.SCRATCH_ROWS * (per // P)
    assert pc.SCRATCH_ROWS == P
    assert pages_in(10 * per + scratch - 1, CFG) == 9 and pages_in(10 * per + scratch, CFG) == 10
    pool = jax.eval_shape(lambda: pc.init_paged_dsa_cache(CFG, 10))
    assert sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(pool)) \
        == 10 * per + scratch
    assert pages_needed(70, 12, 3 * P) == 2 and pages_needed(150, 100, 3 * P) == 3
    # on TPU (128 lanes) every row lies in HBM padded to 128 lanes: the RoPE key's 128 columns
    # are in the pool's array itself, the latent's and index keys' padding in the row-major
    # layout the runner gives them (infer/cache_layout.py)
    wide = page_bytes(CFG, 128)
    pool = jax.eval_shape(lambda: pc.init_paged_dsa_cache(CFG, 10, rope_lanes=128))
    assert pool.k_rope.shape[-1] == 128 and pool.kv_latent.shape[-1] < 128
    assert pool.index_keys.shape[-1] < 128
    assert wide == P * 3 * 128 * 4  # three float32 buffers of 128 lanes
    assert pages_in(11 * wide, CFG, 128) == 10
    with pytest.raises(ValueError, match="holds no page"):
        pages_in(per - 1, CFG)
    dense = apply_overrides(CFG, ["linear_attn_config.kda_layers=[1, 2]",
                                  "linear_attn_config.full_attn_layers=[]"])
    with pytest.raises(ValueError, match="no DSA layers"):
        pages_in(1 << 30, dense)


def test_generate_refuses_both_pool_sizes(tmp_path, capsys):
    from kdsa.cli.main import main

    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
    rc = main(["generate", "--preset", "tiny", "--num-pages", "4", "--cache-memory", "1GiB",
               "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl")])
    assert rc == 2 and "--num-pages or --cache-memory, not both" in capsys.readouterr().err


def test_generate_and_serve_default_to_the_paged_cache_with_prefix_caching(tmp_path, capsys):
    """One device: ``--slots`` x the pages of ``--max-len`` with the prefix cache on;
    ``--dense-cache`` opts out (and takes no pool size)."""
    import argparse

    from kdsa.cli.generate_cmd import add_engine_args, engine_from_args
    from kdsa.cli.main import main

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = ["--preset", "tiny", "--slots", "2", "--max-len", "200"]
    engine, _, _ = engine_from_args(p.parse_args(args))
    assert engine.pages.num_pages == 2 * 4 and engine.prefix is not None
    assert engine.metrics()["cache"]["kind"] == "paged"
    engine, _, _ = engine_from_args(p.parse_args(args + ["--dense-cache"]))
    assert engine.pages is None and engine.prefix is None
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
    rc = main(["generate", "--preset", "tiny", "--dense-cache", "--num-pages", "4",
               "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl")])
    assert rc == 2 and "--dense-cache takes no pool size" in capsys.readouterr().err


def test_logits_at_equals_the_full_logits_there(model):
    """``forward(logits_at=...)`` (prefill's lean logits) equals the full logits at those
    positions."""
    ids = jnp.asarray(np.random.default_rng(3).integers(0, CFG.vocab_size, (2, 20)), jnp.int32)
    at = jnp.asarray([[19, 3], [0, 7]], jnp.int32)
    full = nnx.jit(lambda m, x: m.forward(x).logits)(model, ids)
    lean = nnx.jit(lambda m, x, a: m.forward(x, logits_at=a).logits)(model, ids, at)
    assert lean.shape == (2, 2, CFG.vocab_size)
    np.testing.assert_allclose(np.asarray(lean),
                               np.take_along_axis(np.asarray(full), np.asarray(at)[..., None],
                                                  axis=1), rtol=1e-5, atol=1e-5)


def test_a_request_without_max_tokens_fits_a_pool_smaller_than_the_context(model):
    """The servers default ``max_tokens`` to the room left in ``Engine.max_request_tokens``:
    with a pool of 2 pages under a 192-token context that is 128 tokens, so such a request
    is admitted (the rest of the context was refused: "needs 3 cache pages")."""
    from kdsa.infer import openai_api
    from kdsa.infer.chat import get_format
    from kdsa.infer.tokenizer import load_tokenizer

    eng = _engine(model, num_pages=2)
    assert eng.max_request_tokens == 2 * P < eng.runner.max_len
    assert _engine(model).max_request_tokens == eng.runner.max_len  # dense slots
    tok = load_tokenizer(None, vocab_size=CFG.vocab_size, flavor="k2")
    job = openai_api.parse_chat_request({"messages": [{"role": "user", "content": "hi"}]},
                                        model_name="m", chat_format=get_format("k2", tok),
                                        max_len=eng.max_request_tokens)
    assert len(job.prompt) + job.sampling[0].max_tokens == 2 * P
    from kdsa.infer.engine import Request

    eng.submit(Request(job.prompt, job.sampling[0]))  # admitted: it fits the pool
    eng.cancel(eng._waiting[0].req.request_id)
    while eng.has_work():
        eng.step()
