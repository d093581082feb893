"""``GET /metrics`` (``infer/prometheus.py``, docs/serving.md Metrics): real requests through the
server (scripted model, ``tests/scripted.py``), the exposition parsed with prometheus_client's
own parser: request counts, latencies and token counts per effort level and API, tool-call
rounds, failures, the engine's gauges (dense and paged cache), the prefix-cache counters, and
one registry per app."""

import http.client
import json

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kdsa.infer.budget import BudgetConfig  # noqa: E402
from kdsa.infer.engine import Engine  # noqa: E402
from kdsa.infer.prometheus import tool_rounds  # noqa: E402
from kdsa.infer.server_run import start_server  # noqa: E402

from scripted import CALL, CAPS, FMT, GRACE, TOK, TOOLS, USER, EosSecond, _answer  # noqa: E402

MODEL = "kdsa-test"
REASONING = {"low": 13, "high": 37, "max": 68, "none": 0}  # the scripted model, CAPS + GRACE


class PagedScripted(EosSecond):
    """The scripted model on a paged cache: the engine runs its page pool."""

    num_pages = 40

    def set_pages(self, slot, pages):
        pass


def _server(answer_ids, runner_cls=EosSecond):
    runner = runner_cls(TOK, FMT, answer_ids=answer_ids, num_slots=4, max_len=1024)
    eng = Engine(runner, TOK, chat_format=FMT, budgets=BudgetConfig(caps=dict(CAPS),
                                                                     grace=GRACE))
    return start_server(eng, FMT, model_name=MODEL), eng


@pytest.fixture(scope="module")
def chat():
    handle, eng = _server(_answer("It is sunny."))
    yield handle, eng
    handle.stop()


@pytest.fixture(scope="module")
def tools():
    handle, eng = _server(_answer("", [CALL]))
    yield handle, eng
    handle.stop()


def _call(handle, method, path, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=30)
    conn.request(method, path, None if body is None else json.dumps(body).encode(),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, r.getheader("Content-Type"), r.read().decode()
    conn.close()
    return out


def _post(handle, body, path="/v1/chat/completions"):
    status, _, text = _call(handle, "POST", path, body)
    return status, text


def _scrape(handle):
    """``{(sample name, frozenset(labels)): value}`` and the family types of ``/metrics``."""
    status, ctype, text = _call(handle, "GET", "/metrics")
    assert status == 200 and ctype == prometheus_client.CONTENT_TYPE_LATEST
    samples, types = {}, {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, types


def _get(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())))


def test_counts_latencies_and_tokens_per_effort(chat):
    handle, _ = chat
    sent = {"low": 2, "high": 1, "max": 1, "none": 1}
    usage = {}
    for effort, k in sent.items():
        for _ in range(k):
            status, text = _post(handle, {"model": MODEL, "messages": USER, "max_tokens": 200,
                                          "reasoning_effort": effort})
            assert status == 200, text
            u = json.loads(text)["usage"]
            assert u["completion_tokens_details"]["reasoning_tokens"] == REASONING[effort]
            usage.setdefault(effort, []).append(u)
    # one streamed request with n=2: two engine requests (choices), counted apiece
    status, text = _post(handle, {"messages": USER, "reasoning_effort": "high", "n": 2,
                                  "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and text.endswith("data: [DONE]\n\n")
    sent["high"] += 2
    u = json.loads(text.split("data: ")[-2])["usage"]  # both choices: the same prompt
    each = {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"] // 2}
    usage["high"] += [{**each, "total_tokens": each["prompt_tokens"] + each["completion_tokens"]}
                      ] * 2
    m, types = _scrape(handle)
    assert types["kdsa_requests"] == "counter"
    assert types["kdsa_request_ttft_seconds"] == "histogram"
    for effort, k in sent.items():
        lab = {"api": "openai", "effort": effort}
        assert _get(m, "kdsa_requests_total", **lab, finish_reason="stop") == k, effort
        for h in ("ttft_seconds", "queue_seconds", "decode_seconds", "e2e_seconds",
                  "time_per_output_token_seconds", "prompt_tokens", "context_tokens",
                  "reasoning_tokens", "generation_tokens", "tool_rounds"):
            assert _get(m, f"kdsa_request_{h}_count", **lab) == k, (h, effort)
            assert _get(m, f"kdsa_request_{h}_bucket", **lab, le="+Inf") == k, (h, effort)
        assert _get(m, "kdsa_request_reasoning_tokens_sum", **lab) == k * REASONING[effort]
        assert _get(m, "kdsa_request_tool_rounds_sum", **lab) == 0
        assert _get(m, "kdsa_request_ttft_seconds_sum", **lab) > 0
    for effort, us in usage.items():  # prompt and context lengths are the usage's
        lab = {"api": "openai", "effort": effort}
        assert _get(m, "kdsa_request_prompt_tokens_sum", **lab) == sum(
            u["prompt_tokens"] for u in us)
        assert _get(m, "kdsa_request_context_tokens_sum", **lab) == sum(
            u["total_tokens"] for u in us)
        assert _get(m, "kdsa_request_generation_tokens_sum", **lab) == sum(
            u["completion_tokens"] for u in us)
    # the scripted model thinks past every cap: each thinking request's budget ran out
    for effort in ("low", "high", "max"):
        assert _get(m, "kdsa_reasoning_forced_close_total", api="openai",
                    effort=effort) == sent[effort]
    assert _get(m, "kdsa_reasoning_forced_close_total", api="openai", effort="none") is None
    # the scrape-time gauges: an idle dense engine
    assert _get(m, "kdsa_engine_up") == 1 and _get(m, "kdsa_queue_length") == 0
    assert _get(m, "kdsa_active_slots") == 0 and _get(m, "kdsa_num_slots") == 4
    assert _get(m, "kdsa_engine_generated_tokens_total") >= sum(
        u["completion_tokens"] for us in usage.values() for u in us)
    assert _get(m, "kdsa_engine_preemptions_total") == 0
    assert not any(n.startswith(("kdsa_cache_", "kdsa_prefix_cache_")) for n, _ in m)


def test_anthropic_requests_are_labelled_and_refusals_not_counted(chat):
    handle, _ = chat
    before, _ = _scrape(handle)
    status, text = _post(handle, {"model": MODEL, "max_tokens": 200, "messages": USER,
                                  "output_config": {"effort": "low"}}, "/v1/messages")
    assert status == 200, text
    assert _post(handle, {"messages": USER, "reasoning_effort": "ultra"})[0] == 400
    m, _ = _scrape(handle)
    lab = {"api": "anthropic", "effort": "low"}
    assert _get(m, "kdsa_requests_total", **lab, finish_reason="stop") == 1
    assert _get(m, "kdsa_request_reasoning_tokens_sum", **lab) == REASONING["low"]
    assert _get(m, "kdsa_request_prompt_tokens_sum", **lab) == json.loads(text)["usage"][
        "input_tokens"]
    openai = [(k, v) for k, v in m.items() if ("api", "openai") in k[1]]
    assert openai == [(k, before[k]) for k, _ in openai]  # the 400 added nothing


def test_a_failed_request_counts_as_error(chat):
    handle, eng = chat
    real = eng.runner.decode

    def fail_once(*a, **kw):
        eng.runner.decode = real
        raise RuntimeError("injected decode failure")

    eng.runner.decode = fail_once
    status, _ = _post(handle, {"messages": USER, "reasoning_effort": "max"})
    assert status == 500
    m, _ = _scrape(handle)
    assert _get(m, "kdsa_requests_total", api="openai", effort="max",
                finish_reason="error") == 1
    assert _get(m, "kdsa_engine_up") == 1


def test_tool_rounds(tools, chat):
    handle, _ = tools
    lab = {"api": "openai", "effort": "low"}
    status, text = _post(handle, {"messages": USER, "tools": TOOLS, "reasoning_effort": "low"})
    msg = json.loads(text)["choices"][0]["message"]
    assert status == 200 and msg["tool_calls"]
    history = USER + [msg, {"role": "tool", "tool_call_id": CALL.id, "content": "sunny"}]
    status, _ = _post(handle, {"messages": history, "tools": TOOLS, "reasoning_effort": "low",
                               "stream": True})
    assert status == 200
    # thinking off, tool_choice "none": no call; history of two tool rounds
    status, _ = _post(handle, {"messages": history + [msg, history[-1]], "tools": TOOLS,
                               "reasoning_effort": "none", "tool_choice": "none"})
    assert status == 200
    # Anthropic: one tool_use turn in the history, and the answer calls again
    a_tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    a_hist = USER + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": CALL.id,
                                           "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": CALL.id,
                                      "content": "sunny"}]}]
    status, text = _post(handle, {"model": MODEL, "max_tokens": 200, "messages": a_hist,
                                  "tools": a_tools, "output_config": {"effort": "low"}},
                         "/v1/messages")
    assert status == 200 and json.loads(text)["stop_reason"] == "tool_use", text
    m, _ = _scrape(handle)
    assert _get(m, "kdsa_requests_total", **lab, finish_reason="tool_calls") == 2
    assert _get(m, "kdsa_request_tool_rounds_count", **lab) == 2
    assert _get(m, "kdsa_request_tool_rounds_sum", **lab) == 1 + 2  # 0 + call, 1 + call
    assert _get(m, "kdsa_request_tool_rounds_bucket", **lab, le="0.0") == 0
    assert _get(m, "kdsa_request_tool_rounds_bucket", **lab, le="1.0") == 1
    assert _get(m, "kdsa_request_tool_rounds_bucket", **lab, le="2.0") == 2
    off = {"api": "openai", "effort": "none"}
    assert _get(m, "kdsa_requests_total", **off, finish_reason="stop") == 1
    assert _get(m, "kdsa_request_tool_rounds_sum", **off) == 2
    anth = {"api": "anthropic", "effort": "low"}
    assert _get(m, "kdsa_requests_total", **anth, finish_reason="tool_calls") == 1
    assert _get(m, "kdsa_request_tool_rounds_sum", **anth) == 2
    # one registry per app: the chat server saw none of these
    other, _ = _scrape(chat[0])
    assert _get(other, "kdsa_requests_total", **lab, finish_reason="tool_calls") is None


def test_tool_rounds_definition():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {"messages": [{"role": "user", "content": "q"},
                         {"role": "assistant", "content": None, "tool_calls": [call, call]},
                         {"role": "tool", "tool_call_id": "c", "content": "r"},
                         {"role": "tool", "tool_call_id": "c", "content": "r"},
                         {"role": "assistant", "content": "thinking aloud", "tool_calls": []},
                         {"role": "assistant", "content": None, "tool_calls": [call]}]}
    assert tool_rounds(body, "openai") == 2  # parallel calls in one turn: one round
    assert tool_rounds({"messages": "x"}, "openai") == tool_rounds(None, "anthropic") == 0
    anth = {"messages": [{"role": "assistant", "content": "text only"},
                         {"role": "assistant", "content": [{"type": "text", "text": "x"},
                                                           {"type": "tool_use"}]}]}
    assert tool_rounds(anth, "anthropic") == 1


def test_paged_pool_and_prefix_cache_gauges():
    handle, eng = _server(_answer("It is sunny."), PagedScripted)
    try:
        status, _ = _post(handle, {"messages": USER, "reasoning_effort": "low"})
        assert status == 200
        m, types = _scrape(handle)
        cache = eng.metrics()["cache"]
        assert cache["kind"] == "paged"
        assert _get(m, "kdsa_cache_pages_capacity") == cache["pages_total"] == 40
        assert _get(m, "kdsa_cache_pages_used") == 0
        assert _get(m, "kdsa_cache_pages_free") == 40
        assert _get(m, "kdsa_cache_usage_ratio") == 0
        assert _get(m, "kdsa_cache_page_size_tokens") == cache["page_size"]
        assert not any(n.startswith("kdsa_prefix_cache_") for n, _ in m)
        # the prefix cache reports its counters in Engine.metrics()["prefix_cache"]
        real = eng.metrics
        eng.metrics = lambda: {**real(), "prefix_cache": {
            "hit_tokens": 48, "queried_tokens": 100, "evictions_total": 2, "entries": 3,
            "kind": "radix", "bad name": 1}}
        m, types = _scrape(handle)
        assert _get(m, "kdsa_prefix_cache_hit_tokens_total") == 48
        assert _get(m, "kdsa_prefix_cache_queried_tokens_total") == 100
        assert _get(m, "kdsa_prefix_cache_evictions_total") == 2
        assert _get(m, "kdsa_prefix_cache_entries") == 3
        assert types["kdsa_prefix_cache_hit_tokens"] == "counter"
        assert types["kdsa_prefix_cache_entries"] == "gauge"
        assert sum(n.startswith("kdsa_prefix_cache_") for n, _ in m) == 4
    finally:
        handle.stop()
