"""Host-side bookkeeping of the paged cache (``model/paged_cache.py``): which pages are free,
and how many a request needs.

Pages are taken as a request grows (``infer/engine_pages.py``): when it is admitted to a slot,
those of what it prefills and its first decoded token, if they are free with one page of
growth to spare for each running request; then one page each time decode reaches a new page.
When decode finds no page free, the most recently admitted request is preempted and later runs
again by recompute, with the same output. A request waiting for pages waits in the queue
(first come, first served; a preempted one goes first); one whose whole length,
``pages_needed``, is more than the pool is refused when it is submitted, so the oldest
running request always finishes. On a mesh the engine keeps one pool per device group
(``infer/engine_pages.py``) and all of this holds within a group.
"""

from __future__ import annotations

from kdsa.model.paged_cache import PAGE_SIZE, SCRATCH_ROWS, pages_for


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.peak = 0  # the most pages held at once
        self.reset()

    def reset(self) -> None:
        """Every page free (what they held is gone); ``peak`` is kept."""
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` pages, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self.peak = max(self.peak, self.used)
        return pages

    def release(self, pages: list[int]) -> None:
        """Return pages taken by :meth:`allocate`; a page not held (or twice) is an error."""
        free = set(self._free)
        if (len(set(pages)) != len(pages)
                or any(not 0 <= p < self.num_pages or p in free for p in pages)):
            raise ValueError(f"pages {pages} are not all held")
        self._free.extend(reversed(pages))

    def usage(self) -> dict:
        return {"page_size": PAGE_SIZE, "pages_total": self.num_pages, "pages_used": self.used,
                "pages_free": self.free, "pages_peak": self.peak}


def page_bytes(config, rope_lanes: int | None = None) -> int:
    """Bytes of one page over every DSA layer (latent + RoPE key + indexer key per token; with
    ``rope_lanes``, the runner on TPU (``cache_layout.rope_lanes_for``), each row as it lies in
    HBM: ``dsa_cache.dsa_cache_bytes_per_token``)."""
    from kdsa.model.dsa_cache import dsa_cache_bytes_per_token

    n_dsa = sum(m != "kda" for m in config.mixer_kinds)
    return n_dsa * PAGE_SIZE * dsa_cache_bytes_per_token(config, rope_lanes)


def pages_in(cache_bytes: int, config, rope_lanes: int | None = None) -> int:
    """The pages a pool of ``cache_bytes`` holds (``--cache-memory``), besides each DSA
    layer's ``SCRATCH_ROWS`` (``PagedDSACache``: the writes of tokens without a page)."""
    per = page_bytes(config, rope_lanes)
    if per == 0:
        raise ValueError("this model has no DSA layers: there is nothing to page")
    n = (cache_bytes - SCRATCH_ROWS * (per // PAGE_SIZE)) // per
    if n < 1:
        raise ValueError(f"--cache-memory {cache_bytes} B holds no page ({per} B per page of "
                         f"{PAGE_SIZE} tokens)")
    return n


def pages_needed(prompt_len: int, max_tokens: int, max_len: int) -> int:
    """The pages of a request's whole length: its prompt and every token it may generate."""
    return pages_for(min(prompt_len + max_tokens, max_len))
