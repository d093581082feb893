"""Exact prefix caching for the hybrid model (host-side bookkeeping; the runner moves the data).

Agents resend their whole history every turn. What a new request can reuse of an earlier one
is, for the Gated DSA layers, the cache pages of their common prefix, and for the KDA layers
their recurrent state *at the point where the reuse stops* (a KDA state cannot be cut back).
So the cache keeps two things:

* **pages** keyed by a hash chain over full 64-token pages, ``key_j = H(key_{j-1}, tokens of
  page j)``: a page written by a prefill is registered under its key once it is full, and any
  later request whose prompt has the same first ``j + 1`` pages shares it (reference counts);
* **KDA snapshots** taken during prefill at page-aligned points, every ``snapshot_every`` pages
  (the state after ``j`` pages, keyed by ``key_{j-1}``), in a fixed number of snapshot slots.

A request resumes from the deepest snapshot whose pages are all still cached and that leaves at
least one prompt token to prefill (its logits give the first output token); it shares those
pages, gets the snapshot copied into its own state slot (so two requests resuming from one
snapshot never interfere) and prefills only the rest. Exactness: the shared rows and the state
are those an uncached prefill of the same tokens writes, so outputs equal those without a hit
up to float rounding of a different chunking (the tests check tokens and log-probs within 1e-5).

Eviction is LRU over pages no running request references, and over snapshots; a page still
referenced is never evicted. Requests with images do not use the cache (their placeholder
tokens do not identify the image).
"""

from __future__ import annotations

import collections
import hashlib

from kdsa.infer.page_pool import PagePool
from kdsa.model.paged_cache import PAGE_SIZE


def page_keys(tokens) -> list[bytes]:
    """The hash chain of the full pages of ``tokens``."""
    keys, prev = [], b""
    for j in range(len(tokens) // PAGE_SIZE):
        page = ",".join(str(int(t)) for t in tokens[j * PAGE_SIZE:(j + 1) * PAGE_SIZE])
        prev = hashlib.blake2b(prev + page.encode(), digest_size=16).digest()
        keys.append(prev)
    return keys


class PrefixCache:
    def __init__(self, pool: PagePool, num_snapshots: int, snapshot_every: int):
        if num_snapshots < 1 or snapshot_every < 1:
            raise ValueError(f"need num_snapshots >= 1 and snapshot_every >= 1, got "
                             f"{num_snapshots}, {snapshot_every}")
        self.pool, self.every = pool, snapshot_every
        self.page_of: dict[bytes, int] = {}  # key -> page holding those rows
        self.key_of: dict[int, bytes] = {}
        self.refs: collections.Counter[int] = collections.Counter()
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU
        self.snap_of: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU
        self.free_snaps = list(range(num_snapshots - 1, -1, -1))
        self.num_snapshots = num_snapshots
        self.hit_tokens = self.queried_tokens = 0

    # ---- lookup and pages ----
    def lookup(self, keys: list[bytes], prompt_len: int) -> tuple[int, int | None, list[int]]:
        """``(pages, snapshot slot, shared pages)`` of the deepest usable snapshot for a prompt
        with these page keys, the shared pages held once more; ``(0, None, [])`` on a miss."""
        for j in range(min(len(keys), (prompt_len - 1) // PAGE_SIZE), 0, -1):
            slot = self.snap_of.get(keys[j - 1])
            if slot is None or any(k not in self.page_of for k in keys[:j]):
                continue
            self.snap_of.move_to_end(keys[j - 1])
            pages = [self.page_of[k] for k in keys[:j]]
            self.acquire(pages)
            return j, slot, pages
        return 0, None, []

    def acquire(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] += 1
            self.idle.pop(p, None)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh pages (held once), evicting idle cached pages as needed; None (nothing
        taken) when even that is not enough."""
        if n > self.pool.free + len(self.idle):
            return None
        while self.pool.free < n:
            page, _ = self.idle.popitem(last=False)
            del self.page_of[self.key_of.pop(page)]
            self.pool.release([page])
        pages = self.pool.allocate(n)
        self.acquire(pages)
        return pages

    def release(self, pages: list[int]) -> None:
        """Drop one reference per page; a cached page becomes idle (evictable), another one
        goes back to the pool."""
        free = []
        for p in pages:
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

    # ---- snapshots ----
    def wants_snapshot(self, key: bytes) -> bool:
        return key not in self.snap_of

    def add_snapshot(self, key: bytes) -> int:
        """A snapshot slot for ``key`` (the least recently used one is given up when full)."""
        if self.free_snaps:
            slot = self.free_snaps.pop()
        else:
            _, slot = self.snap_of.popitem(last=False)
        self.snap_of[key] = slot
        return slot

    def usage(self) -> dict:
        q = self.queried_tokens
        return {"hit_tokens": self.hit_tokens, "queried_tokens": q,
                "hit_rate": self.hit_tokens / q if q else 0.0,
                "cached_pages": len(self.page_of), "idle_pages": len(self.idle),
                "snapshots": len(self.snap_of), "snapshot_slots": self.num_snapshots,
                "snapshot_every_pages": self.every}
