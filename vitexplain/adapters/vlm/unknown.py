"""The refusal of a Hugging Face vision-language model whose family vitexplain has no adapter for.

Explaining a VLM needs its family's geometry: which of its image tokens come from which pixels (tiles, thumbnails,
merges, pooling, resamplers), which every adapter in this package writes out and tests against a footprint probe.
A family without one is refused saying so, rather than with the generic "unknown model" message (which lists
vision transformers and CNNs).
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from ..base import register_refusal

__all__ = ["SUPPORTED_FAMILIES"]

#: The vision-language families vitexplain explains (docs/support.md has a row and a test for each).
SUPPORTED_FAMILIES = (
    "LLaVA-1.5, ViP-LLaVA, Video-LLaVA and LLaVA-NeXT-Video (images), LLaVA-NeXT, LLaVA-OneVision, Mistral 3, Pixtral, LightOnOCR, InternVL, "
    "Aya Vision, Command A Vision, GLM-4.1V/4.5V/4.6V, GLM-OCR, PaliGemma, Gemma 3, Gemma 4, Qwen2-VL, Qwen2.5-VL, "
    "Qwen3-VL, Qwen3.5, Idefics2, Idefics3, SmolVLM, LFM2-VL, Janus, DeepSeek-VL, PerceptionLM, Molmo2, MiniCPM-V, "
    "Fuyu, BLIP-2, InstructBLIP, Kosmos-2, mllama, Florence-2, Pix2Struct"
)


@register_refusal
def _refuse_unknown_vlm(model: nn.Module) -> Optional[str]:
    """Why a generative model with a vision and a text config (a Hugging Face VLM) that no adapter recognised is not
    explained."""
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is None or getattr(config, "text_config", None) is None:
        return None
    can_generate = getattr(model, "can_generate", None)
    if not (callable(can_generate) and can_generate()):  # (a dual encoder such as ALIGN or OWL-ViT writes no text)
        return None
    return (
        f"{type(model).__name__} (model type {getattr(config, 'model_type', '?')!r}) is a vision-language model whose "
        "family vitexplain has no adapter for: a per-word map needs the family's geometry (which image tokens come "
        "from which pixels: tiles, merges, pooling, resamplers), and this family's is not written. Supported "
        f"vision-language families: {SUPPORTED_FAMILIES} (docs/support.md). vx.capture(model) still records its "
        "attention; vitexplain.adapters.register_adapter adds your own adapter (a VLMAdapter subclass, see "
        "vitexplain/adapters/vlm/llava.py for the simplest)."
    )
