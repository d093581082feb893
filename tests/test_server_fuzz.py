"""A small seeded fuzz of ``POST /v1/chat/completions``: random JSON values (huge and negative
ints, NaN / Infinity, strings, lists, objects, null, booleans) put into each request field and
each field of a message (edge values first, then random ones), or at a random place of a valid
request that uses most features. Every request must be answered with a 2xx or 4xx (never a 5xx
but the documented ``tool_choice_unsatisfied``, never a hang: a client timeout), and a normal
request still works afterwards. Scripted model, small budgets: 260 requests in a few seconds on
127.0.0.1."""

import http.client
import json
import random

import pytest

from kdsa.infer.budget import BudgetConfig
from kdsa.infer.engine import Engine
from kdsa.infer.server_run import start_server

from scripted import FMT, TOK, TOOLS, USER, EosSecond, _answer

FIELDS = ["model", "messages", "tools", "tool_choice", "response_format", "reasoning_effort",
          "temperature", "top_p", "top_k", "min_p", "seed", "n", "stream", "stream_options",
          "logprobs", "top_logprobs", "stop", "max_tokens", "max_completion_tokens"]
MESSAGE_FIELDS = ["role", "content", "tool_calls", "tool_call_id", "reasoning_content", "name"]
WORDS = ["", "x", "none", "low", "max", "auto", "required", "text", "json_object",
         "json_schema", "function", "user", "assistant", "tool", "system", "kdsa-fuzz",
         "get_weather", "\u00e9\u4e2d\U0001f600", "<|open|>", "\x00", "a" * 3000]
INTS = [0, 1, -1, 2, 16, 17, 20, 21, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63, -2**63,
        10**30]
FLOATS = [0.0, -0.0, 0.5, 1.0, 2.5, 1e-300, 1e308, float("nan"), float("inf"), float("-inf")]
EDGES = [2**32, 2**63, -2**63, float("nan")]  # tried in every field, then random values
RANDOM_PER_FIELD, MUTATED = 4, 60


def value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["int", "float", "str", "list", "dict", "null", "bool"]
                      if depth < 2 else ["int", "float", "str", "null", "bool"])
    if kind == "int":
        return rng.choice(INTS + [rng.randint(-10**6, 10**6)])
    if kind == "float":
        return rng.choice(FLOATS + [rng.uniform(-5, 5)])
    if kind == "str":
        return rng.choice(WORDS)
    if kind == "list":
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "dict":
        keys = FIELDS + MESSAGE_FIELDS + ["type", "function", "name", "arguments", "id",
                                          "include_usage", "json_schema", "schema", "text"]
        return {rng.choice(keys): value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return None if kind == "null" else rng.random() < 0.5


def fuzzed_body(rng: random.Random, field: str, v) -> dict:
    """A plain request with ``field`` set to ``v`` (a message field when it is one of
    ``MESSAGE_FIELDS``), sometimes with tools and one more random field."""
    body = {"model": "kdsa-fuzz", "messages": [dict(m) for m in USER],
            "reasoning_effort": "low", "max_tokens": 8}
    if rng.random() < 0.3:
        body["tools"] = TOOLS
    if rng.random() < 0.3:
        body[rng.choice(FIELDS)] = value(rng)
    if field in MESSAGE_FIELDS:
        body["messages"] = [dict(m) for m in USER]
        body["messages"][0][field] = v
    else:
        body[field] = v
    return body


def bodies(rng: random.Random):
    for field in FIELDS + MESSAGE_FIELDS:
        for v in EDGES + [value(rng) for _ in range(RANDOM_PER_FIELD)]:
            yield fuzzed_body(rng, field, v)
    for _ in range(MUTATED):
        yield mutated_body(rng)


RICH = {  # a valid request using most features; mutated at a random place
    "model": "kdsa-fuzz", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}],
    "tools": TOOLS, "tool_choice": "auto", "response_format": {
        "type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}},
    "reasoning_effort": "low", "max_tokens": 8, "stop": ["zz"], "n": 2, "seed": 3,
    "logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True},
    "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1}


def _paths(x, at=()):
    """Every place in a JSON value, as a key path."""
    yield at
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for k, v in items:
        yield from _paths(v, at + (k,))


def mutated_body(rng: random.Random) -> dict:
    body = json.loads(json.dumps(RICH))
    body["stream"] = rng.random() < 0.5
    for _ in range(rng.randint(1, 2)):
        at = rng.choice([p for p in _paths(body) if p])
        parent = body
        for k in at[:-1]:
            parent = parent[k]
        if rng.random() < 0.15:
            del parent[at[-1]]
        else:
            parent[at[-1]] = value(rng)
        if not isinstance(body, dict) or not body:
            break
    return body


def _post(port, data: bytes, timeout=20, content_type="application/json"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/chat/completions", data, {"Content-Type": content_type})
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    return r.status, text


@pytest.fixture(scope="module")
def server():
    runner = EosSecond(TOK, FMT, answer_ids=_answer("ok"), num_slots=4, max_len=1024)
    eng = Engine(runner, TOK, chat_format=FMT,
                 budgets=BudgetConfig(caps={"low": 2, "high": 4, "max": 6}, grace=0))
    handle = start_server(eng, FMT, model_name="kdsa-fuzz", default_max_tokens=16)
    yield handle, eng
    handle.stop()


def test_random_values_in_every_field_never_5xx_never_hang(server):
    handle, eng = server
    rng = random.Random(0)
    statuses = []
    for k, body in enumerate(bodies(rng)):
        data = json.dumps(body).encode()  # NaN / Infinity as Python's json writes them
        status, text = _post(handle.port, data)
        if status >= 400:
            err = json.loads(text)["error"]
            assert err["message"] and err["type"] in ("invalid_request_error", "server_error")
        # the one 500 by design: a forced tool call the (scripted) model cannot complete
        assert status < 500 or err["code"] == "tool_choice_unsatisfied", \
            f"request {k}: {data[:400]!r} -> {status} {text[:400]}"
        statuses.append(status)
    assert 0 < statuses.count(200) < len(statuses)  # both kinds were exercised
    status, text = _post(handle.port, json.dumps({"messages": USER, "reasoning_effort": "none",
                                                  "max_tokens": 8}).encode())
    assert status == 200 and json.loads(text)["choices"][0]["message"]["content"] == "ok"
    m = eng.metrics()
    assert eng.healthy and m["failed_requests"] == 0 and m["active_slots"] == 0


def test_bodies_the_json_parser_refuses_are_400s(server):
    """Inputs Python's ``json`` refuses with other errors than ``JSONDecodeError``: an integer of
    over 4,300 digits (ValueError), nesting past the parser's stack (RecursionError), an
    unknown charset (LookupError); and a tool call's arguments string nested that deep, which
    the chat format parses to render it. Each gets a 400 naming the problem, not a 500."""
    handle, eng = server
    deep_args = {"role": "assistant", "content": None, "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": "[" * 100_000}}]}
    json_400 = (400, "not valid JSON")
    deep = {}
    for _ in range(1000):
        deep = {"items": deep}
    cases = [
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000
         + b"}", "application/json", json_400),
        (b"[" * 100_000 + b"]" * 100_000, "application/json", json_400),
        (json.dumps({"messages": USER}).encode(), "application/json; charset=bogus", json_400),
        # rendered as text, then too long for the 1,024-token context
        (json.dumps({"messages": USER + [deep_args, {"role": "tool", "tool_call_id": "c1",
                                                     "content": "sunny"}],
                     "tools": TOOLS, "max_tokens": 4}).encode(), "application/json",
         (400, "this model's context is 1024 tokens")),
        (json.dumps({"model": None, "messages": USER, "max_tokens": 4}).encode(),
         "application/json", (200, "")),  # null: the served model, as when absent
        # a tool schema nested 1,000 deep: within the JSON parser's stack, past Python's in
        # the schema check (was a 500)
        (json.dumps({"messages": USER, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": deep}}}}]})
         .encode(), "application/json", (400, "deeper than 64 levels")),
        # stop of another type than a string or list (false and {} meant "no stop")
        (json.dumps({"messages": USER, "stop": False}).encode(), "application/json",
         (400, "stop must be")),
        (json.dumps({"messages": USER, "stop": {}}).encode(), "application/json",
         (400, "stop must be")),
        (json.dumps({"messages": USER, "max_tokens": 4, "stream": True,
                     "stream_options": {"include_usage": None}}).encode(),
         "application/json", (200, "")),  # null: the default, as when absent
    ]
    for k, (data, ctype, (want, says)) in enumerate(cases):
        status, text = _post(handle.port, data, content_type=ctype)
        assert status == want and says in text, (k, status, text[:300])
    assert eng.healthy and eng.metrics()["failed_requests"] == 0


def test_a_slow_request_check_does_not_stall_the_event_loop(server, monkeypatch):
    """Request checks (JSON decoding, tokenizing, image decoding) run off the event loop: while
    one request's check takes 1.5 s, ``/health`` answers at once (it waited for the check)."""
    import threading
    import time

    from kdsa.infer import openai_api

    handle, _ = server
    real = openai_api.parse_chat_request

    def slow(*a, **kw):
        time.sleep(1.5)  # (a sleep releases the GIL; pure-Python checks share it in slices)
        return real(*a, **kw)

    monkeypatch.setattr(openai_api, "parse_chat_request", slow)
    result = {}
    t = threading.Thread(target=lambda: result.update(r=_post(
        handle.port, json.dumps({"messages": USER, "max_tokens": 2}).encode())))
    t.start()
    time.sleep(0.3)
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    waited = time.perf_counter() - t0
    conn.close()
    t.join()
    assert result["r"][0] == 200 and waited < 0.8, waited
