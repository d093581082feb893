"""The Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the
official ``anthropic`` client, over real HTTP on 127.0.0.1: plain, streaming (the event
sequence, pings), a tools round trip, thinking on / capped / off, effort, stop sequences,
count_tokens, Anthropic error objects, failures that leave the server serving. Scripted model
(``tests/scripted.py``), one server per kind of answer for the module."""

import http.client
import json

import pytest

anthropic = pytest.importorskip("anthropic")

from kdsa.infer.budget import BudgetConfig  # noqa: E402
from kdsa.infer.engine import Engine  # noqa: E402
from kdsa.infer.server_run import start_server  # noqa: E402

from scripted import CALL, CAPS, FMT, GRACE, TOK, EosSecond, SeeingRunner, _answer  # noqa: E402

MODEL = "kdsa-test"
USER = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}}}]
OFF = {"type": "disabled"}


def _server(answer_ids):
    runner = EosSecond(TOK, FMT, answer_ids=answer_ids, num_slots=4, max_len=1024)
    eng = Engine(runner, TOK, chat_format=FMT, budgets=BudgetConfig(caps=dict(CAPS),
                                                                     grace=GRACE))
    return start_server(eng, FMT, model_name=MODEL), eng


@pytest.fixture(scope="module")
def chat():
    handle, eng = _server(_answer("It is sunny."))
    yield handle, eng, anthropic.Anthropic(api_key="test", base_url=handle.url,
                                           max_retries=0, timeout=30)
    handle.stop()


@pytest.fixture(scope="module")
def tools():
    handle, _ = _server(_answer("", [CALL]))
    yield anthropic.Anthropic(api_key="test", base_url=handle.url, max_retries=0, timeout=30)
    handle.stop()


def _create(client, **kw):
    return client.messages.create(**{"model": MODEL, "max_tokens": 200, "messages": USER, **kw})


def _raw(handle, method, path, body=None, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=30)
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, r.read().decode()
    conn.close()
    return out


def _events(text):
    """SSE text -> [(event name, data)]; each data's type is its event name."""
    out = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(ln.split(": ", 1) for ln in chunk.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        out.append((lines["event"], data))
    return out


def test_plain_message(chat):
    m = _create(chat[2])
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.id.startswith("msg_") and m.stop_reason == "end_turn" and m.stop_sequence is None
    assert [b.type for b in m.content] == ["thinking", "text"]  # thinking on by default (max)
    assert m.content[1].text == "It is sunny." and len(m.content[0].thinking) == 68
    assert m.usage.output_tokens_details.thinking_tokens == 68 < m.usage.output_tokens
    assert m.usage.input_tokens > 0


@pytest.mark.parametrize("thinking,config,reasoning", [
    (OFF, None, None),                                  # disabled: no thinking block
    ({"type": "enabled", "budget_tokens": 10}, None, (10, 10 + GRACE)),
    ({"type": "enabled", "budget_tokens": 3}, {"effort": "high"}, (3, 3 + GRACE)),
    ({"type": "enabled", "budget_tokens": 190}, {"effort": "low"}, (13, 13)),  # low's cap
    (None, {"effort": "low"}, (13, 13)),                # the OpenAI path's low: 13
    ({"type": "adaptive"}, {"effort": "medium"}, (37, 37)),  # medium -> high
])
def test_thinking_on_capped_and_off(chat, thinking, config, reasoning):
    kw = {"thinking": thinking} if thinking else {}
    m = _create(chat[2], **kw, **({"output_config": config} if config else {}))
    assert m.content[-1].type == "text" and m.content[-1].text == "It is sunny."
    assert m.stop_reason == "end_turn"
    if reasoning is None:
        assert [b.type for b in m.content] == ["text"]
        assert m.usage.output_tokens_details.thinking_tokens == 0
        return
    assert m.content[0].type == "thinking" and m.content[0].signature == ""
    lo, hi = reasoning
    assert lo <= len(m.content[0].thinking) <= hi
    assert m.usage.output_tokens_details.thinking_tokens == len(m.content[0].thinking)


def test_streaming_event_sequence_and_pings(chat):
    handle, _, client = chat
    body = {"model": MODEL, "max_tokens": 200, "messages": USER, "stream": True,
            "thinking": {"type": "enabled", "budget_tokens": 10}, "system": "Be brief."}
    status, text = _raw(handle, "POST", "/v1/messages", body)
    assert status == 200
    events = _events(text)
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta",
                                                                      "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    blocks, text_of = [], {}
    for name, d in events[2:-2]:  # start, deltas, stop per block, indexed in order
        if name == "content_block_start":
            assert d["index"] == len(blocks)
            blocks.append(d["content_block"]["type"])
            text_of[d["index"]] = ""
        elif name == "content_block_delta":
            assert d["index"] == len(blocks) - 1
            text_of[d["index"]] += d["delta"].get("thinking", d["delta"].get("text"))
            assert d["delta"]["type"] == {"thinking": "thinking_delta",
                                          "text": "text_delta"}[blocks[-1]]
        else:
            assert name == "content_block_stop" and d["index"] == len(blocks) - 1
    assert blocks == ["thinking", "text"] and text_of[1] == "It is sunny."
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    # the client's own stream assembles the same message as the non-streaming call
    body.pop("stream")
    with client.messages.stream(**body) as s:
        final = s.get_final_message()
    plain = client.messages.create(**body)
    dump = lambda m: m.model_dump(exclude={"id"}, exclude_none=True)  # noqa: E731
    assert dump(final) == dump(plain)
    assert final.content[0].thinking == text_of[0]
    assert final.usage.output_tokens == delta["usage"]["output_tokens"]


def test_stop_sequences(chat):
    m = _create(chat[2], thinking=OFF, stop_sequences=["zzz", "sunny"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "sunny"
    assert m.content[0].text == "It is "
    with chat[2].messages.stream(model=MODEL, max_tokens=200, messages=USER, thinking=OFF,
                                 stop_sequences=["sunny"]) as s:
        assert "".join(s.text_stream) == "It is "
        assert s.get_final_message().stop_sequence == "sunny"
    assert _create(chat[2], thinking=OFF, max_tokens=4).stop_reason == "max_tokens"


def test_tools_round_trip(tools):
    m = _create(tools, tools=TOOLS, tool_choice={"type": "auto"},
                output_config={"effort": "low"})
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["thinking",
                                                                          "tool_use"]
    call = m.content[1]
    assert (call.id, call.name, call.input) == (CALL.id, "get_weather", {"city": "Paris"})
    # the client sends the call (with its thinking) and the result back; the next call
    # index moves on, streamed as an input_json_delta
    history = USER + [{"role": "assistant", "content": m.content},
                      {"role": "user", "content": [{"type": "tool_result",
                                                    "tool_use_id": call.id,
                                                    "content": [{"type": "text",
                                                                 "text": "sunny"}]}]}]
    with tools.messages.stream(model=MODEL, max_tokens=200, messages=history, tools=TOOLS,
                               output_config={"effort": "low"}) as s:
        events = list(s)
        final = s.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta"
               for e in events)
    assert final.stop_reason == "tool_use" and final.content[-1].id == "functions.get_weather:1"
    assert final.content[-1].input == {"city": "Paris"}


@pytest.mark.parametrize("choice,stop", [({"type": "any"}, "tool_use"),
                                         ({"type": "tool", "name": "get_weather"}, "tool_use"),
                                         ({"type": "none"}, "end_turn")])
def test_tool_choice(tools, choice, stop):
    m = _create(tools, tools=TOOLS, tool_choice=choice, thinking=OFF)
    assert m.stop_reason == stop
    assert any(b.type == "tool_use" for b in m.content) == (stop == "tool_use")


def test_count_tokens(chat):
    client = chat[2]
    kw = {"system": [{"type": "text", "text": "Be brief."}], "tools": TOOLS,
          "thinking": {"type": "enabled", "budget_tokens": 10}}
    n = client.messages.count_tokens(model=MODEL, messages=USER, **kw).input_tokens
    assert n == _create(client, **kw).usage.input_tokens
    assert client.messages.count_tokens(model=MODEL, messages=USER).input_tokens < n
    long = [{"role": "user", "content": "x" * 2000}]  # past the 1024-token context: counted
    assert client.messages.count_tokens(model=MODEL, messages=long).input_tokens > 2000
    with pytest.raises(anthropic.BadRequestError, match="context"):
        _create(client, messages=long)


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}


@pytest.mark.parametrize("kw,status,words", [
    ({"extra_body": {"temperature": "hot"}}, 400, "temperature must be a number in [0, 1]"),
    ({"extra_body": {"top_k": -1}}, 400, "top_k"),
    ({"max_tokens": 0}, 400, "max_tokens must be an integer >= 1"),
    ({"model": "claude-9"}, 404, "the model 'claude-9' does not exist"),
    ({"thinking": {"type": "enabled", "budget_tokens": 500}}, 400, "thinking.budget_tokens"),
    ({"thinking": {"type": "sometimes"}}, 400, "thinking.type"),
    ({"output_config": {"effort": "ultra"}}, 400, "output_config.effort"),
    ({"stop_sequences": [""]}, 400, "stop_sequences"),
    ({"system": [{"type": "image"}]}, 400, "system"),
    ({"messages": []}, 400, "messages must be a non-empty list"),
    ({"messages": [{"role": "system", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400,
     "messages[0].content[0].type 'video'"),
    ({"messages": [{"role": "user", "content": ["hi", IMAGE]}]}, 400,
     "messages[0].content[0] must be a content block"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, IMAGE]}]}, 400,
     "messages[0].content[1].source: this model does not read images"),
    ({"messages": USER + [{"role": "assistant", "content": "It"}]}, 400, "prefill"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "zz", "content": "r"}]}]}, 400,
     "messages[0].content[0]: tool_call_id 'zz' answers no earlier"),
    ({"tools": [{"name": "a b", "input_schema": {"type": "object"}}]}, 400, "tools[0].name"),
    ({"tools": [{"name": "f"}]}, 400, "tools[0].input_schema is required"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, 400,
     "tools[0].input_schema must describe an object"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "custom tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 400, "'nope'"),
    ({"tool_choice": {"type": "any"}}, 400, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "maybe"}}, 400, "tool_choice must be"),
])
def test_errors_are_anthropic_error_objects(chat, kw, status, words):
    with pytest.raises(anthropic.APIStatusError) as info:
        _create(chat[2], **kw)
    e = info.value
    assert e.status_code == status and e.body["type"] == "error", e.body
    err = e.body["error"]
    assert err["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert words in err["message"], err["message"]


def test_http_level_errors_and_still_serving(chat):
    handle = chat[0]
    for method, path, raw, status, kind in [
            ("POST", "/v1/messages", b"{not json", 400, "invalid_request_error"),
            ("POST", "/v1/messages", json.dumps({"messages": USER}).encode(), 400,
             "invalid_request_error"),  # no max_tokens
            ("GET", "/v1/messages", None, 405, "invalid_request_error"),
            ("POST", "/v1/messages/nope", b"{}", 404, "not_found_error"),
            ("POST", "/v1/messages/count_tokens", b"[]", 400, "invalid_request_error"),
            ("POST", "/v1/messages", b" " * (17 * 2**20), 413, "request_too_large")]:
        got, text = _raw(handle, method, path, raw=raw)
        body = json.loads(text)
        assert got == status and body["type"] == "error", (path, text)
        assert body["error"]["type"] == kind and body["error"]["message"]
    got, text = _raw(handle, "POST", "/v1/chat/completions", raw=b"{not json")
    assert got == 400 and "param" in json.loads(text)["error"]  # the OpenAI shape stays
    assert _create(chat[2], thinking=OFF).content[0].text == "It is sunny."


def _fail_once(obj, name, exc):
    real, state = getattr(obj, name), {"left": 1}

    def wrapper(*a, **kw):
        if state["left"]:
            state["left"] -= 1
            raise exc
        return real(*a, **kw)
    setattr(obj, name, wrapper)


def test_a_failed_request_is_an_api_error_and_the_server_goes_on(chat):
    handle, eng, client = chat
    _fail_once(eng.runner, "decode", RuntimeError("injected decode failure"))
    with pytest.raises(anthropic.InternalServerError) as info:
        _create(client)
    assert info.value.body["error"]["type"] == "api_error"
    assert "RuntimeError: injected decode failure" in info.value.body["error"]["message"]
    _fail_once(eng.runner, "decode", RuntimeError("injected"))
    status, text = _raw(handle, "POST", "/v1/messages", {"model": MODEL, "max_tokens": 50,
                                                         "messages": USER, "stream": True})
    events = _events(text)
    assert status == 200 and events[-1][0] == "error"  # the error event ends the stream
    assert events[-1][1]["error"]["type"] == "api_error"
    assert "message_stop" not in [n for n, _ in events]
    assert _create(client, thinking=OFF).content[0].text == "It is sunny."
    assert eng.metrics()["active_slots"] == 0 and eng.failure is None


def test_pings_while_waiting_and_a_dead_engine(chat, monkeypatch):
    import time

    from kdsa.infer import anthropic_server

    handle, eng, _ = chat
    monkeypatch.setattr(anthropic_server, "PING_S", 0.3)
    real = eng.runner.decode
    monkeypatch.setattr(eng.runner, "decode", lambda *a: (time.sleep(0.7), real(*a))[1])
    status, text = _raw(handle, "POST", "/v1/messages", {
        "model": MODEL, "max_tokens": 3, "messages": USER, "thinking": OFF, "stream": True})
    names = [n for n, _ in _events(text)]
    assert status == 200 and names.count("ping") >= 2 and names[-1] == "message_stop", names
    monkeypatch.undo()
    dead, eng2 = _server(_answer("x"))
    try:
        eng2.die("injected death")
        client = anthropic.Anthropic(api_key="test", base_url=dead.url, max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as info:
            _create(client)
        assert info.value.status_code == 503 and info.value.body["error"]["type"] == "api_error"
        assert "injected death" in info.value.body["error"]["message"]
    finally:
        dead.stop()


BAD = [None, 0, -1, 1.5, "x", True, [], {}, [1], {"type": 1}, [{"type": "text"}]]


def test_no_field_value_is_a_5xx(chat):
    """Every field set to each odd value: a 200 or an Anthropic 4xx, never a 5xx."""
    handle = chat[0]
    base = {"model": MODEL, "max_tokens": 20, "messages": USER, "thinking": OFF}
    fields = ["model", "max_tokens", "messages", "system", "tools", "tool_choice", "thinking",
              "output_config", "stop_sequences", "temperature", "top_p", "top_k", "stream",
              "metadata"]
    nested = [{"messages": [{"role": "user", "content": [v]}]} for v in BAD] + [
        {"messages": [{"role": "user", "content": [{"type": "image", "source": v}]}]}
        for v in BAD] + [{"messages": USER + [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "a", "name": "f", "input": v}]}, USER[0]]} for v in BAD]
    for fix in [{f: v} for f in fields for v in BAD] + nested:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            status, text = _raw(handle, "POST", path, {**base, **fix})
            assert status < 500, (fix, text)
            if status != 200:
                assert json.loads(text)["type"] == "error", (fix, text)


def test_base64_image_block():
    import numpy as np

    from kdsa.model.vision.inputs import to_data_url

    runner = SeeingRunner(TOK, FMT, answer_ids=_answer("A square."), num_slots=1, max_len=1024)
    eng = Engine(runner, TOK, chat_format=FMT)
    handle = start_server(eng, FMT, model_name=MODEL)
    try:
        client = anthropic.Anthropic(api_key="test", base_url=handle.url, max_retries=0)
        url = to_data_url(np.full((30, 45, 3), 200, np.uint8))
        media, data = url[5:].split(";base64,")
        image = {"type": "image", "source": {"type": "base64", "media_type": media,
                                             "data": data}}
        msgs = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]
        m = _create(client, messages=msgs, thinking=OFF)
        assert m.content[0].text == "A square." and runner.image_positions > 0
        # the same prompt as the OpenAI route's image_url part, and counted the same
        status, text = _raw(handle, "POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is it?"},
                {"type": "image_url", "image_url": {"url": url}}]}],
            "reasoning_effort": "none", "max_tokens": 200})
        assert status == 200 and json.loads(text)["usage"]["prompt_tokens"] == \
            m.usage.input_tokens
        n = client.messages.count_tokens(model=MODEL, messages=msgs, thinking=OFF)
        assert n.input_tokens == m.usage.input_tokens
        bad = dict(image, source={**image["source"], "data": "bm90IGFuIGltYWdl"})
        with pytest.raises(anthropic.BadRequestError) as info:
            _create(client, messages=[{"role": "user", "content": [bad]}])
        assert info.value.body["error"]["message"].startswith("messages[0].content[0].source: ")
    finally:
        handle.stop()


def test_a_call_whose_arguments_are_not_an_object_does_not_satisfy_tool_choice():
    """The XTML format parses a call whose ``json`` element holds any JSON; a ``tool_use`` block
    needs an object, so the Anthropic API cannot return ``[1, 2]``: with ``tool_choice``
    ``any`` such an answer is ``tool_choice_unsatisfied`` (it was an ``end_turn`` without the
    call), while the OpenAI API, whose arguments are a string, returns it."""
    from types import SimpleNamespace

    from kdsa.infer import anthropic_server
    from kdsa.infer import openai_api as api
    from kdsa.infer.chat import ToolCall

    out = SimpleNamespace(tool_calls=(ToolCall("functions.f:0", "f", "[1, 2]"),), errors=())
    c = SimpleNamespace(finish_reason="stop", output=out, error=None, request_id="r")
    job = SimpleNamespace(answer_prefix=True, tool_choice="required")
    api.check_tool_output(job, c)  # OpenAI: a call
    with pytest.raises(api.ApiError) as e:
        anthropic_server._checked(SimpleNamespace(job=job), c)
    assert e.value.code == "tool_choice_unsatisfied"
    out.tool_calls = (ToolCall("functions.f:0", "f", '{"a": 1}'),)
    assert anthropic_server._checked(SimpleNamespace(job=job), c) is c
