"""``torch.compile``-d models inside a capture: recorded as the original module, run eagerly.

A compiled model (an ``OptimizedModule``) is unwrapped (``_orig_mod``) and recorded as the
original module; inside the scope the compiler's stance is ``"force_eager"``, so calling the
compiled model runs the original module eagerly (every attention call is seen, the maps equal
the uncompiled model's) and nothing is compiled or recompiled. The compiled code is reused
unchanged after the scope.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

__all__ = ["unwrap_compiled", "eager_stance"]


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The original module of a ``torch.compile``-d model (itself otherwise)."""
    while hasattr(model, "_orig_mod") and isinstance(getattr(model, "_orig_mod"), nn.Module):
        model = model._orig_mod  # type: ignore[assignment]
    return model


def eager_stance(compiled: bool) -> Optional[Any]:
    """Enter the ``"force_eager"`` compiler stance when the model or one of its submodules is compiled.

    Args:
        compiled: the captured model was a compiled one (unwrapped by :func:`unwrap_compiled`), or one
            of its submodules is (``discovery.Survey.compiled``).

    Returns:
        The stance now in force (leave it with ``__exit__(None, None, None)``), or None.
    """
    if not compiled:
        return None
    return torch.compiler.set_stance("force_eager")  # in force now; its __exit__ restores the previous one
