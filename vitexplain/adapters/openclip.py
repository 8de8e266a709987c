"""OpenCLIP image towers (``open_clip.transformer.VisionTransformer``) and the CLIP models that hold one.

OpenCLIP's ViT (OpenAI CLIP, LAION, DFN, MetaCLIP, EVA-free ``ViT-*`` models of ``open_clip.create_model``):
a class token and the patches of ``conv1`` (``grid_size``, position embeddings for ``image_size`` only),
``transformer.resblocks`` of ``ResidualAttentionBlock`` (``ln_1`` before an ``nn.MultiheadAttention``),
then ``_pool``: ``ln_post`` and the class token (``pool_type='tok'``) or the mean of the patches
(``'avg'``), then ``proj``. Its output is the pooled embedding, so explanations score it with
``vx.targets.similarity`` / ``vx.targets.norm`` or a callable. A CLIP model (``open_clip.model.CLIP``,
``CustomTextCLIP``, CoCa) is explained through its image tower, as ``encode_image`` runs it (CoCa's
normalises the embedding to unit length by default, and so does the adapter's head).

Refused with the reason: the other OpenCLIP towers (``TimmModel``: the message says how to explain its
timm trunk; ``ModifiedResNet``), ``pool_type='none'`` (no pooled embedding), and, for the methods that carry
a readout row through the attention, a tower with attention pooling (CoCa's ``attn_pool``: learned
queries read every token).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UnsupportedModelError
from ..layout import TokenLayout, pair
from ..methods.families import VIT
from .base import Adapter, register_adapter, register_refusal
from .vit import ViTAdapter

__all__ = ["OpenCLIPViTAdapter"]

_CLIP_STATS = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))


class OpenCLIPViTAdapter(ViTAdapter):
    """An OpenCLIP ViT image tower, or a CLIP model's (see the module docstring).

    Args:
        model: the tower (``VisionTransformer``) or the CLIP model holding it as ``visual``.
        visual: the tower's module name in ``model`` (``""``: the model is the tower).
    """

    def __init__(self, model: nn.Module, visual: str = "") -> None:
        super().__init__(model)
        tower = model.get_submodule(visual) if visual else model
        kind = getattr(tower, "attn_pool_type", "")
        if kind in ("parallel", "cascade"):
            raise UnsupportedModelError(
                f"{type(model).__name__}'s image tower pools with attentional_pool={kind!r} (two attention poolers, "
                "which open_clip marks as untested work in progress); it is not supported: build the tower with "
                "attentional_pool=True (CoCa's pooling) or pool_type='tok' / 'avg', or record its attention with "
                "vx.capture(model)")
        if tower.pool_type not in ("tok", "avg"):
            raise UnsupportedModelError(
                f"{type(model).__name__}'s image tower has pool_type={tower.pool_type!r}: it returns every token, no "
                "pooled embedding a target could score; build it with pool_type='tok' or 'avg', or record its "
                "attention with vx.capture(model)")
        self.tower, self.visual = tower, visual
        self.normalized = bool(visual) and _normalizes(model.encode_image)  # CoCa's latent has unit length
        prefix = f"{visual}." if visual else ""
        self.blocks = [f"{prefix}transformer.resblocks.{i}" for i in range(len(tower.transformer.resblocks))]
        self.norm1 = f"{self.blocks[-1]}.ln_1"
        self.has_head = False  # the output is an embedding
        self.fixed_size = pair(tower.image_size)  # position embeddings for that grid only
        if getattr(tower, "attn_pool", None) is not None:
            self.drop_readout_row(
                "its attention pooling (attn_pool, as in CoCa) reads every token through learned queries, so no "
                "one row of token weights is what it reads (raw, rollout, grad_rollout, generic and attention "
                "Grad-CAM carry such a row); cdam and the token Grad-CAM read the gradient through the pooling")

    def layout(self, input_size: tuple[int, int]) -> TokenLayout:
        patch = pair(self.tower.patch_size)
        size = pair(input_size)
        readout = "class" if self.tower.pool_type == "tok" else "mean"
        return TokenLayout(1, (size[0] // patch[0], size[1] // patch[1]), True, readout, patch_size=patch)

    def forward(self, x: Tensor) -> Any:
        out = self.model.encode_image(x) if self.visual else self.model(x)
        return out[0] if isinstance(out, tuple) else out  # (output_tokens=True: (pooled, tokens))

    def head(self, tokens: Tensor) -> Tensor:
        pooled, _ = self.tower._pool(tokens)  # the tower's own pooling and final norm
        pooled = pooled @ self.tower.proj if self.tower.proj is not None else pooled
        return F.normalize(pooled, dim=-1) if self.normalized else pooled

    def preprocess_kwargs(self) -> dict[str, Any]:
        cfg = getattr(self.tower, "preprocess_cfg", None) or {}  # set by open_clip.create_model
        mean, std = cfg.get("mean", _CLIP_STATS[0]), cfg.get("std", _CLIP_STATS[1])
        return dict(input_size=pair(self.tower.image_size), mean=tuple(mean), std=tuple(std), crop_pct=1.0,
                    interpolation=cfg.get("interpolation", "bicubic"))


def _normalizes(encode_image: Any) -> bool:
    """Whether a CLIP model's ``encode_image`` normalises the embedding when called with the image alone (its
    ``normalize`` argument defaults to True: CoCa; False: CLIP, CustomTextCLIP)."""
    try:
        parameter = inspect.signature(encode_image).parameters.get("normalize")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.default is True


def _is_tower(module: Any) -> bool:
    return any(c.__module__ == "open_clip.transformer" and c.__name__ == "VisionTransformer"
               for c in type(module).__mro__)


def _other_tower(module: Any) -> Optional[str]:
    """The class name of an OpenCLIP image tower that is not its VisionTransformer (TimmModel, ModifiedResNet)."""
    for cls in type(module).__mro__:
        if (cls.__module__, cls.__name__) in (("open_clip.timm_model", "TimmModel"),
                                              ("open_clip.modified_resnet", "ModifiedResNet")):
            return cls.__name__
    return None


def _why_other_tower(model: nn.Module, tower: nn.Module, path: str) -> str:
    """Why an OpenCLIP model whose image tower (``path`` in the user's words) is not a VisionTransformer is not
    explained, and what to do instead."""
    kind = _other_tower(tower)
    where = f"{type(model).__name__}'s image tower is" if path != "model" else f"{type(model).__name__} is"
    if kind == "TimmModel":
        trunk = type(getattr(tower, "trunk", None)).__name__
        return (f"{where} OpenCLIP's TimmModel (a timm {trunk} trunk, then the tower's head), which vitexplain does "
                f"not explain as a whole; explain its trunk, vx.Explainer({path}.trunk), with a target that applies "
                f"the head to the trunk's output, e.g. target=lambda f: vx.targets.similarity(v)({path}.head(f)): "
                "the score is then the CLIP embedding's")
    return (f"{where} OpenCLIP's ModifiedResNet (an RN50-style CLIP tower with an attention-pooling head), which no "
            "vitexplain adapter describes; register one (vitexplain.adapters.register_adapter, see docs/guide.md, "
            "'Your own model') or record its attention with vx.capture(model)")


@register_adapter(priority=10, family=VIT)
def _detect_openclip(model: nn.Module) -> Optional[Adapter]:
    if _is_tower(model):
        return OpenCLIPViTAdapter(model)
    visual = getattr(model, "visual", None)
    clip = callable(getattr(model, "encode_image", None))
    if _is_tower(visual) and clip:
        return OpenCLIPViTAdapter(model, "visual")
    return None


@register_refusal
def _refuse_openclip(model: nn.Module) -> Optional[str]:
    """Why a CLIP model with another OpenCLIP tower, or that tower, is not explained (its trunk's layout stays
    findable: vx.capture and vx.token_layout read it)."""
    if _other_tower(model):
        return _why_other_tower(model, model, "model")
    visual = getattr(model, "visual", None)
    if callable(getattr(model, "encode_image", None)) and _other_tower(visual):
        return _why_other_tower(model, visual, "model.visual")
    return None
