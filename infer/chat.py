"""Chat messages, tools and the OpenAI wire format; the chat-format interface.

A conversation is a list of :class:`Message` (roles ``system``, ``user``, ``assistant``,
``tool``). Assistant messages carry ``reasoning``, ``content`` and ``tool_calls`` (id, name, JSON
arguments); a ``tool`` message answers one call through ``tool_call_id``. The full history is
kept: the formats render earlier reasoning back as they define (``kimi_k3.md`` 6,
``rl_and_serving.md`` 5: tool loops need their reasoning returned).

Formats (``xtml.py``: K3's XTML; ``k2_format.py``: K2's ``<|im_*|>`` / ``<think>``) implement
:class:`ChatFormat`: ``render`` to token ids (markup as specials, every user-supplied string as
ordinary text), ``parser`` for model output (incremental, for streaming; ``parse`` for a whole
output) and the reasoning markers the thinking budget forces.

``messages_from_openai`` / ``tools_from_openai`` / ``check_tool_choice`` turn request JSON into
these types and raise ``ValueError`` naming the offending field (the server answers 400).

Images (``docs/vision.md``): a user message's ``parts`` hold its text and images in order; an
image is anything with ``size`` (width, height) and ``num_tokens`` (a patched image,
``model/vision/patching.py``). Formats render it as :func:`media_span`, whose ``num_tokens``
``<|media_pad|>`` placeholders take the image features in the model.
"""

from __future__ import annotations

import dataclasses
import json
import re

ROLES = ("system", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_SCHEMA_TYPES = ("object", "string", "number", "integer", "boolean", "array", "null")


class MalformedOutputError(ValueError):
    """Model output that does not follow the chat format (e.g. a broken tool call)."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text (OpenAI sends and expects a string)

    def to_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function",
             "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


@dataclasses.dataclass(frozen=True)
class Message:
    role: str
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    parts: tuple = ()  # text (str) and images in order; content is the text joined

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; roles are {ROLES}")
        if self.parts and self.role != "user":
            raise ValueError(f"only user messages carry images, not {self.role!r}")
        if self.role != "assistant" and (self.tool_calls or self.reasoning):
            raise ValueError(f"only assistant messages carry reasoning or tool_calls, not "
                             f"{self.role!r}")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")

    @property
    def images(self) -> tuple:
        return tuple(p for p in self.parts if not isinstance(p, str))


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict = dataclasses.field(default_factory=lambda: {"type": "object",
                                                                   "properties": {}})

    def to_openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


MALFORMED_CALL = "malformed tool call"  # how the parsers' errors name a call they dropped


def _distinct_pairs(items: list) -> dict:
    keys = [k for k, _ in items]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(f"repeated keys {repeated}")
    return dict(items)


# JSON that refuses an object with a repeated key at any depth (``ValueError``): a parsed tool
# call's arguments must mean one thing to every client (``json.loads`` keeps the last value,
# others the first). ``raw_decode`` reads one value inside a longer text the same way.
DISTINCT_KEYS = json.JSONDecoder(object_pairs_hook=_distinct_pairs)


def loads_distinct_keys(text: str):
    """``json.loads`` with :data:`DISTINCT_KEYS`."""
    return DISTINCT_KEYS.decode(text)


@dataclasses.dataclass(frozen=True)
class AssistantOutput:
    """Parsed model output. ``errors``: problems skipped in non-strict parsing."""

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()
    complete: bool = False  # the end-of-message marker was seen

    def as_message(self) -> Message:
        return Message("assistant", self.content, self.reasoning or None, self.tool_calls)


def normalize_arguments(arguments) -> str:
    """Dict or JSON text -> compact JSON text (non-JSON text is kept as it is)."""
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise ValueError(f"tool call arguments must be a JSON string, got "
                         f"{type(arguments).__name__}")
    return arguments


# ---- OpenAI request JSON -> types ----------------------------------------------------------

def _text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(
                    p.get("text"), str):
                raise ValueError(f"{where}.content[{i}]: only text parts "
                                 f"{{'type': 'text', 'text': str}} are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise ValueError(f"{where}.content must be a string or a list of text parts, got "
                     f"{type(content).__name__}")


MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END = ("<|media_begin|>", "<|media_content|>",
                                                    "<|media_pad|>", "<|media_end|>")


def media_span(image) -> list[tuple[str, str]]:
    """``[("special" | "text", s)]`` of one image: ``<|media_begin|>image WxH<|media_content|>``,
    ``num_tokens`` x ``<|media_pad|>``, ``<|media_end|>`` (``kimi_k3.md`` 5)."""
    w, h = image.size
    return ([("special", MEDIA_BEGIN), ("text", f"image {w}x{h}"), ("special", MEDIA_CONTENT)]
            + [("special", MEDIA_PAD)] * image.num_tokens + [("special", MEDIA_END)])


def _user_parts(content, where: str, image_loader) -> tuple[str, tuple]:
    """User content with ``image_url`` parts -> (joined text, parts)."""
    if not isinstance(content, list) or not any(
            isinstance(p, dict) and p.get("type") == "image_url" for p in content):
        return _text(content, where), ()
    parts = []
    for i, p in enumerate(content):
        if isinstance(p, dict) and p.get("type") == "image_url":
            if image_loader is None:
                raise ValueError(f"{where}.content[{i}]: this model does not read images (it "
                                 f"has no vision tower)")
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            parts.append(image_loader(url, f"{where}.content[{i}].image_url"))
        elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
            parts.append(p["text"])
        else:
            raise ValueError(f"{where}.content[{i}]: parts are {{'type': 'text', 'text': str}} "
                             f"or {{'type': 'image_url', 'image_url': {{'url': str}}}}")
    return "".join(p for p in parts if isinstance(p, str)), tuple(parts)


def messages_from_openai(raw, image_loader=None) -> list[Message]:
    """``image_loader(url, where)`` turns an ``image_url`` part of a user message into an image
    (``None``: images are refused)."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object")
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {ROLES + ('developer',)}, got "
                             f"{role!r}")
        if m.get("content") is None and role != "assistant":
            raise ValueError(f"{where}.content is required for a {role} message (a string or "
                             f"a list of parts), got null")
        content = _text(m.get("content"), where) if role != "user" else None
        if role == "assistant":
            reasoning = m.get("reasoning_content")
            if reasoning is None or reasoning == "":  # (an empty one hides no reasoning)
                reasoning = m.get("reasoning", reasoning)
            if reasoning is not None and not isinstance(reasoning, str):
                raise ValueError(f"{where}.reasoning_content must be a string")
            calls = []
            if not isinstance(m.get("tool_calls") or [], list):
                raise ValueError(f"{where}.tool_calls must be a list")
            for j, c in enumerate(m.get("tool_calls") or []):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ValueError(f"{where}.tool_calls[{j}] needs function.name")
                cid = c.get("id") or f"call_{i}_{j}"
                if not isinstance(cid, str):
                    raise ValueError(f"{where}.tool_calls[{j}].id must be a string")
                calls.append(ToolCall(cid, fn["name"],
                                      normalize_arguments(fn.get("arguments", "{}"))))
            out.append(Message("assistant", content, reasoning or None, tuple(calls)))
        elif role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise ValueError(f"{where}: tool messages need a string tool_call_id")
            out.append(Message("tool", content, tool_call_id=cid))
        elif role == "user":
            text, parts = _user_parts(m.get("content"), where, image_loader)
            out.append(Message(role, text, parts=parts))
        else:
            out.append(Message(role, content))
    return out


def _check_schema(schema, where: str) -> None:
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON Schema object")
    t = schema.get("type")
    types = t if isinstance(t, list) else [t] if t is not None else []
    for ty in types:
        if ty not in _SCHEMA_TYPES:
            raise ValueError(f"{where}.type {ty!r} is not a JSON Schema type {_SCHEMA_TYPES}")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise ValueError(f"{where}.properties must be an object")
        for k, v in props.items():
            _check_schema(v, f"{where}.properties.{k}")
    req = schema.get("required")
    if req is not None and (not isinstance(req, list) or not all(isinstance(r, str)
                                                                  for r in req)):
        raise ValueError(f"{where}.required must be a list of property names")
    if isinstance(schema.get("items"), dict):
        _check_schema(schema["items"], f"{where}.items")


def tools_from_openai(raw) -> list[Tool]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError("tools must be a list")
    out, seen = [], set()
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(
                t.get("function"), dict):
            raise ValueError(f"{where} must be {{'type': 'function', 'function': {{...}}}}")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise ValueError(f"{where}.function.name {name!r} must match {_TOOL_NAME.pattern}")
        if name in seen:
            raise ValueError(f"{where}: duplicate tool name {name!r}")
        seen.add(name)
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise ValueError(f"{where}.function.description must be a string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        _check_schema(params, f"{where}.function.parameters")
        if params.get("type", "object") != "object":
            raise ValueError(f"{where}.function.parameters must describe an object")
        out.append(Tool(name, desc, params))
    return out


def check_tool_choice(choice, tools: list[Tool]):
    """``auto`` / ``none`` / ``required`` / ``{"type": "function", "function": {"name"}}``."""
    if choice is None or choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise ValueError("tool_choice 'required' needs tools")
        return choice
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in {t.name for t in tools}:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        return choice
    raise ValueError(f"tool_choice must be 'auto', 'none', 'required' or a function object, "
                     f"got {choice!r}")


def check_history(messages: list[Message]) -> dict[int, tuple[int, int, ToolCall]]:
    """Every tool message answers an earlier call. Returns, for each tool message's index, the
    call it answers as ``(turn, index in that turn, call)``: the latest call with its id before
    it, so an id used twice (a client that trimmed its history, then got an id again) labels
    each result with the call it followed, not the last one."""
    calls: dict[str, tuple[int, int, ToolCall]] = {}
    answered: dict[int, tuple[int, int, ToolCall]] = {}
    for i, m in enumerate(messages):
        for j, c in enumerate(m.tool_calls):
            calls[c.id] = (i, j, c)
        if m.role == "tool":
            if m.tool_call_id not in calls:
                raise ValueError(f"messages[{i}]: tool_call_id {m.tool_call_id!r} answers no "
                                 f"earlier assistant tool call")
            answered[i] = calls[m.tool_call_id]
    return answered


MAX_CALL_NUMBER_DIGITS = 9  # a longer N is a client's own id, not one of ours


def call_number(call_id: str, name: str | None = None) -> int | None:
    """``N`` of a call id ``functions.NAME:N`` (of ``name`` when given; N of 1 to 9 ASCII
    digits, and ``N + 1`` too, so the id generated next is read as ours again), else None.
    ``str.isdigit`` alone also accepts ``"²"`` and 5,000-digit numbers, which ``int`` refuses
    or the next id would carry on."""
    head, _, tail = call_id.rpartition(":")
    ok = head == f"functions.{name}" if name is not None else head.startswith("functions.")
    digits = tail.isascii() and tail.isdigit() and len(tail) <= MAX_CALL_NUMBER_DIGITS
    return int(tail) if ok and digits and int(tail) < 10 ** MAX_CALL_NUMBER_DIGITS - 1 else None


def next_call_index(messages: list[Message]) -> int:
    """``N`` for the next generated call's id ``functions.NAME:N``: past every call in the
    history and past the largest ``N`` of its ids of that form, so a history whose old turns
    were trimmed does not get an id it still holds."""
    numbers = [call_number(c.id) for m in messages for c in m.tool_calls]
    return max([len(numbers)] + [n + 1 for n in numbers if n is not None])


# ---- the format interface ------------------------------------------------------------------

class OutputParser:
    """Incremental parser of generated ids: ``feed(id)`` returns events ``("reasoning", text)``,
    ``("content", text)`` or ``("tool_call", ToolCall)``; ``finish()`` the whole output."""

    def feed(self, token_id: int) -> list[tuple[str, object]]:
        raise NotImplementedError

    def flush(self) -> list[tuple[str, object]]:
        """Events for text held back (an incomplete UTF-8 tail), at the end of the output."""
        return []

    def finish(self) -> AssistantOutput:
        raise NotImplementedError


class ChatFormat:
    name: str

    def render(self, messages: list[Message], *, tools: list[Tool] = (), tool_choice=None,
               response_format=None, effort: str | None = None, thinking: bool = True,
               add_generation_prompt: bool = True) -> list[int]:
        raise NotImplementedError

    def parser(self, *, thinking: bool = True, strict: bool = False,
               first_call_index: int = 0) -> OutputParser:
        raise NotImplementedError

    @property
    def reasoning_end_ids(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def after_reasoning_ids(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def reasoning_exit_ids(self) -> tuple[int, ...]:
        """Ids that end the reasoning without its end marker, as the format's parser reads
        them (K2: a tool-call section opened inside the reasoning); none by default."""
        return ()

    @property
    def stop_ids(self) -> tuple[int, ...]:
        raise NotImplementedError

    def parse(self, ids, *, thinking: bool = True, strict: bool = True,
              first_call_index: int = 0) -> AssistantOutput:
        p = self.parser(thinking=thinking, strict=strict, first_call_index=first_call_index)
        for i in ids:
            p.feed(int(i))
        return p.finish()


def get_format(name: str, tokenizer) -> ChatFormat:
    """``"xtml"`` (K3, default) or ``"k2"``."""
    from kdsa.infer.k2_format import K2Format
    from kdsa.infer.xtml import XtmlFormat

    formats = {"xtml": XtmlFormat, "k2": K2Format}
    if name not in formats:
        raise ValueError(f"unknown chat format {name!r}; choose from {sorted(formats)}")
    return formats[name](tokenizer)
