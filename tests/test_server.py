"""The OpenAI-compatible server over real HTTP on 127.0.0.1 (scripted model, bounded, stopped at
module end): non-streaming and SSE streaming, tools, budgets per effort level, errors, 16
concurrent clients, a disconnecting client."""

import concurrent.futures
import http.client
import json
import socket
import time

import numpy as np
import pytest

from kdsa.infer.budget import BudgetConfig
from kdsa.infer.chat import Message, get_format
from kdsa.infer.engine import Engine
from kdsa.infer.server_run import start_server
from kdsa.infer.tokenizer import ByteTokenizer

from scripted import (CALL, CAPS, EOS_LOGIT, FMT, GRACE, TOK, TOOLS, USER, EosSecond,
                      ScriptedRunner, _answer)

def _server(answer_ids, slots=4, caps=CAPS):
    runner = EosSecond(TOK, FMT, answer_ids=answer_ids, num_slots=slots, max_len=1024)
    eng = Engine(runner, TOK, chat_format=FMT, budgets=BudgetConfig(caps=dict(caps),
                                                                     grace=GRACE))
    return start_server(eng, FMT, model_name="kdsa-test"), eng


@pytest.fixture(scope="module")
def chat():
    handle, eng = _server(_answer("It is sunny."))
    yield handle, eng
    handle.stop()


@pytest.fixture(scope="module")
def tools_server():
    handle, eng = _server(_answer("", [CALL]))
    yield handle
    handle.stop()


def _post(handle, body, path="/v1/chat/completions", raw: bytes | None = None,
          headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=30)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    return r.status, text


def _get(handle, path):
    conn = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=30)
    conn.request("GET", path)
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out




@pytest.mark.parametrize("effort,reasoning_tokens", [("low", 13), ("high", 37), ("max", 68)])
def test_non_streaming_with_budget_per_level(chat, effort, reasoning_tokens):
    status, text = _post(chat[0], {"model": "kdsa-test", "messages": USER,
                                   "reasoning_effort": effort, "max_tokens": 200})
    assert status == 200, text
    body = json.loads(text)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == "It is sunny."
    assert len(choice["message"]["reasoning_content"]) == reasoning_tokens
    assert reasoning_tokens <= CAPS[effort] + GRACE
    usage = body["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == reasoning_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def _sse(text):
    lines = [ln[6:] for ln in text.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_streaming_matches_non_streaming(chat):
    req = {"messages": USER, "reasoning_effort": "low", "stream": True, "n": 2, "seed": 1,
           "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}
    status, text = _post(chat[0], req)
    assert status == 200
    chunks = _sse(text)
    per = {0: {"reasoning": "", "content": "", "finish": None},
           1: {"reasoning": "", "content": "", "finish": None}}
    n_lp = 0
    for c in chunks[:-1]:
        ch = c["choices"][0]
        d, slot = ch["delta"], per[ch["index"]]
        slot["reasoning"] += d.get("reasoning_content") or ""
        slot["content"] += d.get("content") or ""
        slot["finish"] = ch["finish_reason"] or slot["finish"]
        n_lp += len((ch.get("logprobs") or {}).get("content", []))
    for slot in per.values():
        assert slot["content"] == "It is sunny." and len(slot["reasoning"]) == 13
        assert slot["finish"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == n_lp
    status, text = _post(chat[0], {**req, "stream": False})
    body = json.loads(text)
    assert [c["message"]["content"] for c in body["choices"]] == ["It is sunny."] * 2
    lp = body["choices"][0]["logprobs"]["content"]
    assert len(lp) == body["usage"]["completion_tokens"] // 2 and len(lp[0]["top_logprobs"]) == 2


def test_thinking_off_streams_no_reasoning_like_the_body():
    """A K2 model that opens ``<think>`` although thinking is off: its reasoning was streamed
    as ``reasoning_content`` while the body, rendered the same way, left it out."""
    k2tok = ByteTokenizer(384, "k2")
    k2 = get_format("k2", k2tok)
    runner = ScriptedRunner(k2tok, k2, answer_ids=k2tok.encode_markup(
        "<think>R</think>It is sunny.<|im_end|>"), max_len=1024)
    handle = start_server(Engine(runner, k2tok, chat_format=k2), k2, model_name="k2-test")
    try:
        req = {"messages": USER, "reasoning_effort": "none", "max_tokens": 40}
        stream = _sse(_post(handle, {**req, "stream": True})[1])
        deltas = [c["choices"][0]["delta"] for c in stream if c["choices"]]
        assert not any("reasoning_content" in d for d in deltas), deltas
        assert "".join(d.get("content") or "" for d in deltas) == "It is sunny."
        msg = json.loads(_post(handle, req)[1])["choices"][0]["message"]
        assert msg["content"] == "It is sunny." and "reasoning_content" not in msg
    finally:
        handle.stop()


def test_tool_calls_round_trip(tools_server):
    status, text = _post(tools_server, {"messages": USER, "tools": TOOLS, "tool_choice": "auto",
                                        "reasoning_effort": "low"})
    body = json.loads(text)
    msg, choice = body["choices"][0]["message"], body["choices"][0]
    assert status == 200 and choice["finish_reason"] == "tool_calls"
    assert msg["tool_calls"] == [CALL.to_openai()]
    # the client sends the call, its reasoning and the result back; the next call id moves on
    history = USER + [msg, {"role": "tool", "tool_call_id": CALL.id, "content": "sunny"}]
    status, text = _post(tools_server, {"messages": history, "tools": TOOLS,
                                        "reasoning_effort": "low", "stream": True})
    calls = [tc for c in _sse(text) for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert status == 200 and [c["id"] for c in calls] == ["functions.get_weather:1"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


def test_ignore_eos_generates_max_tokens(chat):
    """vLLM's ``ignore_eos`` extension: past the end-of-message token up to ``max_tokens``."""
    base = {"messages": USER, "reasoning_effort": "low", "max_tokens": 120}
    done = json.loads(_post(chat[0], base)[1])
    status, text = _post(chat[0], {**base, "ignore_eos": True})
    assert status == 200, text
    body = json.loads(text)
    assert done["choices"][0]["finish_reason"] == "stop"
    assert done["usage"]["completion_tokens"] < 120
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 120


@pytest.mark.parametrize("body,status,param", [
    ({"messages": USER, "model": "gpt-9"}, 404, "model"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": USER, "temperature": "hot"}, 400, "temperature"),
    ({"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": USER, "n": True}, 400, "n"),
    ({"messages": USER, "ignore_eos": "yes"}, 400, "ignore_eos"),
    ({"messages": USER, "reasoning_effort": "ultra"}, 400, "reasoning_effort"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400,
     "tools"),
    ({"messages": USER, "tool_choice": {"type": "function", "function": {"name": "x"}}}, 400,
     "tool_choice"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {
        "name": "get_time"}}}, 400, "tool_choice"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "tool", "function": {
        "name": "get_weather"}}}, 400, "tool_choice"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": "sometimes"}, 400, "tool_choice"),
    ({"messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x" * 2000}]}, 400, "messages"),
    ({"messages": USER + [{"role": "tool", "tool_call_id": "zz", "content": "r"}]}, 400,
     "messages"),
])
def test_bad_requests_get_openai_errors(chat, body, status, param):
    got, text = _post(chat[0], body)
    err = json.loads(text)["error"]
    assert got == status and err["param"] == param and err["message"]
    assert err["type"] == "invalid_request_error"


def test_malformed_json_then_still_serving(chat):
    got, text = _post(chat[0], None, raw=b"{not json")
    assert got == 400 and "not valid JSON" in json.loads(text)["error"]["message"]
    assert _get(chat[0], "/health")[1]["status"] == "ok"
    # a body that does not decode as its Content-Encoding says (was a 500)
    for encoding in ("gzip", "deflate"):
        got, text = _post(chat[0], None, raw=b"not compressed",
                          headers={"Content-Encoding": encoding})
        assert got == 400 and "could not be read" in json.loads(text)["error"]["message"], text
    status, models = _get(chat[0], "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "kdsa-test"


def test_sixteen_concurrent_clients(chat):
    def one(i):
        body = {"messages": [{"role": "user", "content": f"q{i}"}], "reasoning_effort":
                ("low", "high", "max")[i % 3], "stream": bool(i % 2)}
        return i, *_post(chat[0], body)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    for i, status, text in results:
        assert status == 200
        if i % 2:
            content = "".join(c["choices"][0]["delta"].get("content") or ""
                              for c in _sse(text) if c["choices"])
        else:
            content = json.loads(text)["choices"][0]["message"]["content"]
        assert content == "It is sunny."
    m = _get(chat[0], "/health")[1]["metrics"]
    assert m["active_slots"] == 0 and m["queue_length"] == 0 and m["mean_batch"] > 1


def test_disconnected_client_frees_its_slot():
    handle, eng = _server(_answer("x"), slots=1, caps={**CAPS, "max": None})  # endless thought
    try:
        s = socket.create_connection(("127.0.0.1", handle.port))
        body = json.dumps({"messages": USER, "stream": True, "max_tokens": 900}).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                  b"\r\n\r\n" + body)
        s.recv(100)  # streaming has started
        s.close()
        deadline = time.time() + 20
        while time.time() < deadline and eng.metrics()["finish_reasons"].get("abort", 0) < 1:
            time.sleep(0.05)
        assert eng.metrics()["finish_reasons"].get("abort") == 1
        status, text = _post(handle, {"messages": USER, "reasoning_effort": "low"})
        assert status == 200 and json.loads(text)["choices"][0]["message"]["content"] == "x"
    finally:
        handle.stop()


# ----------------------------------------------------------------------------- tool_choice

def test_tool_call_prefix_is_the_formats_call_opening():
    """The ids forced for tool_choice come from the format's own rendering of calls."""
    from kdsa.infer.openai_api import tool_call_prefix

    named = {"type": "function", "function": {"name": "get_weather"}}
    dec = lambda ids: TOK.decode(list(ids))  # noqa: E731
    assert dec(tool_call_prefix(FMT, "required")) == \
        '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="'
    assert dec(tool_call_prefix(FMT, named)) == \
        '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
    tok2 = ByteTokenizer(384, flavor="k2")
    k2 = get_format("k2", tok2)
    assert tok2.decode(list(tool_call_prefix(k2, "required"))) == \
        "<|tool_calls_section_begin|><|tool_call_begin|>functions."
    assert tok2.decode(list(tool_call_prefix(k2, named, 2))) == \
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:2" \
        "<|tool_call_argument_begin|>{"


@pytest.mark.parametrize("thinking,cap,own", [(True, 5, None), (True, None, 4),
                                               (False, None, None)])
def test_engine_forces_the_answer_prefix(thinking, cap, own):
    """After a forced close (cap), after the model's own close, or at once without thinking,
    the answer opens with exactly the forced ids."""
    from kdsa.infer.engine import Request
    from kdsa.infer.openai_api import tool_call_prefix
    from kdsa.infer.sampling import SamplingParams

    runner = ScriptedRunner(TOK, FMT, answer_ids=_answer("It is sunny."), num_slots=1,
                            max_len=512, reasoning_tokens=own)
    eng = Engine(runner, TOK, chat_format=FMT, budgets=BudgetConfig(caps=dict(CAPS), grace=0))
    prefix = list(tool_call_prefix(FMT, "required"))
    prompt = FMT.render([Message("user", "q")], thinking=thinking)
    [c] = eng.generate([Request(prompt, SamplingParams(temperature=0, max_tokens=80),
                                reasoning_cap=cap, in_reasoning=thinking,
                                answer_prefix=tuple(prefix))])
    ids = c.token_ids
    if not thinking:
        assert ids[:len(prefix)] == prefix
        return
    opening = list(FMT.reasoning_end_ids) + list(FMT.after_reasoning_ids) + prefix
    at = next(j for j in range(len(ids)) if ids[j:j + len(FMT.reasoning_end_ids)]
              == list(FMT.reasoning_end_ids))
    assert ids[at:at + len(opening)] == opening
    assert c.forced_close == (cap is not None)


TOOLS2 = TOOLS + [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}}}}]


@pytest.mark.parametrize("flavor,thinking", [("k3", True), ("k3", False), ("k2", True)])
def test_tool_choice_none_bans_the_call_opener(flavor, thinking):
    """A model whose first choice is a tool call: with the format's call opener banned it
    never starts one (it ends the message, its second choice), the banned token has
    probability 0 (renormalised log-probs without it), and the same request without the ban
    does call the tool."""
    from kdsa.infer.engine import Request
    from kdsa.infer.openai_api import tool_call_opener
    from kdsa.infer.sampling import SamplingParams

    tok = TOK if flavor == "k3" else ByteTokenizer(384, flavor="k2")
    fmt = get_format("xtml" if flavor == "k3" else "k2", tok)
    opener = tool_call_opener(fmt)
    name = "<|open|>" if flavor == "k3" else "<|tool_calls_section_begin|>"
    assert opener == (tok.special(name),)
    runner = EosSecond(tok, fmt, answer_ids=_answer("", [CALL], fmt), num_slots=1, max_len=512,
                       reasoning_tokens=4)
    eng = Engine(runner, tok, chat_format=fmt, budgets=BudgetConfig(caps=dict(CAPS), grace=0))
    prompt = fmt.render([Message("user", "q")], thinking=thinking)

    def run(banned):
        req = Request(prompt, SamplingParams(temperature=0, max_tokens=200, top_logprobs=20),
                      in_reasoning=thinking, parser=fmt.parser(thinking=thinking),
                      banned_token_ids=banned)
        return eng.generate([req])[0]

    free = run(())
    assert [c.name for c in free.output.tool_calls] == ["get_weather"]
    c = run(opener)
    assert c.finish_reason == "stop" and c.output.tool_calls == () and not c.output.errors
    assert c.token_ids[:-1] == free.token_ids[:len(c.token_ids) - 1]
    assert c.token_ids[-1] == runner.eos
    # the last step is where the free run opened its call: the opener is gone from the top
    # log-probs, the end of message is first with the mass renormalised over the other tokens
    assert free.token_ids[len(c.token_ids) - 1] == opener[0]
    top_ids = [t for t, _ in c.top_logprobs[-1]]
    assert top_ids[0] == runner.eos and opener[0] not in top_ids
    want = EOS_LOGIT - np.log(np.exp(EOS_LOGIT) + tok.vocab_size - 2)
    assert abs(c.logprobs[-1] - want) < 1e-5 and abs(c.top_logprobs[-1][0][1] - want) < 1e-5


def test_tool_choice_none_server(tools_server):
    """tool_choice "none" over HTTP: the model was told (typed system message) and cannot
    start a call (its opener is banned), streamed or not."""
    req = {"messages": USER, "tools": TOOLS, "tool_choice": "none", "reasoning_effort": "low",
           "temperature": 0}
    status, text = _post(tools_server, req)
    choice = json.loads(text)["choices"][0]
    assert status == 200 and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    status, text = _post(tools_server, {**req, "stream": True})
    chunks = _sse(text)
    assert status == 200 and not any(c["choices"][0]["delta"].get("tool_calls")
                                     for c in chunks if c["choices"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {
    "name": "get_weather"}}])
def test_tool_choice_required_and_named_call(tools_server, choice):
    status, text = _post(tools_server, {"messages": USER, "tools": TOOLS2, "tool_choice": choice,
                                        "reasoning_effort": "low"})
    body = json.loads(text)
    assert status == 200, text
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["choices"][0]["message"]["tool_calls"] == [CALL.to_openai()]


def test_tool_choice_required_when_the_model_cannot_complete_a_call(chat):
    """The scripted model answers in prose: the forced opening turns its answer into a call it
    cannot complete, and the client gets a clear error, not a prose answer."""
    req = {"messages": USER, "tools": TOOLS, "tool_choice": "required",
           "reasoning_effort": "low"}
    status, text = _post(chat[0], req)
    err = json.loads(text)["error"]
    assert status == 500 and err["code"] == "tool_choice_unsatisfied", text
    assert "no valid tool call" in err["message"]
    status, text = _post(chat[0], {**req, "stream": True})
    lines = [json.loads(x[6:]) for x in text.split("\n\n") if x.startswith("data: {")]
    assert status == 200 and any("error" in x and x["error"]["code"] ==
                                 "tool_choice_unsatisfied" for x in lines)
    assert _post(chat[0], {**req, "tool_choice": "auto"})[0] == 200


def test_a_waiting_stream_sends_keepalive_comments(chat, monkeypatch):
    """While a stream waits for its next token (queued, a long prefill), an SSE comment every
    ``KEEPALIVE_S`` keeps proxies from dropping the idle connection (which cancels the
    request); the chunks are unchanged."""
    import time

    from kdsa.infer import server

    handle, eng = chat
    monkeypatch.setattr(server, "KEEPALIVE_S", 0.3)
    real = eng.runner.decode
    monkeypatch.setattr(eng.runner, "decode", lambda *a: (time.sleep(0.7), real(*a))[1])
    status, text = _post(handle, {"messages": USER, "reasoning_effort": "low", "stream": True,
                                  "max_tokens": 3})
    assert status == 200 and text.count(": keepalive\n\n") >= 2, text[:500]
    assert _sse(text)[-1]["choices"][0]["finish_reason"] == "length"
