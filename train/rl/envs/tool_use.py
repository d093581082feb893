"""A multi-turn tool-use environment: call a declared tool with valid JSON, use its result.

Task: "What is the code of WORD? Use the lookup tool." with one declared tool ``lookup``
(``{"word": string}``, required, no other keys). Codes come from a per-task code book (a
function of the seed, split and task index), so the answer cannot be known without the call.

Protocol (``max_turns`` assistant turns, default 3):

1. The assistant emits a tool call (the chat format's tool-call syntax, ``infer/k2_format.py``
   or ``infer/xtml.py``). The call is checked: tool name declared, arguments a JSON object
   matching the schema. Valid: the tool message carries the code of the requested word;
   invalid: it carries ``error: ...`` naming the problem. Either way the episode continues.
   A call the chat format cannot parse (arguments that are not a JSON object: the parser drops
   it, ``AssistantOutput.errors``) gets a user message ``error: ...`` with the parser's words,
   and the episode continues too (it used to count as the final answer, reward 0).
2. The assistant answers in plain content. Reward 1 when the content contains the code of the
   task's word as a number of its own (not inside a longer one: "473" is not 47) and a valid
   ``lookup`` of that word happened earlier in the episode, else 0.
   Running out of turns ends the episode with reward 0.

Per-domain metrics: ``valid_call`` (a valid call of the right word happened), ``correct``.
"""

from __future__ import annotations

import json
import random
import re

from kdsa.infer.chat import MALFORMED_CALL, AssistantOutput, Message, Tool, ToolCall
from kdsa.train.rl.envs.base import Environment, Outcome, Task, register_env

WORDS = ("cat", "dog", "sun", "map", "owl", "fig", "cup", "hat", "pen", "box")
LOOKUP = Tool("lookup", "Look up the code of a word.",
              {"type": "object", "properties": {"word": {"type": "string"}},
               "required": ["word"]})


@register_env("tool_lookup")
class ToolLookupEnv(Environment):
    def __init__(self, *, seed: int = 0, max_turns: int = 3, **kwargs):
        super().__init__(seed=seed, **kwargs)  # unknown options: the base class's error
        if not isinstance(max_turns, int) or max_turns < 2:
            raise ValueError(f"tool_lookup: max_turns must be an integer >= 2 (call, then "
                             f"answer), got {max_turns!r}")
        self.max_turns = max_turns

    def task(self, index: int, split: str = "train") -> Task:
        rng = random.Random(self.split_seed(split) * 1_000_003 + index)
        word = rng.choice(WORDS)
        book = {w: rng.randrange(10, 100) for w in WORDS}
        msgs = (Message("user", f"What is the code of {word}? Use the lookup tool."),)
        return Task(self.domain, index, msgs, tools=(LOOKUP,), data=(word, book))

    @staticmethod
    def check_call(call: ToolCall) -> tuple[str | None, str | None]:
        """``(word, None)`` for a valid call, ``(None, error)`` otherwise."""
        if call.name != LOOKUP.name:
            return None, f"error: unknown tool {call.name!r}; the tool is 'lookup'"
        try:
            args = json.loads(call.arguments)
        except json.JSONDecodeError as e:
            return None, f"error: arguments are not valid JSON ({e.msg})"
        if not isinstance(args, dict) or set(args) != {"word"} or not isinstance(
                args["word"], str):
            return None, 'error: arguments must be {"word": string}'
        return args["word"], None

    def respond(self, task: Task, output: AssistantOutput, history) -> Outcome:
        word, book = task.data
        turn = sum(m.role == "assistant" for m in history)
        looked_up = any(m.role == "tool" and m.content == str(book[word])
                        and _called(history, m.tool_call_id, word) for m in history)
        dropped = [e for e in output.errors if e.startswith(MALFORMED_CALL)]
        if output.tool_calls or dropped:
            if turn + 1 >= self.max_turns:
                return Outcome(0.0, metrics={"valid_call": float(looked_up), "correct": 0.0})
            results = []
            for call in output.tool_calls:
                w, err = self.check_call(call)
                text = err if err else (str(book[w]) if w in book else f"error: no code "
                                        f"for {w!r}")
                results.append(Message("tool", text, tool_call_id=call.id))
            results += [Message("user", f"error: {e}") for e in dropped]  # no call id to answer
            return Outcome(done=False, messages=tuple(results))
        code = re.search(rf"(?<!\d){book[word]}(?!\d)", output.content)  # a number of its own
        correct = looked_up and code is not None
        return Outcome(float(correct), metrics={"valid_call": float(looked_up),
                                                "correct": float(correct)})

    def demonstration(self, task: Task) -> list[Message]:
        word, book = task.data
        call = ToolCall("functions.lookup:0", "lookup", json.dumps({"word": word}))
        return [Message("assistant", "", reasoning="", tool_calls=(call,)),
                Message("tool", str(book[word]), tool_call_id=call.id),
                Message("assistant", str(book[word]), reasoning="")]


def _called(history, call_id: str, word: str) -> bool:
    for m in history:
        for c in m.tool_calls:
            if c.id == call_id:
                return ToolLookupEnv.check_call(c)[0] == word
    return False
