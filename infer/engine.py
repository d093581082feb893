"""Continuous batching over a fixed number of slots: requests, scheduling, stops, metrics.

Each :meth:`Engine.step`:

1. drops cancelled requests (a finished or cancelled request frees its slot at once);
2. moves waiting requests into free slots and prefills them chunk by chunk, at most
   ``prefill_tokens_per_step`` prompt tokens per step (at least one chunk), so running
   requests keep decoding while long prompts come in; while two or more slots have prompt
   left, one chunk of each runs in one batched step (``ModelRunner(batch_prefill=True)``,
   ``--batched-prefill``; one device, text only); a request whose last chunk is done samples its first token from the
   prefill logits;
3. runs one decode step for every slot that is generating (rows at their own positions) and
   samples each row with its own parameters and random stream (``sampling.py``).

The engine is four files: this one (the thread-safe API, the step loop, failures, metrics),
``engine_slots.py`` (admission, cancellation, prefill, decode, finishing a request, images),
``engine_pages.py`` (the paged cache's pages, the prefix cache, preemption; a pool per device
group on a mesh) and ``engine_tokens.py`` (sampling rows and applying each token: forced and
banned tokens, the chat parser, stops, events). :meth:`Engine.generate` is the batch API.

Failures (``docs/serving.md``, Reliability): no request stops the engine. An exception in one
request's work (image encoding, a prefill chunk, packing its sampling row, its parser, its
``on_event``) finishes that request with ``abort`` and ``Completion.error`` set; one in work
shared by a batch (the decode step, the sampler) finishes every request of that step the same
way. Their slots are freed (a new request's first prefill chunk zeroes its cache row), so later
requests are unaffected. When ``max_consecutive_failures`` (default 3) calls of one kind --
prefill, decode, the sampler, the step itself -- fail in a row with no success between, or the
serving loop ends by itself, the engine is dead: ``Engine.failure`` names why, every request
still held is aborted with that error, and :meth:`Engine.submit` raises :class:`EngineDead`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np

from kdsa.infer.budget import BudgetConfig
from kdsa.infer.engine_pages import PageScheduling
from kdsa.infer.engine_slots import SlotScheduling
from kdsa.infer.engine_tokens import TokenStep
from kdsa.infer.page_pool import PagePool, pages_needed
from kdsa.infer.prefix_cache import PrefixCache
from kdsa.infer.requests import (Completion, EngineDead, Event, GenerationError,  # noqa: F401
                                 Request, _Active, _describe)
from kdsa.infer.sampling import sample, sample_jit
from kdsa.model.paged_cache import PAGE_SIZE

log = logging.getLogger("kdsa.engine")


class Engine(SlotScheduling, PageScheduling, TokenStep):
    def __init__(self, runner, tokenizer, *, chat_format=None, budgets: BudgetConfig | None = None,
                 max_top_logprobs: int = 20, prefill_tokens_per_step: int | None = None,
                 seed: int = 0, max_banned_tokens: int = 4, max_consecutive_failures: int = 3,
                 prefix_snapshot_every: int = 4, prefix_cache: bool = True):
        self.runner, self.tok = runner, tokenizer
        self.max_failures = max_consecutive_failures
        self.failure: str | None = None  # set when the engine is dead (EngineDead)
        self._failures = collections.Counter()  # consecutive failures per kind of call
        self._dead = False  # ``die`` ran: every request it held is aborted
        self.budgets = budgets or BudgetConfig()
        self.reasoning_end_ids = tuple(chat_format.reasoning_end_ids) if chat_format else ()
        self.after_reasoning_ids = tuple(chat_format.after_reasoning_ids) if chat_format else ()
        self.reasoning_exit_ids = tuple(chat_format.reasoning_exit_ids) if chat_format else ()
        self.eos_ids = set(chat_format.stop_ids) if chat_format else {tokenizer.eos_id}
        self.num_top = max_top_logprobs
        self.max_banned = max_banned_tokens
        self.prefill_budget = prefill_tokens_per_step or 4 * runner.prefill_chunk
        self._rng = np.random.default_rng(seed)
        self._sample = sample_jit
        self._record_routing = getattr(runner, "record_routing", False)  # ModelRunner option
        if runner.mesh is not None:  # replicated results: every host reads the same tokens
            import jax
            from jax.sharding import NamedSharding, PartitionSpec
            self._sample = jax.jit(sample, static_argnames=("num_top",),
                                   out_shardings=NamedSharding(runner.mesh, PartitionSpec()))
        self._lock = threading.Condition()
        self._waiting: collections.deque[_Active] = collections.deque()
        self._cancel: set[str] = set()
        self.slots: list[_Active | None] = [None] * runner.num_slots
        self._admissions = 0  # requests given a slot so far (preemption takes the latest)
        # paged cache (infer/page_pool.py) and prefix cache (infer/prefix_cache.py): one pool
        # and one prefix cache per partition of the runner (a mesh's batch device groups,
        # model/paged_attention.py; one on one device), numbered within it
        parts = getattr(runner, "partitions", 1)
        num_pages = getattr(runner, "num_pages", None)
        snapshots = getattr(runner, "num_snapshots", 0) if prefix_cache else 0
        self.pools = [] if num_pages is None else [PagePool(num_pages // parts)
                                                   for _ in range(parts)]
        self.prefixes = [PrefixCache(pool, snapshots // parts, prefix_snapshot_every)
                         for pool in self.pools] if snapshots else []
        # where pages come from and go back to: the prefix cache (it evicts idle cached pages
        # for new ones) or the bare pool
        self.page_sources = self.prefixes or self.pools
        if self._record_routing and self.prefixes:
            raise ValueError("record_routing (RL routing replay) records the experts of every "
                             "token the model runs, and a prefix-cache hit runs no cached "
                             "token: build the runner with num_snapshots=0 or pass "
                             "prefix_cache=False")
        self.prefix_every = prefix_snapshot_every if self.prefixes else None
        self.stats = collections.Counter()
        self.started = time.perf_counter()

    @property
    def pages(self) -> PagePool | None:
        """The page pool on one device (None: dense slots); on a mesh see ``pools``."""
        return self._single(self.pools)

    @property
    def prefix(self) -> PrefixCache | None:
        """The prefix cache on one device (None: off); on a mesh see ``prefixes``."""
        return self._single(self.prefixes)

    @staticmethod
    def _single(items):
        if len(items) > 1:
            raise ValueError(f"the cache has {len(items)} partitions: use pools / prefixes")
        return items[0] if items else None

    def _part(self, i: int) -> int:
        """The partition of slot ``i`` (its pages, snapshots and device group)."""
        return self.runner.partition_of(i) if len(self.pools) > 1 else 0

    # ---- thread-safe API ----
    def submit(self, req: Request) -> str:
        """Queue a request (from any thread). Bad prompts raise ValueError here; a dead engine
        raises :class:`EngineDead`."""
        n, limit = len(req.prompt), self.runner.max_len
        if n < 1:
            raise ValueError("the prompt is empty")
        if n >= limit:
            raise ValueError(f"prompt of {n} tokens does not fit the context of {limit} tokens "
                             f"(at least one generated token is needed)")
        bad = [t for t in req.prompt if not 0 <= int(t) < self.runner.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} outside [0, {self.runner.vocab_size})")
        if req.images:
            self._check_images(req)
        banned = req.banned_token_ids
        if len(banned) > self.max_banned or any(
                not 0 <= int(t) < self.runner.vocab_size for t in banned):
            raise ValueError(f"banned_token_ids {tuple(banned)!r}: at most "
                             f"{self.max_banned} ids in [0, {self.runner.vocab_size})")
        if self.pools:
            need = pages_needed(n, req.sampling.max_tokens, limit)
            have = self.pools[0].num_pages
            if need > have:
                raise ValueError(
                    f"the request needs {need} cache pages of {PAGE_SIZE} tokens (prompt {n} + "
                    f"max_tokens {req.sampling.max_tokens}, context {limit}) but the pool has "
                    f"{have}" + (f" per device group ({len(self.pools)} groups)"
                                 if len(self.pools) > 1 else "")
                    + " (--num-pages / --cache-memory)")
        if req.sampling.top_logprobs > self.num_top:
            raise ValueError(f"top_logprobs={req.sampling.top_logprobs} exceeds the engine's "
                             f"{self.num_top}")
        seed = req.sampling.seed
        if seed is None:
            seed = int(self._rng.integers(0, 2**31 - 1))
        act = _Active(req, seed, self)
        with self._lock:
            if self.failure is not None:
                raise EngineDead(f"the engine has stopped: {self.failure}")
            self._waiting.append(act)
            self._lock.notify_all()
        return req.request_id

    def _check_images(self, req: Request) -> None:
        vc = getattr(getattr(self.runner, "config", None), "vision_config", None)
        if vc is None or not hasattr(self.runner, "encode_images"):
            raise ValueError("this model does not read images (it has no vision tower)")
        have = sum(int(t) == vc.media_placeholder_token_id for t in req.prompt)
        sizes = [int(im.num_tokens) for im in req.images]
        want = sum(sizes)
        if have != want:
            raise ValueError(f"the prompt has {have} image placeholder tokens but its "
                             f"{len(req.images)} image(s) take {want} positions")
        # each run of placeholders holds whole images, in order (a run of image 2's length
        # before one of image 1's would give each image's features to the other's positions)
        runs, n = [], 0
        for t in list(req.prompt) + [None]:
            if t is not None and int(t) == vc.media_placeholder_token_id:
                n += 1
            elif n:
                runs, n = runs + [n], 0
        i = 0
        for k, run in enumerate(runs):  # (the totals agree, so images remain for each run)
            while run > 0 and i < len(sizes):
                run, i = run - sizes[i], i + 1
            if run != 0:
                raise ValueError(f"placeholder run {k + 1} of the prompt does not hold whole "
                                 f"images in order (images take {sizes} positions; the runs "
                                 f"are {runs})")

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancel.add(request_id)
            self._lock.notify_all()

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt and generated) one request can hold: the context, or fewer
        when the paged pool of a device group is smaller (the servers' default ``max_tokens``
        and context checks use it, so a request without ``max_tokens`` fits the pool)."""
        if not self.pools:
            return self.runner.max_len
        return min(self.runner.max_len, self.pools[0].num_pages * PAGE_SIZE)

    def has_work(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self.slots)

    @property
    def healthy(self) -> bool:
        return self.failure is None

    # ---- the loop ----
    def step(self) -> bool:
        """One scheduling iteration; returns False when there was nothing to do (or the engine
        is dead). Never raises for a request's failure: those requests are aborted."""
        if self.failure is not None:
            return False
        failed = self.stats["failed"]
        try:
            self._apply_cancellations()
            did = self._prefill_some()
            if any(a is not None and a.prefilled == len(a.feed) for a in self.slots):
                self._decode()
                did = True
        except Exception as e:  # noqa: BLE001 -- a fault outside the per-request guards
            log.exception("engine step failed; its running requests are aborted")
            self._note("step", e)  # first: the engine may be dead before they hear of it
            for i, a in enumerate(self.slots):
                if a is not None:
                    self._fail(i, a, e)
            did = True
        else:
            self._note("step")
        lost = getattr(self.runner, "lost_buffers", None)
        if self.stats["failed"] > failed and lost is not None and lost():
            self._after_lost_cache()
        if self.failure is not None:  # doomed in this step: ``die`` aborts what is left
            self.die(self.failure)
        return did

    def _note(self, kind: str, error: BaseException | None = None) -> None:
        """Count a success or failure of one kind of shared work (prefill, decode, sample,
        step); ``max_consecutive_failures`` failures of one kind in a row doom the engine."""
        if error is None:
            self._failures[kind] = 0
            return
        self._failures[kind] += 1
        if self._failures[kind] >= self.max_failures and self.failure is None:
            # dead from now on (``/health``, ``submit``), before the failed requests get their
            # errors: a client that saw its request fail then reads a dead engine, never a
            # healthy one; ``die`` at the end of the step aborts the rest
            self.failure = (f"{self._failures[kind]} consecutive {kind} calls failed "
                            f"(last: {_describe(error)})")

    def die(self, reason: str) -> None:
        """Stop for good: every waiting and running request is aborted with ``reason``."""
        with self._lock:
            if self._dead:
                return
            self._dead = True
            self.failure = self.failure or reason
            waiting, self._waiting = list(self._waiting), collections.deque()
        log.error("engine stopped: %s", reason)
        err = f"the engine has stopped: {reason}"
        for a in waiting:
            self._finish(None, a, "abort", error=err)
        for i, a in enumerate(self.slots):
            if a is not None:
                self._finish(i, a, "abort", error=err)

    def generate(self, requests: list[Request], *, raise_errors: bool = True) -> list[Completion]:
        """Run ``requests`` to completion (batch API); completions in request order. A request
        that failed (``Completion.error``) raises :class:`GenerationError` after the batch is
        done, unless ``raise_errors=False``."""
        done: dict[str, Completion] = {}
        for r in requests:
            user_cb = r.on_event

            def cb(ev, user_cb=user_cb):
                if ev.completion is not None:
                    done[ev.request_id] = ev.completion
                if user_cb is not None:
                    user_cb(ev)
            r.on_event = cb
        for k, r in enumerate(requests):
            try:
                self.submit(r)
            except Exception:  # a refused request: the batch is not started
                for q in requests[:k]:
                    self.cancel(q.request_id)
                while self.has_work():
                    self.step()
                raise
        try:
            while self.has_work() and self.failure is None:
                self.step()
        except BaseException:  # an interrupt (Ctrl-C, a stop signal) in a step: the batch's
            for r in requests:  # requests are aborted, so the engine can run the next batch
                self.cancel(r.request_id)
            self._apply_cancellations()
            raise
        out = [done[r.request_id] for r in requests]
        bad = [c for c in out if c.error is not None]
        if bad and raise_errors:
            raise GenerationError(f"{len(bad)} of {len(out)} requests failed; "
                                  f"{bad[0].request_id}: {bad[0].error}")
        return out

    def serve_forever(self, stop: threading.Event, idle_wait_s: float = 0.05) -> None:
        """The server's engine thread: step while there is work, sleep on the queue otherwise.
        Returns when ``stop`` is set or the engine is dead; if the loop itself ends any other
        way, the engine is marked dead so no request waits forever."""
        try:
            while not stop.is_set() and self.failure is None:
                if not self.step():
                    with self._lock:
                        if not self._waiting and not self._cancel:
                            self._lock.wait(idle_wait_s)
        finally:
            if not stop.is_set() and self.failure is None:
                self.die("the engine loop ended unexpectedly")

    # ---- metrics ----
    def _record(self, c: Completion) -> None:
        m = c.metrics
        if m.ttft_s is not None:
            self.stats["ttft_sum"] += m.ttft_s
            self.stats["ttft_n"] += 1
        self.stats["queue_sum"] += m.queue_s

    def metrics(self) -> dict:
        """Read on the HTTP thread while the engine thread updates: every dict iterated here is
        copied first (a key added during the iteration would raise)."""
        st, elapsed = collections.Counter(dict(self.stats)), time.perf_counter() - self.started
        n = max(st["ttft_n"], 1)
        return {
            "requests_finished": st["finished"], "queue_length": self.queue_length,
            "active_slots": sum(a is not None for a in list(self.slots)),
            "num_slots": len(self.slots), "generated_tokens": st["generated_tokens"],
            "prefill_tokens": st["prefill_tokens"],
            "tokens_per_s": st["generated_tokens"] / elapsed if elapsed > 0 else 0.0,
            "mean_ttft_s": st["ttft_sum"] / n, "mean_queue_s": st["queue_sum"] / max(
                st["finished"], 1),
            "decode_steps": st["decode_steps"],
            "mean_decode_step_s": st["decode_s"] / max(st["decode_steps"], 1),
            "mean_batch": st["decode_rows"] / max(st["decode_steps"], 1),
            "batched_prefill_steps": st["batched_prefill_steps"],
            "mean_batched_prefill_rows": st["batched_prefill_rows"] / max(
                st["batched_prefill_steps"], 1),
            "finish_reasons": {k[7:]: v for k, v in st.items() if k.startswith("finish_")},
            "failed_requests": st["failed"], "engine_failure": self.failure,
            "preemptions": st["preempted"],
            "uptime_s": elapsed,
            "cache": {"kind": "dense_slots"} if not self.pools else {
                "kind": "paged", "partitions": len(self.pools), **_summed(
                    [p.usage() for p in self.pools])},
            **({} if not self.prefixes else {"prefix_cache": _hit_rate(_summed(
                [p.usage() for p in self.prefixes]))}),
        }


def _summed(usages: list[dict]) -> dict:
    """Counters of several partitions' ``usage()`` added up (ratios and settings: the first's)."""
    out = dict(usages[0])
    for u in usages[1:]:
        for k, v in u.items():
            if isinstance(v, int) and k not in ("page_size", "snapshot_every_pages"):
                out[k] += v
    return out


def _hit_rate(usage: dict) -> dict:
    q = usage["queried_tokens"]
    return {**usage, "hit_rate": usage["hit_tokens"] / q if q else 0.0}
