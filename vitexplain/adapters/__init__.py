"""Model adapters (timm, torchvision, Hugging Face, CNNs, captioners) and the zoo captioner."""

from __future__ import annotations

import importlib

from .base import CAPABILITIES, Adapter, adapter_for, register_adapter, unwrap_compiled

__all__ = ["Adapter", "adapter_for", "register_adapter", "unwrap_compiled", "CAPABILITIES"]

_ADAPTER_MODULES = ("vit", "hf", "swin", "hybrid", "cnn", "captioning")


def _load_adapters() -> None:
    """Import the adapter modules (each registers its detectors on import)."""
    for name in _ADAPTER_MODULES:
        try:
            importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as err:  # a family that is not built yet
            if err.name != f"{__name__}.{name}":
                raise
