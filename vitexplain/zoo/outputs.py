"""The latest outputs of some of a model's modules, kept by forward hooks (for the zoo's training signals)."""

from __future__ import annotations

from typing import Any, Hashable, Mapping

import torch
from torch import nn

__all__ = ["Outputs"]


class Outputs:
    """Forward hooks that keep the latest output of each module, by key.

    Args:
        modules: key -> module whose output is kept (e.g. block index -> block).

    ``outputs[key]`` is that module's output in the last forward; :meth:`remove` detaches the hooks.
    """

    def __init__(self, modules: Mapping[Hashable, nn.Module]) -> None:
        self._out: dict[Hashable, torch.Tensor] = {}
        self._hooks = [module.register_forward_hook(self._keeper(key)) for key, module in modules.items()]

    def _keeper(self, key: Hashable) -> Any:
        def keep(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            self._out[key] = out
        return keep

    def __getitem__(self, key: Hashable) -> torch.Tensor:
        return self._out[key]

    def remove(self) -> None:
        """Detach the hooks from the model."""
        for hook in self._hooks:
            hook.remove()
