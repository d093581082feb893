"""pyproject.toml lists every package: a wheel (non-editable) install must not lose a subfolder."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    package_dir = setuptools["package-dir"]
    found = {"kdsa"}
    for name, folder in package_dir.items():
        if name == "kdsa":
            continue
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    assert not found - listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
    assert not listed - found, f"listed but missing on disk: {sorted(listed - found)}"
    assert all(re.fullmatch(r"kdsa(\.\w+)*", p) for p in listed)
