"""Thinking budgets: effort levels ``low`` / ``high`` / ``max`` and a hard reasoning-token cap.

The level is told to the model in the prompt (K3 carries ``thinking_effort`` as a typed system
message, ``kimi_k3.md`` 6; see ``chat.py``) and caps the reasoning tokens (``rl_and_serving.md``
2.4, recommended recipe point 3, as NVIDIA NIM's ``max_thinking_tokens``): when a request has
produced ``cap`` reasoning tokens the engine waits at most ``grace`` more tokens for a sentence
boundary (the last non-space character one of ``.!?`` and their full-width forms, or a newline),
then forces the format's end-of-thinking marker (XTML: ``<|close|>think<|sep|>`` followed by
``<|open|>response<|sep|>``; K2: ``</think>``) and lets the model answer. So a request's
reasoning never exceeds ``cap + grace`` tokens. A marker the model had started (a prefix of it
at the end of the output) is completed rather than repeated. A format's exit token (K2's
tool-call section opened inside the reasoning, which its parser reads as the reasoning's end)
ends the reasoning too: nothing is forced after it.

The same controller serves RL rollouts and the server: one cap per level, configurable.
"""

from __future__ import annotations

import dataclasses

EFFORTS = ("low", "high", "max")
DEFAULT_EFFORT = "max"
DEFAULT_CAPS = {"low": 2048, "high": 8192, "max": 32768}
BOUNDARY_CHARS = frozenset(".!?。！？")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BudgetConfig:
    """Reasoning-token cap per effort level (``None`` = no cap) and the grace window."""

    caps: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_CAPS))
    grace: int = 32

    def __post_init__(self):
        if set(self.caps) != set(EFFORTS):
            raise ValueError(f"budget caps must name exactly {EFFORTS}, got {sorted(self.caps)}")
        for level, cap in self.caps.items():
            if cap is not None and (not isinstance(cap, int) or cap < 0):
                raise ValueError(f"budget cap for {level!r} must be an int >= 0 or None, "
                                 f"got {cap!r}")
        if not isinstance(self.grace, int) or self.grace < 0:
            raise ValueError(f"budget grace must be an int >= 0, got {self.grace!r}")

    def cap(self, effort: str | None) -> int | None:
        return self.caps[check_effort(effort)]


def check_effort(effort: str | None) -> str:
    """``None`` -> the default (``max``); an unknown level is a ValueError."""
    if effort is None:
        return DEFAULT_EFFORT
    if effort not in EFFORTS:
        raise ValueError(f"unknown reasoning effort {effort!r}; choose from {EFFORTS}")
    return effort


class ThinkingBudget:
    """Per-request state: are we inside the reasoning span, how many tokens has it used, which
    tokens must be forced next.

    ``end_marker``: the token ids closing the reasoning span; ``after``: ids forced after a
    forced close (the answer opener); ``in_reasoning``: whether the prompt opened the span;
    ``exits``: ids that end the span without the marker (``ChatFormat.reasoning_exit_ids``).
    Call :meth:`observe` with every generated token (sampled or forced) and its text; it returns
    the ids to force next (empty when nothing is to be forced).
    """

    def __init__(self, *, cap: int | None, grace: int, end_marker: tuple[int, ...],
                 after: tuple[int, ...] = (), in_reasoning: bool = True,
                 exits: tuple[int, ...] = ()):
        if not end_marker:
            raise ValueError("a thinking budget needs a non-empty end-of-thinking marker")
        self.cap, self.grace = cap, grace
        self.end_marker, self.after = tuple(end_marker), tuple(after)
        self.exits = frozenset(exits)
        self.exited = False  # the reasoning ended at an exit token (no answer opened)
        self.in_reasoning = in_reasoning
        self.reasoning_tokens = 0
        self.forced_close = False
        self._recent: list[int] = []  # last len(end_marker) tokens
        self._boundary = False
        self._closing = False

    def start(self) -> list[int]:
        """Ids to force before the first generated token (a zero cap closes at once)."""
        if self.in_reasoning and self.cap == 0:
            self._closing = self.forced_close = True
            return list(self.end_marker) + list(self.after)
        return []

    def observe(self, token_id: int, text: str = "", partial: bool = False) -> list[int]:
        """``partial``: the output so far ends inside a character (the decoder holds bytes of
        it): no close there, or the reasoning would end in half a character."""
        if not self.in_reasoning:
            return []
        if token_id in self.exits and not self._closing:  # e.g. straight into a tool call
            self.in_reasoning, self.exited = False, True
            return []
        self._recent = (self._recent + [token_id])[-len(self.end_marker):]
        if tuple(self._recent) == self.end_marker:
            self.in_reasoning = False
            if not self._closing:  # the model's own marker: its first tokens were counted
                self.reasoning_tokens -= len(self.end_marker) - 1
            return []
        if self._closing:
            return []
        self.reasoning_tokens += 1
        stripped = text.rstrip(" \t")
        if "\n" in text:
            self._boundary = True
        elif stripped:
            self._boundary = stripped[-1] in BOUNDARY_CHARS
        if partial:
            self._boundary = False
        if self.cap is None or self.reasoning_tokens < self.cap:
            return []
        if self._boundary or self.reasoning_tokens >= self.cap + self.grace:
            self._closing = self.forced_close = True
            return list(self.end_marker[self._marker_prefix():]) + list(self.after)
        return []

    def _marker_prefix(self) -> int:
        """Length of the longest prefix of the end marker that the output already ends with."""
        for n in range(min(len(self._recent), len(self.end_marker) - 1), 0, -1):
            if tuple(self._recent[-n:]) == self.end_marker[:n]:
                return n
        return 0
