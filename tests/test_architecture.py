"""The package import graph: layers without cycles (every import, including those inside
functions, read from the source with ``ast``)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels_pallas", "model", "sharding", "infer", "train", "cli")
# what each package must never import (directly or inside a function)
FORBIDDEN = {
    "kernels_pallas": {"model", "sharding", "infer", "train", "cli"},
    "model": {"sharding", "infer", "train", "cli"},
    "sharding": {"infer", "train", "cli"},
    "infer": {"train", "cli"},
    "train": {"cli"},
}


def package_imports() -> dict[str, dict[str, list[str]]]:
    """``{package: {imported package: ["file:line", ...]}}`` over the ``kdsa.*`` imports."""
    graph: dict[str, dict[str, list[str]]] = {p: {} for p in PACKAGES}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for name in names:
                    parts = name.split(".")
                    if parts[0] == "kdsa" and len(parts) > 1 and parts[1] != pkg:
                        where = f"{path.relative_to(ROOT)}:{node.lineno}"
                        graph[pkg].setdefault(parts[1], []).append(where)
    return graph


GRAPH = package_imports()


@pytest.mark.parametrize("pkg", sorted(FORBIDDEN))
def test_package_imports_only_lower_layers(pkg):
    bad = {dep: GRAPH[pkg][dep] for dep in sorted(FORBIDDEN[pkg] & set(GRAPH[pkg]))}
    assert not bad, f"{pkg} imports {bad}"


def test_no_package_cycles():
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for dep in GRAPH.get(todo.pop(), {}):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    cycles = [p for p in PACKAGES if p in reach(p)]
    assert not cycles, {p: sorted(GRAPH[p]) for p in cycles}


def test_the_library_holds_no_test_drivers():
    """Multi-host self-checks and the scripted model live under tests/."""
    for name in ("sharding/jobcheck.py", "sharding/selfcheck.py", "infer/scripted.py"):
        assert not (ROOT / name).exists(), name
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            text = path.read_text()
            assert "import pytest" not in text and "sys.path.insert" not in text, path


def test_public_api():
    """``kdsa.model`` and ``kdsa.infer`` export what their docstrings promise."""
    import kdsa.infer
    import kdsa.model
    from kdsa.infer.engine import Engine
    from kdsa.model.transformer import Transformer

    assert kdsa.model.Transformer is Transformer and kdsa.infer.Engine is Engine
    for module in (kdsa.model, kdsa.infer):
        for name in module.__all__:
            assert getattr(module, name) is not None, (module.__name__, name)
        with pytest.raises(AttributeError):
            module.no_such_name  # noqa: B018
