"""Gradient checkpointing held off while module activations are captured.

timm's ``set_grad_checkpointing(True)`` runs a model's stages through ``checkpoint_seq(..., flatten=True)``, which
calls the blocks inside each stage directly: the stage modules (``layer4``, ``blocks.6``, the Grad-CAM family's
layers) then never run as modules, so no hook on them fires, and the Grad-CAM family refused a model it lists with
"module 'layer4' gave no tensor in the forward". Checkpointing changes memory, not values, so a capture of
activations without attention (the Grad-CAM family's) holds it off on every module that has it on (timm's
``grad_checkpointing``, transformers' ``gradient_checkpointing`` attributes) and puts each flag back as found when
the scope ends (the graph its forward built needs no recomputation in the backward after it). A capture of attention
keeps checkpointing as the model has it: its records are taken in the forward and the recomputation in the backward
is not recorded again (:func:`vitexplain.recording.sink.in_backward`).
"""

from __future__ import annotations

from typing import Callable

from torch import nn

__all__ = ["checkpointing_off", "FLAGS"]

#: The module attributes that switch gradient checkpointing on: timm's and transformers'.
FLAGS = ("grad_checkpointing", "gradient_checkpointing")


def checkpointing_off(model: nn.Module) -> Callable[[], None]:
    """Turn gradient checkpointing off on every module of ``model`` that has it on.

    Returns:
        A function that turns each flag that was changed back on (call it in ``finally``).
    """
    changed: list[tuple[nn.Module, str]] = []
    try:
        for module in model.modules():
            for flag in FLAGS:
                if getattr(module, flag, None) is True:
                    setattr(module, flag, False)
                    changed.append((module, flag))
    except BaseException:
        _restore(changed)
        raise
    return lambda: _restore(changed)


def _restore(changed: list[tuple[nn.Module, str]]) -> None:
    for module, flag in changed:
        setattr(module, flag, True)
    changed.clear()
