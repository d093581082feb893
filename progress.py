"""The one progress bar of every long job: training and RL steps, generation requests,
conversion bytes, benchmark phases.

A :class:`Progress` draws a ``tqdm`` bar on stderr, or does nothing when not ``enabled`` (a
``--no-progress`` flag, a process other than 0), so call sites never branch::

    bar = Progress(total=steps, initial=start, unit="step", enabled=show)
    bar.advance_to(step, loss="0.412")        # position, then the key=value postfix
    bar.advance_to(step, desc="rl step 3 reward 0.61")   # or a free-text description
    bar.close()
"""

from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, *, initial: int = 0, unit: str = "step",
                 enabled: bool = True, unit_scale: bool = False, desc: str | None = None):
        """``unit_scale``: show k / M / G prefixes and a rate in them (bytes: ``unit="B"``)."""
        self.count = initial
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit=unit, unit_scale=unit_scale,
                             desc=desc, file=sys.stderr, dynamic_ncols=True)

    def update(self, n: int = 1, **postfix) -> None:
        """Advance by ``n``; ``postfix`` (e.g. ``loss="0.41"``) replaces the text after the bar."""
        self.advance_to(self.count + n, **postfix)

    def advance_to(self, position: int, desc: str | None = None, **postfix) -> None:
        """Move to ``position``; ``desc`` replaces the text before the bar, ``postfix`` the
        ``key=value`` text after it."""
        self.count = position
        if self._bar is None:
            return
        if desc is not None:
            self._bar.set_description(desc, refresh=False)
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(position - self._bar.n)

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_description(text, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
