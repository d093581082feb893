"""JSON Lines files as people write them, for every reader of one (training data, chat SFT data,
``--prompts`` of ``kdsa generate`` and ``kdsa quant-check``): UTF-8 text (a leading byte-order
mark is allowed), one JSON value per line, lines ending in ``\\n`` or ``\\r\\n``, blank lines
skipped. Errors name the file and the line. And the files our jobs write: whole or not at all
(:func:`write_atomic`), or record by record, resumable (:class:`ResultsFile`).

Lines are split at ``\\n`` only. JSON strings may hold U+2028, U+2029 and U+0085 unescaped
(``json.dumps(..., ensure_ascii=False)`` writes them so), and ``str.splitlines`` splits at
them too, which cut a valid line in two ("not valid JSON") and shifted every later line number.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator


def read_lines(path: str | Path, name: str | None = None) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of each non-blank line of ``path`` (1-based numbers, ``\\r\\n``
    endings stripped). Text that is not UTF-8 raises ``ValueError`` naming ``name`` (default:
    the path) and the line where it stops decoding."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{name or path}: not UTF-8 text at line {line} (a binary file?)"
                         ) from None
    for n, line in enumerate(text.split("\n"), 1):
        line = line[:-1] if line.endswith("\r") else line
        if line.strip():
            yield n, line


def read_records(path: str | Path, name: str | None = None) -> Iterator[tuple[int, object]]:
    """``(line number, value)`` of each non-blank line of ``path``, parsed as JSON; a line that
    is not JSON raises ``ValueError`` naming ``PATH:LINE``."""
    for n, line in read_lines(path, name):
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None


def write_atomic(path: str | Path, text: str) -> Path:
    """``text`` into ``path`` through a temporary file beside it and ``os.replace``: a reader
    (or a crash) sees the old file or the whole new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


class ResultsFile:
    """A job's output JSONL, one record per input line in input order, written as records
    finish: each goes to ``PATH.partial`` at once (flushed), and the finished file becomes
    ``PATH`` (``os.replace``). An interrupted job leaves its records in ``PATH.partial``;
    ``resume=True`` reads them back (:attr:`done`; a line torn by the interruption is cut off)
    and appends after them. ``enabled=False`` (every process but the writing one) writes
    nothing."""

    def __init__(self, path: str | Path, *, resume: bool = False, enabled: bool = True):
        self.path = Path(path)
        self.partial = partial_of(self.path)
        self.done: list[dict] = []
        self._file = None
        if not enabled:
            return
        if resume and self.partial.is_file():
            self.done = _kept_records(self.partial)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.partial, "a" if self.done else "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
            self._file.flush()

    def finish(self) -> None:
        """Every record written: ``PATH.partial`` becomes ``PATH``."""
        if self._file is not None:
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            os.replace(self.partial, self.path)


def partial_of(path: str | Path) -> Path:
    """Where a :class:`ResultsFile` for ``path`` keeps its records until the job ends."""
    path = Path(path)
    return path.with_name(path.name + ".partial")


def _kept_records(path: Path) -> list[dict]:
    """The whole records at the start of ``path``; the file is cut after the last of them (an
    interruption can tear the line being written)."""
    raw = path.read_bytes()
    records, end = [], 0
    for line in raw.split(b"\n")[:-1]:  # the part after the last newline is torn
        try:
            rec = json.loads(line)
        except ValueError:
            break
        if not isinstance(rec, dict):
            break
        records.append(rec)
        end += len(line) + 1
    if end != len(raw):
        with open(path, "r+b") as f:
            f.truncate(end)
    return records
