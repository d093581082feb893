"""JSON Lines files as people write them, for every reader of one (training data, chat SFT data,
``--prompts`` of ``kdsa generate`` and ``kdsa quant-check``): UTF-8 text (a leading byte-order
mark is allowed), one JSON value per line, lines ending in ``\\n`` or ``\\r\\n``, blank lines
skipped. Errors name the file and the line.

Lines are split at ``\\n`` only. JSON strings may hold U+2028, U+2029 and U+0085 unescaped
(``json.dumps(..., ensure_ascii=False)`` writes them so), and ``str.splitlines`` splits at
them too, which cut a valid line in two ("not valid JSON") and shifted every later line number.
"""

from __future__ import annotations

import json
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
