"""OpenAI- and Anthropic-compatible HTTP server (aiohttp): the HTTP layer only.

Routes: ``POST /v1/chat/completions`` (non-streaming JSON or SSE ``data:`` chunks ending with
``data: [DONE]``), ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (the Anthropic
Messages API, ``anthropic_server.py``), ``GET /v1/models``, ``GET /health`` (with the engine's
metrics), ``GET /metrics`` (Prometheus text, ``prometheus.py``: per-request counts, latencies
and token counts by effort level; the engine's queue, slots, pool and prefix cache). Both APIs
take one request path, :func:`run_job`: their bodies become the same ``openai_api.ChatJob``
(prompt, sampling, effort, tool forcing), submitted as the same engine ``Request`` s.
Request checking and response bodies live in ``openai_api.py`` / ``anthropic_api.py``;
generation in the batching engine, which runs in one background thread
(``Engine.serve_forever``) shared by every connection.
Engine events reach each handler through an ``asyncio.Queue`` (``call_soon_threadsafe``). A
client that disconnects (its stream write fails, or its transport closes while it waits) has
its requests cancelled, which frees their slots. Every error response (bad input 400, unknown
route 404, wrong method 405, body too large 413, a failure 500, a dead engine 503) has the
OpenAI error body ``{"error": {"message", "type", "param", "code"}}`` (middleware ``_errors``);
under ``/v1/messages`` the Anthropic one, ``{"type": "error", "error": {"type", "message"}}``.
A request the engine failed (``Completion.error``) is a 500 naming the error (in a stream: an
``error`` event) and the server keeps serving; when the engine is dead (``Engine.failure``, or
its thread has ended) ``/health`` answers 503, new requests get 503 and ``serve`` returns
``EngineStopped`` so ``kdsa serve`` exits non-zero. Image
parts (a model with a vision tower) are decoded and checked in ``openai_api`` (400 on a bad or
oversized image) and go to the engine with the request.

Running the app (a background thread, the foreground ``kdsa serve`` loop, the port check):
``server_run.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

from aiohttp import web

from kdsa.infer import anthropic_api
from kdsa.infer import openai_api as api
from kdsa.infer import prometheus
from kdsa.infer.request_body import BODY, off_loop, read_json
from kdsa.infer.engine import EngineDead

log = logging.getLogger("kdsa.serve")
ENGINE, FORMAT, TOKENIZER, CONFIG = (web.AppKey(n, object) for n in
                                     ("engine", "format", "tokenizer", "config"))
METRICS = web.AppKey("metrics", object)  # prometheus.ServerMetrics: this app's registry


TEXT_BODY_BYTES = 16 * 2**20  # a request's body without images


def body_limit(engine, image_limits=None) -> int:
    """The largest request body: 16 MiB of text, plus, for a model that reads images, room for
    ``max_images`` images of ``max_bytes`` each in base64 (4/3 of their size), so the image
    limits, not the body cap, decide which images are refused."""
    if vision_config(engine) is None:
        return TEXT_BODY_BYTES
    from kdsa.model.vision.inputs import ImageLimits

    lim = image_limits or ImageLimits()
    return TEXT_BODY_BYTES + lim.max_images * (lim.max_bytes * 4 // 3 + 4)


def build_app(engine, chat_format, *, model_name: str = "kdsa",
              default_max_tokens: int | None = None, image_limits=None) -> web.Application:
    app = web.Application(client_max_size=body_limit(engine, image_limits),
                          middlewares=[_errors])
    app[ENGINE], app[FORMAT], app[TOKENIZER] = engine, chat_format, engine.tok
    app[CONFIG] = {"model": model_name, "default_max_tokens": default_max_tokens,
                   "created": int(time.time()), "image_limits": image_limits}
    app[METRICS] = prometheus.ServerMetrics(engine, failure=lambda: engine_failure(app))
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    from kdsa.infer import anthropic_server  # it imports this module

    anthropic_server.add_routes(app)
    app.on_startup.append(_start_engine)
    app.on_cleanup.append(_stop_engine)
    return app


_STOP = web.AppKey("engine_stop", object)
_THREAD = web.AppKey("engine_thread", object)


async def _start_engine(app):
    stop = threading.Event()
    t = threading.Thread(target=app[ENGINE].serve_forever, args=(stop,), daemon=True,
                         name="kdsa-engine")
    app[_STOP], app[_THREAD] = stop, t
    t.start()


async def _stop_engine(app):
    app[_STOP].set()
    await asyncio.get_running_loop().run_in_executor(None, app[_THREAD].join, 30)


def _error(e: api.ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


def _error_body(request: web.Request, e: api.ApiError) -> dict:
    """The error body in the shape of the API the path belongs to."""
    if request.path == "/v1/messages" or request.path.startswith("/v1/messages/"):
        return anthropic_api.error_body(e)
    return e.body()


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


@web.middleware
async def _errors(request: web.Request, handler):
    """Every error response in the OpenAI shape: aiohttp's own (unknown route, wrong method,
    body too large, ...) and any unexpected exception (500, logged)."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        err = api.ApiError(f"{e.reason}: {request.method} {request.path}"
                           + (f" ({e.text})" if e.status == 413 and e.text else ""),
                           status=e.status, kind=kind, code=_HTTP_CODES.get(e.status))
        headers = {k: v for k, v in e.headers.items() if k in ("Allow",)}
        return web.json_response(_error_body(request, err), status=e.status, headers=headers)
    except Exception as e:  # noqa: BLE001 -- one request's bug: a 500, the server goes on
        log.exception("unexpected error in %s %s", request.method, request.path)
        err = api.ApiError(f"internal server error ({type(e).__name__}: {e})", status=500,
                           kind="server_error", code="internal_error")
        return web.json_response(_error_body(request, err), status=500)


def engine_failure(app) -> str | None:
    """Why the app's engine cannot serve (dead, or its thread has ended); None when fine."""
    eng, thread = app[ENGINE], app.get(_THREAD)
    if eng.failure is not None:
        return eng.failure
    if thread is not None and not thread.is_alive() and not app[_STOP].is_set():
        return "the engine thread has ended"
    return None


def _unavailable(why: str) -> api.ApiError:
    return api.ApiError(f"the engine has stopped: {why}", status=503, kind="server_error",
                        code="engine_unavailable")


async def health(request: web.Request) -> web.Response:
    why = engine_failure(request.app)
    body = {"status": "ok" if why is None else "error", "model": request.app[CONFIG]["model"],
            "metrics": request.app[ENGINE].metrics()}
    if why is not None:
        body["error"] = why
    return web.json_response(body, status=200 if why is None else 503)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition of this app's registry (``prometheus.py``)."""
    return web.Response(body=request.app[METRICS].render(),
                        headers={"Content-Type": prometheus.CONTENT_TYPE})


async def models(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    return web.json_response({"object": "list", "data": [
        {"id": cfg["model"], "object": "model", "created": cfg["created"], "owned_by": "kdsa",
         "max_model_len": request.app[ENGINE].max_request_tokens}]})


# seconds between SSE comments (": keepalive") while a stream waits for its next token (queued,
# a long prefill): proxies drop a connection idle for their timeout (nginx: 60 s), which
# cancels the request; clients ignore comment lines
KEEPALIVE_S = 10.0


def vision_config(engine):
    """The served model's vision config (``None``: it reads no images)."""
    return getattr(getattr(engine.runner, "config", None), "vision_config", None)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    app, cfg = request.app, request.app[CONFIG]
    engine = app[ENGINE]
    try:
        job = await off_loop(api.parse_chat_request, await read_json(request),
                             model_name=cfg["model"], chat_format=app[FORMAT],
                             max_len=engine.max_request_tokens,
                             default_max_tokens=cfg["default_max_tokens"],
                             vision=vision_config(engine), image_limits=cfg.get("image_limits"))
    except api.ApiError as e:
        return _error(e)

    def respond(queue, pending, n):
        return (_stream if job.stream else _collect)(request, job, queue, pending, n,
                                                     cfg["model"], app[TOKENIZER])

    return await run_job(request, job, respond, _error)


async def run_job(request: web.Request, job: api.ChatJob, respond, error, *,
                  budget_tokens: int | None = None) -> web.StreamResponse:
    """The generation path of both APIs: one engine ``Request`` per choice of ``job``
    (reasoning cap: the effort's, or ``budget_tokens`` when smaller); ``await respond(queue,
    pending, n)`` builds the response from the ``(choice, Event)`` pairs on ``queue``. Refusals
    and ``ApiError`` s become ``error(ApiError)``; what is still pending at the end (a client
    gone, a failure) is cancelled, freeing its slots."""
    app = request.app
    engine, fmt = app[ENGINE], app[FORMAT]
    why = engine_failure(app)
    if why is not None:
        return error(_unavailable(why))
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    deliver = _deliver(request, job, queue)
    reqs = api.engine_requests(job, fmt, engine.budgets, budget_tokens=budget_tokens)
    for i, r in enumerate(reqs):
        r.on_event = lambda ev, i=i: loop.call_soon_threadsafe(deliver, i, ev)
    pending = {r.request_id for r in reqs}
    try:
        for r in reqs:
            engine.submit(r)
        return await respond(queue, pending, len(reqs))
    except api.ApiError as e:  # e.g. tool_choice not satisfied (check_tool_output)
        return error(e)
    except EngineDead as e:
        return error(_unavailable(engine.failure or str(e)))
    except ValueError as e:  # refused by the engine (e.g. prompt too long)
        return error(api.ApiError(str(e)))
    except ConnectionResetError:  # the client left; nobody reads this response
        log.info("client disconnected from %s; cancelled", job.id)
        return web.Response(status=499)
    finally:
        for rid in pending:  # disconnected or failed: free the slots
            engine.cancel(rid)


def _deliver(request: web.Request, job: api.ChatJob, queue: asyncio.Queue):
    """``deliver(choice, event)`` on the event loop: the event onto ``queue``; a finished
    request is recorded in the app's metrics (a metrics bug is logged, never felt)."""
    obs, api_name = request.app.get(METRICS), prometheus.api_of(request.path)
    rounds = prometheus.tool_rounds(request.get(BODY), api_name) if obs is not None else 0

    def deliver(i, ev) -> None:
        queue.put_nowait((i, ev))
        if obs is not None and ev.completion is not None:
            try:
                obs.observe(ev.completion, job, api=api_name, history_rounds=rounds)
            except Exception:  # noqa: BLE001
                log.exception("recording the metrics of %s failed", ev.request_id)

    return deliver


async def _next(request, queue, keepalive=None, every: float = 10.0):
    """The next engine event; raises ConnectionResetError when the client has gone and a 503
    ``ApiError`` when the engine has stopped (its requests would never finish). While it
    waits, ``await keepalive()`` runs every ``every`` seconds (a stream's ping events)."""
    last = time.monotonic()
    while True:
        # checked on every event, not only while idle: a client that stops waiting for a
        # non-streamed answer is otherwise noticed only when the generation ends
        t = request.transport
        if t is None or t.is_closing():
            raise ConnectionResetError("client disconnected")
        try:
            return await asyncio.wait_for(queue.get(), timeout=0.25)
        except asyncio.TimeoutError:
            if keepalive is not None and time.monotonic() - last >= every:
                await keepalive()
                last = time.monotonic()
            why = engine_failure(request.app)
            if why is not None and queue.empty():
                raise _unavailable(why) from None


def _failed(c) -> api.ApiError:
    """A request the engine failed: a 500 naming the error."""
    return api.ApiError(f"generation failed: {c.error}", status=500, kind="server_error",
                        code="engine_error")


async def _collect(request, job, queue, pending, n, model, tok) -> web.Response:
    done = [None] * n
    while pending:
        i, ev = await _next(request, queue)
        if ev.completion is not None:
            done[i] = ev.completion
            pending.discard(ev.request_id)
    for c in done:
        if c.error is not None:
            raise _failed(c)
    for c in done:
        if c.output is not None and c.output.errors:
            log.warning("unparsed model output in %s: %s", c.request_id, c.output.errors)
        api.check_tool_output(job, c)  # tool_choice required / named: a valid call or a 500
    return web.json_response(api.completion_body(job, done, model_name=model, tokenizer=tok))


async def _stream(request, job, queue, pending, n, model, tok) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(obj) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
        await resp.write(f"data: {data}\n\n".encode())

    async def keepalive() -> None:
        await resp.write(b": keepalive\n\n")

    done = [None] * n
    try:
        await _stream_events(request, job, queue, pending, n, model, tok, send, done,
                             keepalive)
    except api.ApiError as e:  # the engine stopped: say so, then end the stream
        await send(e.body())
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001 -- the headers are out: an error event, not a 500
        log.exception("streaming %s failed", job.id)
        await send(api.ApiError(f"internal server error ({type(e).__name__}: {e})",
                                status=500, kind="server_error", code="internal_error").body())
    if job.include_usage and all(c is not None and c.error is None for c in done):
        await send({"id": job.id, "object": "chat.completion.chunk", "created": job.created,
                    "model": model, "choices": [], "usage": api.usage(job, done)})
    await send("[DONE]")
    await resp.write_eof()
    return resp


async def _stream_events(request, job, queue, pending, n, model, tok, send, done,
                         keepalive=None) -> None:
    """The chunks of a stream until every choice is done (``done`` filled in); ``keepalive()``
    every :data:`KEEPALIVE_S` seconds of waiting."""
    for i in range(n):
        await send(api.chunk(job, model_name=model, index=i, delta={"role": "assistant",
                                                                     "content": ""}))
    tool_index = [0] * n
    while pending:
        i, ev = await _next(request, queue, keepalive=keepalive, every=KEEPALIVE_S)
        lp = None
        if job.logprobs and ev.token_id is not None:
            lp = api._logprob_entries(tok, [ev.token_id], [ev.logprob], [ev.top_logprobs])
        for kind, value in ev.deltas:
            if kind == "tool_call" and job.tool_choice == "none":
                continue  # tool_choice "none": never sampled; a second guard (docs/serving.md)
            if kind == "reasoning" and not job.thinking:
                continue  # as the whole body: no reasoning_content with thinking off
            await send(api.chunk(job, model_name=model, index=i,
                                 delta=api.delta_of(kind, value, tool_index[i]), logprobs=lp))
            lp = None
            tool_index[i] += kind == "tool_call"
        if lp is not None:
            await send(api.chunk(job, model_name=model, index=i, delta={}, logprobs=lp))
        if ev.completion is not None:
            done[i] = ev.completion
            pending.discard(ev.request_id)
            if ev.completion.error is not None:  # failed: an error event, no finish chunk
                await send(_failed(ev.completion).body())
                continue
            try:
                api.check_tool_output(job, ev.completion)
            except api.ApiError as e:  # the stream has started: an error event, then on
                await send(e.body())
            await send(api.chunk(job, model_name=model, index=i, delta={},
                                 finish=api.finish_reason(ev.completion, job)))
