"""One helper for lazily imported package attributes (keeps ``import vitexplain`` light)."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional

__all__ = ["lazy_attributes"]


def lazy_attributes(
    package: str, names: dict[str, tuple[str, Optional[str]]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module ``__getattr__`` and ``__dir__`` that import public names on first use.

    Args:
        package: ``__name__`` of the package whose attributes these are.
        names: public name -> (module, attribute); a module path starting with ``.`` is
            relative to ``package``; attribute None means the module itself.

    Returns:
        ``(__getattr__, __dir__)`` to assign in the package's namespace.
    """
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        try:
            module_name, attr = names[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        module = importlib.import_module(module_name, package)
        value = module if attr is None else getattr(module, attr)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *names})

    return __getattr__, __dir__
