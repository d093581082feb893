"""Checks of a run directory before a job spends time computing: it can be written, and it
has room for its checkpoints. Each failure is a one-line ``ValueError`` naming the folder,
instead of an error deep inside an asynchronous checkpoint write minutes into the run.

``check_run_dir(run_dir, checkpoint_bytes, keep)`` creates ``run_dir`` if needed, writes and
removes a probe file (a read-only file system or a missing permission fails here), and asks
for free space of ``(keep + 1) * checkpoint_bytes``: the kept checkpoints plus the one being
written into its temporary folder. Space already taken by this run's own step folders counts
as available, so a resumed run that will prune old steps is not refused; so do the unfinished saves
of interrupted runs (the run's first save removes them before it writes); steps set aside as
corrupt do not (nothing removes them).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import jax
import numpy as np

from kdsa.model.folders import train_steps
from kdsa.sharding.agreement import agreed
from kdsa.train.checkpointing import UNFINISHED_MARK


def state_bytes(tree) -> int:
    """Bytes of every array leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct``)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "shape"))


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _folder_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def check_run_dir(run_dir: str | Path, checkpoint_bytes: int, keep: int,
                  checkpoints: str = "checkpoints", resume: bool = False,
                  also=None) -> None:
    """Raise ``ValueError`` unless ``run_dir`` is writable and has room for ``keep + 1``
    checkpoints of ``checkpoint_bytes`` (``run_dir/checkpoints`` already counts as room), and
    with ``resume`` unless it is a run directory rather than one of the folders inside one
    (:func:`_inside_a_run`), and unless ``also()`` (another check of the run's folders, e.g.
    ``init_from.check_export_destination``) raises. In a
    job of several processes every process raises when any one's check failed (one process
    alone exiting left the others waiting in the job's first collective): every process must
    call it, with ``checkpoint_bytes`` 0 where another process asks for the room."""
    def check():
        try:
            _check(Path(run_dir), checkpoint_bytes, keep, checkpoints)
            if resume:
                _inside_a_run(Path(run_dir), checkpoints)
            if also is not None:
                also()
        except OSError as e:  # (a stale mount, a missing permission: every process must hear)
            raise ValueError(f"run dir {run_dir} cannot be checked "
                             f"({e.strerror or type(e).__name__})") from None

    agreed(check, f"run dir {run_dir}")


def _inside_a_run(run_dir: Path, checkpoints: str) -> None:
    """``--resume`` into ``RUN_DIR/model``, ``RUN_DIR/checkpoints`` or a step folder in it
    would find no checkpoint there and start a new run inside that folder: refused, naming the
    run directory meant."""
    if (run_dir / "_CHECKPOINT_METADATA").is_file():
        what = "a checkpoint or model folder"
    elif train_steps(run_dir):
        what = "a folder of training checkpoints"
    else:
        return
    meant = next((p for p in (run_dir.parent, run_dir.parent.parent)
                  if train_steps(p / checkpoints)), None)
    raise ValueError(f"--resume: {run_dir} is {what}, not a run directory"
                     + (f"; resume with --run-dir {meant}" if meant else ""))


def _check(run_dir: Path, checkpoint_bytes: int, keep: int, checkpoints: str) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run dir {run_dir} is a file, not a folder")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".kdsa-write-probe-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"run dir {run_dir} is not writable "
                         f"({e.strerror or type(e).__name__})") from None
    need = (keep + 1) * checkpoint_bytes
    # room the run gets back: its step folders (pruned as it saves) and the unfinished saves
    # of interrupted runs (N.orbax-checkpoint-tmp-..., removed by its first save); not steps
    # set aside (N.corrupt) or anything else, which nothing removes
    own = leftovers = 0
    folder = run_dir / checkpoints
    for p in sorted(folder.iterdir()) if folder.is_dir() else ():
        size = _folder_bytes(p) if p.is_dir() else p.lstat().st_size
        if p.name.isdigit() or UNFINISHED_MARK in p.name:
            own += size
        else:
            leftovers += size
    free = shutil.disk_usage(run_dir).free
    if free + own < need:
        extra = (f"; {_mb(leftovers)} of it in {folder} is steps set aside as corrupt and "
                 f"other files, which may be removed" if leftovers else "")
        raise ValueError(f"run dir {run_dir}: {_mb(free)} free, but {keep} kept checkpoints "
                         f"plus the one being written need {_mb(need)} "
                         f"({_mb(checkpoint_bytes)} each; lower train.keep_checkpoints or "
                         f"free some space{extra})")
