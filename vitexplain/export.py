"""Old import path of ``vitexplain export``'s engine: the code lives in :mod:`vitexplain.batch`.

::

    from vitexplain.export import ExportOptions, export
    result = export(ExportOptions(inputs=["photos/"], out="maps/", methods=["rollout", "cdam"]))

Every name below is the same object as in :mod:`vitexplain.batch` (the underscored ones are
kept for code that patched or imported them).
"""

from __future__ import annotations

from .batch.decoding import ImageDataset as _ImageDataset
from .batch.decoding import cap_size as _cap_size
from .batch.decoding import collate as _collate
from .batch.distributed import Dist as _Dist
from .batch.distributed import autocast as _autocast
from .batch.distributed import device_and_amp as _device_and_amp
from .batch.driver import Command, ExportResult, ProcessFn, Run as _Run, drive as _drive
from .batch.export import DEFAULT_METHODS, ExportOptions, export
from .batch.inputs import IMAGE_EXTENSIONS, InputItem, discover_inputs
from .batch.manifest import GALLERY, MANIFEST, SUMMARY, read_manifest
from .batch.models import load_model
from .batch.models import model_id as _model_id
from .batch.models import zoo_weights_id as _zoo_weights_id
from .batch.setup import resolve_methods as _resolve_methods
from .batch.writing import WriteFn
from .batch.writing import Writer as _Writer
from .batch.writing import encode_npy as _encode_npy
from .batch.writing import encode_png as _encode_png
from .errors import UsageError

__all__ = [
    "ExportOptions",
    "ExportResult",
    "InputItem",
    "UsageError",
    "IMAGE_EXTENSIONS",
    "DEFAULT_METHODS",
    "discover_inputs",
    "load_model",
    "export",
    "read_manifest",
]
