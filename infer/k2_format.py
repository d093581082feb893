"""Kimi K2's chat format: ``<|im_*|>`` turns, ``<think>`` reasoning, tool-call sections.

From ``kimi_k3.md`` 6 (K2 / K2.5 / K2-Thinking template)::

    <|im_system|>system<|im_middle|>S<|im_end|>
    <|im_user|>user<|im_middle|>Q<|im_end|>
    <|im_assistant|>assistant<|im_middle|><think>R</think>A
      <|tool_calls_section_begin|><|tool_call_begin|>functions.get:0
      <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>
    <|im_end|>

Tool declarations are a ``tool_declare`` system turn (the OpenAI tool list as JSON); a tool
result is ``<|im_system|>tool<|im_middle|>## Return of ID\\nRESULT<|im_end|>``. Across turns
(K2-Thinking) reasoning is kept for the assistant turns after the last assistant turn without
tool calls (the tool loop in progress, which a user message inside it, such as the text beside
an Anthropic ``tool_result``, does not end); that turn and older ones get an empty
``<think></think>`` (the published template's ``last_non_tool_call_assistant_msg``). A trailing
assistant turn without a generation prompt (a training row's turn) is the turn in progress
and keeps its reasoning. Ours where the template has nothing: the effort level as a
``thinking_effort`` system turn, ``tool_choice`` and ``response_format`` as system turns of
those names, and the generation prompt ends with ``<think>`` when thinking (so the output
starts inside the reasoning, as with XTML).
"""

from __future__ import annotations

import codecs
import json

from kdsa.infer.budget import check_effort
from kdsa.infer.chat import (MALFORMED_CALL, AssistantOutput, ChatFormat,
                             MalformedOutputError, Message,
                             OutputParser, Tool, ToolCall, call_number, check_history,
                             loads_distinct_keys, media_span)

SYS, USER, ASST, MID, END = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>",
                             "<|im_middle|>", "<|im_end|>")
THINK, UNTHINK = "<think>", "</think>"
SEC_BEGIN, SEC_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                                   "<|tool_call_end|>")
_ALL = (SYS, USER, ASST, MID, END, THINK, UNTHINK, SEC_BEGIN, SEC_END, CALL_BEGIN, ARG_BEGIN,
        CALL_END)


class K2Format(ChatFormat):
    name = "k2"

    def __init__(self, tokenizer):
        for s in _ALL:
            tokenizer.special(s)
        self.tok = tokenizer

    @property
    def reasoning_end_ids(self):
        return (self.tok.special(UNTHINK),)

    @property
    def after_reasoning_ids(self):
        return ()

    @property
    def reasoning_exit_ids(self):  # the parser leaves the reasoning for a tool-call section
        return (self.tok.special(SEC_BEGIN),)

    @property
    def stop_ids(self):
        return (self.tok.special(END),)

    def render(self, messages, **kw) -> list[int]:
        return [t for _, ids in self._segments(messages, **kw) for t in ids]

    def render_text(self, messages, **kw) -> str:
        return "".join(t for t, _ in self._segments(messages, **kw))

    def _segments(self, messages: list[Message], *, tools: list[Tool] = (), tool_choice=None,
                  response_format=None, effort=None, thinking=True,
                  add_generation_prompt=True):
        """(readable text, ids) pairs; markup as specials, every given string as text."""
        tok = self.tok
        sp = lambda name: (name, [tok.special(name)])  # noqa: E731
        tx = lambda s: (s, tok.encode(s))  # noqa: E731
        answered = check_history(messages)  # tool message index -> the call it answers
        shown: dict[tuple[int, int], str] = {}  # (turn, index) -> the call's id as rendered
        free = 0  # past every N shown so far (a kept functions.f:1 and a renamed call: no clash)
        out = []

        def turn(opener, role, body):
            out.extend([sp(opener), tx(role), sp(MID), tx(body), sp(END)])

        if tools:
            turn(SYS, "tool_declare", json.dumps([t.to_openai() for t in tools],
                                                 ensure_ascii=False))
        if tool_choice is not None:
            turn(SYS, "tool_choice", tool_choice if isinstance(tool_choice, str)
                 else json.dumps(tool_choice, ensure_ascii=False))
        if response_format is not None:
            turn(SYS, "response_format", json.dumps(response_format, ensure_ascii=False))
        if thinking:
            turn(SYS, "thinking_effort", check_effort(effort))
        # the last final answer before the turn in progress (a trailing assistant turn of a
        # render without a generation prompt, as a training row ends, is in progress: its own
        # reasoning, and its loop's, are kept)
        trailing = (not add_generation_prompt and messages
                    and messages[-1].role == "assistant")
        done = messages[:-1] if trailing else messages
        answered_last = max((i for i, m in enumerate(done)
                             if m.role == "assistant" and not m.tool_calls), default=-1)
        for i, m in enumerate(messages):
            if m.parts:  # a user message with images (media_span) in order
                out.extend([sp(USER), tx(m.role), sp(MID)])
                for part in m.parts:
                    out.extend([tx(part)] if isinstance(part, str) else
                               [sp(v) if k == "special" else tx(v) for k, v in media_span(part)])
                out.append(sp(END))
            elif m.role in ("system", "user"):
                turn(SYS if m.role == "system" else USER, m.role, m.content)
            elif m.role == "tool":
                t, j, _ = answered[i]
                turn(SYS, "tool", f"## Return of {shown[(t, j)]}\n{m.content}")
            else:
                out.extend([sp(ASST), tx("assistant"), sp(MID)])
                if thinking:
                    keep = i > answered_last
                    out.extend([sp(THINK), tx((m.reasoning or "") if keep else ""),
                                sp(UNTHINK)])
                out.append(tx(m.content))
                if m.tool_calls:
                    out.append(sp(SEC_BEGIN))
                    for j, c in enumerate(m.tool_calls):
                        shown[(i, j)] = k2_call_id(c, free)
                        free = max(free, call_number(shown[(i, j)]) + 1)
                        out.extend([sp(CALL_BEGIN), tx(shown[(i, j)]), sp(ARG_BEGIN),
                                    tx(c.arguments), sp(CALL_END)])
                    out.append(sp(SEC_END))
                out.append(sp(END))
        if add_generation_prompt:
            out.extend([sp(ASST), tx("assistant"), sp(MID)])
            if thinking:
                out.append(sp(THINK))
        return out

    def parser(self, *, thinking=True, strict=False, first_call_index=0) -> "K2Parser":
        return K2Parser(self.tok, thinking=thinking, strict=strict,
                        first_call_index=first_call_index)


def k2_call_id(call: ToolCall, index: int) -> str:
    """The id K2 sees for ``call``: its own when it is ``functions.NAME:N`` of its name, else
    ``functions.NAME:index`` (``index`` past every N shown before it). K2 reads the function's
    name only from the id, and clients send their own ids (``call_abc``, ``toolu_...``): shown
    as they are, the history would lose which function was called."""
    if call_number(call.id, call.name) is not None:
        return call.id
    return f"functions.{call.name}:{index}"


def call_name(call_id: str) -> str:
    """``functions.NAME:IDX`` -> NAME (K2's call ids name the function)."""
    head = call_id.split(".", 1)[1] if call_id.startswith("functions.") else call_id
    name = head.rsplit(":", 1)[0]
    if not name:
        raise ValueError(f"tool call id {call_id!r} names no function")
    return name


class K2Parser(OutputParser):
    def __init__(self, tok, *, thinking: bool, strict: bool, first_call_index: int = 0):
        self.tok, self.strict = tok, strict
        self.free, self.shown = first_call_index, set()  # the render's numbering of calls
        self.sid = {s: tok.special(s) for s in _ALL}
        self.state = "reasoning" if thinking else "content"
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.buf = bytearray()
        self.call_id: str | None = None
        self.reasoning, self.content, self.calls, self.errors = [], [], [], []
        self.done = False

    def _error(self, msg):
        if self.strict:
            raise MalformedOutputError(msg)
        self.errors.append(msg)

    def _text(self, data: bytes, final: bool = False) -> list:
        text = self.decoder.decode(data, final=final)
        if not text:
            return []
        kind = "reasoning" if self.state == "reasoning" else "content"
        (self.reasoning if kind == "reasoning" else self.content).append(text)
        return [(kind, text)]

    def feed(self, token_id: int) -> list:
        if self.done:
            return []
        s, ev = self.sid, []
        if token_id == s[UNTHINK]:
            ev += self._text(b"", True)
            if self.state != "reasoning":
                self._error("</think> outside the reasoning")
            self.state = "content"
        elif token_id == s[THINK] and self.state == "content" and not self.content:
            self.state = "reasoning"
        elif token_id == s[SEC_BEGIN]:
            ev += self._text(b"", True)
            self.state = "section"
        elif token_id == s[CALL_BEGIN] and self.state == "section":
            self.state, self.buf = "call_id", bytearray()
        elif token_id == s[ARG_BEGIN] and self.state == "call_id":
            self.call_id = self.buf.decode("utf-8", errors="replace").strip()
            self.state, self.buf = "arguments", bytearray()
        elif token_id == s[CALL_END] and self.state == "arguments":
            ev += self._finish_call()
            self.state = "section"
        elif token_id == s[SEC_END] and self.state == "section":
            self.state = "content"
        elif token_id == s[END]:
            ev += self._text(b"", True)
            if self.state not in ("content", "reasoning"):
                self._error(f"message ended inside a tool-call section ({self.state})")
            self.done = True
        elif self.tok.is_special(token_id):
            self._error(f"unexpected {self.tok.special_name(token_id)} in state {self.state}")
        elif self.state in ("reasoning", "content"):
            ev += self._text(self.tok.token_bytes(token_id))
        elif self.state in ("call_id", "arguments"):
            self.buf += self.tok.token_bytes(token_id)
        elif self.tok.token_bytes(token_id).strip():
            self._error(f"text between tool calls: {self.tok.token_bytes(token_id)!r}")
        return ev

    def _finish_call(self) -> list:
        """The call as the model wrote it: ``arguments`` are its own text (checked to be one
        JSON object without repeated keys), not a re-serialisation, so the next turn's history
        renders the tokens it generated (``{"x":1.0}`` came back as ``{"x": 1.0}``); an id
        repeated within the message gets the next free ``functions.NAME:N``, so each result
        can be told apart."""
        raw = self.buf.decode("utf-8", errors="replace")
        try:
            name = call_name(self.call_id or "")
            args = loads_distinct_keys(raw)
            if not isinstance(args, dict):
                raise ValueError(f"arguments are a JSON {type(args).__name__}, not an object")
        except (ValueError, RecursionError) as e:  # RecursionError: nested past the stack
            self._error(f"{MALFORMED_CALL} {self.call_id!r}: {e}")
            return []
        call = ToolCall(self.call_id, name, raw)
        shown = k2_call_id(call, self.free)  # the id the next turn's render shows
        if shown in self.shown or any(c.id == call.id for c in self.calls):
            shown = f"functions.{name}:{self.free}"
            call = ToolCall(shown, name, raw)
        self.shown.add(shown)
        self.free = max(self.free, call_number(shown) + 1)
        self.calls.append(call)
        return [("tool_call", call)]

    def flush(self) -> list:
        return self._text(b"", True) if self.state in ("reasoning", "content") else []

    def finish(self) -> AssistantOutput:
        self.flush()
        return AssistantOutput("".join(self.reasoning), "".join(self.content),
                               tuple(self.calls), tuple(self.errors), self.done)
