"""Model adapters: the one place a model is recognised (timm, torchvision, Hugging Face, CNNs,
Swin, captioners). Every built-in adapter module is imported here, eagerly, and registers its
detectors on import, so recognition never depends on what was imported first."""

from __future__ import annotations

from .base import (CAPABILITIES, Adapter, adapter_for, find_adapter, find_layout_module, preprocessing,
                   register_adapter, register_refusal, token_layout, unwrap_compiled)

# built-in adapters, registered on import (priorities order them, not import order)
from . import vit, hf, swin, hier, hier_timm, hier_more, hier_hf, hier_hf_more, hier_sam2, hier_metaformer, hier_tinyvit, hier_pvt, cnn, cnn_hf, openclip, captioning, captioning_hf, vlm  # noqa: E402,F401

__all__ = ["Adapter", "adapter_for", "find_adapter", "find_layout_module", "preprocessing", "register_adapter",
           "register_refusal", "token_layout", "unwrap_compiled", "CAPABILITIES"]
