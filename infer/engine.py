"""Continuous batching over a fixed number of slots: requests, scheduling, stops, metrics.

Each :meth:`Engine.step`:

1. drops cancelled requests (a finished or cancelled request frees its slot at once);
2. moves waiting requests into free slots and prefills them chunk by chunk, at most
   ``prefill_tokens_per_step`` prompt tokens per step (at least one chunk), so running
   requests keep decoding while long prompts come in; a request whose last chunk is done samples
   its first token from the prefill logits;
3. runs one decode step for every slot that is generating (rows at their own positions) and
   samples each row with its own parameters and random stream (``sampling.py``).

Per token the engine applies, in order: forced tokens (thinking-budget close, ``budget.py``;
``Request.answer_prefix``, forced once the answer starts: the tool-call opening of
``tool_choice``),
banned tokens (``Request.banned_token_ids``: masked to ``-inf`` in the jitted sampler, a fixed
``[slots, max_banned_tokens]`` array so nothing recompiles; ``tool_choice: "none"`` bans the
format's call opener; with bans or a prefix the engine also forces the format's answer opening
after the model's own end of thinking, as forced tokens are exempt from the ban),
the chat parser (events ``reasoning`` / ``content`` / ``tool_call``; without a parser raw text
events), stop token ids (the format's end of message unless ``ignore_eos``), stop strings
(matched on the content, or the raw text without a parser; the text is cut before the stop and
content is held back by ``len(stop) - 1`` characters so a stream never shows a partial stop),
``max_tokens`` and the context (``max_len``). Events go to ``Request.on_event`` from the engine
thread; :meth:`Engine.generate` is the batch API.

Images (``docs/vision.md``): a request's ``images`` (patched, in prompt order) must match its
``<|media_pad|>`` placeholders (checked in :meth:`Engine.submit`, a ``ValueError``); when the
request is admitted the runner encodes them once (``ModelRunner.encode_images``) and every
prefill chunk passes the features of the placeholders it holds. A failure there finishes that
request with ``abort`` and the engine keeps serving.

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
import dataclasses
import logging
import threading
import time

import numpy as np

from kdsa.infer.budget import BudgetConfig
from kdsa.infer.requests import (Completion, EngineDead, Event, GenerationError,  # noqa: F401
                                 Request, _Active, _describe)
from kdsa.infer.sampling import sample, sample_jit

log = logging.getLogger("kdsa.engine")


class Engine:
    def __init__(self, runner, tokenizer, *, chat_format=None, budgets: BudgetConfig | None = None,
                 max_top_logprobs: int = 20, prefill_tokens_per_step: int | None = None,
                 seed: int = 0, max_banned_tokens: int = 4, max_consecutive_failures: int = 3):
        self.runner, self.tok = runner, tokenizer
        self.max_failures = max_consecutive_failures
        self.failure: str | None = None  # set when the engine is dead (EngineDead)
        self._failures = collections.Counter()  # consecutive failures per kind of call
        self._doomed: str | None = None  # why the engine dies at the end of this step
        self.budgets = budgets or BudgetConfig()
        self.reasoning_end_ids = tuple(chat_format.reasoning_end_ids) if chat_format else ()
        self.after_reasoning_ids = tuple(chat_format.after_reasoning_ids) if chat_format else ()
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
        self.stats = collections.Counter()
        self.started = time.perf_counter()

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
        want = sum(int(im.num_tokens) for im in req.images)
        if have != want:
            raise ValueError(f"the prompt has {have} image placeholder tokens but its "
                             f"{len(req.images)} image(s) take {want} positions")

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancel.add(request_id)
            self._lock.notify_all()

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

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
        try:
            self._apply_cancellations()
            did = self._prefill_some()
            if any(a is not None and a.prefilled == len(a.req.prompt) for a in self.slots):
                self._decode()
                did = True
        except Exception as e:  # noqa: BLE001 -- a fault outside the per-request guards
            log.exception("engine step failed; its running requests are aborted")
            for i, a in enumerate(self.slots):
                if a is not None:
                    self._fail(i, a, e)
            self._note("step", e)
            did = True
        else:
            self._note("step")
        if self._doomed is not None:
            self.die(self._doomed)
        return did

    def _note(self, kind: str, error: BaseException | None = None) -> None:
        """Count a success or failure of one kind of shared work (prefill, decode, sample,
        step); ``max_consecutive_failures`` failures of one kind in a row doom the engine."""
        if error is None:
            self._failures[kind] = 0
            return
        self._failures[kind] += 1
        if self._failures[kind] >= self.max_failures and self._doomed is None:
            self._doomed = (f"{self._failures[kind]} consecutive {kind} calls failed "
                            f"(last: {_describe(error)})")

    def die(self, reason: str) -> None:
        """Stop for good: every waiting and running request is aborted with ``reason``."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
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
        while self.has_work() and self.failure is None:
            self.step()
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

    # ---- scheduling ----
    def _apply_cancellations(self) -> None:
        with self._lock:
            if not self._cancel:
                return
            cancel, self._cancel = self._cancel, set()
            keep = [a for a in self._waiting if a.req.request_id not in cancel]
            dropped = [a for a in self._waiting if a.req.request_id in cancel]
            self._waiting = collections.deque(keep)
        for a in dropped:
            self._finish(None, a, "abort")
        for i, a in enumerate(self.slots):
            if a is not None and a.req.request_id in cancel:
                self._finish(i, a, "abort")

    def _prefill_some(self) -> bool:
        budget, did = self.prefill_budget, False
        with self._lock:
            for i in range(len(self.slots)):
                if self.slots[i] is None and self._waiting:
                    self.slots[i] = self._waiting.popleft()
                    self.slots[i].metrics.admitted = time.perf_counter()
        for i, a in enumerate(self.slots):
            if a is not None and a.req.images and a.features is None and not self._encode(i, a):
                did, a = True, None
            if a is not None and a.prefilled < len(a.req.prompt) and (budget > 0 or not did):
                try:
                    budget = self._prefill_slot(i, a, budget, did)
                except Exception as e:  # noqa: BLE001 -- this request fails, not the engine
                    log.exception("prefill of %s failed; aborted", a.req.request_id)
                    self._note("prefill", e)
                    self._fail(i, a, e)
                did = True
        return did

    def _prefill_slot(self, i: int, a: _Active, budget: int, did: bool) -> int:
        """Prefill chunks of slot ``i`` within ``budget`` tokens (one at least); returns the
        budget left. The last chunk samples the first token."""
        while a is not None and a.prefilled < len(a.req.prompt) and (budget > 0 or not did):
            chunk = a.req.prompt[a.prefilled:a.prefilled + self.runner.prefill_chunk]
            logits = self.runner.prefill(i, chunk, a.prefilled,
                                         **self._chunk_images(a, len(chunk)))
            self._note("prefill")
            if self._record_routing:
                a.routing.append(self.runner.last_routing)
            a.prefilled += len(chunk)
            budget -= len(chunk)
            did = True
            self.stats["prefill_tokens"] += len(chunk)
            if a.prefilled == len(a.req.prompt):
                self._sample_and_apply([(0, i)], logits)
                a = self.slots[i]
        return budget

    def _encode(self, i: int, a: _Active) -> bool:
        """Encode a request's images once; a failure aborts that request only."""
        try:
            a.features = np.asarray(self.runner.encode_images(a.req.images), np.float32)
        except Exception:  # noqa: BLE001 -- one bad request must not stop the engine
            log.exception("encoding the images of %s failed; aborted", a.req.request_id)
            self._finish(i, a, "abort")
            return False
        vc = self.runner.config.vision_config
        ph = np.asarray(a.req.prompt) == vc.media_placeholder_token_id
        a.feature_index = np.where(ph, np.cumsum(ph) - 1, -1)
        return True

    def _chunk_images(self, a: _Active, n: int) -> dict:
        if a.features is None:
            return {}
        idx = a.feature_index[a.prefilled:a.prefilled + n]
        return {"image_embeds": a.features[np.maximum(idx, 0)], "image_mask": idx >= 0}

    def _decode(self) -> None:
        s = len(self.slots)
        rows = [i for i, a in enumerate(self.slots)
                if a is not None and a.prefilled == len(a.req.prompt)]
        tokens, pos, active = np.zeros(s, np.int32), np.zeros(s, np.int32), np.zeros(s, bool)
        for i in rows:
            a = self.slots[i]
            tokens[i], pos[i], active[i] = a.tokens[-1], len(a.req.prompt) + len(a.tokens) - 1, 1
        t0 = time.perf_counter()
        try:
            logits = self.runner.decode(tokens, pos, active)
        except Exception as e:  # noqa: BLE001 -- a batched step: every row of it fails
            log.exception("decode step failed; its %d requests are aborted", len(rows))
            self._note("decode", e)
            for i in rows:
                self._fail(i, self.slots[i], e)
            return
        self._note("decode")
        if self._record_routing:
            for i in rows:
                self.slots[i].routing.append(self.runner.last_routing[i:i + 1])
        self._sample_and_apply([(i, i) for i in rows], logits)
        self.stats["decode_steps"] += 1
        self.stats["decode_s"] += time.perf_counter() - t0
        self.stats["decode_rows"] += len(rows)

    def _sample_and_apply(self, pairs: list[tuple[int, int]], logits) -> None:
        """Sample every (logits row, slot) pair and apply the tokens. A row that cannot be
        packed, parsed or delivered fails alone; a failing sampler fails every row."""
        n, vocab = logits.shape[0], min(self.runner.vocab_size, self.tok.vocab_size)
        if logits.shape[-1] > vocab:  # a padded embedding: ids the tokenizer lacks are never
            logits = logits[:, :vocab]  # sampled (log-probs over the tokenizer's ids)
        temp, top_p, min_p = (np.ones(n, np.float32), np.ones(n, np.float32),
                              np.zeros(n, np.float32))
        top_k, seeds, counters = (np.zeros(n, np.int32), np.zeros(n, np.uint32),
                                  np.zeros(n, np.int32))
        forced = np.full(n, -1, np.int32)
        banned = np.full((n, self.max_banned), -1, np.int32)
        ok = []
        for r, i in pairs:
            a, sp = self.slots[i], self.slots[i].req.sampling
            try:  # top_k past the vocabulary keeps every token: clamped so it fits int32
                temp[r], top_k[r], top_p[r], min_p[r] = (sp.temperature, min(sp.top_k, vocab),
                                                         sp.top_p, sp.min_p)
                seeds[r], counters[r] = a.seed, len(a.tokens)
                ban = a.req.banned_token_ids
                banned[r, :len(ban)] = ban
            except Exception as e:  # noqa: BLE001 -- e.g. a value the arrays cannot hold
                log.exception("sampling parameters of %s rejected; aborted", a.req.request_id)
                self._fail(i, a, e)
                continue
            if a.forced:
                forced[r] = a.forced.popleft()
            ok.append((r, i))
        if not ok:
            return
        try:
            out = self._sample(logits, temp, top_k, top_p, min_p, seeds, counters, forced,
                               banned, num_top=self.num_top)
            tok, lp, top_ids, top_lp = (np.asarray(x) for x in out)
            self._note("sample")
        except Exception as e:  # noqa: BLE001 -- shared by the rows: they all fail
            log.exception("sampling failed; %d requests aborted", len(ok))
            self._note("sample", e)
            for _, i in ok:
                self._fail(i, self.slots[i], e)
            return
        for r, i in ok:
            a = self.slots[i]
            try:
                self._apply(i, int(tok[r]), float(lp[r]), top_ids[r], top_lp[r])
            except Exception as e:  # noqa: BLE001 -- its parser or on_event: this one fails
                log.exception("applying a token to %s failed; aborted", a.req.request_id)
                self._fail(i, a, e)

    def _apply(self, i: int, token: int, logprob: float, top_ids, top_lp) -> None:
        a = self.slots[i]
        req, sp = a.req, a.req.sampling
        now = time.perf_counter()
        if a.metrics.first_token is None:
            a.metrics.first_token = now
        a.tokens.append(token)
        a.logprobs.append(logprob)
        k = sp.top_logprobs
        top = [(int(t), float(v)) for t, v in zip(top_ids[:k], top_lp[:k])]
        a.top.append(top)
        self.stats["generated_tokens"] += 1
        piece = "" if self.tok.is_special(token) else a.raw.decode(self.tok.token_bytes(token))
        if a.budget is not None:
            a.forced.extend(a.budget.observe(token, piece))
            if a.open_answer and not a.budget.in_reasoning:  # reasoning closed: open the answer
                a.forced.extend((() if a.budget.forced_close else self.after_reasoning_ids)
                                + a.prefix)
                a.prefix, a.open_answer = (), False
        deltas: list[tuple[str, object]] = []
        if req.parser is not None:
            for kind, value in req.parser.feed(token):
                if kind == "content":
                    a.text += value
                else:
                    deltas.append((kind, value))
        else:
            a.text += piece
        reason = None
        if token in a.stop_ids:
            reason = "stop"
        cut = self._find_stop(a)
        if cut is not None:
            a.text, reason = a.text[:cut], "stop"
        elif len(a.tokens) >= sp.max_tokens or len(req.prompt) + len(a.tokens) >= \
                self.runner.max_len:
            reason = reason or "length"
        if reason is not None and req.parser is not None:
            for kind, value in req.parser.flush():
                if kind == "content" and cut is None:
                    a.text += value
                elif kind != "content":
                    deltas.append((kind, value))
        upto = len(a.text) if reason else max(a.sent, len(a.text) - a.hold)
        if upto > a.sent:
            deltas.append(("content" if req.parser is not None else "text", a.text[a.sent:upto]))
            a.sent = upto
        ev = Event(req.request_id, token, logprob, top, deltas)
        if reason is not None:
            ev.completion = self._finish(i, a, reason, emit=False)
        if req.on_event is not None:
            req.on_event(ev)

    def _find_stop(self, a: _Active) -> int | None:
        stops = a.req.sampling.stop
        if not stops:
            return None
        lo = a.sent  # text before it was checked on earlier tokens
        hits = [j for j in (a.text.find(s, lo) for s in stops) if j >= 0]
        return min(hits) if hits else None

    def _fail(self, i: int | None, a: _Active, e: BaseException) -> None:
        """Abort request ``a`` (in slot ``i``) because of ``e``, unless it already finished."""
        if a.finish_reason is not None:  # e.g. its on_event failed on the last event
            if i is not None and self.slots[i] is a:
                self.slots[i] = None
            return
        self.stats["failed"] += 1
        self._finish(i, a, "abort", error=_describe(e))

    def _finish(self, i: int | None, a: _Active, reason: str, emit: bool = True,
                error: str | None = None) -> Completion:
        """Free slot ``i`` and build ``a``'s completion; ``emit``: send the last event (a
        failing ``on_event`` is only logged: the request is over either way)."""
        a.metrics.finished = time.perf_counter()
        a.finish_reason = reason
        if i is not None:
            self.slots[i] = None
        output = None
        if a.req.parser is not None:
            try:
                output = dataclasses.replace(a.req.parser.finish(), content=a.text)
            except Exception as e:  # noqa: BLE001 -- a broken parser fails this request
                log.exception("the parser of %s failed", a.req.request_id)
                reason, error = "abort", error or _describe(e)
        b = a.budget
        comp = Completion(a.req.request_id, len(a.req.prompt), a.tokens, a.logprobs, a.top,
                          a.text, output, reason, b.reasoning_tokens if b else 0,
                          bool(b and b.forced_close), a.metrics,
                          np.concatenate(a.routing) if a.routing else None, error)
        self.stats["finished"] += 1
        self.stats[f"finish_{reason}"] += 1
        self._record(comp)
        if emit and a.req.on_event is not None:
            try:
                a.req.on_event(Event(a.req.request_id, None, None, [], [], comp))
            except Exception:  # noqa: BLE001
                log.exception("on_event of %s failed on its last event", a.req.request_id)
        return comp

    # ---- metrics ----
    def _record(self, c: Completion) -> None:
        m = c.metrics
        if m.ttft_s is not None:
            self.stats["ttft_sum"] += m.ttft_s
            self.stats["ttft_n"] += 1
        self.stats["queue_sum"] += m.queue_s

    def metrics(self) -> dict:
        st, elapsed = self.stats, time.perf_counter() - self.started
        n = max(st["ttft_n"], 1)
        return {
            "requests_finished": st["finished"], "queue_length": self.queue_length,
            "active_slots": sum(a is not None for a in self.slots),
            "num_slots": len(self.slots), "generated_tokens": st["generated_tokens"],
            "prefill_tokens": st["prefill_tokens"],
            "tokens_per_s": st["generated_tokens"] / elapsed if elapsed > 0 else 0.0,
            "mean_ttft_s": st["ttft_sum"] / n, "mean_queue_s": st["queue_sum"] / max(
                st["finished"], 1),
            "decode_steps": st["decode_steps"],
            "mean_decode_step_s": st["decode_s"] / max(st["decode_steps"], 1),
            "mean_batch": st["decode_rows"] / max(st["decode_steps"], 1),
            "finish_reasons": {k[7:]: v for k, v in st.items() if k.startswith("finish_")},
            "failed_requests": st["failed"], "engine_failure": self.failure,
            "uptime_s": elapsed,
        }
