"""The engine's paged cache and prefix cache (mixed into :class:`~kdsa.infer.engine.Engine`):
which pages and snapshots a request gets when it is admitted, pages as it grows, preemption,
and the prefix cache's registrations and snapshots around each prefill chunk.

Pages are taken as a request grows (``infer/page_pool.py``): at admission those of what it
prefills and its first decoded token, if they are free with a page of growth to spare per
running request; then one more each time decode reaches a new page. When decode finds no page
free, the most recently admitted request is preempted (:meth:`PageScheduling._preempt`): it is
queued first and later prefills its prompt and generated tokens again (``_Active.feed``).

With a runner split into partitions (a mesh's batch device groups, ``model/paged_attention.py``)
a slot takes pages and snapshots from its own partition's pool and prefix cache only (ids are
numbered within a partition; the runner makes them global); a request goes to the partition
with the most of its prefix cached (:meth:`PageScheduling._candidate_slots`), and preemption
frees pages within a partition.

The methods use the engine's ``runner``, ``slots``, ``_waiting``, ``_lock``, ``stats``,
``pools``, ``prefixes``, ``page_sources``, ``prefix_every`` and ``_part``.
"""

from __future__ import annotations

import logging

import numpy as np

from kdsa.infer.prefix_cache import CONFIRMED, SPECULATIVE, key_items, page_keys
from kdsa.infer.requests import _Active
from kdsa.model.paged_cache import PAGE_SIZE, pages_for

log = logging.getLogger("kdsa.engine")


class PageScheduling:
    """Pages and prefix-cache snapshots of :class:`Engine`'s slots."""

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
        keys = self._fed_keys(a)[1] if self.prefixes else []
        return sorted(firsts.values(), key=lambda i: (
            -self.prefixes[self._part(i)].cached_pages(keys) if keys else 0,
            -_available(self.page_sources[self._part(i)])))

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
            a.pages, a.part = pool.allocate(need), part
            self.runner.set_pages(i, a.pages)
            return True
        prefix = self.prefixes[part]
        # prefix cache (infer/prefix_cache.py): share the pages of the deepest snapshot; a
        # preempted request resumes from its own snapshot (its prompt and generated tokens)
        items, keys = self._fed_keys(a)
        depth, snapshot, shared, partial = prefix.lookup(keys, items, leave=0 if a.tokens else 1)
        held = shared + ([] if partial is None else [partial])
        fresh = None  # (end snapshots give way: allocate drops them for their pages; counting
        # only free and idle pages kept a request out, its slot empty, while another ran)
        if not spare or prefix.reclaimable >= need - len(shared) + spare:
            fresh = prefix.allocate(need - len(shared))
        if fresh is None:
            prefix.release(held)
            return False
        a.pages, a.page_keys, a.part = shared + fresh, keys, part
        self.runner.set_pages(i, a.pages)
        try:
            if partial is not None:  # resuming inside a page: this request's own copy of it
                self.runner.copy_page(partial, fresh[0], slot=i)
            if snapshot is not None:  # resume: this slot's own copy of the KDA states
                self.runner.restore_state(snapshot, i)
        except BaseException:  # nothing held stays held: the caller fails the request
            prefix.release(held + fresh)
            a.pages = []
            self.runner.set_pages(i, [])
            raise
        if partial is not None:
            prefix.release([partial])
        first = not a.tokens and not a.preemptions  # (a preempted request's own pages and
        if first:  # snapshots are not hits, nor is its prompt queried twice)
            prefix.queried_tokens += len(a.feed)
        if snapshot is not None:
            a.prefilled = depth
            if first:
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

    def _after_lost_cache(self) -> None:
        """A failed step consumed the runner's cache (``ModelRunner.lost_buffers`` rebuilt it
        empty): the requests still running lost their state and are aborted, and the pools and
        prefix caches start afresh (their pages' rows and snapshots are gone; the hit counters
        are kept). Waiting requests are untouched and run later; the engine goes on."""
        log.error("a failed step consumed the cache: the running requests are aborted and the "
                  "prefix cache is emptied")
        error = RuntimeError("a failed step lost the cache this request's state was in")
        for i, a in enumerate(self.slots):
            if a is not None:
                self._fail(i, a, error)
        for source in self.page_sources:  # a prefix cache resets its pool too
            source.reset()

    def _preempt(self, i: int, a: _Active) -> None:
        """Give slot ``i`` and its pages back and queue ``a`` first, to run again by recompute:
        its prompt and every generated token but the last are prefilled again, then decoding
        goes on from the last token, which was sampled and not yet fed; its tokens, log-probs,
        budget and parser state stay as they are, so the output is the one it would have had.
        With the prefix cache the state after those tokens is kept as an end-of-request
        snapshot, so the recompute is only what was evicted meanwhile."""
        if self.prefixes and a.tokens and a.prefilled == len(a.feed):
            self._snapshot_end(i, a)
        self.page_sources[a.part].release(a.pages)
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
        fed, keys = self._fed_keys(a)
        prefix = self.prefixes[a.part]
        self._save_snapshot(i, prefix, prefix.add_end_snapshot(keys, fed, a.pages))

    def _save_snapshot(self, i: int, prefix, slot: int | None) -> None:
        """Copy slot ``i``'s KDA states into snapshot ``slot`` (None: nothing to save). A copy
        that fails gives the snapshot up, so no later request resumes from a stale state; the
        request itself goes on (its slot's states are untouched)."""
        if slot is None:
            return
        try:
            self.runner.save_state(i, slot)
        except BaseException as e:  # the key is filed: no hit may find the slot unsaved
            prefix.drop_slot(slot)
            if not isinstance(e, Exception):  # an interrupt goes on up
                raise
            log.exception("saving a prefix-cache snapshot from slot %d failed; dropped", i)

    def _fed_keys(self, a: _Active) -> tuple[list, list[bytes]]:
        """What ``a`` feeds as the prefix cache sees it (its prompt's :meth:`_key_items` and
        every generated token but the last) and the page keys of that, computed once per
        length: a request waiting for pages asks again at every engine step, and a 128K-token
        prompt's hash chain takes about 40 ms (measured here)."""
        if a.fed_keys is None or a.fed_keys[0] != len(a.tokens):
            if not a.key_items:
                a.key_items = self._key_items(a, a.req.prompt)
            items = a.key_items + [int(t) for t in a.tokens[:-1]]
            a.fed_keys = (len(a.tokens), items, page_keys(items))
        return a.fed_keys[1], a.fed_keys[2]

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
            self._save_snapshot(i, prefix, prefix.add_snapshot(
                a.page_keys[j - 1], CONFIRMED if branch else SPECULATIVE))


def _available(source) -> int:
    """Pages a page source can hand out: a prefix cache's free and idle pages, a pool's free."""
    return source.available if hasattr(source, "available") else source.free
