"""OpenAI chat-completions wire format: request validation and response bodies (no HTTP).

``parse_chat_request(body, ...)`` checks a ``POST /v1/chat/completions`` body and returns a
:class:`ChatJob` (rendered prompt, sampling, effort); every problem is an :class:`ApiError`
with the HTTP status and the offending parameter (``rl_and_serving.md`` 5 lists the fields).
``completion_body`` / ``chunk`` build the responses: ``message.reasoning_content``,
``tool_calls``, ``finish_reason`` (``tool_calls`` when the answer calls tools),
``usage.completion_tokens_details.reasoning_tokens``.

Images (``docs/vision.md``): with a ``vision`` config, user messages may hold ``image_url`` parts
with base64 data URLs; they are decoded (Pillow), checked against ``image_limits`` and patched
here, so a bad image is a 400 naming its part and never reaches the engine. ``ChatJob.images``
lists them in prompt order.

Numeric fields are checked against what the sampler holds (``docs/serving.md``, Reliability):
``seed`` in ``[0, 2**32)`` with ``seed + n - 1`` too (choice ``i`` uses ``seed + i``), ``top_k``
in ``[0, 2**31)`` (past the vocabulary size it keeps every token). ``response_format`` is
``{"type": "text" | "json_object" | "json_schema"}`` (the last with a ``json_schema`` object);
the format renders it into the prompt, as the model was trained to read it.

``reasoning_effort`` accepts ``low`` / ``high`` / ``max`` and maps the other common names as
DeepSeek-V4 does (``minimal`` -> low, ``medium`` / ``xhigh`` -> high); ``none`` turns thinking
off. Default ``max``.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

from kdsa.infer.budget import check_effort
from kdsa.infer.chat import (Message, ToolCall, check_tool_choice, messages_from_openai,
                             next_call_index, tools_from_openai)
from kdsa.infer.sampling import SEED_LIMIT, TOP_K_LIMIT, SamplingParams

EFFORT_ALIASES = {"minimal": "low", "low": "low", "medium": "high", "high": "high",
                  "xhigh": "high", "max": "max"}


class ApiError(Exception):
    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclasses.dataclass
class ChatJob:
    prompt: list[int]
    sampling: list[SamplingParams]  # one per choice (n)
    thinking: bool
    effort: str
    stream: bool
    include_usage: bool
    logprobs: bool
    first_call_index: int
    images: list = dataclasses.field(default_factory=list)  # patched, in prompt order
    id: str = dataclasses.field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    tool_choice: object = None  # checked: None | "auto" | "none" | "required" | {function}
    answer_prefix: tuple[int, ...] = ()  # ids the engine forces to open the answer
    banned_token_ids: tuple[int, ...] = ()  # ids the engine never samples (tool_choice none)


def _get(body: dict, name: str, types, default=None, check=None, why: str = ""):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ApiError(f"{name} must be {why or types}, got a boolean", param=name)
    if not isinstance(v, types) or (check is not None and not check(v)):
        raise ApiError(f"{name} must be {why or types}, got {v!r}", param=name)
    return v


def image_loader(vision, limits=None):
    """``(url, where) -> patched image`` for ``messages_from_openai`` (``None`` without a
    vision tower): data URLs only, counted against ``limits.max_images``."""
    if vision is None:
        return None
    from kdsa.model.vision.inputs import ImageLimits, make_image_loader

    return make_image_loader(vision, limits or ImageLimits())


def sampling_fields(body: dict) -> dict:
    """The sampling fields of a request (a chat-completions body, or a line of ``kdsa
    generate``'s prompts), checked: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``n``,
    ``seed``, ``ignore_eos``, ``stop`` (a tuple), ``max_tokens`` (or
    ``max_completion_tokens``); an absent or null field is left out."""
    num = (int, float)
    out = {
        "temperature": _get(body, "temperature", num, None, lambda v: 0 <= v <= 2,
                            "a number in [0, 2]"),
        "top_p": _get(body, "top_p", num, None, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        "top_k": _get(body, "top_k", int, None, lambda v: 0 <= v < TOP_K_LIMIT,
                      "an integer in [0, 2**31)"),
        "min_p": _get(body, "min_p", num, None, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        "n": _get(body, "n", int, None, lambda v: 1 <= v <= 16, "an integer in [1, 16]"),
        # vLLM's extension: generate max_tokens even past the end-of-message token (benchmarks)
        "ignore_eos": _get(body, "ignore_eos", bool, None, why="a boolean")}
    n = out["n"] or 1
    seed_range = "an integer in [0, 2**32)" + (f" with seed + {n - 1} < 2**32 (n={n})"
                                                if n > 1 else "")
    out["seed"] = _get(body, "seed", int, None, lambda v: 0 <= v <= SEED_LIMIT - n, seed_range)
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s
                                                                    for s in stop):
            raise ApiError("stop must be a string or a list of at most 4 non-empty strings",
                           param="stop")
        out["stop"] = tuple(stop)
    mt_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = body.get(mt_name)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(
            max_tokens, int) or max_tokens < 1):
        raise ApiError(f"{mt_name} must be an integer >= 1, got {max_tokens!r}",
                       param=mt_name)
    out["max_tokens"] = max_tokens
    return {k: v for k, v in out.items() if v is not None}


def parse_chat_request(body, *, model_name: str, chat_format, max_len: int,
                       default_max_tokens: int | None = None, vision=None,
                       image_limits=None, images=None) -> ChatJob:
    """``images``: the loader of image parts (default: data URLs only, ``image_limits``;
    ``kdsa generate`` passes one that also reads files next to its prompts)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:  # absent or null: the served one
        raise ApiError(f"the model {model!r} does not exist; this server serves "
                       f"{model_name!r}", status=404, param="model", code="model_not_found")
    try:
        messages = messages_from_openai(body.get("messages"), images if images is not None
                                        else image_loader(vision, image_limits))
    except ValueError as e:
        raise ApiError(str(e), param="messages") from None
    try:
        tools = tools_from_openai(body.get("tools"))
    except ValueError as e:
        raise ApiError(f"invalid tool schema: {e}", param="tools") from None
    try:
        tool_choice = check_tool_choice(body.get("tool_choice"), tools)
    except ValueError as e:
        raise ApiError(str(e), param="tool_choice") from None
    if isinstance(tool_choice, dict) and tool_choice.get("type") != "function":
        raise ApiError(f"tool_choice objects must have type 'function', got "
                       f"{tool_choice.get('type')!r}", param="tool_choice")
    raw_effort = _get(body, "reasoning_effort", str, why="a string")
    thinking = raw_effort != "none"
    try:
        effort = check_effort(EFFORT_ALIASES.get(raw_effort, raw_effort) if thinking else None)
    except ValueError as e:
        raise ApiError(str(e), param="reasoning_effort") from None
    response_format = _response_format(body.get("response_format"))
    f = sampling_fields(body)
    n, seed, max_tokens = f.get("n", 1), f.get("seed"), f.get("max_tokens")
    stream = _get(body, "stream", bool, False, why="a boolean")
    opts = _get(body, "stream_options", dict, {}, why="an object")
    if opts.get("include_usage") is not None and not isinstance(opts["include_usage"], bool):
        raise ApiError(f"stream_options.include_usage must be a boolean, got "
                       f"{opts['include_usage']!r}", param="stream_options")
    logprobs = _get(body, "logprobs", bool, False, why="a boolean")
    top_logprobs = _get(body, "top_logprobs", int, 0, lambda v: 0 <= v <= 20,
                        "an integer in [0, 20]")
    try:
        prompt = chat_format.render(messages, tools=tools, tool_choice=tool_choice,
                                    response_format=response_format, effort=effort,
                                    thinking=thinking)
    except ValueError as e:
        raise ApiError(str(e), param="messages") from None
    room = max_len - len(prompt)
    if room < 1:
        raise ApiError(f"the prompt is {len(prompt)} tokens; this model's context is "
                       f"{max_len} tokens", param="messages", code="context_length_exceeded")
    limit = min(room, max_tokens or default_max_tokens or room)
    sampling = [SamplingParams(temperature=float(f.get("temperature", 1.0)),
                               top_p=float(f.get("top_p", 1.0)), top_k=f.get("top_k", 0),
                               min_p=float(f.get("min_p", 0.0)),
                               seed=None if seed is None else seed + i, max_tokens=limit,
                               stop=f.get("stop", ()), ignore_eos=f.get("ignore_eos", False),
                               top_logprobs=top_logprobs if logprobs else 0)
                for i in range(n)]
    calls = next_call_index(messages)  # the first generated call's N (functions.NAME:N)
    forcing = tool_choice == "required" or isinstance(tool_choice, dict)
    prefix = tool_call_prefix(chat_format, tool_choice, calls) if forcing else ()
    banned = tool_call_opener(chat_format) if tool_choice == "none" else ()
    return ChatJob(prompt, sampling, thinking, effort, stream,
                   bool(opts.get("include_usage")), logprobs, calls,
                   images=[im for m in messages for im in m.images],
                   tool_choice=tool_choice, answer_prefix=prefix, banned_token_ids=banned)


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _response_format(rf):
    """``None`` or a checked ``response_format`` object (400 naming it otherwise)."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise ApiError(f"response_format must be an object, got {rf!r}",
                       param="response_format")
    if rf.get("type") not in RESPONSE_FORMATS:
        raise ApiError(f"response_format.type must be one of {RESPONSE_FORMATS}, got "
                       f"{rf.get('type')!r}", param="response_format")
    if rf["type"] == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict) or \
                not isinstance(js.get("name", ""), str):
            raise ApiError("response_format json_schema needs a json_schema object "
                           "{name: str, schema: object}", param="response_format")
    return rf


def engine_requests(job: ChatJob, chat_format, budgets, *, budget_tokens: int | None = None,
                    request_ids=None) -> list:
    """The engine ``Request`` of each choice of ``job`` (``infer/requests.py``): its prompt,
    sampling, images, reasoning cap (the effort's, or ``budget_tokens`` when smaller), parser
    and forced answer opening; ids ``request_ids`` (default ``JOB_ID-i``). The one place both
    HTTP APIs and ``kdsa generate`` make them."""
    from kdsa.infer.requests import Request

    cap = budgets.cap(job.effort) if job.thinking else None
    if job.thinking and budget_tokens is not None:
        cap = budget_tokens if cap is None else min(cap, budget_tokens)
    ids = request_ids or [f"{job.id}-{i}" for i in range(len(job.sampling))]
    return [Request(list(job.prompt), sp, images=list(job.images), reasoning_cap=cap,
                    in_reasoning=job.thinking,
                    parser=chat_format.parser(thinking=job.thinking, strict=False,
                                              first_call_index=job.first_call_index),
                    request_id=rid, answer_prefix=job.answer_prefix,
                    banned_token_ids=job.banned_token_ids)
            for rid, sp in zip(ids, job.sampling)]


def tool_call_opener(chat_format) -> tuple[int]:
    """The one token id that starts a tool call, banned in decoding for ``tool_choice:
    "none"``: the first token where the format's rendering of an assistant turn with a call
    departs from the same turn without one (XTML ``<|open|>``, which opens ``tools`` after the
    response -- the engine forces the response's own opening, so the ban only ever stops calls;
    K2 ``<|tool_calls_section_begin|>``). It must be a special token: banning a text token
    would also censor ordinary answers."""
    user = [Message("user", "x")]
    plain = chat_format.render(user + [Message("assistant", "", None)], thinking=False,
                               add_generation_prompt=False)
    call = ToolCall("functions.a:0", "a", "{}")
    called = chat_format.render(user + [Message("assistant", "", None, (call,))],
                                thinking=False, add_generation_prompt=False)
    n = next((i for i, (x, y) in enumerate(zip(plain, called)) if x != y), None)
    if n is None or not chat_format.tok.is_special(called[n]):
        raise ApiError(f"tool_choice 'none' cannot be enforced with the {chat_format.name} "
                       f"chat format (no special token opens its tool calls)",
                       param="tool_choice")
    return (called[n],)


def tool_call_prefix(chat_format, choice, first_call_index: int = 0) -> tuple[int, ...]:
    """Token ids that make the answer open with a tool call: for ``"required"`` the opening
    every call shares (up to the tool name), for ``{"function": {"name"}}`` that tool's whole
    call header. Taken from the format's own rendering of assistant turns that call tools
    (the common prefix of several), so it holds for any chat format."""
    if isinstance(choice, dict):
        calls = [(choice["function"]["name"], a) for a in ("{}", '{"a": 1}', '{"b": "x"}')]
    else:
        calls = [("a", "{}"), ("b", "{}")]
    user = [Message("user", "x")]
    gen = chat_format.render(user, thinking=False)
    rows = []
    for name, args in calls:
        call = ToolCall(f"functions.{name}:{first_call_index}", name, args)
        full = chat_format.render(user + [Message("assistant", "", None, (call,))],
                                  thinking=False, add_generation_prompt=False)
        if full[:len(gen)] != gen:
            rows = []
            break
        rows.append(full[len(gen):])
    n = 0
    while rows and all(len(r) > n and r[n] == rows[0][n] for r in rows):
        n += 1
    if n == 0:
        raise ApiError(f"tool_choice {choice!r} cannot be enforced with the "
                       f"{chat_format.name} chat format (no common tool-call opening)",
                       param="tool_choice")
    return tuple(rows[0][:n])


def check_tool_output(job: ChatJob, completion, usable=None) -> None:
    """``tool_choice`` "required" / a named function: a finished answer must hold a valid call
    (of that function). The engine forces the call's opening; when the model still does not
    complete a valid call, this is an error (500, code ``tool_choice_unsatisfied``) rather
    than an answer that breaks the contract. A ``length`` cut is reported as such.
    ``usable(call)``: the calls the API can return (Anthropic: arguments that are a JSON
    object, its ``tool_use`` input); the others do not count."""
    if not job.answer_prefix or completion.finish_reason != "stop":
        return
    out = completion.output
    calls = [c for c in (out.tool_calls if out is not None else ())
             if usable is None or usable(c)]
    want = job.tool_choice["function"]["name"] if isinstance(job.tool_choice, dict) else None
    if calls and (want is None or all(c.name == want for c in calls)):
        return
    errors = "; ".join(out.errors) if out is not None and out.errors else "none"
    raise ApiError(f"tool_choice {job.tool_choice!r}: the model's answer holds no valid "
                   f"tool call{f' to {want!r}' if want else ''} although its opening was "
                   f"forced (parser errors: {errors})", status=500, kind="server_error",
                   param="tool_choice", code="tool_choice_unsatisfied")


def _logprob_entries(tok, ids, logprobs, tops) -> dict:
    def entry(t, lp):
        b = tok.token_bytes(int(t))
        return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                        for t, lp, top in zip(ids, logprobs, tops)]}


def finish_reason(completion, job: ChatJob | None = None) -> str:
    out = completion.output
    if completion.finish_reason == "stop" and out is not None and out.tool_calls and \
            (job is None or job.tool_choice != "none"):
        return "tool_calls"
    return "stop" if completion.finish_reason == "abort" else completion.finish_reason


def usage(job: ChatJob, completions) -> dict:
    gen = sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": len(job.prompt), "completion_tokens": gen,
            "total_tokens": len(job.prompt) + gen,
            "completion_tokens_details": {"reasoning_tokens": sum(c.reasoning_tokens
                                                                  for c in completions)}}


def completion_body(job: ChatJob, completions, *, model_name: str, tokenizer) -> dict:
    choices = []
    for i, c in enumerate(completions):
        out = c.output
        msg = {"role": "assistant", "content": c.text or None}
        if job.thinking:
            msg["reasoning_content"] = out.reasoning if out is not None else ""
        if out is not None and out.tool_calls and job.tool_choice != "none":
            msg["tool_calls"] = [tc.to_openai() for tc in out.tool_calls]
        choice = {"index": i, "message": msg, "finish_reason": finish_reason(c, job),
                  "logprobs": None}
        if job.logprobs:
            choice["logprobs"] = _logprob_entries(tokenizer, c.token_ids, c.logprobs,
                                                  c.top_logprobs)
        choices.append(choice)
    return {"id": job.id, "object": "chat.completion", "created": job.created,
            "model": model_name, "choices": choices, "usage": usage(job, completions)}


def chunk(job: ChatJob, *, model_name: str, index: int, delta: dict,
          finish: str | None = None, logprobs: dict | None = None) -> dict:
    choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    return {"id": job.id, "object": "chat.completion.chunk", "created": job.created,
            "model": model_name, "choices": [choice]}


def delta_of(kind: str, value, tool_index: int) -> dict:
    if kind == "reasoning":
        return {"reasoning_content": value}
    if kind == "content":
        return {"content": value}
    return {"tool_calls": [value.to_openai(index=tool_index)]}
