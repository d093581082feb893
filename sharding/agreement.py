"""Decisions every process of a multi-process job must take together.

Every host runs the same command, but each reads its own disk: a check that fails on one host
only (a file missing there, a different copy at the same path) must not let that process exit
alone while the others wait in the job's next collective until the coordination service gives
up with a generic error, nor let the hosts go on with different inputs. In a one-process job
each function is the plain check (or value).
"""

from __future__ import annotations

import hashlib
from typing import Callable, TypeVar

import jax
import numpy as np

T = TypeVar("T")


def _process_count() -> int:
    return jax.process_count()


def _gather(x: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x))


def every_process(ok: bool) -> bool:
    """Whether ``ok`` holds on every process of the job (a collective when there are
    several; every process must call it)."""
    if _process_count() == 1:
        return bool(ok)
    return bool(np.all(_gather(np.int32(ok))))


def agreed(check: Callable[[], T], what: str) -> T:
    """``check()``'s value; when it raised on any process, every process raises: the failing
    ones their own error (an ``OSError`` as a ``ValueError`` naming ``what``), the others one
    naming them. Any exception counts: one that skipped the all-gather (an ``OverflowError``
    from a damaged data file) left the other processes waiting in it."""
    error, value = None, None
    try:
        value = check()
    except OSError as e:  # (a stale mount, a missing permission: every process must hear)
        error = ValueError(f"{what}: {e.strerror or type(e).__name__}"
                           + (f" ({e.filename})" if e.filename else ""))
    except Exception as e:  # noqa: BLE001 -- raised again below, after the all-gather
        error = e
    if _process_count() > 1:
        failed = _gather(np.int32(error is not None))
        if error is None and failed.any():  # (naming them: every_process only says whether)
            raise ValueError(f"{what}: the check failed on process(es) "
                             f"{np.flatnonzero(failed).tolist()} (their error says why)")
    if error is not None:
        raise error
    return value


def same_on_every_process(value: str, what: str) -> None:
    """Raise on every process unless ``value`` (e.g. a data fingerprint) is the same on all,
    naming the processes that differ from process 0."""
    if _process_count() == 1:
        return
    digest = np.frombuffer(hashlib.sha256(value.encode()).digest()[:8], np.uint32)  # [2]
    every = _gather(digest).reshape(-1, digest.size)                               # [P, 2]
    differ = [p for p in range(len(every)) if (every[p] != every[0]).any()]
    if differ:
        raise ValueError(f"{what} differs between processes: process(es) {differ} read "
                         f"other {what} than process 0 (every host must read the same)")


def from_first_process(value: int) -> int:
    """Process 0's ``value`` on every process (a decision only process 0 can take, e.g. how
    many records of an interrupted job's output, which only it reads, are done)."""
    if _process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int64(value)))
