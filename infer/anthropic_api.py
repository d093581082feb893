"""Anthropic Messages wire format: request translation and response bodies (no HTTP).

Formats as documented at https://docs.anthropic.com/en/api/messages (request, response),
https://docs.anthropic.com/en/api/messages-streaming (events) and
https://docs.anthropic.com/en/api/errors (error objects). ``anthropic_server.py`` serves them.

There is no second implementation here: :func:`parse_messages_request` rewrites the body as a
chat-completions body and hands it to ``openai_api.parse_chat_request``, so both APIs get the
same messages, tools, tool-choice forcing, effort, rendering, context check and
``SamplingParams``; the responses are built from the engine's own events and ``Completion``.

Request (fields not listed are accepted and ignored, e.g. ``metadata``, ``cache_control``):

* ``system``: a string or ``[{"type": "text", "text"}]`` -> a system message first;
* ``messages[i]``: ``{"role": "user" | "assistant", "content": str | [block]}``. User blocks:
  ``text``; ``image`` with ``source`` ``{"type": "base64", "media_type", "data"}`` (or
  ``{"type": "url", "url"}``; the image checks refuse what is not a data URL) -> an
  ``image_url`` part; ``tool_result`` ``{"tool_use_id", "content": str | [text blocks],
  "is_error"?}`` -> a ``tool`` message (``is_error`` is not rendered: the formats have no
  place for it). Assistant blocks: ``text``; ``thinking`` ``{"thinking", "signature"}`` ->
  ``reasoning_content``; ``tool_use`` ``{"id", "name", "input": object}`` -> a tool call;
  ``redacted_thinking`` is dropped. A final assistant message (response prefill) is a 400.
* ``tools[i]``: ``{"name", "description"?, "input_schema"}`` (``type`` absent or
  ``custom``; server tools are a 400); ``tool_choice``: ``{"type": "auto" | "any" | "none"}``
  or ``{"type": "tool", "name"}`` -> ``auto`` / ``required`` / ``none`` / a named function
  (``disable_parallel_tool_use`` is ignored).
* ``thinking``: absent or ``{"type": "adaptive"}`` -> thinking on, the effort's cap;
  ``{"type": "enabled", "budget_tokens": N}`` (integer >= 1, < ``max_tokens``) -> thinking on,
  reasoning cap ``N`` (bounded by the effort's cap; with no effort given, the lowest level
  whose cap holds ``N`` is the one told to the model); ``{"type": "disabled"}`` -> off.
* ``output_config.effort``: ``low`` / ``medium`` / ``high`` / ``xhigh`` / ``max`` mapped as
  ``reasoning_effort`` is (``openai_api.EFFORT_ALIASES``); ``output_config.format``
  ``{"type": "json_schema", "schema"}`` -> ``response_format``.
* ``max_tokens`` (required, integer >= 1; it counts thinking tokens too), ``stop_sequences``
  (at most 16 non-empty strings), ``temperature`` in ``[0, 1]``, ``top_p`` in ``(0, 1]``,
  ``top_k``, ``stream``, ``model`` (absent: the served model; another one is a 404).

Response (:func:`message_body`): ``{"id": "msg_...", "type": "message", "role":
"assistant", "model", "content": [thinking?, text?, tool_use...], "stop_reason",
"stop_sequence", "usage": {"input_tokens", "output_tokens", "output_tokens_details":
{"thinking_tokens"}}}``; a thinking block is ``{"type": "thinking", "thinking", "signature":
""}`` (not signed), a tool_use block ``{"type": "tool_use", "id", "name", "input"}`` (the
format's call id, e.g. ``functions.get_weather:0``, so a returned call renders as it was).
``stop_reason``: ``tool_use`` (a call), ``max_tokens`` (``length``), ``stop_sequence`` (with
the sequence), else ``end_turn``. Stream events: ``anthropic_server.EventStream``. Errors
(:func:`error_body`): ``{"type": "error", "error": {"type", "message"}}``, the message naming
the field (``temperature must be ...``, ``messages[1].content[0].source: ...``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from kdsa.infer import openai_api as api
from kdsa.infer.budget import EFFORTS
from kdsa.infer.openai_api import EFFORT_ALIASES, ApiError, _get
from kdsa.infer.sampling import TOP_K_LIMIT

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}
MAX_STOP_SEQUENCES = 16


def error_body(e: ApiError) -> dict:
    """The Anthropic error object for ``e`` (its HTTP status picks the type)."""
    kind = ERROR_TYPES.get(e.status) or ("invalid_request_error" if e.status < 500
                                          else "api_error")
    return {"type": "error", "error": {"type": kind, "message": str(e)}}


@dataclasses.dataclass
class MessagesJob:
    job: api.ChatJob  # what the OpenAI path builds (prompt, sampling, effort, tool forcing)
    budget_tokens: int | None  # thinking.budget_tokens (None: the effort's cap)


def parse_messages_request(body, *, model_name: str, chat_format, max_len: int, budgets,
                           vision=None, image_limits=None,
                           count_only: bool = False) -> MessagesJob:
    """Check a ``POST /v1/messages`` body (``count_only``: a ``count_tokens`` body, no
    ``max_tokens`` and no context limit) and build its job; every problem is an ``ApiError``."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    max_tokens = _get(body, "max_tokens", int, None, lambda v: v >= 1, "an integer >= 1")
    if max_tokens is None and not count_only:
        raise ApiError("max_tokens is required (an integer >= 1)", param="max_tokens")
    num = (int, float)
    temperature = _get(body, "temperature", num, 1.0, lambda v: 0 <= v <= 1,
                       "a number in [0, 1]")
    top_p = _get(body, "top_p", num, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")
    top_k = _get(body, "top_k", int, 0, lambda v: 0 <= v < TOP_K_LIMIT,
                 "an integer in [0, 2**31)")
    stops = _get(body, "stop_sequences", list, [], lambda v: len(v) <= MAX_STOP_SEQUENCES and
                 all(isinstance(s, str) and s for s in v),
                 f"a list of at most {MAX_STOP_SEQUENCES} non-empty strings")
    stream = _get(body, "stream", bool, False, why="a boolean")
    effort, budget = _thinking(body, max_tokens, budgets)
    paths: dict[str, str] = {}
    messages = _system(body.get("system"))
    messages += _messages(body.get("messages"), paths, len(messages))
    tools = _tools(body.get("tools"))
    chat = {"model": model_name if body.get("model") is None else body["model"],
            "messages": messages, "tools": tools,
            "tool_choice": _tool_choice(body.get("tool_choice"), tools),
            "reasoning_effort": effort, "response_format": _format(body),
            "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "max_tokens": max_tokens, "stream": stream}
    try:
        job = api.parse_chat_request(chat, model_name=model_name, chat_format=chat_format,
                                     max_len=2**62 if count_only else max_len, vision=vision,
                                     image_limits=image_limits)
    except ApiError as e:
        raise ApiError(_renamed(str(e), paths), status=e.status, param=e.param, code=e.code,
                       kind=e.kind) from None
    job.id = f"msg_{uuid.uuid4().hex[:24]}"
    job.sampling = [dataclasses.replace(sp, stop=tuple(stops)) for sp in job.sampling]
    return MessagesJob(job, budget)


def _thinking(body, max_tokens, budgets) -> tuple[str | None, int | None]:
    """``thinking`` and ``output_config.effort`` -> (``reasoning_effort``, budget_tokens)."""
    oc = _get(body, "output_config", dict, {}, why="an object")
    raw = oc.get("effort")
    if raw is not None and (not isinstance(raw, str) or raw not in EFFORT_ALIASES):
        raise ApiError(f"output_config.effort must be one of {tuple(EFFORT_ALIASES)}, got "
                       f"{raw!r}", param="output_config.effort")
    effort = EFFORT_ALIASES.get(raw)
    th = _get(body, "thinking", dict, {"type": "adaptive"}, why="an object")
    kind = th.get("type")
    if kind == "disabled":
        return "none", None
    if kind == "adaptive":
        return effort, None
    if kind != "enabled":
        raise ApiError(f"thinking.type must be 'enabled', 'disabled' or 'adaptive', got "
                       f"{kind!r}", param="thinking.type")
    n = th.get("budget_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or (
            max_tokens is not None and n >= max_tokens):
        raise ApiError(f"thinking.budget_tokens must be an integer >= 1 and less than "
                       f"max_tokens ({max_tokens}), got {n!r}", param="thinking.budget_tokens")
    if effort is None:  # tell the model the lowest level whose cap holds the budget
        effort = next((e for e in EFFORTS if budgets.caps[e] is None or budgets.caps[e] >= n),
                      EFFORTS[-1])
    return effort, n


def _blocks(content, where: str) -> list:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(f"{where} must be a string or a list of content blocks, got "
                       f"{type(content).__name__}", param="messages")
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise ApiError(f"{where}[{j}] must be a content block {{'type': ..., ...}}",
                           param="messages")
    return content


def _text_of(block, where: str, param: str = "messages") -> str:
    if not isinstance(block.get("text"), str):
        raise ApiError(f"{where}.text must be a string", param=param)
    return block["text"]


def _system(system) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if not isinstance(system, list) or not all(isinstance(b, dict) and b.get("type") == "text"
                                               for b in system):
        raise ApiError("system must be a string or a list of text blocks", param="system")
    return [{"role": "system",
             "content": "".join(_text_of(b, f"system[{j}]", "system")
                                for j, b in enumerate(system))}]


def _messages(raw, paths: dict, first: int) -> list[dict]:
    """Anthropic messages -> chat messages; ``paths`` maps each chat message / part location
    (``messages[k]``, ``messages[k].content[p]``) to its Anthropic one, for error messages."""
    if not isinstance(raw, list) or not raw:
        raise ApiError("messages must be a non-empty list", param="messages")
    out: list[dict] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            role = m.get("role") if isinstance(m, dict) else m
            raise ApiError(f"{where}.role must be 'user' or 'assistant', got {role!r}",
                           param="messages")
        blocks = _blocks(m.get("content"), f"{where}.content")
        if m["role"] == "assistant":
            paths[f"messages[{first + len(out)}]"] = where
            out.append(_assistant(blocks, where))
        else:
            _user(blocks, where, out, paths, first)
    if raw[-1]["role"] == "assistant":
        raise ApiError(f"messages[{len(raw) - 1}]: a final assistant message (response "
                       f"prefill) is not supported; end with a user message", param="messages")
    return out


def _user(blocks, where, out, paths, first) -> None:
    parts: list[dict] = []

    def flush(force=False):
        if parts or force:
            k = f"messages[{first + len(out)}]"
            paths[k] = where
            for p, (_, bw) in enumerate(parts):
                paths[f"{k}.content[{p}]"] = paths[f"{k}.content[{p}].image_url"] = bw
            out.append({"role": "user", "content": [part for part, _ in parts]})
            parts.clear()

    n = len(out)
    for j, b in enumerate(blocks):
        bw = f"{where}.content[{j}]"
        if b["type"] == "text":
            parts.append(({"type": "text", "text": _text_of(b, bw)}, bw))
        elif b["type"] == "image":
            parts.append(({"type": "image_url", "image_url": {"url": _image_url(b, bw)}},
                          bw + ".source"))
        elif b["type"] == "tool_result":
            flush()
            tid = b.get("tool_use_id")
            if not isinstance(tid, str) or not tid:
                raise ApiError(f"{bw}.tool_use_id must be a non-empty string", param="messages")
            paths[f"messages[{first + len(out)}]"] = bw
            out.append({"role": "tool", "tool_call_id": tid,
                        "content": _result_text(b.get("content"), bw)})
        else:
            raise ApiError(f"{bw}.type {b['type']!r}: user messages hold text, image and "
                           f"tool_result blocks", param="messages")
    flush(force=len(out) == n)  # a message of no blocks is an empty user turn


def _image_url(block, where: str) -> str:
    src = block.get("source")
    if isinstance(src, dict) and src.get("type") == "base64" and isinstance(
            src.get("media_type"), str) and isinstance(src.get("data"), str):
        return f"data:{src['media_type']};base64,{src['data']}"
    if isinstance(src, dict) and src.get("type") == "url" and isinstance(src.get("url"), str):
        return src["url"]
    raise ApiError(f"{where}.source must be {{'type': 'base64', 'media_type': str, 'data': "
                   f"str}} or {{'type': 'url', 'url': str}}", param="messages")


def _result_text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list) or not all(isinstance(b, dict) and b.get("type") == "text"
                                                for b in content):
        raise ApiError(f"{where}.content must be a string or a list of text blocks (images "
                       f"in tool results are not supported)", param="messages")
    return "".join(_text_of(b, f"{where}.content[{j}]") for j, b in enumerate(content))


def _assistant(blocks, where: str) -> dict:
    text, reasoning, calls = [], [], []
    for j, b in enumerate(blocks):
        bw = f"{where}.content[{j}]"
        if b["type"] == "text":
            text.append(_text_of(b, bw))
        elif b["type"] == "thinking":
            if not isinstance(b.get("thinking"), str):
                raise ApiError(f"{bw}.thinking must be a string", param="messages")
            reasoning.append(b["thinking"])
        elif b["type"] == "tool_use":
            if not isinstance(b.get("id"), str) or not b["id"] or not isinstance(
                    b.get("name"), str) or not isinstance(b.get("input"), dict):
                raise ApiError(f"{bw} must be {{'type': 'tool_use', 'id': str, 'name': str, "
                               f"'input': object}}", param="messages")
            calls.append({"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
        elif b["type"] != "redacted_thinking":
            raise ApiError(f"{bw}.type {b['type']!r}: assistant messages hold text, thinking "
                           f"and tool_use blocks", param="messages")
    return {"role": "assistant", "content": "".join(text),
            "reasoning_content": "".join(reasoning) if reasoning else None, "tool_calls": calls}


def _tools(raw) -> list[dict] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise ApiError("tools must be a list", param="tools")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type", "custom") not in ("custom", None):
            kind = t.get("type") if isinstance(t, dict) else t
            raise ApiError(f"tools[{i}] ({kind!r}): only custom tools {{'name', 'description', "
                           f"'input_schema'}} are supported", param="tools")
        if not isinstance(t.get("input_schema"), dict):
            raise ApiError(f"tools[{i}].input_schema is required (a JSON Schema object)",
                           param="tools")
        out.append({"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description") or "",
            "parameters": t["input_schema"]}})
    return out


def _tool_choice(tc, tools):
    if tc is None:
        return None
    kind = tc.get("type") if isinstance(tc, dict) else None
    if kind in ("any", "tool") and not tools:
        raise ApiError(f"tool_choice {{'type': {kind!r}}} needs tools", param="tool_choice")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": tc.get("name")}}
    raise ApiError(f"tool_choice must be {{'type': 'auto' | 'any' | 'none'}} or {{'type': "
                   f"'tool', 'name': str}}, got {tc!r}", param="tool_choice")


def _format(body):
    fmt = _get(body, "output_config", dict, {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(
            fmt.get("schema"), dict):
        raise ApiError("output_config.format must be {'type': 'json_schema', 'schema': object}",
                       param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


_PATH = re.compile(r"messages\[\d+\](?:\.content\[\d+\](?:\.image_url)?)?")


def _renamed(msg: str, paths: dict) -> str:
    """A chat-completions error message with Anthropic locations and field names."""
    def where(m):
        s = m.group(0)
        if s in paths:
            return paths[s]
        k = s[:s.index("]") + 1]
        return paths.get(k, k) + s[len(k):]

    msg = _PATH.sub(where, msg)
    msg = re.sub(r"(tools\[\d+\])\.function\.parameters", r"\1.input_schema", msg)
    return re.sub(r"(tools\[\d+\])\.function\b", r"\1", msg)


# ---- responses ----------------------------------------------------------------------------

def tool_input(call) -> dict | None:
    """A parsed tool call's arguments as the ``input`` object (``None``: not a JSON object)."""
    try:
        value = json.loads(call.arguments)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _calls(job, c) -> list:
    out = c.output
    if out is None or job.tool_choice == "none":  # "none": never sampled; a second guard
        return []
    return [(tc, inp) for tc in out.tool_calls if (inp := tool_input(tc)) is not None]


def stop_reason(job, c, chat_format) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished completion."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if _calls(job, c):
        return "tool_use", None
    stops = job.sampling[0].stop
    if stops and c.finish_reason == "stop" and c.token_ids and \
            c.token_ids[-1] not in chat_format.stop_ids:  # cut at a stop string: which one
        full = chat_format.parse(c.token_ids, thinking=job.thinking, strict=False,
                                 first_call_index=job.first_call_index).content
        hits = [(full.find(s, len(c.text)), s) for s in stops]
        hit = min(((j, s) for j, s in hits if j >= 0), default=None)
        if hit is not None:
            return "stop_sequence", hit[1]
    return "end_turn", None


def usage(job, c) -> dict:
    return {"input_tokens": len(job.prompt), "output_tokens": len(c.token_ids),
            "output_tokens_details": {"thinking_tokens": c.reasoning_tokens}}


def message_body(mj: MessagesJob, c, *, model: str, chat_format) -> dict:
    job, out = mj.job, c.output
    content = []
    if job.thinking and out is not None and out.reasoning:
        content.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if c.text:
        content.append({"type": "text", "text": c.text})
    content += [{"type": "tool_use", "id": tc.id, "name": tc.name, "input": inp}
                for tc, inp in _calls(job, c)]
    reason, seq = stop_reason(job, c, chat_format)
    return {"id": job.id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": seq,
            "usage": usage(job, c)}
