"""Adapters for ViTs: timm (ViT, DeiT, EVA, BEiT, CaiT, XCiT, ConViT, NaFlexViT on image tensors, ...) and torchvision.

Each adapter owns its model's token layout, names the blocks whose token attention the
attention methods read and the norm whose output T enters the last token attention (CDAM,
token Grad-CAM), and runs the model's own head on tokens for the methods that re-run part
of the model (``tail``: smooth / integrated CDAM; ``head``: LeGrad). Those partial forwards
are checked against the model's own outputs before use (``Context.partial``).
Hugging Face ViTs are in ``adapters/hf.py``; the interface is described in ``adapters/base.py``.

Families whose blocks are not plain token self-attention are handled honestly:

- CaiT: the patch blocks use talking-heads attention (heads are mixed by a linear map
  *after* the softmax, so no recorded softmax is the attention applied to the values); the
  class-attention blocks (``blocks_token_only``, the class token attending to [class,
  patches]) carry the readout. Attention methods read the class-attention blocks; methods
  that multiply attention across all layers (rollout, grad_rollout, generic) are refused.
- XCiT: the XCA blocks attend across channels (a d x d matrix per head), not across tokens;
  token attention exists only in the class-attention blocks (``cls_attn_blocks``), which the
  attention methods read. Rollout-type methods are refused.
- ConViT: the first ``local_up_to_layer`` blocks use gated positional self-attention (a
  sigmoid-gated mix of a content softmax and a positional softmax, renormalised): the capture
  sees two softmax calls, neither of which is the attention applied to the values. Attention
  methods read the later (plain) blocks; rollout-type methods are refused.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..errors import UnsupportedMethodError, UnsupportedModelError
from ..layout import TokenLayout, pair, patch_multiple_advice
from ..recording.activations import ActivationRecord
from ..methods.families import VIT
from .base import Adapter, register_adapter

__all__ = ["ViTAdapter", "TimmViTAdapter", "NaFlexViTAdapter", "CaitAdapter", "XcitAdapter", "ConvitAdapter", "TorchvisionViTAdapter"]

_FULL = frozenset({"grid", "tokens", "attention", "rollout", "tail", "head", "pixels", "lrp"})


class ViTAdapter(Adapter):
    """A Vision Transformer (classifier or headless backbone).

    Attributes:
        blocks: module names of the blocks whose token attention the attention methods
            read, input side first; each issues one attention call per forward whose keys
            are the layout's tokens and whose queries are all of them (self-attention) or
            the first few (class attention).
        norm1: module name of the norm whose output T (B, N, D) enters the model's last
            token attention; its input is the residual stream entering the last block.
        pool_attention: module name of an attention-pooling head whose learned query's attention
            over the final tokens is the readout (layout readout ``"pool"``), or None.
        pool_query: which of that head's queries the output reads: 0 (the first), or None (their mean).
        capabilities: see ``adapters/base.py``.
    """

    family = VIT
    blocks: list[str]
    norm1: str
    pool_attention: Optional[str] = None
    pool_query: Optional[int] = None

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.capabilities = _FULL

    def layout(self, input_size: tuple[int, int]) -> TokenLayout:
        """Token layout for a (H, W) input."""
        raise self.not_implemented("layout()")

    def block(self, index: int) -> nn.Module:
        """The block ``index`` of :attr:`blocks` (negative counts from the end)."""
        return self.model.get_submodule(self.blocks[index])

    def head(self, tokens: Tensor) -> Tensor:
        """Final norm + pooling + classifier (or embedding) on the output tokens of a block.

        Args:
            tokens: (B, N, D) output tokens of any block in :attr:`blocks`.

        Returns:
            (B, C) logits, or (B, D') the pooled embedding of a headless model: what
            :meth:`forward` returns.
        """
        raise UnsupportedMethodError(
            f"{type(self.model).__name__}: running the head on tokens is not supported for this "
            "model family, so smooth/integrated CDAM and LeGrad are not available; use 'cdam' or 'generic'"
        )

    def tail(self, tokens: Tensor, call: ActivationRecord) -> Tensor:
        """The model's outputs recomputed from the residual stream entering the last block.

        Args:
            tokens: (B', N, D) the input of :attr:`norm1` (B' may be a multiple of the
                explained batch: noisy or interpolated copies).
            call: the recorded call of ``blocks[-1]`` in the explained forward; its other
                arguments (position biases, sizes, masks) are passed again.

        Returns:
            what :meth:`forward` returns, for the B' rows.
        """
        out = self.block(-1)(tokens, *call.args[1:], **call.kwargs)
        return self.head(out[0] if isinstance(out, tuple) else out)

    def drop_readout_row(self, why: str) -> None:
        """Refuse, saying ``why``, the methods that carry the head's readout row through the attention (raw,
        rollout, grad_rollout, generic, attention Grad-CAM): the head reads no one row of token weights."""
        self._drop("rollout", why)
        self._drop("attention", why)

    def drop_all(self, why: str) -> None:
        """Refuse every method, saying ``why`` (a model whose layout is known but whose outputs no target scores)."""
        self.notes.update({capability: why for capability in self.capabilities})
        self.capabilities = frozenset()

    def _drop(self, capability: str, why: str) -> None:
        """Remove a capability, remembering why (for refusal messages)."""
        self.capabilities = self.capabilities - {capability}
        self.notes[capability] = why
        if capability == "rollout" and "lrp" in self.capabilities:  # attention the LRP rules do not cover
            self._drop("lrp", why)


# -- timm -------------------------------------------------------------------------------------
def _patch_embed(model: nn.Module) -> nn.Module:
    """The patch embedding of a timm ViT: ``patch_embed``, or NaFlexViT's ``embeds`` (which also holds the class
    and register tokens and adds the position embedding)."""
    embed = getattr(model, "patch_embed", None)
    return embed if embed is not None else model.embeds


def _timm_layout(model: nn.Module, size: tuple[int, int]) -> TokenLayout:
    embed = _patch_embed(model)
    patch = pair(embed.patch_size)
    if hasattr(embed, "dynamic_feat_size"):
        grid = tuple(embed.dynamic_feat_size(size))
    elif getattr(embed, "dynamic_img_pad", False):  # (NaFlexViT pads the image up to whole patches)
        grid = (-(-size[0] // patch[0]), -(-size[1] // patch[1]))
    else:
        grid = (size[0] // patch[0], size[1] // patch[1])
    owner = model if hasattr(model, "patch_embed") else embed  # (NaFlexViT's class token is its embedding's)
    has_cls = getattr(owner, "cls_token", None) is not None
    pool = getattr(model, "global_pool", "token")
    if pool in ("map", "prr") and getattr(model, "attn_pool", None) is not None:
        readout = "pool"  # SigLIP's MAP head (PRR's self-attention): its query's attention row is what the head reads
    elif getattr(model, "dist_token", None) is not None:
        readout = "prefix"  # DeiT distilled: the output averages the class head's and the distillation head's
    else:
        readout = "class" if has_cls and pool in ("token", "") else "mean"
        if readout == "mean" and pool == "avg" and getattr(model, "pool_include_prefix", False) \
                and int(model.num_prefix_tokens):
            readout = "all"  # (the average takes the prefix tokens too)
    layout = TokenLayout(int(model.num_prefix_tokens), (int(grid[0]), int(grid[1])), has_cls, readout, patch_size=patch)
    return layout.for_map(layout.grid, size)  # hybrid stems (vitamin): the patch embedding reads a feature map


class TimmViTAdapter(ViTAdapter):
    """timm VisionTransformer (+ distilled, rel-pos, registers, avg-pool), Eva, Beit, the zoo
    ViT, and the base of CaiT / XCiT / ConViT; ``num_classes=0`` makes it a headless backbone
    whose output is the pooled embedding."""

    def __init__(self, model: nn.Module, blocks: Optional[list[str]] = None) -> None:
        super().__init__(model)
        self.blocks = blocks or [f"blocks.{i}" for i in range(len(model.blocks))]
        if not self.blocks:
            raise UnsupportedModelError(
                f"this {type(model).__name__} has no transformer blocks (depth=0): there is no attention and no "
                "block tokens to explain; build it with at least one block"
            )
        self.norm1 = f"{self.blocks[-1]}.norm1"
        self.has_head = int(getattr(model, "num_classes", 1) or 0) > 0
        pool = getattr(model, "global_pool", "token")
        attn_pool = getattr(model, "attn_pool", None)
        if pool in ("map", "prr") and attn_pool is not None:  # (PRR: a parameter-free self-attention, then row 0
            self.pool_attention = "attn_pool"  # or the mean: its attention rows are what the output reads)
            self.pool_query = 0 if getattr(attn_pool, "pool", "token") == "token" else None
            if getattr(attn_pool, "pool", "token") not in ("token", "avg"):
                self.drop_readout_row(
                    f"its attention-pooling head returns its {getattr(attn_pool, 'latent_len', '?')} latent queries "
                    f"unpooled (pool={getattr(attn_pool, 'pool', None)!r}): no one row of token weights is what the "
                    "output reads")
        if pool == "" and isinstance(pool, str):
            self.drop_readout_row(
                "it is built with global_pool='' (no pooling): its output is every token (B, N, ...), so no one row "
                "of token weights is what a score of it reads (raw, rollout, grad_rollout, generic and attention "
                "Grad-CAM carry such a row through the attention; reading the class row would explain the class "
                "token only); cdam and the token Grad-CAM read the gradient of your target through the model itself, "
                "or build it with global_pool='token' or 'avg'")
        if pool in ("max", "avgmax"):
            why = (f"its head pools the tokens with global_pool={pool!r}: each channel reads its own token, so no "
                   "one row of token weights is what the head reads (raw, rollout, grad_rollout, generic and "
                   "attention Grad-CAM carry such a row through the attention); cdam and the token Grad-CAM read "
                   "the gradient through the head itself")
            self.drop_readout_row(why)
        diff = [b for b in self.blocks if _is_diff_attention(getattr(model.get_submodule(b), "attn", None))]
        if diff:
            self.drop_readout_row(
                f"its blocks use differential attention (timm DiffAttention, in {diff[0]!r}): each layer applies "
                "softmax(q1 k1^T) - lambda softmax(q2 k2^T), signed and not one softmax, through two attention calls "
                "of which no one is the attention applied to the values; cdam, the token Grad-CAM and the pixel "
                "methods read the gradient through the model itself")
        post = type(model.get_submodule(self.blocks[-1]))
        if any(_timm_class(post, module, name) for module, name in _POST_NORM_BLOCKS):
            why = (f"its blocks ({post.__name__}) normalise the attention's output (x + norm1(attn(x))): no norm's "
                   "output is the tokens entering the last attention, and norm1's input is not the residual stream, "
                   "so CDAM and the token Grad-CAM have no tokens to read; use 'generic', 'rollout', 'legrad' or "
                   "'integrated_gradients'")
            self._drop("tokens", why)
            self._drop("tail", why)

    def layout(self, input_size: tuple[int, int]) -> TokenLayout:
        return _timm_layout(self.model, pair(input_size))

    def head(self, tokens: Tensor) -> Tensor:
        return self.model.forward_head(self.model.norm(tokens))

    def preprocess_kwargs(self) -> dict[str, Any]:
        kwargs = super().preprocess_kwargs()
        embed = _patch_embed(self.model)
        fixed = getattr(embed, "img_size", None) and not getattr(self.model, "dynamic_img_size", False)
        if fixed and tuple(pair(embed.img_size)) != tuple(kwargs["input_size"]):
            # built without a config, or with another img_size than its config's
            kwargs["input_size"] = tuple(pair(embed.img_size))
        return kwargs


class NaFlexViTAdapter(TimmViTAdapter):
    """timm NaFlexVit on (B, C, H, W) images: the class and register tokens live in its ``embeds`` (before the
    patches), the position embedding is resized to any grid; its dictionary input (patches and coordinates) is not
    read."""

    def size_refusal(self, x: Tensor) -> Optional[str]:
        """Why the model does not take the size of ``x``: its patch must divide the image (unless it pads), else None."""
        embed = self.model.embeds
        patch = pair(embed.patch_size)
        h, w = (int(v) for v in x.shape[-2:])
        if getattr(embed, "dynamic_img_pad", False) or (h % patch[0] == 0 and w % patch[1] == 0):
            return None
        return patch_multiple_advice(patch, (h, w))


class CaitAdapter(TimmViTAdapter):
    """timm CaiT: attention methods read the class-attention blocks (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        token_only = getattr(model, "blocks_token_only", None)
        names = [f"blocks_token_only.{i}" for i in range(len(token_only))] if token_only else None
        super().__init__(model, names)
        self._drop(
            "rollout",
            "CaiT's patch blocks use talking-heads attention (heads are mixed after the softmax), "
            "so there is no per-layer attention matrix to multiply across all layers",
        )
        if not token_only:
            self._drop("attention", "this CaiT has no class-attention blocks and its patch blocks use talking-heads attention")
            self._drop("head", "this CaiT has no class-attention blocks")

    def tail(self, tokens: Tensor, call: ActivationRecord) -> Tensor:
        if not getattr(self.model, "blocks_token_only", None):
            return super().tail(tokens, call)
        # the last class-attention block sees u = [class token, patches] through norm1
        cls_token = self.block(-1)(tokens[:, 1:], tokens[:, :1])
        return self.head(torch.cat([cls_token, tokens[:, 1:]], dim=1))


class XcitAdapter(TimmViTAdapter):
    """timm XCiT: attention methods read the class-attention blocks (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        cls_blocks = getattr(model, "cls_attn_blocks", None)
        names = [f"cls_attn_blocks.{i}" for i in range(len(cls_blocks))] if cls_blocks else None
        super().__init__(model, names)
        why = (
            "XCiT's XCA blocks attend across channels (a d x d cross-covariance matrix per head), "
            "not across tokens"
        )
        self._drop("rollout", why)
        if not cls_blocks:
            self._drop("attention", why + ", and this XCiT has no class-attention blocks")
            self._drop("head", "this XCiT has no class-attention blocks")

    def layout(self, input_size: tuple[int, int]) -> TokenLayout:
        size = pair(input_size)
        patch = pair(self.model.patch_embed.patch_size)
        grid = (size[0] // patch[0], size[1] // patch[1])
        has_cls = self.model.cls_attn_blocks is not None
        readout = "class" if has_cls and self.model.global_pool == "token" else "mean"
        return TokenLayout(int(self.model.num_prefix_tokens), grid, has_cls, readout, patch_size=patch)


class ConvitAdapter(TimmViTAdapter):
    """timm ConViT: attention methods read the plain blocks after the GPSA blocks."""

    def __init__(self, model: nn.Module) -> None:
        local = int(model.local_up_to_layer)
        plain = [f"blocks.{i}" for i in range(local, len(model.blocks))]
        super().__init__(model, plain or None)
        why = (
            f"ConViT's first {local} blocks use gated positional self-attention: a gated mix of two "
            "softmaxes (content and position), neither of which is the attention applied to the values"
        )
        if local > 0:
            self._drop("rollout", why)
        if not plain:
            self._drop("attention", why + ", and this ConViT has no plain attention block")
            self._drop("head", why)


# -- torchvision ------------------------------------------------------------------------------
class TorchvisionViTAdapter(ViTAdapter):
    """torchvision.models.VisionTransformer."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        names = [n for n, _ in model.encoder.layers.named_children()]
        self.blocks = [f"encoder.layers.{n}" for n in names]
        self.norm1 = f"{self.blocks[-1]}.ln_1"

    def layout(self, input_size: tuple[int, int]) -> TokenLayout:
        size, p = pair(input_size), int(self.model.patch_size)
        return TokenLayout(1, (size[0] // p, size[1] // p), True, "class", patch_size=(p, p))

    def head(self, tokens: Tensor) -> Tensor:
        return self.model.heads(self.model.encoder.ln(tokens)[:, 0])

    def preprocess_kwargs(self) -> dict[str, Any]:
        size = int(self.model.image_size)
        # torchvision's ImageClassification eval transform: resize 256 / crop 224, bilinear
        return dict(input_size=(size, size), mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), crop_pct=224 / 256, interpolation="bilinear")


#: timm blocks that compute x + norm1(attn(x)) (res-post-norm): their norm1 does not feed the attention
_POST_NORM_BLOCKS = (("vision_transformer", "ResPostBlock"), ("vision_transformer_relpos", "ResPostRelPosBlock"),
                     ("eva", "EvaBlockPostNorm"))


def _is_diff_attention(module: Any) -> bool:
    """Whether ``module`` is timm's differential attention (two softmaxes, their weighted difference applied)."""
    return any(c.__module__ == "timm.layers.diff_attention" and c.__name__ == "DiffAttention"
               for c in type(module).__mro__)


def _timm_class(model: Any, module: str, name: str) -> bool:
    cls = model if isinstance(model, type) else type(model)
    return any(c.__module__ == f"timm.models.{module}" and c.__name__ == name for c in cls.__mro__)


@register_adapter(priority=10, family=VIT)
def _detect_timm(model: nn.Module) -> Optional[Adapter]:
    if not (
        isinstance(getattr(model, "blocks", None), (nn.Sequential, nn.ModuleList))
        and hasattr(model, "num_prefix_tokens")
        and hasattr(model, "forward_head")
        and (hasattr(getattr(model, "patch_embed", None), "patch_size")
             or (_timm_class(model, "naflexvit", "NaFlexVit") and hasattr(getattr(model, "embeds", None), "patch_size")))
    ):
        return None
    if _timm_class(model, "cait", "Cait"):
        return CaitAdapter(model)
    if _timm_class(model, "xcit", "Xcit"):
        return XcitAdapter(model)
    if _timm_class(model, "convit", "ConVit"):
        return ConvitAdapter(model)
    if "swin" in type(model).__name__.lower():
        return None  # windowed attention: adapters/swin.py
    if all(hasattr(b, "norm1") for b in model.blocks):
        return NaFlexViTAdapter(model) if _timm_class(model, "naflexvit", "NaFlexVit") else TimmViTAdapter(model)
    return None


@register_adapter(priority=10, family=VIT)
def _detect_torchvision(model: nn.Module) -> Optional[Adapter]:
    if hasattr(model, "class_token") and hasattr(model, "conv_proj") and hasattr(model, "encoder"):
        return TorchvisionViTAdapter(model)
    return None
