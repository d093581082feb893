"""Citations stay inside the repository (issue #19 section 6, "honest docs").

Pure Python, no JAX: every ``.py`` and ``.md`` file of the repository (outside the virtual
environments, ``.git`` and build outputs) must not cite notes outside the repository, and every
``docs/reference/<file>.md`` it cites must exist, with the section it names where it names one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", "build", "runs", "kdsa.egg-info"}
# Built from pieces so this file does not match its own patterns.
OUTSIDE = ("shared" + "/reference", ".." + "/shared", "/work" + "/shared")
CITATION = re.compile(r"docs/reference/([A-Za-z0-9_.-]+\.md)")
# a section number right after a citation: ``docs/reference/kda.md`` §1, ... section 2, ... (1.1)
SECTION = re.compile(r"docs/reference/([A-Za-z0-9_.-]+\.md)[`\])]*(?:\([^)]*\))?\s*"
                     r"(?:§\s*|sections?\s+|\()(\d+(?:\.\d+)?)")


def _skipped(path: Path) -> bool:
    rel = path.relative_to(ROOT).parts
    return any(p in SKIP_DIRS or p.startswith(".venv") or p.endswith(".egg-info")
               for p in rel[:-1])


def _files() -> list[Path]:
    return sorted(p for ext in ("*.py", "*.md") for p in ROOT.rglob(ext)
                  if p.is_file() and not _skipped(p))


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _sections(md: Path) -> set[str]:
    """Section numbers of a reference file: ``## 1. Maths`` -> "1", ``### 1.3 ...`` -> "1.3"."""
    heads = re.findall(r"^#{2,4}\s+(\d+(?:\.\d+)*)\.?\s", _read(md), flags=re.M)
    return set(heads)


def test_the_scan_sees_the_repository():
    files = {p.relative_to(ROOT).as_posix() for p in _files()}
    assert "README.md" in files and "model/kda.py" in files, sorted(files)[:20]
    assert not any(f.startswith(".venv") for f in files)


def test_no_citation_outside_the_repository():
    bad = []
    for path in _files():
        for n, line in enumerate(_read(path).splitlines(), 1):
            for pat in OUTSIDE:
                if pat in line:
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {pat!r}: {line.strip()[:100]}")
    assert not bad, "files citing notes outside the repository:\n" + "\n".join(bad)


def test_cited_reference_files_exist():
    missing = []
    for path in _files():
        for name in CITATION.findall(_read(path)):
            if not (REFERENCE / name).is_file():
                missing.append(f"{path.relative_to(ROOT)}: docs/reference/{name}")
    assert not missing, "cited reference files that do not exist:\n" + "\n".join(missing)


def test_cited_sections_exist():
    sections = {p.name: _sections(p) for p in REFERENCE.glob("*.md")}
    missing = []
    for path in _files():
        for name, sec in SECTION.findall(_read(path)):
            if name in sections and sec not in sections[name]:
                missing.append(f"{path.relative_to(ROOT)}: docs/reference/{name} section {sec} "
                               f"(has {sorted(sections[name])})")
    assert not missing, "cited sections that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("name", ["kda.md", "dsa.md", "kimi_k3.md", "mxfp4.md",
                                  "rl_and_serving.md", "maxtext.md"])
def test_reference_files_are_indexed_and_name_sources(name):
    assert name in _read(REFERENCE / "README.md"), f"{name} missing from docs/reference/README.md"
    text = _read(REFERENCE / name)
    assert re.search(r"sources?", text, flags=re.I), f"{name} names no source"
