"""Prometheus metrics of the HTTP server: ``GET /metrics`` (``docs/serving.md``, Metrics).

:class:`ServerMetrics` holds one app's metrics in its own ``CollectorRegistry`` (never the
process-global one, so several servers in one process keep apart). Two kinds:

* per finished engine request (one per choice), observed by ``server.run_job`` through
  :meth:`ServerMetrics.observe` on the event loop, labelled ``api`` (``openai`` /
  ``anthropic``) and ``effort`` (``low`` / ``high`` / ``max``, ``none`` with thinking off):
  the request count by finish reason, queue / TTFT / decode / per-token / end-to-end time,
  prompt / generated / reasoning / context tokens, tool-call rounds, thinking budgets that ran
  out (``kdsa_reasoning_forced_close_total``);
* read from ``Engine.metrics()`` at scrape time (:class:`EngineCollector`): whether the engine
  serves, queue length, active and total slots, the paged pool's pages (only with a paged
  cache), engine-wide token counters, and the prefix cache's counters when the engine reports
  a ``prefix_cache`` entry.

:func:`tool_rounds` defines the tool-call rounds of a request from its JSON body.
"""

from __future__ import annotations

import logging
import re

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("kdsa.serve")

LABELS = ("api", "effort")
FINISH_REASONS = ("stop", "length", "tool_calls", "abort", "error")
# seconds: first tokens and queues (short) / whole decodes (long, reasoning at max effort)
SHORT_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
           160.0, 320.0, 640.0)
LONG_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0,
          2560.0, 5120.0)
PER_TOKEN_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
TOKENS = (0, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144,
          524288, 1048576)
ROUNDS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 25, 32, 50, 64, 100, 128, 256)
CONTENT_TYPE = CONTENT_TYPE_LATEST


def api_of(path: str) -> str:
    """The API a request path belongs to: ``anthropic`` under ``/v1/messages``."""
    return "anthropic" if path == "/v1/messages" or path.startswith("/v1/messages/") \
        else "openai"


def effort_of(job) -> str:
    """A ``ChatJob`` 's effort label: its level, ``none`` when thinking is off."""
    return job.effort if job.thinking else "none"


def tool_rounds(body, api: str) -> int:
    """Tool-call rounds the request's history holds: its assistant turns that call at least one
    tool (OpenAI: a non-empty ``tool_calls``; Anthropic: a ``tool_use`` content block). Each is
    one round the client ran tools for and sent back; parallel calls in one turn are one
    round. 0 for a body that is not a dict of messages."""
    msgs = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(msgs, list):
        return 0
    n = 0
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") != "assistant":
            continue
        if api == "anthropic":
            blocks = m.get("content")
            n += isinstance(blocks, list) and any(
                isinstance(b, dict) and b.get("type") == "tool_use" for b in blocks)
        else:
            n += isinstance(m.get("tool_calls"), list) and bool(m["tool_calls"])
    return int(n)


def finish_label(completion, job) -> str:
    """``error`` (the engine failed it), ``abort`` (cancelled: the client left), ``tool_calls``
    (stopped on a tool call), else the engine's reason (``stop`` / ``length``)."""
    if completion.error is not None:
        return "error"
    out = completion.output
    if completion.finish_reason == "stop" and out is not None and out.tool_calls and \
            getattr(job, "tool_choice", None) != "none":
        return "tool_calls"
    return completion.finish_reason


class ServerMetrics:
    """One app's metrics: ``observe`` per finished request, ``render`` for ``/metrics``."""

    def __init__(self, engine, failure=lambda: None):
        self.registry = reg = CollectorRegistry()

        def hist(name, doc, buckets):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=reg)

        self.requests = Counter("kdsa_requests", "Finished engine requests (one per choice) by "
                                "finish reason", LABELS + ("finish_reason",), registry=reg)
        self.queue = hist("kdsa_request_queue_seconds", "Arrival to admission into a slot",
                          SHORT_S)
        self.ttft = hist("kdsa_request_ttft_seconds", "Arrival to the first sampled token "
                         "(queue and prefill included)", SHORT_S)
        self.decode = hist("kdsa_request_decode_seconds", "First sampled token to the last",
                           LONG_S)
        self.per_token = hist("kdsa_request_time_per_output_token_seconds", "Decode time per "
                              "generated token after the first", PER_TOKEN_S)
        self.e2e = hist("kdsa_request_e2e_seconds", "Arrival to finish", LONG_S)
        self.prompt = hist("kdsa_request_prompt_tokens", "Prompt length (tokens)", TOKENS)
        self.generated = hist("kdsa_request_generation_tokens", "Generated tokens (reasoning "
                              "and answer)", TOKENS)
        self.reasoning = hist("kdsa_request_reasoning_tokens", "Reasoning tokens", TOKENS)
        self.context = hist("kdsa_request_context_tokens", "Context length at the end: prompt "
                            "plus generated tokens", TOKENS)
        self.rounds = hist("kdsa_request_tool_rounds", "Tool-call rounds: assistant tool-call "
                           "turns in the history, plus one when this completion calls a tool",
                           ROUNDS)
        self.forced = Counter("kdsa_reasoning_forced_close", "Requests whose thinking budget "
                              "ran out (the end of thinking was forced)", LABELS, registry=reg)
        reg.register(EngineCollector(engine, failure))

    def observe(self, completion, job, *, api: str, history_rounds: int = 0) -> None:
        """Record one finished engine request (``completion``) of ``job``."""
        lab = {"api": api, "effort": effort_of(job)}
        finish = finish_label(completion, job)
        self.requests.labels(**lab, finish_reason=finish).inc()
        m, n = completion.metrics, len(completion.token_ids)
        self.queue.labels(**lab).observe(max(m.queue_s, 0.0))
        if m.first_token is not None:
            self.ttft.labels(**lab).observe(max(m.ttft_s, 0.0))
            if m.finished is not None:
                decode = max(m.finished - m.first_token, 0.0)
                self.decode.labels(**lab).observe(decode)
                if n > 1:
                    self.per_token.labels(**lab).observe(decode / (n - 1))
        if m.finished is not None:
            self.e2e.labels(**lab).observe(max(m.finished - m.arrival, 0.0))
        self.prompt.labels(**lab).observe(completion.prompt_tokens)
        self.generated.labels(**lab).observe(n)
        self.reasoning.labels(**lab).observe(completion.reasoning_tokens)
        self.context.labels(**lab).observe(completion.prompt_tokens + n)
        self.rounds.labels(**lab).observe(history_rounds + (finish == "tool_calls"))
        if completion.forced_close:
            self.forced.labels(**lab).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class EngineCollector:
    """Gauges and counters read from ``Engine.metrics()`` at every scrape."""

    PREFIX_COUNTERS = {"hit_tokens": "Prompt tokens served from the prefix cache",
                       "queried_tokens": "Prompt tokens looked up in the prefix cache"}

    def __init__(self, engine, failure=lambda: None):
        self.engine, self.failure = engine, failure

    def describe(self):
        return []  # families depend on the engine (paged pool, prefix cache): not fixed

    def collect(self):
        m = self.engine.metrics()
        yield GaugeMetricFamily("kdsa_engine_up", "1 while the engine serves, 0 once it has "
                                "stopped (see /health)", value=int(self.failure() is None))
        for key, doc in (("queue_length", "Requests waiting for a slot"),
                         ("active_slots", "Slots running a request"),
                         ("num_slots", "Slots of the engine (the batch size)")):
            if _number(m.get(key)):
                yield GaugeMetricFamily(f"kdsa_{key}", doc, value=m[key])
        for key, doc in (("generated_tokens", "Tokens sampled by the engine"),
                         ("prefill_tokens", "Prompt tokens the engine prefilled"),
                         ("preemptions", "Requests preempted for cache pages (run again by "
                          "recompute)")):
            if _number(m.get(key)):
                yield CounterMetricFamily(f"kdsa_engine_{key}", doc, value=m[key])
        cache = m.get("cache") or {}
        if cache.get("kind") == "paged":
            for key, name, doc in (
                    ("pages_used", "kdsa_cache_pages_used", "Pool pages held by requests"),
                    ("pages_free", "kdsa_cache_pages_free", "Pool pages free"),
                    ("pages_peak", "kdsa_cache_pages_peak", "The most pool pages held at once"),
                    ("pages_total", "kdsa_cache_pages_capacity", "Pool pages in all"),
                    ("page_size", "kdsa_cache_page_size_tokens", "Tokens per pool page")):
                if _number(cache.get(key)):
                    yield GaugeMetricFamily(name, doc, value=cache[key])
            if _number(cache.get("pages_total")) and cache["pages_total"] > 0 and \
                    _number(cache.get("pages_used")):
                yield GaugeMetricFamily("kdsa_cache_usage_ratio", "Pool pages used / total",
                                        value=cache["pages_used"] / cache["pages_total"])
        yield from self._prefix_cache(m.get("prefix_cache"))

    def _prefix_cache(self, pc):
        """``metrics()["prefix_cache"]``: ``hit_tokens`` / ``queried_tokens`` (either spelled
        with ``_total`` too) and any key ending in ``_total`` are counters
        ``kdsa_prefix_cache_<key>_total``; other numbers are gauges
        ``kdsa_prefix_cache_<key>``."""
        if not isinstance(pc, dict):
            return
        seen = set()
        for key, v in sorted(pc.items(), key=lambda kv: str(kv[0])):
            if not _number(v) or not isinstance(key, str) or not _NAME.fullmatch(key):
                continue
            base = key.removeprefix("prefix_cache_")
            counter = base.endswith("_total") or base in self.PREFIX_COUNTERS
            base = base.removesuffix("_total")
            name = f"kdsa_prefix_cache_{base}"
            if name in seen:  # hit_tokens and hit_tokens_total: one family
                continue
            seen.add(name)
            if counter:
                doc = self.PREFIX_COUNTERS.get(base, f"Prefix cache: {base}")
                yield CounterMetricFamily(name, doc, value=v)
            else:
                yield GaugeMetricFamily(name, f"Prefix cache: {base}", value=v)
