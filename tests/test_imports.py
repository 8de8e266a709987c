"""The package's import graph: lower layers never import the layers above them.

The graph is built from the source (every ``import`` and ``from ... import`` statement, also the
ones inside functions), not from what happens to be imported at run time. Layers, bottom up:
``errors`` / ``layout`` (geometry) / ``recording`` (capture, knows no model family), then the
adapters, methods, the explainer, the batch engine and the explorer, and ``facade`` (``vx.capture``,
``vx.token_layout``), which joins the recorder to the adapters.
"""

from __future__ import annotations

import ast
import builtins
from functools import lru_cache
from pathlib import Path

import pytest

import vitexplain

ROOT = Path(vitexplain.__file__).parent

#: modules (or packages) -> what they must not reach, directly or through other modules
LOWER_LAYERS = {
    "vitexplain.recording": ("vitexplain.adapters", "vitexplain.methods", "vitexplain.explainer",
                             "vitexplain.batch", "vitexplain.explorer", "vitexplain.facade"),
    "vitexplain.layout": ("vitexplain.adapters", "vitexplain.methods", "vitexplain.explainer",
                          "vitexplain.batch", "vitexplain.explorer", "vitexplain.facade",
                          "vitexplain.recording"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(name: str, source: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package modules that module ``name`` imports anywhere in ``source``.

    ``from X import y`` counts as importing ``X.y`` when that is a module, ``X`` otherwise.
    """
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules)
    return found


@lru_cache(maxsize=1)
def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (statements anywhere in its source)."""
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths)
    return {
        name: imports_of(name, path.read_text(encoding="utf-8"), path.name == "__init__.py", modules)
        for name, path in paths.items()
    }


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` reaches -> the module that imports it on the way (for messages)."""
    seen: dict[str, str] = {}
    stack = [start]
    while stack:
        module = stack.pop()
        for target in graph.get(module, ()):
            if target not in seen and target != start:
                seen[target] = module
                stack.append(target)
    return seen


def _inside(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_the_graph_sees_relative_and_function_level_imports():
    source = "from .b import c\nimport x.y\n\ndef f():\n    from ..z import w\n    from . import d\n"
    modules = {"p.q.b", "p.q.b.c", "p.z", "p.q.d", "x.y"}
    assert imports_of("p.q.a", source, False, modules) == {"p.q.b.c", "x.y", "p.z", "p.q.d"}
    assert imports_of("p.q", "from .b import e", True, modules) == {"p.q.b"}


@pytest.mark.parametrize("layer", sorted(LOWER_LAYERS))
def test_lower_layers_import_nothing_above_them(layer):
    graph = import_graph()
    members = [m for m in graph if _inside(m, layer)]
    assert members, f"no module {layer} found"
    wrong = []
    for module in members:
        for target, via in reachable(graph, module).items():
            if any(_inside(target, above) for above in LOWER_LAYERS[layer]):
                wrong.append(f"{module} reaches {target} (imported by {via})")
    assert not wrong, "\n".join(sorted(wrong))


@pytest.mark.parametrize("layer", sorted(LOWER_LAYERS))
def test_lower_layers_raise_only_vitexplain_errors(layer):
    """Validation raises a VitexplainError subclass: no built-in exception, no assert."""
    builtin = {n for n in dir(builtins) if n.endswith(("Error", "Exception"))}
    wrong = []
    for path in ROOT.rglob("*.py"):
        if not _inside(module_name(path), layer):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assert):
                wrong.append(f"{path.name}:{node.lineno} assert")
            elif isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in builtin:
                    wrong.append(f"{path.name}:{node.lineno} raise {exc.id}")
    assert not wrong, wrong
