"""Generation engine: greedy equals the full forward, batching equals running alone, slot reuse,
chunked prefill, stops, cancellation, thinking budgets per level, a sharded run."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdsa.infer.budget import BudgetConfig
from kdsa.infer.chat import Message, get_format
from kdsa.infer.engine import Engine, Request
from kdsa.infer.runner import ModelRunner, length_buckets
from kdsa.infer.sampling import SamplingParams
from scripted import ScriptedRunner
from kdsa.infer.tokenizer import ByteTokenizer
from kdsa.model.config import get_preset
from kdsa.model.transformer import Transformer

MAX_LEN, SLOTS, CHUNK, NEW = 128, 4, 16, 6
LENGTHS = [5, 20, 11, 3, 9, 34]  # 20 and 34 > CHUNK: chunked prefill; 6 requests > 4 slots


@pytest.fixture(scope="module")
def model():
    return Transformer(get_preset("tiny"), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def engine(model):
    runner = ModelRunner(model, num_slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK,
                         min_bucket=CHUNK)
    return Engine(runner, ByteTokenizer(model.config.vocab_size), max_top_logprobs=3)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(0, 256, n)] for n in LENGTHS]


def _greedy(n=NEW, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def batched(engine, prompts):
    return engine.generate([Request(p, _greedy(top_logprobs=3)) for p in prompts])


def test_greedy_equals_argmax_of_full_forward(model, prompts, batched):
    """Every generated token is the argmax of an uncached full forward over prompt + output."""
    seqs = np.zeros((len(prompts), MAX_LEN), np.int32)  # right padding: causal, so harmless
    for r, (p, c) in enumerate(zip(prompts, batched)):
        seqs[r, :len(p) + NEW] = p + c.token_ids
    logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(seqs)))
    for r, (p, c) in enumerate(zip(prompts, batched)):
        want = logits[r, len(p) - 1:len(p) - 1 + NEW]
        assert c.token_ids == [int(t) for t in want.argmax(-1)]
        lp = jax.nn.log_softmax(want, -1)
        np.testing.assert_allclose(c.logprobs, lp[np.arange(NEW), c.token_ids], atol=2e-4)
        top = [[i for i, _ in step] for step in c.top_logprobs]
        assert [t[0] for t in top] == c.token_ids  # greedy token is the top-1
        assert c.finish_reason == "length" and len(c.token_ids) == NEW


def test_batch_equals_alone_and_slots_are_reused(engine, prompts, batched):
    for p, c in zip(prompts, batched):
        alone = engine.generate([Request(p, _greedy())])[0]
        assert alone.token_ids == c.token_ids
        np.testing.assert_allclose(alone.logprobs, c.logprobs, atol=1e-5)
    m = engine.metrics()
    assert m["requests_finished"] >= len(prompts) * 2 and m["active_slots"] == 0
    assert m["mean_batch"] > 1  # rows decoded together
    assert m["queue_length"] == 0 and m["mean_ttft_s"] > 0


def test_seeded_sampling_is_independent_of_batch(engine, prompts):
    sp = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=i, max_tokens=5,
                         ignore_eos=True) for i in range(3)]
    together = engine.generate([Request(p, s) for p, s in zip(prompts, sp)])
    for p, s, c in zip(prompts, sp, together):
        assert engine.generate([Request(p, s)])[0].token_ids == c.token_ids
    other_seed = dataclass_replace(sp[0], seed=99)
    assert engine.generate([Request(prompts[0], other_seed)])[0].token_ids != \
        together[0].token_ids


def dataclass_replace(sp, **kw):
    import dataclasses
    return dataclasses.replace(sp, **kw)


def test_context_limit_and_bad_prompts(engine, prompts):
    c = engine.generate([Request(prompts[5], _greedy(n=100))])[0]
    assert c.finish_reason == "length" and len(prompts[5]) + len(c.token_ids) == MAX_LEN
    with pytest.raises(ValueError, match="does not fit the context"):
        engine.submit(Request([1] * MAX_LEN))
    with pytest.raises(ValueError, match="outside"):
        engine.submit(Request([1, 999]))
    with pytest.raises(ValueError, match="empty"):
        engine.submit(Request([]))


def test_failed_decode_step_leaves_later_requests_exact(engine, prompts, batched):
    """A decode step that raises (mid-generation, slots holding cache rows) aborts that step's
    requests only; the engine goes on and the same prompts then give the same greedy tokens:
    freed slots start clean."""
    real, calls = engine.runner.decode, []

    def flaky(*a):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected decode failure")
        return real(*a)
    engine.runner.decode = flaky
    try:
        got = engine.generate([Request(p, _greedy()) for p in prompts], raise_errors=False)
    finally:
        engine.runner.decode = real
    aborted = [c for c in got if c.finish_reason == "abort"]
    assert len(aborted) == SLOTS and all("injected decode" in c.error for c in aborted)
    assert all(s is None for s in engine.slots) and engine.healthy
    again = engine.generate([Request(p, _greedy()) for p in prompts])
    assert [c.token_ids for c in again] == [c.token_ids for c in batched]
    for c, b in zip(got, batched):
        if c.error is None:
            assert c.token_ids == b.token_ids


def test_length_buckets():
    assert length_buckets(8, 16) == (8, 16)
    assert length_buckets(16, 100) == (16, 32, 64, 100)
    with pytest.raises(ValueError):
        length_buckets(0, 4)


# ---- scripted model: stops, budgets, cancellation ----

TOK = ByteTokenizer(384)
FMT = get_format("xtml", TOK)
ANSWER = "The answer is 42."


def _answer_ids(fmt=FMT, tok=TOK, text=ANSWER):
    msg = Message("assistant", text, "r")
    full = fmt.render([Message("user", "q"), msg], add_generation_prompt=False)
    gen = fmt.render([Message("user", "q")])
    close = list(fmt.reasoning_end_ids)
    body = full[len(gen):]
    i = next(j for j in range(len(body)) if body[j:j + len(close)] == close)
    return body[i + len(close):]


CAPS = {"low": 5, "high": 30, "max": 60}
GRACE = 8


def _scripted_engine(**kw):
    runner = ScriptedRunner(TOK, FMT, answer_ids=_answer_ids(), **kw)
    return Engine(runner, TOK, chat_format=FMT,
                  budgets=BudgetConfig(caps=dict(CAPS), grace=GRACE))


def _chat_request(effort, eng, thinking=True, **sp):
    prompt = FMT.render([Message("user", "What is 6 x 7?")], effort=effort, thinking=thinking)
    return Request(prompt, SamplingParams(temperature=0.0, max_tokens=200, **sp),
                   reasoning_cap=eng.budgets.cap(effort) if thinking else None,
                   in_reasoning=thinking, parser=FMT.parser(thinking=thinking))


@pytest.mark.parametrize("effort,reasoning_tokens,ends", [
    ("low", 5 + GRACE, "let me t"),        # no sentence end within the grace window: hard cut
    ("high", 37, "some more."),            # the sentence ends inside the window: cut there
    ("max", 60 + GRACE, "it som")])        # the next sentence end is too far
def test_budget_caps_per_level(effort, reasoning_tokens, ends):
    eng = _scripted_engine()
    c = eng.generate([_chat_request(effort, eng)])[0]
    out = c.output
    assert c.forced_close and c.reasoning_tokens == reasoning_tokens
    assert c.reasoning_tokens <= CAPS[effort] + GRACE
    assert out.reasoning.endswith(ends) and len(out.reasoning) == reasoning_tokens
    assert out.content == ANSWER and out.complete and c.finish_reason == "stop"


def test_budget_not_forced_below_cap_and_thinking_off():
    eng = _scripted_engine(reasoning_tokens=4)
    c = eng.generate([_chat_request("low", eng)])[0]
    assert not c.forced_close and c.reasoning_tokens == 4 and c.output.content == ANSWER
    c = eng.generate([_chat_request("low", eng, thinking=False)])[0]
    assert c.reasoning_tokens == 0 and c.output.reasoning == "" and c.output.content == ANSWER


def test_budget_does_not_close_inside_a_character():
    """A sentence end, then the first byte of a two-byte character (its text so far "", the
    decoder holding a byte): the cap is reached there, but the close waits (it used to come at
    once, after the sentence end, and left half a character, U+FFFD, at the end of the
    reasoning); so for a piece that ends a sentence and starts a character."""
    from kdsa.infer.budget import ThinkingBudget

    b = ThinkingBudget(cap=2, grace=5, end_marker=(99,))
    assert b.observe(1, "x.") == [] and b.observe(2, "", partial=True) == []
    assert b.observe(3, "\u00e9") == [] and b.observe(4, " y.") == [99]
    assert b.forced_close and b.reasoning_tokens == 4
    # a piece that ends a sentence and starts a character (b".\xf0\x9f" decodes to ".")
    b = ThinkingBudget(cap=1, grace=5, end_marker=(99,))
    assert b.observe(1, ".", partial=True) == [] and b.observe(2, "\U0001f600.") == [99]


class _CallInsideReasoning(ScriptedRunner):
    """A K2 model that thinks a little, then opens a tool-call section without ``</think>``
    (which K2's parser reads as the end of the reasoning), then ends its message."""

    def __init__(self, tok, fmt, *, script: list[int], args: list[int], **kw):
        super().__init__(tok, fmt, answer_ids=[], **kw)
        self.script, self.args = script, args

    def _next(self, slot: int) -> int:
        g = self.seen[slot][self.prompt_len[slot]:]
        arg = self.tok.special("<|tool_call_argument_begin|>")
        if arg in g:  # past the call header (its own or a forced one): the arguments
            k = len(g) - g.index(arg) - 1
            return self.args[k] if k < len(self.args) else self.eos
        return self.script[len(g)] if len(g) < len(self.script) else self.eos


def test_a_tool_call_opened_inside_the_reasoning_ends_it_for_the_budget():
    """K2: the budget's cap falls inside the call (3 reasoning tokens, cap 5, no grace). The
    section ends the reasoning for the budget as for the parser, so nothing is forced into the
    call (a ``</think>`` was, at the cap: the call came out broken); the RL budget replay
    agrees (nothing forced, out of the reasoning)."""
    from kdsa.train.rl.rollout import _budget_replay

    tok = ByteTokenizer(384, "k2")
    fmt = get_format("k2", tok)
    sp = lambda name: tok.special(name)  # noqa: E731
    header = ([sp("<|tool_calls_section_begin|>"), sp("<|tool_call_begin|>")]
              + tok.encode("functions.get_weather:0") + [sp("<|tool_call_argument_begin|>")])
    args = (tok.encode('{"city": "Paris"}')
            + [sp("<|tool_call_end|>"), sp("<|tool_calls_section_end|>")])
    runner = _CallInsideReasoning(tok, fmt, script=tok.encode("Hm.") + header, args=args)
    eng = Engine(runner, tok, chat_format=fmt,
                 budgets=BudgetConfig(caps={"low": 5, "high": 5, "max": 5}, grace=0))
    prompt = fmt.render([Message("user", "Weather in Paris?")], effort="low")

    def run(prefix=()):
        return eng.generate([Request(prompt, SamplingParams(temperature=0.0, max_tokens=100),
                                     reasoning_cap=5, in_reasoning=True, answer_prefix=prefix,
                                     parser=fmt.parser(thinking=True))])[0]

    c = run()
    out = c.output
    assert not c.forced_close and out.reasoning == "Hm." and out.complete, out
    assert [(t.name, t.arguments) for t in out.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    forced, queue, b, _ = _budget_replay(eng, fmt, 5, list(c.token_ids))
    assert forced == set() and queue == [] and not b.in_reasoning and b.exited
    # tool_choice naming another function: after the model's own section token, the rest of
    # that call's opening is forced (it was dropped: the model called what it liked)
    from kdsa.infer.openai_api import tool_call_prefix

    named = tool_call_prefix(fmt, {"type": "function", "function": {"name": "lookup"}})
    assert named[0] == sp("<|tool_calls_section_begin|>")
    out = run(named).output
    assert [t.name for t in out.tool_calls] == ["lookup"] and out.complete, out


def test_zero_cap_closes_at_once():
    eng = Engine(ScriptedRunner(TOK, FMT, answer_ids=_answer_ids()), TOK, chat_format=FMT,
                 budgets=BudgetConfig(caps={"low": 0, "high": 1, "max": 2}, grace=0))
    c = eng.generate([_chat_request("low", eng)])[0]
    assert c.reasoning_tokens == 0 and c.output.reasoning == "" and c.output.content == ANSWER


def test_stop_strings_are_cut_and_never_streamed():
    eng = _scripted_engine(reasoning_tokens=4)
    seen = []
    req = _chat_request("low", eng, stop=("is 4",))
    req.on_event = lambda ev: seen.extend(v for k, v in ev.deltas if k == "content")
    c = eng.generate([req])[0]
    assert c.finish_reason == "stop" and c.text == "The answer " and "".join(seen) == c.text
    c = eng.generate([_chat_request("low", eng, stop_token_ids=(ord("a"),))])[0]
    assert TOK.decode(c.token_ids).endswith("The a")


def test_held_back_text_goes_out_before_a_tool_call():
    """With a stop string, the text's last characters wait (they may start one); a tool call
    after them went out first, and the streamed order (text, call, the held text) was not the
    message's (the Anthropic stream opened a text block after the tool_use block)."""
    from scripted import CALL, _answer

    eng = Engine(ScriptedRunner(TOK, FMT, answer_ids=_answer("Let me check.", [CALL]),
                                reasoning_tokens=4), TOK, chat_format=FMT,
                 budgets=BudgetConfig(caps=dict(CAPS), grace=GRACE))
    kinds = []
    for stop in ((), ("STOP!",)):
        req = _chat_request("low", eng, stop=stop)
        req.on_event = lambda ev: kinds.extend(k for k, v in ev.deltas if k != "content" or v)
        c = eng.generate([req])[0]
        assert c.output.content == "Let me check." and len(c.output.tool_calls) == 1
        order = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
        assert order == ["reasoning", "content", "tool_call"], (stop, kinds)
        kinds.clear()


def test_cancel_frees_the_slot():
    eng = _scripted_engine()  # reasons without end until the cap
    reqs = [_chat_request("max", eng) for _ in range(eng.runner.num_slots + 1)]
    for r in reqs:
        eng.submit(r)
    eng.step()
    assert eng.queue_length == 1
    eng.cancel(reqs[0].request_id)
    eng.step()
    assert eng.slots[0] is not None and eng.slots[0].req is reqs[-1]  # the waiting one moved in
    assert eng.metrics()["finish_reasons"]["abort"] == 1


@pytest.mark.skipif(not os.environ.get("KDSA_SLOW_TESTS"),
                    reason="two more compiles (~50 s on 2 cores): set KDSA_SLOW_TESTS=1")
def test_sharded_generate_layout_matches(model, prompts, batched):
    """The same requests on a data=2 x expert=2 x tensor=2 mesh give the same greedy tokens."""
    from kdsa.sharding.mesh import make_mesh
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 host devices (conftest)")
    mesh = make_mesh("data=2,expert=2,tensor=2")
    sharded = Transformer(get_preset("tiny"), rngs=nnx.Rngs(0))
    runner = ModelRunner(sharded, num_slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK,
                         min_bucket=CHUNK, mesh=mesh)
    eng = Engine(runner, ByteTokenizer(model.config.vocab_size), max_top_logprobs=3)
    got = eng.generate([Request(p, _greedy()) for p in prompts[:4]])
    assert [c.token_ids for c in got] == [c.token_ids for c in batched[:4]]
    leaf = jax.tree.leaves(runner.cache)[0]
    assert len(leaf.sharding.device_set) == 8


def test_generate_job_jsonl(tmp_path):
    import json

    from kdsa.infer.generate import read_requests, run_job
    eng = _scripted_engine(reasoning_tokens=4)
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [
        {"id": "chat", "messages": [{"role": "user", "content": "6 x 7?"}],
         "reasoning_effort": "low"},
        {"id": "raw", "prompt": "abc", "max_tokens": 3},
        {"prompt_ids": [1, 2, 3], "max_tokens": 2, "stop": "zz"}]) + "\n")
    reqs = read_requests(src, eng, FMT, effort="max", defaults={"max_tokens": 100,
                                                                "temperature": 0.0}, seed=5)
    assert [r.sampling.seed for r in reqs] == [5, 6, 7]
    summary = run_job(eng, reqs, tmp_path / "out.jsonl", progress=False)
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["chat", "raw", "3"]
    assert rows[0]["content"] == ANSWER and rows[0]["reasoning_tokens"] == 4
    assert rows[1]["completion_tokens"] == 3 and len(rows[1]["logprobs"]) == 3
    assert summary["requests"] == 3 and summary["generated_tokens"] == sum(
        r["completion_tokens"] for r in rows)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"nothing": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: a request needs"):
        read_requests(bad, eng, FMT, effort=None, defaults={}, seed=0)


def test_real_model_over_http(engine):
    """The real model behind the server: streamed and non-streamed greedy answers agree with
    the engine's own tokens (thinking off keeps the prompt short)."""
    import http.client
    import json

    from kdsa.infer.server_run import start_server
    fmt = get_format("xtml", engine.tok)
    chat_engine = Engine(engine.runner, engine.tok, chat_format=fmt, max_top_logprobs=3)
    prompt = fmt.render([Message("user", "Hi")], thinking=False)
    want = chat_engine.generate([Request(prompt, SamplingParams(temperature=0.0, max_tokens=5))])
    handle = start_server(chat_engine, fmt, model_name="tiny")
    try:
        got = []
        for stream in (False, True):
            conn = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=60)
            conn.request("POST", "/v1/chat/completions", json.dumps({
                "messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "none",
                "temperature": 0, "max_tokens": 5, "logprobs": True, "stream": stream}))
            text = conn.getresponse().read().decode()
            if stream:
                chunks = [json.loads(x[6:]) for x in text.split("\n\n")
                          if x.startswith("data: {")]
                assert text.rstrip().endswith("data: [DONE]")
                lps = [e for c in chunks for e in ((c["choices"][0].get("logprobs") or {})
                                                   .get("content") or [])]
            else:
                lps = json.loads(text)["choices"][0]["logprobs"]["content"]
            got.append([bytes(e["bytes"]) for e in lps])
        assert got[0] == got[1] == [engine.tok.token_bytes(t) for t in want[0].token_ids]
    finally:
        handle.stop()


def test_cpu_decode_weights_follow_the_model(model, monkeypatch):
    """On one CPU device the decode step reads per-layer copies of the scanned layers'
    weights (``model/transformer.py : per_layer_state``) when a repeated layer's weights are large
    (``PER_LAYER_MIN_BYTES``, lowered here). They are rebuilt when the weights change: a new
    ``runner.state`` or the model updated in place (``nnx.split`` shares its Variables), so
    decode never runs on older weights than prefill."""
    from kdsa.model.transformer import LayerSlices

    import kdsa.infer.runner as runner_module

    model = nnx.clone(model)  # updated in place below
    runner = ModelRunner(model, num_slots=1, max_len=32, prefill_chunk=16)
    assert runner.decode_state() is runner.state  # tiny's layers: too small to pay off
    monkeypatch.setattr(runner_module, "PER_LAYER_MIN_BYTES", 0)
    runner = ModelRunner(model, num_slots=1, max_len=32, prefill_chunk=16)
    first = runner.decode_state()
    assert runner.decode_state() is first  # cached while nothing changed

    def w1(state):
        (leaf,) = [v for p, v in nnx.to_flat_state(state)
                   if p[:2] == ("segments", 1) and p[-2:] == ("experts", "w1")]
        return leaf.get_value()
    assert isinstance(w1(first), LayerSlices) and len(w1(first).parts) == 2
    stacked = nnx.state(model)
    nnx.update(model, jax.tree.map(lambda a: a * 2.0, stacked))  # in place
    again = runner.decode_state()
    assert again is not first
    for j, part in enumerate(w1(again).parts):
        np.testing.assert_array_equal(part, w1(nnx.state(model))[j])
        np.testing.assert_array_equal(part, 2.0 * w1(first).parts[j])


class _BatchedScript(ScriptedRunner):
    """``ScriptedRunner`` with the batched prefill's interface (rows in the order given)."""
    batched_prefill = True

    def prefill_batch(self, slots, chunks, starts):
        return np.concatenate([self.prefill(s, c, st) for s, c, st in zip(slots, chunks, starts)])


@pytest.mark.parametrize("runner,slots", [(ScriptedRunner, 2), (_BatchedScript, 6)],
                         ids=["one-slot", "batched"])
def test_prefill_budget_goes_to_the_oldest_request_first(runner, slots):
    """A steady stream of long prompts: a new one always lands in the lowest free slot. The
    step's prefill budget (4 chunks) went in slot order, so requests in the higher slots,
    submitted early, got no token while later ones finished (batched: 6 rows, 4 chunks a
    step); now the oldest requests' prompts come first and they finish first."""
    eng = Engine(runner(TOK, FMT, answer_ids=_answer_ids(), num_slots=slots, prefill_chunk=64),
                 TOK, chat_format=FMT)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    order = []

    def submit(name, token):
        eng.submit(Request([token] * 512, sp, request_id=name,
                           on_event=lambda ev: ev.completion and order.append(ev.request_id)))

    first = [f"R{n}" for n in range(slots)]
    for n, name in enumerate(first):
        submit(name, n + 1)
    for step in range(80):
        if len(eng._waiting) < 2:
            submit(f"C{step}", 99)
        eng.step()
    assert order[:slots] == first, order
