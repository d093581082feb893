"""The Anthropic Messages API over HTTP: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (https://docs.anthropic.com/en/api/messages,
https://docs.anthropic.com/en/api/messages-count-tokens).

Routes are added by ``server.build_app``; they take the OpenAI route's path: the body is
translated by ``anthropic_api.parse_messages_request`` into the same ``ChatJob`` and generated
by ``server.run_job`` (one engine, the same ``Request`` s, budgets, parsers, cancellation on
disconnect, 503 for a dead engine). Every error is ``{"type": "error", "error": {"type",
"message"}}`` with the HTTP status (400 ``invalid_request_error``, 404 ``not_found_error``,
413 ``request_too_large``, 500 / 503 ``api_error``).

Streaming (https://docs.anthropic.com/en/api/messages-streaming) sends named SSE events
(``event: <type>`` then ``data: <json>``), as :class:`EventStream` builds them, with a ``ping``
after ``message_start`` and every ``PING_S`` seconds while the engine has nothing new (a long
prefill or queue). A failure once the stream has started (the engine failed the request or
stopped, ``tool_choice`` not satisfied) is an ``error`` event, which ends the stream.

``count_tokens`` answers ``{"input_tokens": N}``: the length of the prompt the same body would
be rendered to (with its system, tools, images and thinking settings), any length.
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from kdsa.infer import anthropic_api as anth
from kdsa.infer import openai_api as api
from kdsa.infer import server as srv
from kdsa.infer.request_body import off_loop, read_json

log = logging.getLogger("kdsa.serve")
PING_S = 10.0


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)


def _error(e: api.ApiError) -> web.Response:
    return web.json_response(anth.error_body(e), status=e.status)


async def _parse(request: web.Request, count_only: bool) -> anth.MessagesJob:
    app, cfg = request.app, request.app[srv.CONFIG]
    engine = app[srv.ENGINE]
    return await off_loop(
        anth.parse_messages_request, await read_json(request), model_name=cfg["model"],
        chat_format=app[srv.FORMAT], max_len=engine.max_request_tokens, budgets=engine.budgets,
        vision=srv.vision_config(engine), image_limits=cfg.get("image_limits"),
        count_only=count_only)


async def count_tokens(request: web.Request) -> web.Response:
    try:
        mj = await _parse(request, count_only=True)
    except api.ApiError as e:
        return _error(e)
    return web.json_response({"input_tokens": len(mj.job.prompt)})


async def messages(request: web.Request) -> web.StreamResponse:
    try:
        mj = await _parse(request, count_only=False)
    except api.ApiError as e:
        return _error(e)
    model, fmt = request.app[srv.CONFIG]["model"], request.app[srv.FORMAT]

    def respond(queue, pending, n):
        return (_stream if mj.job.stream else _collect)(request, mj, queue, pending, model, fmt)

    return await srv.run_job(request, mj.job, respond, _error, budget_tokens=mj.budget_tokens)


def _checked(mj, c):
    """A finished completion, or the ``ApiError`` it is (failed; tool_choice unsatisfied)."""
    if c.error is not None:
        raise srv._failed(c)
    if c.output is not None and c.output.errors:
        log.warning("unparsed model output in %s: %s", c.request_id, c.output.errors)
    usable = lambda call: anth.tool_input(call) is not None  # noqa: E731  a tool_use input
    dropped = [tc.name for tc in (c.output.tool_calls if c.output is not None else ())
               if not usable(tc)]
    if dropped:  # (the OpenAI API returns them: its arguments are a string)
        log.warning("%s: tool calls %s have arguments that are not a JSON object; a tool_use "
                    "block cannot hold them", c.request_id, dropped)
    api.check_tool_output(mj.job, c, usable)
    return c


async def _collect(request, mj, queue, pending, model, fmt) -> web.Response:
    done = None
    while pending:
        _, ev = await srv._next(request, queue)
        if ev.completion is not None:
            done = ev.completion
            pending.discard(ev.request_id)
    c = _checked(mj, done)
    return web.json_response(anth.message_body(mj, c, model=model, chat_format=fmt))


async def _stream(request, mj, queue, pending, model, fmt) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(event: dict) -> None:
        data = json.dumps(event, ensure_ascii=False)
        await resp.write(f"event: {event['type']}\ndata: {data}\n\n".encode())

    events = EventStream(mj, model, fmt)
    try:
        for e in events.start():
            await send(e)
        while pending:
            _, ev = await srv._next(request, queue, keepalive=lambda: send(PING), every=PING_S)
            for e in events.deltas(ev.deltas):
                await send(e)
            if ev.completion is not None:
                pending.discard(ev.request_id)
                for e in events.finish(_checked(mj, ev.completion)):
                    await send(e)
    except api.ApiError as e:  # failed, unsatisfied, or the engine stopped: the stream ends
        await send(anth.error_body(e))
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001 -- the headers are out: an error event, not a 500
        log.exception("streaming %s failed", mj.job.id)
        await send(anth.error_body(api.ApiError(
            f"internal server error ({type(e).__name__}: {e})", status=500)))
    await resp.write_eof()
    return resp


PING = {"type": "ping"}


class EventStream:
    """One request's engine events -> Anthropic stream events (dicts; the SSE event name is
    their ``type``): ``message_start`` (empty content) and a ``ping``; per block
    ``content_block_start``, ``content_block_delta`` (``thinking_delta`` / ``text_delta`` /
    ``input_json_delta``, a tool call's whole input in one delta: the parser reports calls
    once complete), ``content_block_stop``; then ``message_delta`` (``stop_reason``,
    ``stop_sequence``, ``usage``) and ``message_stop``. Blocks are indexed in order;
    reasoning, text and calls each open a new block when the previous one was another kind."""

    def __init__(self, mj: anth.MessagesJob, model: str, chat_format):
        self.job, self.model, self.fmt = mj.job, model, chat_format
        self.index, self.open = -1, None  # the open block's index and kind

    def start(self) -> list[dict]:
        msg = {"id": self.job.id, "type": "message", "role": "assistant", "model": self.model,
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": len(self.job.prompt), "output_tokens": 0}}
        return [{"type": "message_start", "message": msg}, PING]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _block(self, kind: str, block: dict) -> list[dict]:
        if self.open == kind:
            return []
        out = self._close()
        self.index, self.open = self.index + 1, kind
        return out + [{"type": "content_block_start", "index": self.index,
                       "content_block": block}]

    def deltas(self, deltas) -> list[dict]:
        out = []
        for kind, value in deltas:
            if kind == "reasoning" and value and self.job.thinking:
                out += self._block("thinking", {"type": "thinking", "thinking": "",
                                                "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": value}))
            elif kind == "content" and value:
                out += self._block("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": value}))
            elif kind == "tool_call" and self.job.tool_choice != "none":
                inp = anth.tool_input(value)
                if inp is None:
                    continue
                out += self._block("tool_use", {"type": "tool_use", "id": value.id,
                                                "name": value.name, "input": {}})
                out.append(self._delta({"type": "input_json_delta", "partial_json":
                                        json.dumps(inp, ensure_ascii=False)}))
                out += self._close()  # one block per call
        return out

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def finish(self, c) -> list[dict]:
        reason, seq = anth.stop_reason(self.job, c, self.fmt)
        return self._close() + [
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
             "usage": anth.usage(self.job, c)}, {"type": "message_stop"}]
