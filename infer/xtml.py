"""Kimi K3's "XTML" chat format: render conversations, parse model output (``kimi_k3.md`` 6).

Four specials carry the structure: ``<|open|>NAME attrs<|sep|>`` opens an element,
``<|close|>NAME<|sep|>`` closes it, ``<|end_of_msg|>`` ends a message (the EOS). Tag names and
attributes are ordinary text tokens; every user-supplied string is encoded as text (never as
specials), each segment on its own. Rendered::

    <|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>R<|close|>think<|sep|>
      <|open|>response<|sep|>A<|close|>response<|sep|>
      <|open|>tools<|sep|><|open|>call tool="get" index="1"<|sep|>
        <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
      <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>

Choices where the public facts stop (ours): typed system messages (``type="tools"`` with the
OpenAI tool list as JSON, ``tool_choice``, ``response_format``, ``thinking_effort``) follow the
leading system messages; a tool result is ``message role="tool" tool="NAME" index="I"``, the
name and 1-based index of the call it answers (found through ``tool_call_id``); attribute values
escape ``&`` and ``"`` as ``&amp;`` ``&quot;``; arguments that are not a JSON object go in one
raw ``json`` element. Parsed tool calls get ids ``functions.NAME:N`` (N counts calls across the
conversation, starting at ``first_call_index``).

Thinking on: every assistant turn carries its think element (empty when the client did not send
the reasoning back) and the generation prompt opens ``think``; off: no think elements and the
prompt opens ``response``.
"""

from __future__ import annotations

import codecs
import json
import re

from kdsa.infer.budget import check_effort
from kdsa.infer.chat import (MALFORMED_CALL, AssistantOutput, ChatFormat,
                             MalformedOutputError, Message,
                             OutputParser, Tool, ToolCall, check_history, DISTINCT_KEYS,
                             loads_distinct_keys, media_span)

OPEN, CLOSE, SEP, EOM = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
_ATTR = re.compile(r'([A-Za-z_][\w\-]*)="([^"]*)"')
_ARG_TYPES = {str: "string", bool: "boolean", int: "number", float: "number",
              type(None): "null", dict: "object", list: "array"}


def _esc(v: str) -> str:
    return v.replace("&", "&amp;").replace('"', "&quot;")


def _unesc(v: str) -> str:
    return v.replace("&quot;", '"').replace("&amp;", "&")


class _Builder:
    """Token ids and their readable text, built segment by segment."""

    def __init__(self, tok):
        self.tok, self.ids, self.parts = tok, [], []

    def special(self, name: str) -> "_Builder":
        self.ids.append(self.tok.special(name))
        self.parts.append(name)
        return self

    def text(self, s: str) -> "_Builder":
        self.ids.extend(self.tok.encode(s))
        self.parts.append(s)
        return self

    def open(self, header: str) -> "_Builder":
        return self.special(OPEN).text(header).special(SEP)

    def close(self, name: str) -> "_Builder":
        return self.special(CLOSE).text(name).special(SEP)

    def element(self, header: str, body: str) -> "_Builder":
        return self.open(header).text(body).close(header.split(" ", 1)[0])


class XtmlFormat(ChatFormat):
    name = "xtml"

    def __init__(self, tokenizer):
        for s in (OPEN, CLOSE, SEP, EOM):
            tokenizer.special(s)  # a clear error when the tokenizer lacks K3's specials
        self.tok = tokenizer

    @property
    def reasoning_end_ids(self) -> tuple[int, ...]:
        return tuple(_Builder(self.tok).close("think").ids)

    @property
    def after_reasoning_ids(self) -> tuple[int, ...]:
        return tuple(_Builder(self.tok).open("response").ids)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.tok.special(EOM),)

    # ---- rendering ----
    def render(self, messages, *, tools=(), tool_choice=None, response_format=None,
               effort=None, thinking=True, add_generation_prompt=True) -> list[int]:
        return self.build(messages, tools=tools, tool_choice=tool_choice,
                          response_format=response_format, effort=effort, thinking=thinking,
                          add_generation_prompt=add_generation_prompt).ids

    def render_text(self, messages, **kw) -> str:
        return "".join(self.build(messages, **kw).parts)

    def build(self, messages: list[Message], *, tools: list[Tool] = (), tool_choice=None,
              response_format=None, effort=None, thinking=True,
              add_generation_prompt=True) -> _Builder:
        answered = check_history(messages)  # tool message index -> the call it answers
        b = _Builder(self.tok)
        n_lead = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
        for m in messages[:n_lead]:
            self._message(b, m, None, thinking)
        if tools:
            self._typed(b, "tools", json.dumps([t.to_openai() for t in tools],
                                               ensure_ascii=False))
        if tool_choice is not None:
            self._typed(b, "tool_choice", tool_choice if isinstance(tool_choice, str)
                        else json.dumps(tool_choice, ensure_ascii=False))
        if response_format is not None:
            self._typed(b, "response_format", json.dumps(response_format, ensure_ascii=False))
        if thinking:
            self._typed(b, "thinking_effort", check_effort(effort))
        for i, m in enumerate(messages[n_lead:], n_lead):
            self._message(b, m, answered.get(i), thinking)
        if add_generation_prompt:
            b.open('message role="assistant"').open("think" if thinking else "response")
        return b

    def _typed(self, b: _Builder, kind: str, body: str) -> None:
        b.element(f'message role="system" type="{_esc(kind)}"', body).special(EOM)

    def _message(self, b: _Builder, m: Message, answers, thinking: bool) -> None:
        if m.role == "tool":  # answers: (turn, index, call) of the call it answers
            _, j, call = answers
            b.open(f'message role="tool" tool="{_esc(call.name)}" index="{j + 1}"')
            b.text(m.content)
        elif m.role == "assistant":
            b.open('message role="assistant"')
            if thinking:
                b.element("think", m.reasoning or "")
            b.element("response", m.content)
            if m.tool_calls:
                b.open("tools")
                for j, c in enumerate(m.tool_calls):
                    self._call(b, c, j + 1)
                b.close("tools")
        else:
            b.open(f'message role="{m.role}"')
            for part in m.parts or (m.content,):  # text and images (media_span) in order
                if isinstance(part, str):
                    b.text(part)
                else:
                    for kind, v in media_span(part):
                        b.special(v) if kind == "special" else b.text(v)
        b.close("message").special(EOM)

    def _call(self, b: _Builder, c: ToolCall, index: int) -> None:
        b.open(f'call tool="{_esc(c.name)}" index="{index}"')
        items = object_items(c.arguments)
        if items is not None:
            for k, v, raw in items:  # a number as written (1e3, 2.50), not re-serialised
                ty = _ARG_TYPES[type(v)]
                b.element(f'argument key="{_esc(k)}" type="{ty}"', v if ty == "string" else raw)
        else:
            b.element("json", c.arguments)
        b.close("call")

    # ---- parsing ----
    def parser(self, *, thinking=True, strict=False, first_call_index=0) -> "XtmlParser":
        return XtmlParser(self.tok, thinking=thinking, strict=strict,
                          first_call_index=first_call_index)


_CHILDREN = {"message": ("think", "response", "tools"), "tools": ("call",),
             "call": ("argument", "json"), "think": (), "response": (), "argument": (),
             "json": ()}
_TEXT = {"think": "reasoning", "response": "content"}


_JSON_WS = re.compile(r"[ \t\n\r]*")


def object_items(text: str) -> list[tuple[str, object, str]] | None:
    """``(key, value, value's own text)`` of a JSON object's members in order, or None when
    ``text`` is not one JSON object with distinct keys. The value's text is what the JSON
    holds (``1e3``, ``2.50``, ``{"a":1}``), so a call renders as the model wrote it: with the
    whitespace around it, but for the one space after the colon that the parser's arguments
    put there (``"key": TEXT``)."""
    ws = lambda i: _JSON_WS.match(text, i).end()  # noqa: E731
    try:
        i = ws(0)
        if text[i:i + 1] != "{":
            return None
        items, i = [], ws(i + 1)
        while text[i:i + 1] != "}":
            if items:
                if text[i:i + 1] != ",":
                    return None
                i = ws(i + 1)
            if text[i:i + 1] != '"':
                return None
            key, i = json.decoder.scanstring(text, i + 1)
            i = ws(i)
            if text[i:i + 1] != ":":
                return None
            start = i + 1 + (text[i + 1:i + 2] == " ")  # the value's text, its own spaces in
            i = ws(i + 1)
            value, end = DISTINCT_KEYS.raw_decode(text, i)  # repeated keys inside: None
            i = ws(end)
            items.append((key, value, text[start:i]))
        if ws(i + 1) != len(text) or len({k for k, _, _ in items}) != len(items):
            return None
        return items
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's stack
        return None


class _Frame:
    def __init__(self, name: str, attrs: dict):
        self.name, self.attrs = name, attrs
        self.buf = bytearray()
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.args: dict = {}  # key -> the value's JSON text
        self.raw: str | None = None
        self.bad: str | None = None


class XtmlParser(OutputParser):
    """Token-level state machine over the assistant message the generation prompt opened."""

    def __init__(self, tok, *, thinking: bool, strict: bool, first_call_index: int = 0):
        self.tok, self.strict = tok, strict
        self.ids = {s: tok.special(s) for s in (OPEN, CLOSE, SEP, EOM)}
        self.stack = [_Frame("message", {"role": "assistant"}),
                      _Frame("think" if thinking else "response", {})]
        self.mode, self.tag = "body", bytearray()
        self.reasoning, self.content, self.calls, self.errors = [], [], [], []
        self.next_call = first_call_index
        self.done = False

    def _error(self, msg: str) -> None:
        if self.strict:
            raise MalformedOutputError(msg)
        self.errors.append(msg)

    def feed(self, token_id: int) -> list:
        if self.done:
            return []
        ev: list = []
        ids = self.ids
        if token_id == ids[OPEN] or token_id == ids[CLOSE]:
            if self.mode != "body":
                self._error(f"markup token inside a tag name ({bytes(self.tag)!r})")
            self.mode = "open" if token_id == ids[OPEN] else "close"
            self.tag = bytearray()
        elif token_id == ids[SEP]:
            name = bytes(self.tag).decode("utf-8", errors="replace").strip()
            if self.mode == "open":
                self._push(name)
            elif self.mode == "close":
                ev += self._pop(name)
            else:
                self._error("<|sep|> outside a tag")
            self.mode = "body"
        elif token_id == ids[EOM]:
            self.done = True
        elif self.tok.is_special(token_id):
            self._error(f"unexpected special token {self.tok.special_name(token_id)} in output")
        elif self.mode != "body":
            self.tag += self.tok.token_bytes(token_id)
        else:
            ev += self._body(self.tok.token_bytes(token_id))
        return ev

    def _push(self, header: str) -> None:
        name, _, rest = header.partition(" ")
        attrs = {k: _unesc(v) for k, v in _ATTR.findall(rest)}
        parent = self.stack[-1].name if self.stack else None
        if parent is None or name not in _CHILDREN.get(parent, ()):
            self._error(f"element {name!r} may not appear inside {parent!r}")
        frame = _Frame(name, attrs)
        if name == "call" and not attrs.get("tool"):
            frame.bad = f"tool call without a tool name ({header!r})"
        self.stack.append(frame)

    def _pop(self, name: str) -> list:
        if not self.stack or self.stack[-1].name != name:
            self._error(f"closing {name!r} but {self.stack[-1].name if self.stack else None!r} "
                        f"is open")
            if not any(f.name == name for f in self.stack):
                return []
            while self.stack[-1].name != name:
                self.stack.pop()
        f = self.stack.pop()
        parent = self.stack[-1] if self.stack else None
        ev = []
        if f.name in _TEXT:
            text = f.decoder.decode(b"", final=True)
            ev += self._emit(f.name, text)
        elif f.name == "argument" and parent is not None and parent.name == "call":
            self._argument(f, parent)
        elif f.name == "json" and parent is not None and parent.name == "call":
            parent.raw = f.buf.decode("utf-8", errors="replace")
        elif f.name == "call":
            ev += self._finish_call(f)
        return ev

    def _argument(self, f: _Frame, call: _Frame) -> None:
        key, ty = f.attrs.get("key"), f.attrs.get("type", "string")
        text = f.buf.decode("utf-8", errors="replace")
        if key is None:
            call.bad = call.bad or "argument without a key"
            return
        if key in call.args:
            call.bad = call.bad or f"argument {key!r} given twice"
            return
        if ty == "string":
            call.args[key] = json.dumps(text, ensure_ascii=False)
            return
        try:
            value = loads_distinct_keys(text)  # (a repeated nested key: a malformed call)
        except (ValueError, RecursionError):
            value = _Bad
        want = {"number": (int, float), "boolean": (bool,), "null": (type(None),),
                "object": (dict,), "array": (list,)}.get(ty)
        if want is None:
            call.bad = call.bad or f"argument {key!r} has unknown type {ty!r}"
        elif value is _Bad or not isinstance(value, want) or (ty == "number" and
                                                               isinstance(value, bool)):
            call.bad = call.bad or f"argument {key!r} of type {ty} has value {text[:40]!r}"
        else:
            call.args[key] = text  # as written: 1e3 stays 1e3 in the arguments and the history

    def _finish_call(self, f: _Frame) -> list:
        name = f.attrs.get("tool", "")
        if f.raw is not None and f.args:
            f.bad = f.bad or "tool call mixes argument and json elements"
        if f.raw is not None:
            try:
                loads_distinct_keys(f.raw)
            except (ValueError, RecursionError):
                f.bad = f.bad or f"json element is not valid JSON: {f.raw[:40]!r}"
        if f.bad:
            self._error(f"{MALFORMED_CALL} {name!r}: {f.bad}")
            return []
        args = f.raw if f.raw is not None else "{" + ", ".join(  # each value's JSON text
            f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in f.args.items()) + "}"
        call = ToolCall(f"functions.{name}:{self.next_call}", name, args)
        self.next_call += 1
        self.calls.append(call)
        return [("tool_call", call)]

    def _body(self, data: bytes) -> list:
        f = self.stack[-1] if self.stack else None
        if f is None:
            self._error("text after the message was closed")
            return []
        if f.name in _TEXT:
            return self._emit(f.name, f.decoder.decode(data))
        if f.name in ("argument", "json"):
            f.buf += data
            return []
        if data.strip():
            self._error(f"text {data[:20]!r} directly inside {f.name!r}")
        return []

    def _emit(self, name: str, text: str) -> list:
        if not text:
            return []
        kind = _TEXT[name]
        (self.reasoning if kind == "reasoning" else self.content).append(text)
        return [(kind, text)]

    def flush(self) -> list:
        """Events for text still held by open elements (truncated output)."""
        ev = []
        for f in self.stack:
            if f.name in _TEXT:
                ev += self._emit(f.name, f.decoder.decode(b"", final=True))
        return ev

    def finish(self) -> AssistantOutput:
        self.flush()
        if self.strict and self.stack and self.done:
            raise MalformedOutputError(f"message ended with {[f.name for f in self.stack]} open")
        return AssistantOutput("".join(self.reasoning), "".join(self.content),
                               tuple(self.calls), tuple(self.errors), self.done)


_Bad = object()
