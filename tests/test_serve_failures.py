"""Failures inside a served request reach its client and nothing else: a non-streamed request
whose client hangs up stops generating (its slot freed) instead of running to ``max_tokens``;
images the tower cannot encode fail that request with a 500 naming the error (not a 200 with
empty content); ``/health`` and ``/metrics`` read the engine's counters while the engine
thread adds to them. Scripted runner throughout (no compiles)."""

import json
import socket
import threading
import time

import numpy as np

from kdsa.infer.engine import Engine, Request
from kdsa.infer.page_pool import PagePool
from kdsa.infer.prefix_cache import PrefixCache
from kdsa.infer.server_run import start_server
from kdsa.model.vision.inputs import to_data_url

from scripted import FMT, TOK, USER, EosSecond, SeeingRunner, _answer


def _post(port: int, body: dict, read: bool = True):
    """POST a chat completion over a raw socket; the socket (``read=False``) or the answer."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
              b"application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    if not read:
        return s
    raw = b""
    while chunk := s.recv(65536):
        raw += chunk
        head, _, rest = raw.partition(b"\r\n\r\n")
        n = next((int(x.split(b":")[1]) for x in head.split(b"\r\n")
                  if x.lower().startswith(b"content-length:")), None)
        if n is not None and len(rest) >= n:
            break
    s.close()
    return int(head.split()[1]), json.loads(rest)


def test_a_non_streamed_request_stops_when_its_client_hangs_up():
    runner = EosSecond(TOK, FMT, answer_ids=_answer("ok"), num_slots=1, max_len=400_000)
    eng = Engine(runner, TOK, chat_format=FMT)
    handle = start_server(eng, FMT, model_name="m")
    try:
        s = _post(handle.port, {"messages": USER, "reasoning_effort": "none",
                                "max_tokens": 300_000, "ignore_eos": True}, read=False)
        deadline = time.monotonic() + 20
        while eng.metrics()["generated_tokens"] < 50 and time.monotonic() < deadline:
            time.sleep(0.02)
        s.close()  # the client gives up mid-generation
        while eng.metrics()["requests_finished"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        m = eng.metrics()
        print(f"generated {m['generated_tokens']} tokens of 300,000 before the abort")
        assert m["finish_reasons"] == {"abort": 1}, m["finish_reasons"]
        assert m["generated_tokens"] < 300_000 and m["active_slots"] == 0
        status, body = _post(handle.port, {"messages": USER, "reasoning_effort": "none",
                                           "max_tokens": 8})
        assert status == 200 and body["choices"][0]["message"]["content"] == "ok"
    finally:
        handle.stop()


class BlindRunner(SeeingRunner):
    """A vision tower that fails on every image."""

    def encode_images(self, images):
        raise RuntimeError("the tower ran out of memory")


def test_an_image_the_tower_cannot_encode_fails_its_request():
    eng = Engine(BlindRunner(TOK, FMT, answer_ids=_answer("A square."), num_slots=1,
                             max_len=1024), TOK, chat_format=FMT)
    handle = start_server(eng, FMT, model_name="m")
    try:
        url = to_data_url(np.full((30, 45, 3), 200, np.uint8))
        status, body = _post(handle.port, {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is it?"},
            {"type": "image_url", "image_url": {"url": url}}]}],
            "reasoning_effort": "none", "max_tokens": 20})
        assert status == 500, body
        assert body["error"]["code"] == "engine_error"
        assert "the tower ran out of memory" in body["error"]["message"]
        m = eng.metrics()
        assert m["failed_requests"] == 1 and eng.healthy and m["active_slots"] == 0
    finally:
        handle.stop()


def test_metrics_read_while_the_engine_thread_counts():
    """Engine.metrics and PrefixCache.usage iterate dicts the engine thread changes: each
    reads a copy (else 'dictionary changed size during iteration', a 500 on /health)."""
    eng = Engine(EosSecond(TOK, FMT, answer_ids=_answer("ok"), num_slots=1, max_len=1024), TOK,
                 chat_format=FMT)
    prefix = PrefixCache(PagePool(8), num_snapshots=20_000, snapshot_every=1)
    stop, errors = threading.Event(), []

    def engine_thread():
        k = 0
        while not stop.is_set():
            k += 1
            eng.stats[f"finish_reason_{k}"] += 1  # a new key each time
            key = k.to_bytes(8, "little")
            prefix.add_snapshot(key)
            if k % 2:
                prefix.drop_slot(prefix.snap_of[key])

    t = threading.Thread(target=engine_thread)
    t.start()
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            for read in (eng.metrics, prefix.usage):
                try:
                    read()
                except RuntimeError as e:
                    errors.append(str(e))
    finally:
        stop.set()
        t.join()
    assert not errors, f"{len(errors)} reads failed: {errors[0]}"


def test_submit_does_not_wait_while_the_engine_reserves_pages():
    """Admitting a request (hashing its prompt, copying pages and KDA states from the prefix
    cache on the device: a compile the first time) ran under the engine's lock, so a
    ``submit`` from the server's event loop, and with it every stream, waited until it was
    done. The engine thread now holds the lock only to read and pop the queue's head."""
    eng = Engine(EosSecond(TOK, FMT, answer_ids=_answer("ok"), num_slots=1, max_len=1024), TOK,
                 chat_format=FMT)
    entered, release = threading.Event(), threading.Event()
    reserve = eng._reserve_pages

    def slow_reserve(i, a):  # the engine thread inside the admission's device work
        entered.set()
        assert release.wait(30)
        return reserve(i, a)

    eng._reserve_pages = slow_reserve
    first = eng.submit(_request("first"))
    stepper = threading.Thread(target=eng.step)
    stepper.start()
    try:
        assert entered.wait(30)
        submitter = threading.Thread(target=lambda: eng.submit(_request("second")))
        submitter.start()
        submitter.join(5)
        assert not submitter.is_alive(), "submit waited for the engine's admission"
    finally:
        release.set()
        stepper.join(30)
    assert eng.slots[0] is not None and eng.slots[0].req.request_id == first
    assert [a.req.request_id for a in eng._waiting] == ["second"]


def _request(request_id: str) -> Request:
    return Request(TOK.encode("hello there"), request_id=request_id)
