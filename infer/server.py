"""OpenAI-compatible HTTP server (aiohttp): the HTTP layer only.

Routes: ``POST /v1/chat/completions`` (non-streaming JSON or SSE ``data:`` chunks ending with
``data: [DONE]``), ``GET /v1/models``, ``GET /health`` (with the engine's metrics). Request
checking and response bodies live in ``openai_api.py``; generation in the batching engine,
which runs in one background thread (``Engine.serve_forever``) shared by every connection.
Engine events reach each handler through an ``asyncio.Queue`` (``call_soon_threadsafe``). A
client that disconnects (its stream write fails, or its transport closes while it waits) has
its requests cancelled, which frees their slots. Every bad input is a 4xx with an OpenAI
error body; an unexpected failure in one request is a 500 and the server keeps serving. Image
parts (a model with a vision tower) are decoded and checked in ``openai_api`` (400 on a bad or
oversized image) and go to the engine with the request.

``start_server(engine, chat_format, ...)`` runs the app on its own event-loop thread and returns
a handle with ``port`` and ``stop()`` (tests, notebooks); ``serve(...)`` blocks (``kdsa serve``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

from aiohttp import web

from kdsa.infer import openai_api as api
from kdsa.infer.engine import Request

log = logging.getLogger("kdsa.serve")
ENGINE, FORMAT, TOKENIZER, CONFIG = (web.AppKey(n, object) for n in
                                     ("engine", "format", "tokenizer", "config"))


def build_app(engine, chat_format, *, model_name: str = "kdsa",
              default_max_tokens: int | None = None, image_limits=None) -> web.Application:
    app = web.Application(client_max_size=16 * 2**20)
    app[ENGINE], app[FORMAT], app[TOKENIZER] = engine, chat_format, engine.tok
    app[CONFIG] = {"model": model_name, "default_max_tokens": default_max_tokens,
                   "created": int(time.time()), "image_limits": image_limits}
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
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


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "model": request.app[CONFIG]["model"],
                              "metrics": request.app[ENGINE].metrics()})


async def models(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    return web.json_response({"object": "list", "data": [
        {"id": cfg["model"], "object": "model", "created": cfg["created"], "owned_by": "kdsa",
         "max_model_len": request.app[ENGINE].runner.max_len}]})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    app, cfg = request.app, request.app[CONFIG]
    engine, fmt = app[ENGINE], app[FORMAT]
    try:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise api.ApiError(f"the request body is not valid JSON ({e})") from None
        job = api.parse_chat_request(body, model_name=cfg["model"], chat_format=fmt,
                                     max_len=engine.runner.max_len,
                                     default_max_tokens=cfg["default_max_tokens"],
                                     vision=getattr(getattr(engine.runner, "config", None),
                                                    "vision_config", None),
                                     image_limits=cfg.get("image_limits"))
    except api.ApiError as e:
        return _error(e)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    reqs = []
    for i, sp in enumerate(job.sampling):
        reqs.append(Request(
            list(job.prompt), sp, images=list(job.images), reasoning_cap=engine.budgets.cap(job.effort)
            if job.thinking else None, in_reasoning=job.thinking,
            parser=fmt.parser(thinking=job.thinking, strict=False,
                              first_call_index=job.first_call_index),
            request_id=f"{job.id}-{i}", answer_prefix=job.answer_prefix,
            banned_token_ids=job.banned_token_ids,
            on_event=lambda ev, i=i: loop.call_soon_threadsafe(queue.put_nowait, (i, ev))))
    pending = {r.request_id for r in reqs}
    try:
        for r in reqs:
            engine.submit(r)
        if job.stream:
            return await _stream(request, job, queue, pending, len(reqs), cfg["model"],
                                 app[TOKENIZER])
        return await _collect(request, job, queue, pending, len(reqs), cfg["model"],
                              app[TOKENIZER])
    except api.ApiError as e:  # e.g. tool_choice not satisfied (check_tool_output)
        return _error(e)
    except ValueError as e:  # refused by the engine (e.g. prompt too long)
        return _error(api.ApiError(str(e)))
    except ConnectionResetError:  # the client left; nobody reads this response
        log.info("client disconnected from %s; cancelled", job.id)
        return web.Response(status=499)
    finally:
        for rid in pending:  # disconnected or failed: free the slots
            engine.cancel(rid)


async def _next(request, queue):
    """The next engine event; raises ConnectionResetError when the client has gone."""
    while True:
        try:
            return await asyncio.wait_for(queue.get(), timeout=0.25)
        except asyncio.TimeoutError:
            t = request.transport
            if t is None or t.is_closing():
                raise ConnectionResetError("client disconnected") from None


async def _collect(request, job, queue, pending, n, model, tok) -> web.Response:
    done = [None] * n
    while pending:
        i, ev = await _next(request, queue)
        if ev.completion is not None:
            done[i] = ev.completion
            pending.discard(ev.request_id)
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

    for i in range(n):
        await send(api.chunk(job, model_name=model, index=i, delta={"role": "assistant",
                                                                     "content": ""}))
    tool_index = [0] * n
    done = [None] * n
    while pending:
        i, ev = await _next(request, queue)
        lp = None
        if job.logprobs and ev.token_id is not None:
            lp = api._logprob_entries(tok, [ev.token_id], [ev.logprob], [ev.top_logprobs])
        for kind, value in ev.deltas:
            if kind == "tool_call" and job.tool_choice == "none":
                continue  # tool_choice "none": never sampled; a second guard (docs/serving.md)
            await send(api.chunk(job, model_name=model, index=i,
                                 delta=api.delta_of(kind, value, tool_index[i]), logprobs=lp))
            lp = None
            tool_index[i] += kind == "tool_call"
        if lp is not None:
            await send(api.chunk(job, model_name=model, index=i, delta={}, logprobs=lp))
        if ev.completion is not None:
            done[i] = ev.completion
            pending.discard(ev.request_id)
            try:
                api.check_tool_output(job, ev.completion)
            except api.ApiError as e:  # the stream has started: an error event, then on
                await send(e.body())
            await send(api.chunk(job, model_name=model, index=i, delta={},
                                 finish=api.finish_reason(ev.completion, job)))
    if job.include_usage:
        await send({"id": job.id, "object": "chat.completion.chunk", "created": job.created,
                    "model": model, "choices": [], "usage": api.usage(job, done)})
    await send("[DONE]")
    await resp.write_eof()
    return resp


class ServerHandle:
    def __init__(self, runner: web.AppRunner, loop, thread, port: int):
        self._runner, self._loop, self._thread, self.port = runner, loop, thread, port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 30) -> None:
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        fut.result(timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)


def start_server(engine, chat_format, *, host: str = "127.0.0.1", port: int = 0,
                 **kw) -> ServerHandle:
    """Serve on a background thread; ``port=0`` picks a free port (see ``handle.port``)."""
    app = build_app(engine, chat_format, **kw)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, handle_signals=False)
    ready: dict = {}

    def run():
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, host, port)
            loop.run_until_complete(site.start())
            ready["port"] = site._server.sockets[0].getsockname()[1]
        except Exception as e:  # reported to the caller below
            ready["error"] = e
        ready["event"].set()
        if "error" not in ready:
            loop.run_forever()

    ready["event"] = threading.Event()
    t = threading.Thread(target=run, daemon=True, name="kdsa-http")
    t.start()
    ready["event"].wait(60)
    if "error" in ready or "port" not in ready:
        raise RuntimeError(f"server did not start: {ready.get('error', 'timeout')}")
    return ServerHandle(runner, loop, t, ready["port"])


def serve(engine, chat_format, *, host: str = "127.0.0.1", port: int = 8000, **kw) -> None:
    """Serve in the foreground until interrupted."""
    web.run_app(build_app(engine, chat_format, **kw), host=host, port=port, print=log.info)
