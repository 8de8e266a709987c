"""The shape of vitexplain.batch and vitexplain.data: imports flow one way (no circles, no command
module importing another), decoding stands apart from preprocessing, and no package imports
another package's private helpers. Read from the source (every import counts, also those inside
functions and under TYPE_CHECKING)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "vitexplain"
COMMANDS = {"export", "caption", "explore"}


def _imports(path: Path, package: str) -> set[str]:
    """Absolute dotted names a module imports (``from . import x`` gives ``package.x`` too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _graph(subpackage: str) -> dict[str, set[str]]:
    """Module -> modules of the same subpackage it imports (``__init__`` left out)."""
    package = f"vitexplain.{subpackage}"
    files = {p.stem: p for p in (ROOT / subpackage).glob("*.py") if p.stem != "__init__"}
    return {name: {m.rsplit(".", 1)[1] for m in _imports(path, package)
                   if m.startswith(package + ".") and m.rsplit(".", 1)[1] in files and m.count(".") == 2} - {name}
            for name, path in files.items()}


def _circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` (as a path), or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


@pytest.mark.parametrize("subpackage", ["batch", "data"])
def test_imports_have_no_circle(subpackage) -> None:
    assert _circle(_graph(subpackage)) == []


def test_the_circle_finder_finds_one() -> None:  # the oracle of the test above
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) == []


def test_no_batch_command_imports_another() -> None:
    graph = _graph("batch")
    assert COMMANDS <= set(graph)
    assert {name: graph[name] & COMMANDS for name in COMMANDS} == {name: set() for name in COMMANDS}


def test_decoding_stands_apart_from_preprocessing() -> None:
    graph = _graph("data")
    assert "images" not in graph["decoding"]  # decoding needs nothing of preprocessing
    import vitexplain as vx
    from vitexplain.data import decoding, images

    assert vx.load_image is images.load_image is decoding.load_image is vx.data.load_image
    assert images.preprocess is vx.data.preprocess


def test_no_private_name_is_imported_across_packages() -> None:
    crossing = []
    for path in ROOT.rglob("*.py"):
        package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
        top = package.split(".")[1] if "." in package else ""
        for name in _imports(path, package):
            parts = name.split(".")
            if len(parts) < 3 or parts[0] != "vitexplain" or parts[1] == top:
                continue
            if any(p.startswith("_") and not p.startswith("__") for p in parts[2:]):
                crossing.append(f"{path.relative_to(ROOT.parent)}: {name}")
    ours = [c for c in crossing if c.startswith(("vitexplain/data/", "vitexplain/batch/", "vitexplain/viz/gallery",
                                                 "vitexplain/viz/grids", "vitexplain/explorer/page"))]
    assert ours == []
