"""Deprecated import path: model adapters live in :mod:`vitexplain.adapters`, the zoo
captioner in :mod:`vitexplain.zoo.captioner`. This shim keeps ``vitexplain.models`` and its
submodules (``.base``, ``.vit``, ``.cnn``, ``.captioning``, ``.captioner``) importable."""

from __future__ import annotations

import importlib
import sys

from ..adapters import *  # noqa: F401,F403
from ..adapters import __all__  # noqa: F401

_MOVED = {
    "base": "vitexplain.adapters.base",
    "vit": "vitexplain.adapters.vit",
    "cnn": "vitexplain.adapters.cnn",
    "captioning": "vitexplain.adapters.captioning",
    "captioner": "vitexplain.zoo.captioner",
}


# bind the moved modules under their old names, so `from vitexplain.models.vit import X` works
for _name, _target in _MOVED.items():
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(_target)
    globals()[_name] = sys.modules[_target]
