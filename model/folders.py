"""Checkpoint folders on disk: which folder a path names, and whether a command may replace it.

**Destinations.** ``kdsa convert`` (both directions) and ``kdsa.model.checkpoint.save_params`` /
``save_model`` write a whole folder into a temporary sibling and rename it onto the destination
``DST`` when complete, removing what was there. :func:`check_destination` decides, before
anything is read or written, whether that is allowed (:func:`replace_folder` does the rename):

* ``DST`` may not be a source of the command, contain one (a parent folder) or lie inside one,
  whatever ``overwrite`` says: paths are compared after ``Path.resolve()``, so symbolic links
  and ``..`` do not hide the overlap; nor may a source be or lie inside one of ``DST``'s
  scratch siblings ``DST.kdsa-*`` (the writers' temporary folders, cleaned before a write);
* a ``DST`` that does not exist, or is an empty folder, is fine;
* any other existing ``DST`` needs ``overwrite`` (``--overwrite``), and even then only a kdsa
  model folder (an Orbax checkpoint with kdsa metadata) or a Hugging Face checkpoint folder
  (``config.json`` plus ``*.safetensors`` or the index) is replaced: an unrelated folder, a
  regular file or a dangling link is refused, so a mistyped path never deletes anything.

**Sources.** :func:`locate` tells which Orbax folder a path names: a kdsa model folder, a
training checkpoint ``RUN_DIR/checkpoints/N`` (Orbax items ``state`` and ``meta``, written by
``kdsa.train.checkpointing``), or ``RUN_DIR/checkpoints`` / ``RUN_DIR`` for their newest step.

**Files beside the weights.** :func:`tokenizer_files` lists the tokenizer, chat template and
generation defaults (and the remote-code Python files they name) that travel with a folder.

**Orbax's errors.** Its read errors embed whole TensorStore specs and ``<bound method ...>``
reprs, and it logs tracebacks while probing; :func:`orbax_reason` and :func:`quiet_orbax` turn
that into one line.

This module lives in ``model/`` (the lowest package that needs it) and imports nothing from kdsa.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

KDSA = "a kdsa model folder"
HF = "a Hugging Face checkpoint folder"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read or written as asked."""


class DestinationError(ValueError):
    """A destination the command refuses to write (one line naming the path and the reason)."""


def folder_kind(path: str | os.PathLike) -> str | None:
    """``KDSA``, ``HF`` or None (anything else, including a missing path) for ``path``."""
    p = Path(path)
    if not p.is_dir():
        return None
    meta = p / "_CHECKPOINT_METADATA"
    if meta.is_file():
        try:
            custom = json.loads(meta.read_text()).get("custom_metadata") or {}
        except (OSError, ValueError, AttributeError):
            return None
        return KDSA if isinstance(custom, dict) and isinstance(custom.get("kdsa"), dict) \
            else None
    if (p / "config.json").is_file() and ((p / "model.safetensors.index.json").is_file()
                                          or any(p.glob("*.safetensors"))):
        return HF
    return None


def _describe(p: Path) -> str:
    if p.is_symlink() and not p.exists():
        return "a dangling symbolic link"
    if not p.is_dir():
        return "a regular file" if p.is_file() else "not a folder"
    names = sorted(c.name for c in p.iterdir())
    entries = "1 entry" if len(names) == 1 else f"{len(names)} entries"
    return f"a folder holding {entries}, e.g. {names[:3]}"


def check_destination(dst: str | os.PathLike, *, sources: Iterable[str | os.PathLike] = (),
                      overwrite: bool = False) -> Path:
    """``dst`` made absolute, or :class:`DestinationError` when writing it is refused (the
    rules are in the module docstring). ``sources``: the paths the command reads."""
    dst = Path(dst).expanduser().absolute()
    for src in sources:
        how = write_overlap(dst, src)
        if how in ("scratch", "in scratch"):  # (an interrupted run's leftovers there go)
            where = "one of them" if how == "scratch" else "inside one"
            raise DestinationError(f"{dst}: writing it uses the scratch folders {dst}.kdsa-*, "
                                   f"and the source {src} is {where}; rename the source or "
                                   f"write elsewhere")
        if how == "same":
            raise DestinationError(f"{dst}: is the source of this command; write to another "
                                   f"folder")
        if how == "contains":
            raise DestinationError(f"{dst}: contains the source {src}; replacing it would "
                                   f"delete the source")
        if how == "inside":
            raise DestinationError(f"{dst}: is inside the source {src}; write outside it")
    if not os.path.lexists(dst):
        return dst
    if dst.is_dir() and not dst.is_symlink() and not any(dst.iterdir()):
        return dst  # an empty folder: nothing to lose
    kind = folder_kind(dst)
    if kind is None:
        raise DestinationError(f"{dst}: exists and is not a kdsa model folder or a Hugging Face "
                               f"checkpoint folder ({_describe(dst)}); refusing to replace it, "
                               f"even with --overwrite")
    if not overwrite:
        raise DestinationError(f"{dst}: already exists ({kind}); pass --overwrite (Python: "
                               f"overwrite=True) to replace it")
    return dst


# ------------------------------------------------------------------------------- reading

def _is_train_step(p: Path) -> bool:
    """A ``train/checkpointing.py`` step folder: Orbax items ``state`` (the train state) and
    ``meta`` (JSON)."""
    return ((p / "_CHECKPOINT_METADATA").is_file() and (p / "state").is_dir()
            and (p / "meta").is_dir())


def train_steps(root: str | os.PathLike) -> list[int]:
    """The complete training checkpoint steps in ``root`` (a ``RUN_DIR/checkpoints``)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(c.name) for c in root.iterdir() if c.name.isdigit() and _is_train_step(c))


def locate(path: str | os.PathLike) -> tuple[Path, bool]:
    """``(folder, is_training_checkpoint)`` for what ``path`` names: a kdsa model folder is
    itself; a training checkpoint ``RUN_DIR/checkpoints/N`` too; ``RUN_DIR/checkpoints`` and
    ``RUN_DIR`` name their newest step. Relative paths are made absolute (Orbax needs it)."""
    path = Path(path).expanduser().absolute()
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if _is_train_step(path):
        return path, True
    if not (path / "_CHECKPOINT_METADATA").exists():
        for root in (path, path / "checkpoints"):
            steps = train_steps(root)
            if steps:
                return root / str(steps[-1]), True
    return path, False


def orbax_context():
    """A fresh Orbax v1 ``Context`` for kdsa's saves. Replica-parallel saving (the devices that
    hold copies of a replicated array each write a slice of it) is on only in a job of several
    processes: in one process every slice is written by that process anyway, and each slice is a
    compiled program per array shape (368 of them for the two saves of a 3-step ``tiny`` run on
    8 CPU devices, about 10 s of compiles)."""
    import jax
    from orbax.checkpoint.experimental import v1 as ocp

    ctx = ocp.Context()
    ctx.array.saving.use_replica_parallel = jax.process_count() > 1
    return ctx


@contextlib.contextmanager
def quiet_orbax(collect: bool = False):
    """Keep Orbax's log records (absl warnings with whole TensorStore specs, asyncio's "Task
    exception was never retrieved") off stderr during the block; yields the list of their
    messages, so an error can quote the one line that matters. ``collect``: also run the garbage
    collector at the end with unraisable-exception reports dropped (a failed restore leaves
    futures whose collection later prints tracebacks; ~0.2 s, so not for every small read)."""
    got: list[str] = []

    class _Keep(logging.Filter):
        def filter(self, record):
            got.append(record.getMessage())
            return False

    keep = _Keep()
    _drop_closed_loop_reports()
    loggers = [logging.getLogger(n) for n in ("absl", "asyncio")]
    for lg in loggers:
        lg.addFilter(keep)
    try:
        yield got
    finally:
        if collect:
            hook, sys.unraisablehook = sys.unraisablehook, lambda unraisable: None
            try:
                gc.collect()
            finally:
                sys.unraisablehook = hook
        for lg in loggers:
            lg.removeFilter(keep)


class _AbandonedReads(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for a TensorStore read that a
    failed restore abandoned (logged when the task is collected, often at exit)."""

    def filter(self, record):
        e = record.exc_info[1] if record.exc_info else None
        return not (record.getMessage().startswith("Task exception was never retrieved")
                    and e is not None and "tensorstore" in str(e).lower())


def _drop_closed_loop_reports() -> None:
    """Install (once) an unraisable-exception hook that drops uvloop's "Event loop is closed"
    reports, and :class:`_AbandonedReads` on asyncio's logger: when one read of a restore
    fails, Orbax stops its event loop while TensorStore's other reads are in flight, and each
    of them later printed a traceback (dozens, hundreds of lines around the one-line reason,
    some at exit). Every other report goes where it went before."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedReads) for f in asyncio_log.filters):
        asyncio_log.addFilter(_AbandonedReads())
    if getattr(sys.unraisablehook, "_kdsa_drops_closed_loops", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        e, tb = unraisable.exc_value, unraisable.exc_traceback
        files = []
        while tb is not None:
            files.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        if (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"
                and any("uvloop" in f for f in files)):
            return
        previous(unraisable)

    hook._kdsa_drops_closed_loops = True
    sys.unraisablehook = hook


def orbax_reason(e: BaseException) -> str:
    """The innermost cause of an Orbax / TensorStore error in one short line: no TensorStore
    spec, no ``<bound method ...>`` repr (what Orbax's read errors embed)."""
    seen = {id(e)}
    while (e.__cause__ or e.__context__) is not None and id(e.__cause__ or e.__context__) \
            not in seen:
        e = e.__cause__ or e.__context__
        seen.add(id(e))
    return f"{type(e).__name__}: {one_line(str(e))}"


def one_line(text: str) -> str:
    """An Orbax / TensorStore message cut to its first line, without the spec dumps."""
    # Orbax writes ``[tensorstore_spec='...`` or, for several arrays, ``[tensorstore_spec[1]=``
    text = re.split(r"\s*\[tensorstore_spec(?:\[\d+\])?=|\s*See full TensorStore details",
                    text)[0]
    text = re.sub(r"<bound method [^>]*>?", "", text).strip().splitlines()
    return (text[0] if text else "")[:1000]  # one line; long paths must not cut the reason


def write_overlap(dst: Path, src: str | os.PathLike) -> str | None:
    """How writing the folder ``dst`` (absolute) would touch ``src``: ``"scratch"`` / ``"in
    scratch"`` (``src`` is, or lies inside, one of ``dst``'s scratch siblings ``DST.kdsa-*``,
    beside ``dst``'s own name: the writers' temporary and set-aside folders, cleaned before a
    write), ``"same"``, ``"contains"`` (``src`` inside ``dst``), ``"inside"`` (``dst`` inside
    ``src``), or None. Paths are compared after ``Path.resolve()``."""
    real, parent = dst.resolve(), dst.parent.resolve()
    s = Path(src).expanduser().absolute().resolve()
    near = next((p for p in (s, *s.parents)
                 if p.parent == parent and p.name.startswith(f"{dst.name}.kdsa-")), None)
    if near is not None:
        return "scratch" if near == s else "in scratch"
    if real == s:
        return "same"
    if s.is_relative_to(real):
        return "contains"
    return "inside" if real.is_relative_to(s) else None


def tmp_sibling(path: Path, tag: str) -> Path:
    """``NAME.kdsa-TAG``: deterministic, so every process of a multi-host job agrees on it;
    not hidden, as Orbax's partial-save finalize mishandles names starting with "."."""
    return path.parent / f"{path.name}.kdsa-{tag}"


def replace_folder(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` to ``path``. An existing ``path`` is swapped with ``tmp`` in one atomic
    step where the system offers it (Linux ``renameat2(RENAME_EXCHANGE)``), then removed, so
    ``path`` is always either the old or the new folder, a crash included. Elsewhere it is
    moved aside first (``NAME.kdsa-old``) and removed after: a crash between the two renames
    leaves the old folder there. The caller has checked ``path`` (``check_destination``); a
    symbolic link there is replaced, not followed.

    Every file and folder under ``tmp`` is synced to disk first, and the parent folder after
    the rename, before the old folder is removed: a machine crash (not only a killed process)
    soon after a replace cannot leave the new name on empty or torn files with the old ones
    gone (file systems may commit a rename before the data it names)."""
    sync_tree(tmp)
    if os.path.lexists(path) and _exchange(tmp, path):
        _fsync(path.parent)
        _remove(tmp)  # now the old folder
        return
    old = None
    if os.path.lexists(path):
        old = tmp_sibling(path, "old")
        _remove(old)
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        if old is not None:
            os.rename(old, path)
        raise
    _fsync(path.parent)
    if old is not None:
        _remove(old)


def sync_tree(root: Path) -> None:
    """``fsync`` every regular file and folder under ``root``, and ``root`` itself."""
    for folder, _, names in os.walk(root):
        for name in names:
            f = os.path.join(folder, name)
            if not os.path.islink(f):
                _fsync(f)
        _fsync(folder)


def _fsync(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # a file system that cannot sync a folder (some network ones)
        pass
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` in one step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``, glibc >= 2.28); False where the system or file system has no such
    call, and nothing changed."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return False
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    return call(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0


def _remove(p: Path) -> None:
    if p.is_symlink():
        p.unlink()
    else:
        shutil.rmtree(p, ignore_errors=True)


# the files of a model's tokenizer, chat template and generation defaults that travel with its
# weights
TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


def tokenizer_files(folder: str | os.PathLike | None) -> dict[str, Path]:
    """``{name: path}`` of the :data:`TOKENIZER_FILES` present in ``folder`` (a Hugging Face
    checkpoint or a kdsa model folder; a training checkpoint has none), and when its
    ``tokenizer_config.json`` or ``config.json`` names remote code (``auto_map``: e.g. K3's
    ``tokenization_kimi.TikTokenTokenizer``, Kimi Linear's ``modeling_kimi``), the folder's
    Python files, which that code imports from one another (a kdsa model folder holds Python
    files only when its source named remote code); ``{}`` for None."""
    if folder is None:
        return {}
    folder = Path(folder).absolute()
    out = {n: folder / n for n in TOKENIZER_FILES if (folder / n).is_file()}
    if (folder / "_CHECKPOINT_METADATA").is_file() or any(
            _names_remote_code(folder / n) for n in ("tokenizer_config.json", "config.json")):
        out.update({p.name: p for p in sorted(folder.glob("*.py")) if p.is_file()})
    return out


def _names_remote_code(path: Path) -> bool:
    """Whether the JSON object in ``path`` has an ``auto_map`` (False when missing or not
    a JSON object)."""
    try:
        return bool(json.loads(path.read_text()).get("auto_map"))
    except (OSError, ValueError, AttributeError):
        return False
