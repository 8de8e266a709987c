"""Module forwards as narrowing reads them: their code, whether they can issue attention, the layers of a model.

Used by :mod:`vitexplain.recording.narrowing` to decide which modules need the capture's mode.
"""

from __future__ import annotations

import inspect
from types import CodeType
from typing import Any, Mapping, Optional

from torch import nn

__all__ = ["blocks", "forward_code", "inert", "ATTENTION_NAMES"]


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)  # no forward of their own, or one per content


def blocks(model: nn.Module, by_type: Mapping[type, list]) -> list[nn.Module]:
    """The outermost modules of a class with several instances that hold submodules (layers, blocks)."""
    repeated = {kind for kind, instances in by_type.items()
                if len(instances) > 1 and instances[0]._modules and not issubclass(kind, _CONTAINERS)}
    found: list[nn.Module] = []
    seen: set[int] = set()
    stack = [model]
    while stack:
        for child in stack.pop()._modules.values():
            if child is None or id(child) in seen:
                continue
            seen.add(id(child))
            if type(child) in repeated:
                found.append(child)
            else:
                stack.append(child)
    return found

#: Names whose presence in a module's forward code gates its class even if it issued nothing in discovery.
ATTENTION_NAMES = frozenset(("scaled_dot_product_attention", "softmax", "flex_attention", "multi_head_attention_forward"))


_FORWARDS: dict[type, tuple[Any, Optional[CodeType]]] = {}  # class -> (its forward, that forward's code)


def forward_code(module: nn.Module) -> Optional[CodeType]:
    """The code of a module's forward, under its decorators (None: not Python code)."""
    own = "forward" in module.__dict__  # an instance's own forward (e.g. a hook library's wrapper)
    declared = type(module).forward
    if not own:
        cached = _FORWARDS.get(type(module))
        if cached is not None and cached[0] is declared:
            return cached[1]
    forward = getattr(module.forward, "__func__", module.forward)
    try:
        forward = inspect.unwrap(forward)
    except ValueError:  # a __wrapped__ cycle
        pass
    code = getattr(forward, "__code__", None)
    if not own:
        _FORWARDS[type(module)] = (declared, code)
    return code


_UNIMPLEMENTED = nn.Module.forward.__code__  # torch.nn.modules.module._forward_unimplemented


def inert(code: CodeType) -> bool:
    """Whether a forward cannot issue attention: ``nn.ModuleList``'s (none: never called), or one that names
    no global or attribute at all (``nn.Identity``: it can only return or combine its arguments)."""
    return code is _UNIMPLEMENTED or not code.co_names
