"""Serving reliability (docs/serving.md, Reliability): values the sampler cannot hold are 400s,
a failing engine step fails only its requests and the engine goes on, a dead engine is a 503 on
/health and ends ``kdsa serve`` non-zero, every error body is OpenAI-shaped, ``kdsa generate``
writes an error record for a bad line and serves the rest, a port in use is one line before any
model is built. Scripted runner throughout (no compiles)."""

import http.client
import json
import os
import socket
import threading
import time

import pytest

from kdsa.infer import openai_api as api
from kdsa.infer.budget import BudgetConfig
from kdsa.infer.chat import Message
from kdsa.infer.engine import Engine, EngineDead, GenerationError, Request
from kdsa.infer.sampling import SamplingParams
from kdsa.infer.server_run import start_server

from scripted import CAPS, FMT, GRACE, TOK, USER, EosSecond, _answer

ANSWER = "It is sunny."


def _engine(slots=2, runner_cls=EosSecond, **kw):
    runner = runner_cls(TOK, FMT, answer_ids=_answer(ANSWER), num_slots=slots, max_len=1024)
    return Engine(runner, TOK, chat_format=FMT,
                  budgets=BudgetConfig(caps=dict(CAPS), grace=GRACE), **kw)


def _request(handle, method, path, body=None, raw=None, timeout=20):
    conn = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=timeout)
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json"})
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    return r.status, text


def _chat(handle, **fields):
    return _request(handle, "POST", "/v1/chat/completions",
                    {"messages": USER, "reasoning_effort": "low", **fields})


def _error(text):
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _content(text):
    return json.loads(text)["choices"][0]["message"]["content"]


@pytest.fixture
def served():
    eng = _engine()
    handle = start_server(eng, FMT, model_name="kdsa-test")
    yield handle, eng
    handle.stop()


# ---- values the sampler cannot hold --------------------------------------------------------

@pytest.mark.parametrize("fields,param", [
    ({"seed": 2**32}, "seed"), ({"seed": -1}, "seed"), ({"seed": 2**32 - 1, "n": 2}, "seed"),
    ({"top_k": 2**31}, "top_k"), ({"top_k": 2**63}, "top_k")])
def test_values_past_the_samplers_arrays_are_400s(served, fields, param):
    handle, eng = served
    status, text = _chat(handle, **fields)
    assert status == 400 and _error(text)["param"] == param, text
    assert "2**3" in _error(text)["message"]
    status, text = _chat(handle)  # the engine is still serving
    assert status == 200 and _content(text) == ANSWER
    assert eng.healthy


@pytest.mark.parametrize("fields", [{"seed": 2**32 - 1}, {"seed": 2**32 - 2, "n": 2},
                                    {"top_k": 2**31 - 1, "temperature": 0.5}])
def test_largest_values_that_fit_are_served(served, fields):
    status, text = _chat(served[0], **fields)
    assert status == 200 and _content(text) == ANSWER, text


def test_sampling_params_refuse_what_the_arrays_cannot_hold():
    for kw in ({"seed": 2**32}, {"top_k": 2**31}, {"seed": -1}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)


# ---- a failing step fails only its requests --------------------------------------------

def _fail_once(obj, name, exc):
    real, state = getattr(obj, name), {"left": 1}

    def wrapper(*a, **kw):
        if state["left"]:
            state["left"] -= 1
            raise exc
        return real(*a, **kw)
    setattr(obj, name, wrapper)


@pytest.mark.parametrize("where", ["decode", "prefill"])
def test_engine_survives_a_failing_step(served, where):
    handle, eng = served
    _fail_once(eng.runner, where, RuntimeError(f"injected {where} failure"))
    status, text = _chat(handle)
    err = _error(text)
    assert status == 500 and err["type"] == "server_error" and err["code"] == "engine_error"
    assert f"RuntimeError: injected {where} failure" in err["message"]
    for stream in (False, True):  # the next requests are served, and correctly
        status, text = _chat(handle, stream=stream)
        assert status == 200
        if not stream:
            assert _content(text) == ANSWER
    assert _request(handle, "GET", "/health")[0] == 200
    m = eng.metrics()
    assert m["active_slots"] == 0 and m["failed_requests"] == 1 and m["engine_failure"] is None


def test_a_failed_stream_gets_an_error_event(served):
    handle, eng = served
    _fail_once(eng.runner, "decode", RuntimeError("injected"))
    status, text = _chat(handle, stream=True)
    events = [json.loads(x[6:]) for x in text.split("\n\n") if x.startswith("data: {")]
    assert status == 200 and text.rstrip().endswith("data: [DONE]")
    assert [e["error"]["code"] for e in events if "error" in e] == ["engine_error"]
    assert not any(c["choices"][0]["finish_reason"] for c in events if c.get("choices"))


def _prompt():
    return FMT.render([Message("user", "q")], effort="low")


def _req(eng, **sp):
    return Request(_prompt(), SamplingParams(temperature=0.0, max_tokens=200, **sp),
                   reasoning_cap=eng.budgets.cap("low"), in_reasoning=True, parser=FMT.parser())


def test_one_bad_row_fails_alone_in_a_batch():
    """A seed past uint32 that got around the checks (the original OverflowError), a parser
    that raises, an on_event that raises: each fails its own request; the others complete."""
    eng = _engine(slots=4)
    want = eng.generate([_req(eng)])[0]
    overflow = _req(eng)
    object.__setattr__(overflow.sampling, "seed", 2**32)  # frozen dataclass: bypass the check
    parser_bug = _req(eng)
    parser_bug.parser.feed = lambda t: 1 / 0
    cb_bug = _req(eng)
    cb_bug.on_event = lambda ev: [][0]
    good = _req(eng)
    got = eng.generate([overflow, parser_bug, good, cb_bug], raise_errors=False)
    assert [c.finish_reason for c in got] == ["abort", "abort", "stop", "abort"]
    assert "OverflowError" in got[0].error and "ZeroDivisionError" in got[1].error
    assert "IndexError" in got[3].error and got[2].error is None
    assert got[2].token_ids == want.token_ids and eng.healthy
    with pytest.raises(GenerationError, match="1 of 2 requests failed"):
        eng.generate([_req(eng), overflow])
    assert eng.generate([_req(eng)])[0].token_ids == want.token_ids
    assert all(s is None for s in eng.slots) and not eng.has_work()


def test_a_failure_while_finishing_still_answers_the_request(monkeypatch):
    """Something failing after a request's last token but before its completion was sent (here
    the end-of-request prefix snapshot) aborts it with the error: the request used to count as
    finished already, so no completion reached its client, which waited for ever."""
    eng = _engine(slots=1)
    want = eng.generate([_req(eng)])[0]
    monkeypatch.setattr(eng, "prefixes", [object()])  # as with a prefix cache: end snapshots
    monkeypatch.setattr(eng, "_snapshot_end", lambda i, a: 1 / 0)
    events = []
    req = _req(eng)
    req.on_event = events.append
    got = eng.generate([req], raise_errors=False)[0]
    assert got.finish_reason == "abort" and "ZeroDivisionError" in got.error
    assert events and events[-1].completion is got  # the client heard of it
    monkeypatch.undo()
    assert eng.generate([_req(eng)])[0].token_ids == want.token_ids and eng.healthy
    assert all(s is None for s in eng.slots) and not eng.has_work()


def test_decode_failure_aborts_that_step_and_frees_the_slots():
    eng = _engine(slots=2)
    want = eng.generate([_req(eng), _req(eng)])
    _fail_once(eng.runner, "decode", RuntimeError("boom"))
    got = eng.generate([_req(eng), _req(eng), _req(eng)], raise_errors=False)
    assert [c.finish_reason for c in got[:2]] == ["abort", "abort"]  # the two decoding rows
    assert got[2].token_ids == want[0].token_ids  # the waiting one then ran normally
    again = eng.generate([_req(eng), _req(eng)])
    assert [c.token_ids for c in again] == [c.token_ids for c in want]


def test_consecutive_failures_kill_the_engine_and_abort_what_it_holds():
    eng = _engine(slots=1, max_consecutive_failures=2)
    eng.runner.decode = lambda *a: (_ for _ in ()).throw(RuntimeError("device lost"))
    got = eng.generate([_req(eng) for _ in range(3)], raise_errors=False)
    assert all(c.finish_reason == "abort" for c in got)
    assert "device lost" in got[0].error and "engine has stopped" in got[2].error
    assert not eng.healthy and "2 consecutive decode calls failed" in eng.failure
    with pytest.raises(EngineDead):
        eng.submit(_req(eng))


def test_the_engine_is_dead_before_the_request_that_killed_it_hears_of_it():
    """The failure that dooms the engine marks it dead before the failed requests get their
    errors, so a client that saw its request fail never reads a healthy engine on ``/health``
    (that ordering once lost a race in ``test_health_reports_a_dead_engine``)."""
    eng = _dying_engine()
    health_at_error = []
    reqs = [_req(eng) for _ in range(2)]
    for r in reqs:
        r.on_event = lambda ev: health_at_error.append(eng.healthy) if ev.completion else None
    got = eng.generate(reqs, raise_errors=False)
    assert all(c.finish_reason == "abort" for c in got) and not eng.healthy
    assert health_at_error == [True, False]  # the first failure is not yet fatal


# ---- a dead engine: /health 503, kdsa serve exits non-zero -------------------------------

def _dying_engine():
    eng = _engine(slots=1, max_consecutive_failures=2)
    eng.runner.decode = lambda *a: (_ for _ in ()).throw(RuntimeError("device lost"))
    return eng


def test_health_reports_a_dead_engine():
    eng = _dying_engine()
    handle = start_server(eng, FMT, model_name="kdsa-test")
    try:
        assert _request(handle, "GET", "/health")[0] == 200
        for _ in range(2):
            status, text = _chat(handle)
            assert status == 500 and "device lost" in _error(text)["message"]
        status, text = _request(handle, "GET", "/health")
        body = json.loads(text)
        assert status == 503 and body["status"] == "error" and "consecutive" in body["error"]
        status, text = _chat(handle)
        assert status == 503 and _error(text)["code"] == "engine_unavailable"
    finally:
        handle.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_reports_an_ended_engine_thread():
    eng = _engine(slots=1)

    def crash():
        raise SystemExit  # not an Exception: escapes every guard and ends the thread
    eng.step = crash
    handle = start_server(eng, FMT, model_name="kdsa-test")
    try:
        deadline = time.time() + 10
        while eng.healthy and time.time() < deadline:
            time.sleep(0.02)
        status, text = _request(handle, "GET", "/health")
        assert status == 503 and "ended" in json.loads(text)["error"]
        assert _chat(handle)[0] == 503
    finally:
        handle.stop()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Port:
    def __init__(self, port):
        self.port = port


def _serve_in_main_thread(monkeypatch, engine, client):
    """``kdsa serve`` (in-process, this thread) over ``engine`` while ``client(handle)`` runs
    in another thread once ``/health`` answers; returns the exit status."""
    from kdsa.cli import generate_cmd
    from kdsa.cli.main import main

    monkeypatch.setattr(generate_cmd, "engine_from_args", lambda args: (engine, FMT, "kdsa"))
    h = _Port(_free_port())

    def run():
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                _request(h, "GET", "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.05)
        client(h)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    rc = main(["serve", "--port", str(h.port), "--no-warmup"])
    t.join(5)
    return rc


def test_kdsa_serve_exits_non_zero_when_the_engine_dies(monkeypatch, capsys):
    codes = []
    t0 = time.time()
    rc = _serve_in_main_thread(monkeypatch, _dying_engine(),
                               lambda h: codes.extend(_chat(h)[0] for _ in range(2)))
    assert rc == 1 and codes == [500, 500] and time.time() - t0 < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kdsa serve: error: the engine stopped (2 consecutive")


def test_kdsa_serve_stops_cleanly_on_sigterm(monkeypatch):
    import signal

    answers = []

    def client(h):
        answers.append(_chat(h))
        os.kill(os.getpid(), signal.SIGTERM)
    before = signal.getsignal(signal.SIGTERM)
    assert _serve_in_main_thread(monkeypatch, _engine(), client) == 0
    assert answers[0][0] == 200 and _content(answers[0][1]) == ANSWER
    assert signal.getsignal(signal.SIGTERM) == before  # the handler was put back


def test_port_in_use_is_one_line_before_any_model(monkeypatch, capsys):
    from kdsa.cli import generate_cmd
    from kdsa.cli.main import main

    def no_model(args):
        raise AssertionError("the model was built although the port is taken")
    monkeypatch.setattr(generate_cmd, "engine_from_args", no_model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.time()
        rc = main(["serve", "--port", str(port)])
        elapsed = time.time() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and elapsed < 5
    assert err == [f"kdsa serve: error: port {port} on 127.0.0.1 is in use (another server? "
                   f"choose a free one with --port)"]


# ---- error bodies ------------------------------------------------------------------------

def test_every_error_response_is_openai_shaped(served, monkeypatch):
    handle, _ = served
    status, text = _request(handle, "GET", "/v1/nothing-here")
    assert status == 404 and _error(text)["code"] == "not_found"
    status, text = _request(handle, "GET", "/v1/chat/completions")
    assert status == 405 and _error(text)["code"] == "method_not_allowed"
    status, text = _request(handle, "POST", "/v1/chat/completions",
                            raw=b'{"x": "' + b"a" * (16 * 2**20) + b'"}')
    assert status == 413 and _error(text)["code"] == "request_too_large"
    monkeypatch.setattr(api, "completion_body", lambda *a, **k: {}["boom"])
    status, text = _chat(handle)
    err = _error(text)
    assert status == 500 and err["type"] == "server_error" and "KeyError" in err["message"]
    monkeypatch.undo()
    assert _chat(handle)[0] == 200


@pytest.mark.parametrize("fields,param,words", [
    ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must"),
    ({"max_tokens": 5, "max_completion_tokens": "x"}, "max_completion_tokens",
     "max_completion_tokens must"),
    ({"messages": [{"role": "user", "content": None}]}, "messages", "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages", "messages[0].content"),
    ({"messages": [{"role": "system", "content": None}] + USER}, "messages",
     "messages[0].content"),
    ({"messages": USER + [{"role": "assistant", "content": "a", "tool_calls": 5}]}, "messages",
     "tool_calls must be a list"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": "json"}, "response_format", "an object"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options", "include_usage"),
    ({"tool_choice": {"type": "function", "function": {"name": ["x"]}}}, "tool_choice", "names"),
])
def test_smaller_validation_items(served, fields, param, words):
    status, text = _chat(served[0], **fields)
    err = _error(text)
    assert status == 400 and err["param"] == param and words in err["message"], text


@pytest.mark.parametrize("fields", [
    {"max_completion_tokens": 50},
    {"response_format": {"type": "text"}}, {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "object"}}}},
    {"messages": USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function", "function": {
            "name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]}])
def test_valid_forms_stay_valid(served, fields):
    status, text = _chat(served[0], **fields)
    assert status == 200, text


# ---- kdsa generate: a bad line is an error record, the rest is served ----------------------

class FailsOnSevens(EosSecond):
    """Prefill raises for a prompt that opens with token 7 three times (a failed generation)."""

    def prefill(self, slot, tokens, start=0, **kw):
        if start == 0 and list(tokens[:3]) == [7, 7, 7]:
            raise RuntimeError("injected prefill failure")
        return super().prefill(slot, tokens, start, **kw)


def test_kdsa_generate_writes_an_error_record_per_bad_line(tmp_path, monkeypatch, capsys):
    from kdsa.cli import generate_cmd
    from kdsa.cli.main import main

    eng = _engine(slots=2, runner_cls=FailsOnSevens)
    monkeypatch.setattr(generate_cmd, "engine_from_args", lambda args: (eng, FMT, "scripted"))
    chat = {"messages": [{"role": "user", "content": "Weather?"}], "reasoning_effort": "low"}
    lines = [json.dumps({"id": "a", **chat}),
             json.dumps({"id": "big-seed", "prompt": "x", "seed": 2**32}),
             json.dumps({"id": "b", "prompt_ids": [1, 2, 3], "max_tokens": 2}),
             "{not json",
             json.dumps({"id": "big-k", "prompt": "x", "top_k": 2**31}),
             json.dumps({"id": "fails", "prompt_ids": [7, 7, 7, 1]}),
             json.dumps({"id": "too-long", "prompt_ids": [1] * 2000}),
             json.dumps({"id": "no-prompt"}),
             json.dumps({"id": "c", **chat})]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    rc = main(["generate", "--prompts", str(src), "--out", str(out), "--no-progress",
               "--temperature", "0", "--max-tokens", "100"])
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "big-seed", "b", "4", "big-k", "fails", "too-long",
                                       "no-prompt", "c"]
    errors = {r["id"]: r["error"] for r in rows if "error" in r}
    assert set(errors) == {"big-seed", "4", "big-k", "fails", "too-long", "no-prompt"}
    assert "seed must be an integer in [0, 2**32), got 4294967296" in errors["big-seed"]
    assert "top_k must be an integer in [0, 2**31), got 2147483648" in errors["big-k"]
    assert "line 4: not valid JSON" in errors["4"] and "injected prefill" in errors["fails"]
    assert "does not fit the context" in errors["too-long"]
    assert all(set(r) == {"id", "error"} for r in rows if "error" in r)
    assert rows[0]["content"] == rows[8]["content"] == ANSWER
    assert rows[2]["completion_tokens"] == 2
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kdsa generate: error: 6 of 9 requests failed")
    assert eng.healthy  # the failed generation did not stop the engine


def test_kdsa_generate_all_good_exits_zero(tmp_path, monkeypatch, capsys):
    from kdsa.cli import generate_cmd
    from kdsa.cli.main import main

    monkeypatch.setattr(generate_cmd, "engine_from_args", lambda args: (_engine(), FMT, "s"))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": "x", "max_tokens": 3}) + "\n")
    assert main(["generate", "--prompts", str(src), "--out", str(out), "--no-progress"]) == 0
    assert "error" not in json.loads(out.read_text()) and capsys.readouterr().err == ""


def test_kdsa_generate_resumes_an_interrupted_job(tmp_path, monkeypatch, capsys):
    """Records are written as they finish (in order), so an interrupted job keeps them in
    OUT.partial and ``--resume`` generates only the rest: the output equals an uninterrupted
    run's. A torn last line is cut off; records of another prompts file, an existing --out
    without --overwrite and a left partial without --resume are refused before any work (the
    job used to write everything at the end, losing it all to an interruption, and replaced
    an existing --out silently)."""
    from kdsa.cli import generate_cmd
    from kdsa.cli.main import main

    engines = []

    def engine(args):
        engines.append(_engine(slots=2))
        return engines[-1], FMT, "s"

    monkeypatch.setattr(generate_cmd, "engine_from_args", engine)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": "x" * (i + 1),
                                       "max_tokens": 3 + i}) + "\n" for i in range(6)))
    argv = ["generate", "--prompts", str(src), "--out", str(out), "--no-progress",
            "--temperature", "0"]
    assert main(argv) == 0
    whole = out.read_text()
    assert main(argv) == 2 and "exists; --overwrite replaces it" in capsys.readouterr().err
    assert main(argv + ["--overwrite"]) == 0 and out.read_text() == whole
    out.unlink()

    steps = {"n": 0}
    real_step = type(_engine()).step

    def interrupted(self):  # Ctrl-C in the middle of the job
        steps["n"] += 1
        if steps["n"] == 9:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(type(_engine()), "step", interrupted)
    assert main(argv) == 130
    assert "--resume continues" in capsys.readouterr().err
    partial = tmp_path / "out.jsonl.partial"
    kept = partial.read_text().splitlines()
    assert not out.exists() and 0 < len(kept) < 6 and whole.startswith("\n".join(kept))
    monkeypatch.setattr(type(_engine()), "step", real_step)
    partial.write_text(partial.read_text() + '{"id": "r')  # a line torn by the interruption
    assert main(argv) == 2 and "--resume continues it" in capsys.readouterr().err
    assert main(argv + ["--resume"]) == 0
    assert out.read_text() == whole and not partial.exists()
    assert main(argv + ["--resume"]) == 2 and "is complete" in capsys.readouterr().err
    assert main(argv + ["--resume", "--overwrite"]) == 0 and out.read_text() == whole
    out.unlink()
    partial.write_text(json.dumps({"id": "other"}) + "\n")
    assert main(argv + ["--resume"]) == 2
    assert "record 1 of" in capsys.readouterr().err


def test_kdsa_generate_checks_lines_as_the_http_api_does(tmp_path, monkeypatch):
    """A line's fields follow the HTTP API's rules (they had their own: ``max_tokens: true`` and
    ``temperature: 5`` were served, ``temperature: null`` was an error, ``reasoning_effort:
    "none"`` unknown): one request path for both."""
    from kdsa.cli import generate_cmd
    from kdsa.cli.main import main

    monkeypatch.setattr(generate_cmd, "engine_from_args", lambda args: (_engine(), FMT, "s"))
    chat = {"messages": [{"role": "user", "content": "Weather?"}]}
    lines = [{"id": "bool", "prompt": "x", "max_tokens": True},
             {"id": "hot", "prompt": "x", "temperature": 5},
             {"id": "null", "prompt": "x", "temperature": None, "max_tokens": 2},
             {"id": "off", **chat, "reasoning_effort": "none"},
             {"id": "alias", **chat, "reasoning_effort": "medium"},
             {"id": "two", **chat, "n": 2}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["generate", "--prompts", str(src), "--out", str(out), "--no-progress",
                 "--temperature", "0"]) == 1
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "max_tokens must be an integer >= 1, got True" in rows["bool"]["error"]
    assert "temperature must be a number in [0, 2], got 5" in rows["hot"]["error"]
    assert rows["null"]["completion_tokens"] == 2
    assert rows["off"]["content"] == ANSWER and rows["off"]["reasoning_tokens"] == 0
    assert rows["alias"]["content"] == ANSWER and rows["alias"]["reasoning_tokens"] > 0
    assert "n must be 1" in rows["two"]["error"]


def test_duplicate_ids_name_their_lines(tmp_path):
    """A line without an id takes its line number: a user id equal to it is a duplicate, and
    the error names the lines (it named only the id)."""
    from kdsa.infer.generate import read_requests

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "2", "prompt": "a"}) + "\n" +
                   json.dumps({"prompt": "b"}) + "\n")
    eng = _engine()
    with pytest.raises(ValueError, match=r"duplicate request ids '2' \(lines 1, 2\); give each "
                                         r"line its own id"):
        read_requests(src, eng, FMT, effort="low", defaults={}, seed=0, strict=False)
