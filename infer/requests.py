"""What the batching engine takes and gives: requests, their results and events, the
failures it reports, and the per-slot state of a running request (``infer/engine.py``).

``Request`` (prompt ids, sampling, thinking budget, parser, tool-choice forcing and bans,
images) goes in through ``Engine.submit``; every sampled token comes back as an ``Event`` to
``Request.on_event`` and the last one carries the ``Completion`` (ids, log-probs, text, parsed
output, finish reason, timings, routing record, error).
"""

from __future__ import annotations

import codecs
import collections
import copy
import dataclasses
import itertools
import time
from typing import Callable

import numpy as np

from kdsa.infer.budget import ThinkingBudget
from kdsa.infer.sampling import SamplingParams

_ids = itertools.count()


class EngineDead(RuntimeError):
    """The engine stopped for good (``Engine.failure`` says why); it takes no more requests."""


class GenerationError(RuntimeError):
    """:meth:`Engine.generate` could not complete some requests (``Completion.error``)."""


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


@dataclasses.dataclass
class Request:
    prompt: list[int]
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    reasoning_cap: int | None = None  # thinking budget (None: no cap)
    in_reasoning: bool = False  # the prompt opened the reasoning span
    # a budget to continue instead of a new one from ``reasoning_cap`` (RL's partial rollouts:
    # a turn cut mid-way, its budget replayed over the turn so far, a grace window included);
    # copied, and nothing is forced at the start; the Completion's ``reasoning_tokens`` then
    # counts the earlier part too
    budget: ThinkingBudget | None = None
    # the bytes of a character the output so far ends inside (a turn continued after a cut in
    # the middle of one): the engine's text decoder starts holding them, as the uncut turn's did
    pending_utf8: bytes = b""
    parser: object | None = None  # a chat OutputParser (None: raw text)
    request_id: str = dataclasses.field(default_factory=lambda: f"req-{next(_ids)}")
    on_event: Callable[["Event"], None] | None = None
    answer_prefix: tuple[int, ...] = ()  # forced at the start of the answer (tool_choice)
    banned_token_ids: tuple[int, ...] = ()  # never sampled (tool_choice "none"); forced ok
    images: list = dataclasses.field(default_factory=list)  # patched images, prompt order


@dataclasses.dataclass
class RequestMetrics:
    arrival: float
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None

    @property
    def queue_s(self) -> float:
        return (self.admitted or self.arrival) - self.arrival

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclasses.dataclass
class Completion:
    request_id: str
    prompt_tokens: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    text: str  # content (with a parser) or raw text, cut at a stop string
    output: object | None  # the parser's AssistantOutput, content cut like text
    finish_reason: str  # stop | length | abort (cancelled, or failed: then ``error`` is set)
    reasoning_tokens: int
    forced_close: bool
    metrics: RequestMetrics
    # runner.record_routing: experts used per token the model ran (prompt, then every sampled
    # token fed back) [n, L_moe, k] int32 (RL routing replay); None otherwise
    routing: np.ndarray | None = None
    error: str | None = None  # why the request failed (finish_reason "abort"); None otherwise

    @property
    def tokens_per_s(self) -> float:
        m = self.metrics
        dt = (m.finished or 0) - (m.first_token or 0)
        return (len(self.token_ids) - 1) / dt if dt > 0 else 0.0


@dataclasses.dataclass
class Event:
    request_id: str
    token_id: int | None
    logprob: float | None
    top_logprobs: list[tuple[int, float]]
    deltas: list[tuple[str, object]]  # (reasoning|content|text|tool_call, value)
    completion: Completion | None = None  # set on the last event


class _Active:
    """A request in a slot."""

    def __init__(self, req: Request, seed: int, engine):  # engine: the Engine it runs in
        self.req, self.seed = req, seed
        sp = req.sampling
        self.metrics = RequestMetrics(time.perf_counter())
        self.feed = req.prompt  # what prefill runs: the prompt, after a preemption + tokens
        self.prefilled = 0  # tokens of ``feed`` in the cache
        self.admitted = 0  # the engine's admission count when it last got a slot
        self.preemptions = 0
        self.pages: list[int] = []  # paged cache: the pool pages this request holds
        self.part = 0  # ... in this partition of the pool (a mesh's batch device group)
        self.page_keys: list[bytes] = []  # prefix cache: the prompt's page hash chain
        self.key_items: list = []  # prefix cache: its token ids, images by content
        self.fed_keys = None  # prefix cache: (len(tokens), items fed, their page keys)
        self.branch: int | None = None  # prefix cache: the page to snapshot at, a branch point
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.forced: collections.deque[int] = collections.deque()
        self.stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else engine.eos_ids)
        self.budget = None
        if engine.reasoning_end_ids and req.in_reasoning:
            if req.budget is not None:  # a cut turn's budget goes on: nothing forced at start
                self.budget = copy.deepcopy(req.budget)
            else:
                self.budget = ThinkingBudget(cap=req.reasoning_cap, grace=engine.budgets.grace,
                                             end_marker=engine.reasoning_end_ids,
                                             after=engine.after_reasoning_ids,
                                             in_reasoning=True, exits=engine.reasoning_exit_ids)
                self.forced.extend(self.budget.start())
        # tool_choice: ids forced once the answer starts (at once when the prompt opened it)
        self.prefix = tuple(req.answer_prefix)
        self.open_answer = self.budget is not None and bool(self.prefix or req.banned_token_ids)
        if self.prefix and self.budget is None:
            self.forced.extend(self.prefix)
            self.prefix = ()
        self.raw = codecs.getincrementaldecoder("utf-8")(errors="replace")
        if req.pending_utf8:
            self.raw.setstate((bytes(req.pending_utf8), 0))
        self.text = ""  # content / raw text so far
        self.sent = 0  # characters of text already emitted
        self.hold = max((len(s) for s in sp.stop), default=1) - 1
        self.finish_reason: str | None = None
        self.features = None  # [image tokens, D] once encoded
        self.feature_index = None  # [prompt] feature row per placeholder position, -1 elsewhere
        self.routing: list[np.ndarray] = []  # runner.record_routing: [n, L_moe, k] per step
