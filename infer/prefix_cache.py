"""Exact prefix caching for the hybrid model (host-side bookkeeping; the runner moves the data).

Agents resend their whole history every turn. What a new request can reuse of an earlier one
is, for the Gated DSA layers, the cache pages of their common prefix, and for the KDA layers
their recurrent state *at the point where the reuse stops* (a KDA state cannot be cut back).
So the cache keeps two things:

* **pages** keyed by a hash chain over full 64-token pages, ``key_j = H(key_{j-1}, tokens of
  page j)``: a page written by a prefill is registered under its key once it is full, and any
  later request whose prompt has the same first ``j + 1`` pages shares it (reference counts);
* **KDA snapshots** taken during prefill at page-aligned points, every ``snapshot_every`` pages
  (the state after ``j`` pages, keyed by ``key_{j-1}``), in a fixed number of snapshot slots;
* **end-of-request snapshots**: when a request finishes, the state after everything it fed
  (its prompt and every generated token but the last, which was sampled and never fed), so
  the next turn of an agent session, whose prompt is that history plus new messages, resumes
  exactly where the last turn ended. Its full pages (generated rows too) are registered like
  prompt pages; the rows of its last, partial page stay in that page, held by the snapshot
  (keyed by the chain key before it and the page's tokens).

A request resumes from the deepest snapshot whose pages are all still cached and that leaves at
least one prompt token to prefill (its logits give the first output token); it shares those
pages, gets the snapshot copied into its own state slot (so two requests resuming from one
snapshot never interfere) and prefills only the rest. Resuming inside a partial page copies
that page into a fresh page of the request first (copy-on-write: the request writes its next
rows there, the snapshot's page stays as it was). Exactness: the shared rows and the state
are those an uncached prefill of the same tokens writes, so outputs equal those without a hit
up to float rounding of a different chunking (the tests check tokens and log-probs within 1e-5).

Pages are keyed by what determines their rows: token ids, and for image placeholders the
image's content and the position inside it (:func:`key_items`), so requests with images share
pages and snapshots exactly as far as their tokens and images agree.

Which KDA states to keep. A snapshot slot holds a whole stack's recurrent state (at K3 widths
a few hundred MB), so there are few of them and plain LRU thrashes: every prefill takes one
snapshot per ``snapshot_every`` pages, and a handful of concurrent prompts push out the one
state their group shares. Following Marconi (Pan et al., "Marconi: Prefix Caching for the Era
of Hybrid LLMs", MLSys 2025: keep the states likely to be reused, at the branch points of the
prefix tree and at request ends), each snapshot has a rank:

* ``SPECULATIVE``: taken every ``snapshot_every`` pages; evicted first, and never at the cost
  of a higher-ranked one (then it is not taken);
* ``END``: the end of a request, for the next turn of its session;
* ``CONFIRMED``: a snapshot a request resumed from, or one taken at a **branch point**: when a
  new request's prompt has cached pages beyond the snapshot it resumes from, another request
  has fed the same tokens, so the state where the cached pages end is worth keeping; the
  request's prefill stops there to save it. At most 3/4 of the slots are confirmed (so that
  stale ones, such as an agent session's previous turns, leave room for the ends of running
  requests): promoting one more demotes the least recently used confirmed one to ``END``.

Eviction takes the least recently used snapshot of the lowest rank. Pages are evicted LRU among
those no running request references (an evicted end snapshot gives its partial page back; when
the pool runs short, end snapshots are dropped, least recently used first, for their pages); a
page still referenced is never evicted.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from kdsa.infer.page_pool import PagePool
from kdsa.model.paged_cache import PAGE_SIZE

SPECULATIVE, END, CONFIRMED = 0, 1, 2  # snapshot ranks, evicted lowest first


def page_keys(tokens) -> list[bytes]:
    """The hash chain of the full pages of ``tokens`` (token ids, or :func:`key_items`)."""
    keys, prev = [], b""
    for j in range(len(tokens) // PAGE_SIZE):
        page = ",".join(map(_item, tokens[j * PAGE_SIZE:(j + 1) * PAGE_SIZE]))
        prev = hashlib.blake2b(prev + page.encode(), digest_size=16).digest()
        keys.append(prev)
    return keys


def _item(t) -> str:
    return t if isinstance(t, str) else str(int(t))


def key_items(prompt, images=(), placeholder: int | None = None) -> list:
    """What identifies each prompt position's cache rows: its token id, and for an image
    placeholder the image's content and the position inside it (``"<digest>:<k>"``), so two
    prompts with the same placeholders but different images share nothing from the first
    image on."""
    if not images:
        return [int(t) for t in prompt]
    digests = [hashlib.blake2b(np.ascontiguousarray(im.patches).tobytes()
                               + repr((im.grid, im.size, im.merge_size)).encode(),
                               digest_size=16).hexdigest() for im in images]
    spans = [(d, k) for d, im in zip(digests, images) for k in range(int(im.num_tokens))]
    out, it = [], iter(spans)
    for t in prompt:
        if int(t) == placeholder:
            d, k = next(it)
            out.append(f"{d}:{k}")
        else:
            out.append(int(t))
    return out


class PrefixCache:
    def __init__(self, pool: PagePool, num_snapshots: int, snapshot_every: int):
        if num_snapshots < 1 or snapshot_every < 1:
            raise ValueError(f"need num_snapshots >= 1 and snapshot_every >= 1, got "
                             f"{num_snapshots}, {snapshot_every}")
        self.pool, self.every = pool, snapshot_every
        self.num_snapshots = num_snapshots
        self.hit_tokens = self.queried_tokens = 0
        self.reset()

    def reset(self) -> None:
        """Nothing cached and every page of the pool free (their rows and the snapshots are
        gone: ``Engine`` after a failed step consumed the cache); the hit counters are kept."""
        self.pool.reset()
        self.page_of: dict[bytes, int] = {}  # key -> page holding those rows
        self.key_of: dict[int, bytes] = {}
        self.refs: collections.Counter[int] = collections.Counter()
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU
        self.snap_of: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU
        self.rank: dict[bytes, int] = {}  # snapshot key -> SPECULATIVE, END or CONFIRMED
        self.free_snaps = list(range(self.num_snapshots - 1, -1, -1))
        # end-of-request snapshots inside a page: snapshot key -> (chain key before the page,
        # the page's tokens, the page holding their rows); and chain key -> those snapshot keys
        self.partial: dict[bytes, tuple[bytes, tuple[int, ...], int]] = {}
        self.ends_under: collections.defaultdict[bytes, set[bytes]] = \
            collections.defaultdict(set)

    # ---- lookup and pages ----
    def lookup(self, keys: list[bytes], prompt, leave: int = 1
               ) -> tuple[int, int | None, list[int], int | None]:
        """``(tokens, snapshot slot, shared pages, partial page)`` of the deepest usable
        snapshot for ``prompt`` with these page keys that leaves at least ``leave`` tokens to
        prefill (1 for a new request, whose last prompt token's logits give its first token;
        0 for a preempted one, whose next token is known): the shared full pages are held once
        more, and so is the partial page to copy (None when the snapshot is page-aligned;
        release it after the copy); ``(0, None, [], None)`` on a miss."""
        n = len(prompt) - leave
        for j in range(min(len(keys), n // PAGE_SIZE), -1, -1):
            if any(k not in self.page_of for k in keys[:j]):
                continue
            prev = keys[j - 1] if j else b""
            best = None  # the longest end snapshot inside page j that the prompt continues
            for key in self.ends_under.get(prev, ()):
                _, tail, _ = self.partial[key]
                lo = j * PAGE_SIZE
                if (lo + len(tail) <= n and (best is None or len(tail) > len(best[1]))
                        and tuple(prompt[lo:lo + len(tail)]) == tail):
                    best = (key, tail)
            if best is None and (not j or keys[j - 1] not in self.snap_of):
                continue
            key = best[0] if best else keys[j - 1]
            self.snap_of.move_to_end(key)
            self._confirm(key)
            pages = [self.page_of[k] for k in keys[:j]]
            partial = self.partial[key][2] if best else None
            self.acquire(pages + ([partial] if best else []))
            return j * PAGE_SIZE + (len(best[1]) if best else 0), self.snap_of[key], pages, partial
        return 0, None, [], None

    def cached_pages(self, keys: list[bytes]) -> int:
        """How many leading pages of this chain are cached (a probe: nothing is held)."""
        j = 0
        while j < len(keys) and keys[j] in self.page_of:
            j += 1
        return j

    def acquire(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] += 1
            self.idle.pop(p, None)

    @property
    def available(self) -> int:
        """Pages :meth:`allocate` can hand out without dropping a snapshot: free or idle
        (it also drops end snapshots for their partial pages when these are not enough)."""
        return self.pool.free + len(self.idle)

    @property
    def reclaimable(self) -> int:
        """Pages :meth:`allocate` can hand out at most: :attr:`available` and the partial
        pages that only end-of-request snapshots hold (it drops those snapshots for them)."""
        held = collections.Counter(page for _, _, page in self.partial.values())
        return self.available + sum(self.refs[p] == n for p, n in held.items())

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh pages (held once), evicting idle cached pages as needed; None (nothing
        taken) when even that is not enough."""
        while n > self.pool.free + len(self.idle):  # give up end snapshots for their pages
            victim = next((k for k in self.snap_of if k in self.partial), None)
            if victim is None:
                return None
            self._drop(victim)
        while self.pool.free < n:
            page, _ = self.idle.popitem(last=False)
            del self.page_of[self.key_of.pop(page)]
            self.pool.release([page])
        pages = self.pool.allocate(n)
        self.acquire(pages)
        return pages

    def release(self, pages: list[int]) -> None:
        """Drop one reference per page; a cached page becomes idle (evictable), another one
        goes back to the pool. ``pages`` in chain order: the deepest becomes idle first, so
        eviction takes a chain from its end and what stays is still a usable prefix."""
        free = []
        for p in reversed(pages):
            self.refs[p] -= 1
            if self.refs[p] > 0:
                continue
            del self.refs[p]
            if p in self.key_of:
                self.idle[p] = None
            else:
                free.append(p)
        if free:
            self.pool.release(free)

    def register(self, key: bytes, page: int) -> None:
        """Page ``page`` (full, written) holds the rows of ``key``; the first writer wins."""
        if key not in self.page_of and page not in self.key_of:
            self.page_of[key], self.key_of[page] = page, key

    def branch_point(self, keys: list[bytes], depth: int, n: int) -> int | None:
        """Pages of the cached prefix of a new request that resumes at ``depth`` tokens and
        feeds ``n``: the snapshot point to take at a branch (module docstring) when those pages
        reach past ``depth`` and leave tokens to feed, with no snapshot there yet; else None."""
        j = self.cached_pages(keys)
        if j * PAGE_SIZE <= depth or j * PAGE_SIZE >= n or not self.wants_snapshot(keys[j - 1]):
            return None
        return j

    # ---- snapshots ----
    def wants_snapshot(self, key: bytes) -> bool:
        return key not in self.snap_of

    def add_snapshot(self, key: bytes, rank: int = SPECULATIVE) -> int | None:
        """A snapshot slot for ``key``, of ``rank``: a free one, or that of the least recently
        used snapshot of the lowest rank; None (nothing taken) when a speculative snapshot
        would push out a higher-ranked one."""
        if not self.free_snaps:
            victim = min(self.snap_of, key=self.rank.__getitem__)  # LRU among the lowest
            if rank == SPECULATIVE and self.rank[victim] > SPECULATIVE:
                return None
            self._drop(victim)
        slot = self.free_snaps.pop()
        self.snap_of[key], self.rank[key] = slot, rank
        if rank == CONFIRMED:
            self._cap_confirmed(key)
        return slot

    def _confirm(self, key: bytes) -> None:
        """``key``'s snapshot is reused: CONFIRMED (see :meth:`_cap_confirmed`)."""
        if self.rank[key] != CONFIRMED:
            self.rank[key] = CONFIRMED
            self._cap_confirmed(key)

    def _cap_confirmed(self, key: bytes) -> None:
        """At most 3/4 of the slots confirmed: past that, the least recently used confirmed
        snapshot other than ``key`` goes back to END."""
        confirmed = [k for k in self.snap_of if self.rank[k] == CONFIRMED]  # LRU order
        if len(confirmed) > max(1, 3 * self.num_snapshots // 4):
            self.rank[next(k for k in confirmed if k != key)] = END

    def _drop(self, key: bytes) -> None:
        self.free_snaps.append(self.snap_of.pop(key))
        del self.rank[key]
        self._forget(key)

    def add_end_snapshot(self, keys: list[bytes], tokens, pages: list[int]) -> int | None:
        """A snapshot slot for the state after ``tokens`` (a finished request's fed tokens,
        whose full pages have the chain ``keys`` and whose rows are in ``pages``), or None when
        one exists already. The full pages are registered; a last, partial page is held by the
        snapshot until it is evicted."""
        for key, page in zip(keys, pages):
            self.register(key, page)
        j, r = divmod(len(tokens), PAGE_SIZE)
        prev = keys[j - 1] if j else b""
        if r == 0:
            return self.add_snapshot(prev, END) if j and self.wants_snapshot(prev) else None
        tail = tuple(tokens[j * PAGE_SIZE:])
        key = hashlib.blake2b(b"end" + prev + ",".join(map(_item, tail)).encode(),
                              digest_size=16).digest()
        if key in self.snap_of:
            self.snap_of.move_to_end(key)
            return None
        slot = self.add_snapshot(key, END)
        self.acquire([pages[j]])
        self.partial[key] = (prev, tail, pages[j])
        self.ends_under[prev].add(key)
        return slot

    def drop_slot(self, slot: int) -> None:
        """Give up the snapshot held in ``slot`` (its state could not be saved)."""
        key = next((k for k, s in self.snap_of.items() if s == slot), None)
        if key is not None:
            self._drop(key)

    def _forget(self, key: bytes) -> None:
        """A snapshot was given up: an end snapshot's partial page is released."""
        if key in self.partial:
            prev, _, page = self.partial.pop(key)
            self.ends_under[prev].discard(key)
            if not self.ends_under[prev]:
                del self.ends_under[prev]
            self.release([page])

    def usage(self) -> dict:
        q = self.queried_tokens
        return {"hit_tokens": self.hit_tokens, "queried_tokens": q,
                "hit_rate": self.hit_tokens / q if q else 0.0,
                "cached_pages": len(self.page_of), "idle_pages": len(self.idle),
                "snapshots": len(self.snap_of), "end_snapshots": len(self.partial),
                "confirmed_snapshots": sum(r == CONFIRMED for r in list(self.rank.values())),
                "snapshot_slots": self.num_snapshots,
                "snapshot_every_pages": self.every}
