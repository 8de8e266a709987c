"""Old import path of ``vitexplain caption``'s engine: the code lives in :mod:`vitexplain.batch.caption`.

::

    from vitexplain.caption_export import CaptionOptions, export_captions
    result = export_captions(CaptionOptions(inputs=["photos/"], out="captions/"))
"""

from __future__ import annotations

from .batch.caption import DEFAULT_CAPTION_METHODS, DEFAULT_CAPTION_MODEL, CaptionOptions, export_captions
from .batch.writing import encode_npz as _encode_npz

__all__ = ["CaptionOptions", "export_captions", "DEFAULT_CAPTION_MODEL", "DEFAULT_CAPTION_METHODS"]
