"""The package's import graph: no circles, and lower layers never import the layers above them.

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


#: The whole package, bottom up: a module may import only modules of its own unit or of a lower
#: rank. A new top-level module or package must be placed here (the test lists what is not).
RANK = {
    "errors": 0, "_lazy": 0,
    "vitexplain": 0.5,  # the package itself: lazy names over errors and _lazy only
    "layout": 1, "files": 1, "threads": 1, "finite": 1,
    "recording": 2, "data": 2, "targets": 2, "checks": 2,
    "viz": 3,
    "placement": 3.5,  # where maps lie on images' pixels (the results draw with it)
    "saved": 3.6,  # an explanation's folder (maps.npy, manifest.json): what the results save and load
    "results": 4, "zoo": 4,
    "methods": 5, "metrics": 5,
    "adapters": 6,
    "plan": 7, "sizes": 7,  # sizes: a model's refusal of an input size as an InputError (the explainer's)
    "vlm": 7.5,  # explain_caption of vision-language models (the explainer calls it)
    "captioner": 7.5,  # explain_caption of captioners (the explainer calls it)
    "explainer": 8, "facade": 8,
    "explorer": 9,
    "batch": 10,
    "cli": 11,
    "__main__": 12,
}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}}) == [["a"]] and _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_in_the_package():
    assert _cycles(import_graph()) == []


def test_imports_run_down_the_layers():
    graph = import_graph()
    unplaced = sorted({_unit(m) for m in graph} - set(RANK))
    assert not unplaced, f"place these in RANK: {unplaced}"
    upward = [f"{a} -> {b}" for a, targets in graph.items() for b in targets
              if _unit(a) != _unit(b) and RANK[_unit(a)] <= RANK[_unit(b)]]
    assert not upward, "\n".join(sorted(upward))


def test_the_whole_package_raises_only_vitexplain_errors():
    """Every error a user can see is a VitexplainError (no built-in exception, no assert), except
    AttributeError from a module's ``__getattr__`` (Python's protocol for a missing name)."""
    builtin = {n for n in dir(builtins) if n.endswith(("Error", "Exception"))}
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assert):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} assert")
            elif isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in builtin and not (
                        exc.id == "AttributeError" and path.name == "_lazy.py"):
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} raise {exc.id}")
    assert not wrong, wrong
