"""Adapters for ViT classifiers: timm, torchvision and Hugging Face.

Each adapter names the transformer blocks in order and the last block's first norm (whose
output T enters the final attention: CDAM and token Grad-CAM read it), and runs the model's
own head on a token sequence (final norm, pooling, classifier) for methods that need a
partial forward (smooth/integrated CDAM, LeGrad).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn

from ..errors import UnsupportedMethodError
from ..layout import TokenLayout, token_layout
from .base import Adapter, register_adapter

__all__ = ["ViTAdapter", "TimmViTAdapter", "TorchvisionViTAdapter", "HFViTAdapter"]


class ViTAdapter(Adapter):
    """A ViT classifier.

    Attributes:
        blocks: module names of the transformer blocks, input side first.
        norm1: module name of the last block's first norm (tokens entering the last attention).
    """

    family = "vit"
    blocks: list[str]
    norm1: str

    def layout(self, input_size: tuple[int, int]) -> TokenLayout:
        """Token layout for a (H, W) input."""
        return token_layout(self.model, input_size)

    def block(self, index: int) -> nn.Module:
        """The transformer block ``index`` (negative counts from the end)."""
        return self.model.get_submodule(self.blocks[index])

    def run_block(self, index: int, tokens: Tensor) -> Tensor:
        """Run block ``index`` on (B, N, D) tokens."""
        return self.block(index)(tokens)

    def head(self, tokens: Tensor) -> Tensor:
        """Final norm + pooling + classifier on the output tokens of a block.

        Args:
            tokens: (B, N, D) tokens (the output of the last block, or of any block for LeGrad).

        Returns:
            (B, C) logits.
        """
        raise UnsupportedMethodError(
            f"{type(self.model).__name__}: running the classifier head on tokens is not "
            "supported for this model family, so smooth/integrated CDAM and LeGrad are not "
            "available; use 'cdam', 'generic' or 'rollout'"
        )

    def tail(self, tokens: Tensor) -> Tensor:
        """Last block + head on the tokens that enter the last block: (B, N, D) -> (B, C)."""
        return self.head(self.run_block(-1, tokens))


class TimmViTAdapter(ViTAdapter):
    """timm VisionTransformer, VisionTransformerDistilled, Eva and Beit (and the zoo ViT)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.blocks = [f"blocks.{i}" for i in range(len(model.blocks))]
        self.norm1 = f"blocks.{len(model.blocks) - 1}.norm1"

    def run_block(self, index: int, tokens: Tensor) -> Tensor:
        block = self.block(index)
        rel_pos = getattr(self.model, "rel_pos_bias", None)
        if rel_pos is not None and type(self.model).__name__ == "Beit":
            return block(tokens, shared_rel_pos_bias=rel_pos())
        return block(tokens)

    def head(self, tokens: Tensor) -> Tensor:
        return self.model.forward_head(self.model.norm(tokens))

    def preprocess_kwargs(self) -> dict[str, Any]:
        kwargs = super().preprocess_kwargs()
        embed = self.model.patch_embed
        fixed = getattr(embed, "img_size", None) and not getattr(self.model, "dynamic_img_size", False)
        if fixed and tuple(embed.img_size) != tuple(kwargs["input_size"]):
            # built without a config, or with another img_size than its config's
            kwargs["input_size"] = tuple(embed.img_size)
        return kwargs


class TorchvisionViTAdapter(ViTAdapter):
    """torchvision.models.VisionTransformer."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        names = [n for n, _ in model.encoder.layers.named_children()]
        self.blocks = [f"encoder.layers.{n}" for n in names]
        self.norm1 = f"{self.blocks[-1]}.ln_1"

    def head(self, tokens: Tensor) -> Tensor:
        return self.model.heads(self.model.encoder.ln(tokens)[:, 0])

    def preprocess_kwargs(self) -> dict[str, Any]:
        size = int(self.model.image_size)
        # torchvision's ImageClassification eval transform: resize 256 / crop 224, bilinear
        return dict(input_size=(size, size), mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), crop_pct=224 / 256, interpolation="bilinear")


class HFViTAdapter(ViTAdapter):
    """Hugging Face ViT / DeiT image classifiers (``*ForImageClassification``)."""

    def __init__(self, model: nn.Module, blocks: list[str]) -> None:
        super().__init__(model)
        self.blocks = blocks
        self.norm1 = f"{blocks[-1]}.layernorm_before"

    def forward(self, x: Tensor) -> Any:
        return self.model(pixel_values=x).logits

    def run_block(self, index: int, tokens: Tensor) -> Tensor:
        out = self.block(index)(tokens)
        return out[0] if isinstance(out, tuple) else out

    def head(self, tokens: Tensor) -> Tensor:
        base = self.model.base_model
        model_type = self.model.config.model_type
        if model_type not in ("vit", "deit") or not hasattr(self.model, "classifier"):
            return super().head(tokens)
        return self.model.classifier(base.layernorm(tokens)[:, 0])

    def preprocess_kwargs(self) -> dict[str, Any]:
        size = self.model.config.image_size
        size = (size, size) if isinstance(size, int) else tuple(size)
        return dict(input_size=size, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), crop_pct=1.0, interpolation="bilinear")


@register_adapter(priority=10)
def _detect_timm(model: nn.Module) -> Optional[Adapter]:
    if isinstance(getattr(model, "blocks", None), (nn.Sequential, nn.ModuleList)) and hasattr(model, "num_prefix_tokens") and hasattr(model, "forward_head"):
        if "swin" in type(model).__name__.lower():
            return None
        if all(hasattr(b, "norm1") for b in model.blocks):
            return TimmViTAdapter(model)
    return None


@register_adapter(priority=10)
def _detect_torchvision(model: nn.Module) -> Optional[Adapter]:
    if hasattr(model, "class_token") and hasattr(model, "conv_proj") and hasattr(model, "encoder"):
        return TorchvisionViTAdapter(model)
    return None


@register_adapter(priority=5)
def _detect_hf(model: nn.Module) -> Optional[Adapter]:
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in ("vit", "deit", "dinov2", "beit"):
        return None
    for name, module in model.named_modules():
        children = list(module.children()) if isinstance(module, nn.ModuleList) else []
        if children and all(hasattr(c, "layernorm_before") for c in children):
            return HFViTAdapter(model, [f"{name}.{i}" for i in range(len(children))])
    return None
