"""What ``ModelRunner`` (``infer/runner.py``) does with a paged cache: block tables, their
widths, and the ids of pages and KDA snapshots.

On a mesh the runner's slots, the page pool and the KDA snapshots are split alike into
``partitions`` device groups (the layout's batch axes; ``model/paged_attention.py``): group ``p``
runs slots ``[p * S/G, (p + 1) * S/G)`` and holds pages ``[p * N/G, (p + 1) * N/G)`` and
snapshots ``[p * M/G, (p + 1) * M/G)``. Callers (the engine) number pages and snapshots within
the partition of the slot they serve; these methods make them global. One device: one
partition, the ids as they are.
"""

from __future__ import annotations

import jax
import numpy as np

# The narrowest block table a paged decode step reads (4096 tokens): below it the indexer's
# scan costs little beside the rest of the step, and one width serves every short context.
MIN_TABLE_PAGES = 64


class PagedSlots:
    """Mixed into ``ModelRunner``: it sets ``num_slots``, ``max_pages``, ``max_len``,
    ``num_pages``, ``num_snapshots``, ``partitions``, ``block_table``, ``cache``,
    ``snapshots`` and the jitted ``_save`` / ``_restore`` / ``_copy_page``."""

    def _check_partitions(self, num_pages, num_snapshots) -> None:
        k = self.partitions
        for what, n, flag in (("num_pages", num_pages, "--num-pages / --cache-memory"),
                              ("num_snapshots", num_snapshots, "--prefix-snapshots")):
            if n and n % k:
                raise ValueError(f"{what}={n} must be a multiple of the mesh's {k} batch device "
                                 f"groups: each holds its own part of the cache ({flag})")

    def lost_buffers(self) -> bool:
        """Whether a failed step consumed the cache or the snapshots: a compiled step deletes
        the buffers donated to it once it starts running, whether or not it finishes (a device
        out of memory mid-step). Then both are rebuilt empty and every block table row is
        cleared: what the slots, the pages and the snapshots held is gone (the engine aborts
        the running requests and forgets its cached pages)."""
        bufs = jax.tree.leaves(self.cache) + jax.tree.leaves(self.snapshots)
        if not any(x.is_deleted() for x in bufs):
            return False
        self.cache = self._new_cache()
        if self.snapshots is not None:
            self.snapshots = self._new_snapshots(self.cache)
        if self.block_table is not None:
            self.block_table[:] = -1
        return True

    def partition_of(self, slot: int) -> int:
        """The device group that runs ``slot`` (and holds its pages and snapshots)."""
        return slot // (self.num_slots // self.partitions)

    @property
    def pages_per_partition(self) -> int | None:
        return None if self.num_pages is None else self.num_pages // self.partitions

    @property
    def snapshots_per_partition(self) -> int:
        return self.num_snapshots // self.partitions

    @property
    def table_widths(self) -> tuple[int, ...]:
        """Block-table widths (pages) a paged decode step compiles for: powers of two from
        ``MIN_TABLE_PAGES``, and ``max_pages``."""
        w, out = MIN_TABLE_PAGES, []
        while w < self.max_pages:
            out.append(w)
            w *= 2
        return tuple(out) + (self.max_pages,)

    def table_width(self, pages: int) -> int:
        """The narrowest of :attr:`table_widths` holding ``pages`` pages."""
        return next(w for w in self.table_widths if w >= pages)

    def set_pages(self, slot: int, pages) -> None:
        """Give ``slot`` these pages of its partition (its positions ``[j * 64, (j + 1) * 64)``
        live in page ``pages[j]``); the rest of its block-table row becomes -1 (paged cache
        only)."""
        if self.block_table is None:
            raise ValueError("set_pages needs a paged cache (num_pages)")
        if len(pages) > self.max_pages:
            raise ValueError(f"{len(pages)} pages exceed the {self.max_pages} of max_len "
                             f"{self.max_len}")
        per = self.pages_per_partition
        if any(not 0 <= p < per for p in pages):
            raise ValueError(f"pages {list(pages)} outside the {per} of a partition")
        row = np.full(self.max_pages, -1, np.int32)
        row[:len(pages)] = np.asarray(pages, np.int32) + self.partition_of(slot) * per
        self.block_table[slot] = row

    def _snapshot(self, slot: int, snapshot: int) -> np.int32:
        per = self.snapshots_per_partition
        if not 0 <= snapshot < per:
            raise ValueError(f"snapshot {snapshot} outside the {per} of a partition")
        return np.int32(self.partition_of(slot) * per + snapshot)

    def save_state(self, slot: int, snapshot: int) -> None:
        """Copy ``slot``'s KDA states into snapshot ``snapshot`` (prefix caching)."""
        with self._rules():
            self.snapshots = self._save(self.cache, self.snapshots, np.int32(slot),
                                        self._snapshot(slot, snapshot))

    def restore_state(self, snapshot: int, slot: int) -> None:
        """Copy snapshot ``snapshot`` into ``slot``'s KDA states (the slot's own copy)."""
        with self._rules():
            self.cache = self._restore(self.cache, self.snapshots, np.int32(slot),
                                       self._snapshot(slot, snapshot))

    def copy_page(self, src: int, dst: int, *, slot: int) -> None:
        """Copy page ``src``'s rows into page ``dst`` (of ``slot``'s partition) in every DSA
        pool (prefix caching's copy-on-write of a partial page)."""
        per = self.pages_per_partition
        if not (0 <= src < per and 0 <= dst < per):
            raise ValueError(f"pages {src}, {dst} outside the {per} of a partition")
        base = self.partition_of(slot) * per
        self.cache = self._copy_page(self.cache, np.int32(base + src), np.int32(base + dst))
