"""Path arguments: every file or folder a command reads or writes is made absolute once, here.

``type=abs_path`` on an argument turns ``rel/dir`` into ``$PWD/rel/dir`` when the command line
is parsed, so nothing below the CLI (Orbax, which refuses relative destinations; checkpoint
readers that compare stored paths) ever sees a relative path, and error messages name the
folder the user meant. ``~`` is expanded; symbolic links are kept (``resolve`` happens only
where two paths are compared, e.g. ``kdsa convert``'s destination rules).
"""

from __future__ import annotations

from pathlib import Path


def abs_path(text: str) -> Path:
    """``argparse`` type of a path argument: ``~`` expanded, made absolute against the cwd."""
    if not text:
        raise ValueError("an empty path")
    return Path(text).expanduser().absolute()
