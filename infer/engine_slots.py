"""The engine's slots (mixed into :class:`~kdsa.infer.engine.Engine`): admission, cancellation,
chunked prefill, the batched decode step, and finishing a request (its slot freed, its
``Completion`` built).

Waiting requests move into free slots in arrival order and are prefilled chunk by chunk, at most
``prefill_tokens_per_step`` prompt tokens per step (at least one chunk), the oldest request's
first (slot order let a stream of new requests in a lower slot hold an older one's prefill back
for ever); the last chunk samples the request's first token from the prefill logits. The
decode step runs every slot that is generating at once, each row at its own position. Tokens
then go to ``engine_tokens.py``.

Images (``docs/vision.md``): a request's ``images`` (patched, in prompt order) must match its
``<|media_pad|>`` placeholders (checked in :meth:`Engine.submit`, a ``ValueError``); when the
request is admitted the runner encodes them once (``ModelRunner.encode_images``) and every
prefill chunk passes the features of the placeholders it holds. A failure there finishes that
request with ``abort`` and the engine keeps serving.

With the paged cache, pages are taken as a request grows and a request may be preempted for
them (``infer/engine_pages.py``: pages, the prefix cache, partitions on a mesh).

The methods use the engine's state (``runner``, ``slots``, ``_waiting``, ``_cancel``,
``_lock``, ``stats``, ``prefill_budget``, ``_record_routing``, ``prefixes``, ``page_sources``)
and its ``_note`` / ``_record`` and the page methods of ``engine_pages.PageScheduling``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

import numpy as np

from kdsa.infer.requests import Completion, Event, _Active, _describe

log = logging.getLogger("kdsa.engine")


class SlotScheduling:
    """Slots of :class:`Engine`: who runs where, prefill, decode, finishing."""

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
        budget, did, refused = self.prefill_budget, False, []
        # The lock is held only to read and pop the queue's head: reserving pages hashes the
        # prompt and may copy pages and states on the device (a compile the first time), and
        # ``submit`` / ``cancel``, called from the server's event loop, must not wait on that.
        # Only this thread takes from the queue's front (``submit`` appends at its back).
        while True:
            with self._lock:
                if not self._waiting:
                    break
                head = self._waiting[0]
            try:
                i = next((i for i in self._candidate_slots(head)
                          if self._reserve_pages(i, head)), None)
            except Exception as e:  # noqa: BLE001 -- a failed resume fails this request
                log.exception("admitting %s failed; aborted", head.req.request_id)
                self._note("admit", e)
                with self._lock:
                    refused.append((self._waiting.popleft(), e))
                continue
            if i is None:
                break  # no free slot, or the pool is full: the queue waits
            self._note("admit")  # failures count only in a row
            with self._lock:
                a = self.slots[i] = self._waiting.popleft()
            assert a is head  # (only this thread takes from the front)
            self._admissions += 1
            a.admitted = self._admissions
            if a.metrics.admitted is None:
                a.metrics.admitted = time.perf_counter()
        for a, e in refused:
            self._fail(None, a, e)
        if getattr(self.runner, "batched_prefill", False):  # a ModelRunner on one device
            budget, did = self._prefill_together(budget, did)
        for i in self._oldest_first():
            a = self.slots[i]
            if a is not None and a.req.images and a.features is None and not self._encode(i, a):
                did, a = True, None
            if a is not None and a.prefilled < len(a.feed) and (budget > 0 or not did):
                try:
                    budget = self._prefill_slot(i, a, budget, did)
                except Exception as e:  # noqa: BLE001 -- this request fails, not the engine
                    log.exception("prefill of %s failed; aborted", a.req.request_id)
                    self._note("prefill", e)
                    self._fail(i, a, e)
                did = True
        return did

    def _prefill_together(self, budget: int, did: bool) -> tuple[int, bool]:
        """Batched prefill: while two or more slots have prompt left, run one chunk of each
        (oldest request first, as many as the budget holds) in one step; what is left for one
        slot alone goes the one-slot way. A failed step aborts the requests of its rows."""
        while budget > 0 or not did:
            rows, total = [], 0
            for i in self._oldest_first():
                a = self.slots[i]
                if a.prefilled >= len(a.feed):
                    continue
                n = min(self._chunk_length(a), len(a.feed) - a.prefilled)
                if rows and total + n > budget:
                    break
                rows.append((i, a, a.prefilled, n))
                total += n
            if len(rows) < 2:
                return budget, did
            try:
                logits = self.runner.prefill_batch(
                    [i for i, *_ in rows], [a.feed[s:s + n] for _, a, s, n in rows],
                    [s for _, _, s, _ in rows])
            except Exception as e:  # noqa: BLE001 -- a batched step: every row of it fails
                log.exception("batched prefill failed; its %d requests are aborted", len(rows))
                self._note("prefill", e)
                for i, a, *_ in rows:
                    self._fail(i, a, e)
                return budget, True
            self._note("prefill")
            done = []
            for r, (i, a, start, n) in enumerate(rows):
                a.prefilled += n
                self._after_chunk(i, a, start)
                self.stats["prefill_tokens"] += n
                if a.prefilled == len(a.feed) and not a.tokens:  # (resumed: token known)
                    done.append((r, i))
            self.stats["batched_prefill_steps"] += 1
            self.stats["batched_prefill_rows"] += len(rows)
            budget -= total
            did = True
            if done:
                self._sample_and_apply(done, logits)
        return budget, did

    def _oldest_first(self) -> list[int]:
        """The occupied slots, the request that arrived first first."""
        taken = [i for i, a in enumerate(self.slots) if a is not None]
        return sorted(taken, key=lambda i: (self.slots[i].metrics.arrival, self.slots[i].admitted))

    def _prefill_slot(self, i: int, a: _Active, budget: int, did: bool) -> int:
        """Prefill chunks of slot ``i`` within ``budget`` tokens (one at least); returns the
        budget left. The last chunk samples the first token."""
        while a is not None and a.prefilled < len(a.feed) and (budget > 0 or not did):
            start = a.prefilled
            chunk = a.feed[start:start + self._chunk_length(a)]
            logits = self.runner.prefill(i, chunk, start, **self._chunk_images(a, len(chunk)))
            self._note("prefill")
            if self._record_routing:
                a.routing.append(self.runner.last_routing)
            a.prefilled += len(chunk)
            self._after_chunk(i, a, start)
            budget -= len(chunk)
            did = True
            self.stats["prefill_tokens"] += len(chunk)
            if a.prefilled == len(a.feed) and not a.tokens:  # (resumed: its next token known)
                self._sample_and_apply([(0, i)], logits)
                a = self.slots[i]
        return budget

    def _encode(self, i: int, a: _Active) -> bool:
        """Encode a request's images once; a failure aborts that request only."""
        try:
            a.features = np.asarray(self.runner.encode_images(a.req.images), np.float32)
        except Exception as e:  # noqa: BLE001 -- one bad request must not stop the engine
            log.exception("encoding the images of %s failed; aborted", a.req.request_id)
            self._fail(i, a, e)  # a failed request: its error reaches the client
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
        self._grow_pages()
        rows = [i for i, a in enumerate(self.slots)
                if a is not None and a.prefilled == len(a.feed)]
        if not rows:  # every generating request was preempted
            return
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
        if i is not None:
            self.slots[i] = None
        try:
            if (i is not None and self.prefixes and reason != "abort" and a.tokens
                    and a.prefilled == len(a.feed)):
                self._snapshot_end(i, a)
        finally:  # (an interrupt in the snapshot copy: the pages still go back)
            if a.pages:  # paged cache: the pages go back (cached ones stay, evictable)
                pages, a.pages = a.pages, []  # (taken first: a retry never releases them twice)
                self.page_sources[a.part].release(pages)
                if i is not None:
                    self.runner.set_pages(i, [])
        # finished from here on: a failure above leaves it unfinished, so _fail still sends
        # the client its (abort) completion instead of leaving it waiting
        a.finish_reason = reason
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
