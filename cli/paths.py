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


def output_file(path: Path, flag: str, inputs: tuple = ()) -> Path:
    """Get ``path`` ready to be written at the end of a long job: its folder made, and
    refused now (a ``ValueError`` naming ``flag``) when it is a folder, cannot be written, or
    is one of the job's ``inputs`` (``(flag, path)`` pairs: ``--out`` naming the prompts file
    replaced it with the results), rather than after the job."""
    import os

    if path.is_dir():
        raise ValueError(f"{flag} {path}: a folder, not a file")
    for other_flag, other in inputs:
        if (os.path.samefile(path, other) if path.exists() and Path(other).exists()
                else path.resolve() == Path(other).resolve()):
            raise ValueError(f"{flag} {path}: is the {other_flag} file; writing it would "
                             f"replace the input with the results")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot make its folder ({e.strerror})") from None
    # an existing file is opened for writing ("w"): its own permission is what counts
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise ValueError(f"{flag} {path}: not writable")
    return path
