"""The engine's slots (mixed into :class:`~kdsa.infer.engine.Engine`): admission, cancellation,
chunked prefill, the batched decode step, and finishing a request (its slot freed, its
``Completion`` built).

Waiting requests move into free slots in arrival order and are prefilled chunk by chunk, at most
``prefill_tokens_per_step`` prompt tokens per step (at least one chunk); the last chunk samples
the request's first token from the prefill logits. The decode step runs every slot that is
generating at once, each row at its own position. Tokens then go to ``engine_tokens.py``.

Images (``docs/vision.md``): a request's ``images`` (patched, in prompt order) must match its
``<|media_pad|>`` placeholders (checked in :meth:`Engine.submit`, a ``ValueError``); when the
request is admitted the runner encodes them once (``ModelRunner.encode_images``) and every
prefill chunk passes the features of the placeholders it holds. A failure there finishes that
request with ``abort`` and the engine keeps serving.

With the paged cache, pages are taken as a request grows and a request may be preempted for
them (:meth:`SlotScheduling._grow_pages`, :meth:`SlotScheduling._preempt`): it is queued first
and later prefills its prompt and generated tokens again (``_Active.feed``).

The methods use the engine's state (``runner``, ``slots``, ``_waiting``, ``_cancel``,
``_lock``, ``stats``, ``prefill_budget``, ``_record_routing``, ``pools``, ``prefixes``,
``page_sources``, ``prefix_every``, ``_admissions``) and its ``_note`` / ``_part`` /
``_record``. With a runner split into partitions (a mesh's batch device groups) a slot takes
pages and snapshots from its own partition's pool and prefix cache only; a request goes to
the partition with the most of its prefix cached (:meth:`SlotScheduling._candidate_slots`), and
preemption frees pages within a partition.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

import numpy as np

from kdsa.infer.prefix_cache import CONFIRMED, SPECULATIVE, key_items, page_keys
from kdsa.infer.requests import Completion, Event, _Active, _describe
from kdsa.model.paged_cache import PAGE_SIZE, pages_for

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
        budget, did = self.prefill_budget, False
        with self._lock:
            while self._waiting:
                head = self._waiting[0]
                i = next((i for i in self._candidate_slots(head) if self._reserve_pages(i, head)),
                         None)
                if i is None:
                    break  # no free slot, or the pool is full: the queue waits
                a = self.slots[i] = self._waiting.popleft()
                self._admissions += 1
                a.admitted = self._admissions
                if a.metrics.admitted is None:
                    a.metrics.admitted = time.perf_counter()
        if getattr(self.runner, "batched_prefill", False):  # a ModelRunner on one device
            budget, did = self._prefill_together(budget, did)
        for i, a in enumerate(self.slots):
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

    def _candidate_slots(self, a: _Active) -> list[int]:
        """Free slots to try for ``a``, the first free one of each partition (one on one
        device): with the prefix cache the partition holding the most of its prefix's pages
        first (the previous turn of an agent session ran there), then the one with the most
        pages to give."""
        firsts = {}
        for i, s in enumerate(self.slots):
            if s is None:
                firsts.setdefault(self._part(i), i)
        if len(firsts) < 2:
            return list(firsts.values())
        keys = []
        if self.prefixes:
            if not a.key_items:
                a.key_items = self._key_items(a, a.req.prompt)
            keys = page_keys(a.key_items + [int(t) for t in a.tokens[:-1]])
        return sorted(firsts.values(), key=lambda i: (
            -self.prefixes[self._part(i)].cached_pages(keys) if keys else 0,
            -self.page_sources[self._part(i)].available))

    def _reserve_pages(self, i: int, a: _Active) -> bool:
        """Paged cache: give slot ``i`` the pages of ``a``'s prefill and its first decoded
        token, if they are free with a page of growth to spare for each running request
        (``infer/page_pool.py``; decode takes more pages as it goes, :meth:`_grow_pages`);
        always True with dense slots."""
        if not self.pools:
            return True
        part = self._part(i)
        need = pages_for(min(len(a.feed) + 1, self.runner.max_len))
        spare = sum(s is not None and self._part(j) == part for j, s in enumerate(self.slots))
        if not self.prefixes:
            pool = self.pools[part]
            if pool.free < need + spare:
                return False
            a.pages = pool.allocate(need)
            self.runner.set_pages(i, a.pages)
            return True
        prefix = self.prefixes[part]
        # prefix cache (infer/prefix_cache.py): share the pages of the deepest snapshot; a
        # preempted request resumes from its own snapshot (its prompt and generated tokens)
        if not a.key_items:
            a.key_items = self._key_items(a, a.req.prompt)
        items = a.key_items + [int(t) for t in a.tokens[:-1]]
        keys = page_keys(items)
        depth, snapshot, shared, partial = prefix.lookup(keys, items,
                                                              leave=0 if a.tokens else 1)
        held = shared + ([] if partial is None else [partial])
        fresh = None  # (alone, it may also take end snapshots' pages: allocate drops them)
        if not spare or prefix.available >= need - len(shared) + spare:
            fresh = prefix.allocate(need - len(shared))
        if fresh is None:
            prefix.release(held)
            return False
        a.pages, a.page_keys = shared + fresh, keys
        self.runner.set_pages(i, a.pages)
        if not a.tokens:
            prefix.queried_tokens += len(a.feed)
        if partial is not None:  # resuming inside a page: this request's own copy of it
            self.runner.copy_page(partial, fresh[0], slot=i)
            prefix.release([partial])
        if snapshot is not None:  # resume: this slot's own copy of the KDA states
            self.runner.restore_state(snapshot, i)
            a.prefilled = depth
            if not a.tokens:
                prefix.hit_tokens += depth
        a.branch = prefix.branch_point(keys, a.prefilled, len(a.feed))
        return True

    def _grow_pages(self) -> None:
        """Paged cache, before a decode step: every generating request whose next position
        starts a page gets one. When none is free, the most recently admitted request is
        preempted (:meth:`_preempt`) until one is; a request never waits on a page mid-decode
        for longer than that, and the oldest always finishes (no request is larger than the
        pool: ``Engine.submit``)."""
        if not self.pools:
            return
        for i in sorted((i for i, a in enumerate(self.slots) if a is not None),
                        key=lambda i: self.slots[i].admitted):
            a = self.slots[i]
            if a is None or a.prefilled < len(a.feed):
                continue
            if (len(a.req.prompt) + len(a.tokens) - 1) // PAGE_SIZE < len(a.pages):
                continue
            part = self._part(i)
            pool = self.page_sources[part]
            page = pool.allocate(1)
            while page is None:  # (pages of this slot's partition)
                victim = max((j for j, b in enumerate(self.slots)
                              if b is not None and self._part(j) == part),
                             key=lambda j: self.slots[j].admitted)
                self._preempt(victim, self.slots[victim])
                if victim == i:
                    break
                page = pool.allocate(1)
            if page is not None:
                a.pages = a.pages + page
                self.runner.set_pages(i, a.pages)

    def _preempt(self, i: int, a: _Active) -> None:
        """Give slot ``i`` and its pages back and queue ``a`` first, to run again by recompute:
        its prompt and every generated token but the last are prefilled again, then decoding
        goes on from the last token, which was sampled and not yet fed; its tokens, log-probs,
        budget and parser state stay as they are, so the output is the one it would have had.
        With the prefix cache the state after those tokens is kept as an end-of-request
        snapshot, so the recompute is only what was evicted meanwhile."""
        if self.prefixes and a.tokens and a.prefilled == len(a.feed):
            self._snapshot_end(i, a)
        self.page_sources[self._part(i)].release(a.pages)
        self.runner.set_pages(i, [])
        self.slots[i] = None
        a.pages, a.page_keys, a.routing, a.prefilled = [], [], [], 0
        if a.tokens:
            a.feed = list(a.req.prompt) + a.tokens[:-1]
            if a.feature_index is not None:
                a.feature_index = np.concatenate([a.feature_index[:len(a.req.prompt)],
                                                  np.full(len(a.tokens) - 1, -1)])
        a.preemptions += 1
        self.stats["preempted"] += 1
        with self._lock:
            self._waiting.appendleft(a)

    def _snapshot_end(self, i: int, a: _Active) -> None:
        """Prefix cache: keep the state after everything a finished (or preempted) request
        fed (its prompt and every generated token but the last), for the next turn of its
        session (or its own resumption)."""
        fed = a.key_items + [int(t) for t in a.tokens[:-1]]
        slot = self.prefixes[self._part(i)].add_end_snapshot(page_keys(fed), fed, a.pages)
        if slot is not None:
            self.runner.save_state(i, slot)

    def _key_items(self, a: _Active, prompt) -> list:
        """The prefix cache's view of the prompt: token ids, image placeholders by content."""
        if not a.req.images:
            return key_items(prompt)
        vc = self.runner.config.vision_config
        return key_items(prompt, a.req.images, vc.media_placeholder_token_id)

    def _chunk_length(self, a: _Active) -> int:
        """Prompt tokens of the next prefill chunk; with the prefix cache a chunk ends at the
        next snapshot point (every ``snapshot_every`` pages, and the request's branch point)
        when the prompt goes past it."""
        n = self.runner.prefill_chunk
        if self.prefix_every is None or not a.page_keys:
            return n
        step = self.prefix_every * PAGE_SIZE
        nxt = (a.prefilled // step + 1) * step
        if a.branch is not None and a.prefilled < a.branch * PAGE_SIZE:
            nxt = min(nxt, a.branch * PAGE_SIZE)
        return min(n, nxt - a.prefilled) if nxt < len(a.feed) else n

    def _after_chunk(self, i: int, a: _Active, start: int) -> None:
        """Prefix cache: register the pages this chunk completed; at a snapshot point, save
        the slot's KDA states there (unless a snapshot of this prefix exists)."""
        if not self.prefixes or not a.page_keys:
            return
        prefix = self.prefixes[self._part(i)]
        for j in range(start // PAGE_SIZE, min(a.prefilled // PAGE_SIZE, len(a.page_keys))):
            prefix.register(a.page_keys[j], a.pages[j])
        j, r = divmod(a.prefilled, PAGE_SIZE)
        branch = j == a.branch and r == 0
        if ((branch or a.prefilled % (prefix.every * PAGE_SIZE) == 0)
                and 0 < j <= len(a.page_keys) and a.prefilled < len(a.feed)
                and prefix.wants_snapshot(a.page_keys[j - 1])):
            slot = prefix.add_snapshot(a.page_keys[j - 1],
                                            CONFIRMED if branch else SPECULATIVE)
            if slot is not None:
                self.runner.save_state(i, slot)

    def _prefill_together(self, budget: int, did: bool) -> tuple[int, bool]:
        """Batched prefill: while two or more slots have prompt left, run one chunk of each
        (slot order, as many as the budget holds) in one step; what is left for one slot alone
        goes the one-slot way. A failed step aborts the requests of its rows."""
        while budget > 0 or not did:
            rows, total = [], 0
            for i, a in enumerate(self.slots):
                if a is None or a.prefilled >= len(a.feed):
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
        a.finish_reason = reason
        if i is not None:
            self.slots[i] = None
        if (i is not None and self.prefixes and reason != "abort" and a.tokens
                and a.prefilled == len(a.feed)):
            self._snapshot_end(i, a)
        if a.pages:  # paged cache: the pages go back (cached ones stay, evictable)
            self.page_sources[self._part(i)].release(a.pages)  # (held: in a slot)
            a.pages = []
            if i is not None:
                self.runner.set_pages(i, [])
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
