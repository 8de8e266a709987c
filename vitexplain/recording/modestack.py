"""The capture's torch function mode on the thread's mode stack, kept at its place while it is entered and left."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from ..errors import CaptureError

__all__ = ["ModeStack"]


class ModeStack:
    """The capture's mode on the thread's torch function mode stack, at its place.

    ``base`` is the stack's height when the scope began: the mode goes there (under modes
    entered later), as it was when it was entered at the start of the scope.
    """

    def __init__(self, mode: TorchFunctionMode) -> None:
        self.mode = mode
        self.base = 0

    def start(self) -> None:
        self.base = torch._C._len_torch_function_stack()

    def top_is_mode(self) -> bool:
        n = torch._C._len_torch_function_stack()
        return n > 0 and torch._C._get_function_stack_at(n - 1) is self.mode

    def push(self) -> None:
        if torch._C._len_torch_function_stack() <= self.base:  # the usual case: nothing above
            torch._C._push_on_torch_function_stack(self.mode)
            return
        above = []
        while torch._C._len_torch_function_stack() > self.base:
            above.append(torch._C._pop_torch_function_stack())
        torch._C._push_on_torch_function_stack(self.mode)
        for mode in reversed(above):
            torch._C._push_on_torch_function_stack(mode)

    def pop(self) -> None:
        n = torch._C._len_torch_function_stack()
        if n > 0 and torch._C._get_function_stack_at(n - 1) is self.mode:  # the usual case
            torch._C._pop_torch_function_stack()
            return
        at = next((i for i in range(n - 1, -1, -1) if torch._C._get_function_stack_at(i) is self.mode), None)
        if at is None:
            raise CaptureError(
                "vx.capture's torch function mode is no longer on the mode stack: a torch function mode was "
                "left without being exited inside the capture (enter and leave modes with `with`)"
            )
        above = [torch._C._pop_torch_function_stack() for _ in range(n - 1 - at)]
        torch._C._pop_torch_function_stack()
        for mode in reversed(above):
            torch._C._push_on_torch_function_stack(mode)
