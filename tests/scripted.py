"""A deterministic stand-in for the model runner: it "writes" a scripted assistant turn.

Random-weight models produce random tokens, so end-to-end checks of thinking budgets, tool calls
and stop handling drive the engine with this runner instead (same interface as
``runner.ModelRunner``: ``prefill(slot, tokens, start)``, ``decode(tokens, positions, active)``,
``num_slots``, ``max_len``, ``vocab_size``, ``prefill_chunk``). Its logits put all weight on
the next token of a script that depends only on what the slot has seen:

* prompt ending inside ``think`` (the generation prompt opened the reasoning): reasoning text
  (``reasoning`` repeated, for ``reasoning_tokens`` tokens, or without end when ``None``), then
  the format's end-of-thinking marker, then ``answer`` (which starts with the answer opener);
* after an end-of-thinking marker (the model's or a forced one): the rest of ``answer``;
* prompt opening the answer directly (thinking off): ``answer`` without its opener.

After the script it repeats ``eos``.
"""

from __future__ import annotations

import numpy as np


class ScriptedRunner:
    def __init__(self, tokenizer, chat_format, *, answer_ids: list[int],
                 reasoning: str = "Hmm, let me think about it some more. ",
                 reasoning_tokens: int | None = None, num_slots: int = 4, max_len: int = 4096,
                 prefill_chunk: int = 64):
        self.tok, self.fmt = tokenizer, chat_format
        self.vocab_size = tokenizer.vocab_size
        self.num_slots, self.max_len, self.prefill_chunk = num_slots, max_len, prefill_chunk
        self.mesh = None
        self.close = list(chat_format.reasoning_end_ids)
        self.opener = list(chat_format.after_reasoning_ids)
        self.answer = list(answer_ids)
        self.reason_unit = tokenizer.encode(reasoning)
        self.reasoning_tokens = reasoning_tokens
        self.eos = chat_format.stop_ids[0]
        from kdsa.infer.chat import Message
        probe = [Message("user", "x")]
        with_gen = chat_format.render(probe, thinking=True)
        self.think_prompt = with_gen[len(chat_format.render(probe, thinking=True,
                                                            add_generation_prompt=False)):]
        self.seen: list[list[int]] = [[] for _ in range(num_slots)]
        self.prompt_len = [0] * num_slots
        self.thinking = [False] * num_slots
        self.calls = {"prefill": 0, "decode": 0}

    def _next(self, slot: int) -> int:
        g = self.seen[slot][self.prompt_len[slot]:]
        if not self.thinking[slot]:
            rest = self.answer[len(self.opener):]
            return rest[len(g)] if len(g) < len(rest) else self.eos
        j = _find(g, self.close)
        if j is None:
            k = len(g)
            if self.reasoning_tokens is not None and k >= self.reasoning_tokens:
                return self.close[k - self.reasoning_tokens]
            return self.reason_unit[k % len(self.reason_unit)]
        m = len(g) - (j + len(self.close))
        return self.answer[m] if m < len(self.answer) else self.eos

    def _logits(self, slots) -> np.ndarray:
        out = np.zeros((len(slots), self.vocab_size), np.float32)
        for r, s in enumerate(slots):
            if s is not None:
                out[r, self._next(s)] = 20.0
        return out

    def prefill(self, slot: int, tokens, start: int = 0) -> np.ndarray:
        self.calls["prefill"] += 1
        if start == 0:
            self.seen[slot] = []
        self.seen[slot] += [int(t) for t in tokens]
        self.prompt_len[slot] = len(self.seen[slot])
        n = len(self.think_prompt)
        self.thinking[slot] = self.seen[slot][-n:] == self.think_prompt
        return self._logits([slot])

    def decode(self, tokens, positions, active) -> np.ndarray:
        self.calls["decode"] += 1
        for s in range(self.num_slots):
            if active[s]:
                self.seen[s].append(int(tokens[s]))
        return self._logits([s if active[s] else None for s in range(self.num_slots)])


def _find(seq: list[int], pat: list[int]) -> int | None:
    n = len(pat)
    for i in range(len(seq) - n + 1):
        if seq[i:i + n] == pat:
            return i
    return None


# ---------------------------------------------------------------------------------------------
# the HTTP tests' model (test_server.py, test_server_fuzz.py, test_serve_reliability.py)
# ---------------------------------------------------------------------------------------------

import json  # noqa: E402

from kdsa.infer.chat import Message, ToolCall, get_format  # noqa: E402
from kdsa.infer.tokenizer import ByteTokenizer  # noqa: E402

TOK = ByteTokenizer(384)
FMT = get_format("xtml", TOK)
CAPS, GRACE = {"low": 5, "high": 30, "max": 60}, 8
CALL = ToolCall("functions.get_weather:0", "get_weather", json.dumps({"city": "Paris"}))
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]


def _answer(content: str, calls=(), fmt=FMT) -> list[int]:
    gen = fmt.render([Message("user", "q")])
    full = fmt.render([Message("user", "q"), Message("assistant", content, "r", tuple(calls))],
                      add_generation_prompt=False)
    body, close = full[len(gen):], list(fmt.reasoning_end_ids)
    i = next(j for j in range(len(body)) if body[j:j + len(close)] == close)
    return body[i + len(close):]


class EosSecond(ScriptedRunner):
    """The scripted model, with ending the message as its second choice everywhere (logit
    ``EOS_LOGIT`` against 20 for the script and 0 for the rest): what it writes when its first
    choice is banned."""

    def _logits(self, slots):
        out = super()._logits(slots)
        out[:, self.eos] = np.maximum(out[:, self.eos], EOS_LOGIT)
        return out


EOS_LOGIT = 5.0


USER = [{"role": "user", "content": "Weather in Paris?"}]


class SeeingRunner(EosSecond):
    """The scripted model with a vision tower: image features are zeros; it counts the image
    positions each prefill was given."""

    def __init__(self, *a, **kw):
        import types

        from kdsa.model.config import get_preset

        super().__init__(*a, **kw)
        self.config = types.SimpleNamespace(vision_config=get_preset("tiny-vl").vision_config)
        self.image_positions = 0

    def encode_images(self, images):
        return np.zeros((sum(im.num_tokens for im in images), 8), np.float32)

    def prefill(self, slot, tokens, start=0, image_embeds=None, image_mask=None):
        self.image_positions += 0 if image_mask is None else int(image_mask.sum())
        return super().prefill(slot, tokens, start)
