"""Adapters for Swin Transformers (windowed attention): timm, torchvision and Hugging Face.

A Swin model runs S stages. Stage s holds tokens on a grid (H_s, W_s); each of its blocks
attends inside non-overlapping windows of that grid, every other block after a cyclic shift
(``torch.roll`` by minus the shift), with the grid padded at the bottom/right to a multiple
of the window; patch merging between stages maps each 2 x 2 group of tokens to one token of
the next grid (odd sizes padded). V1 blocks normalise before attention (``x + attn(norm1(x))``),
V2 blocks after it (``x + norm1(attn(x))``).

The adapter knows, per block, its stage, its module names and its window geometry
(:class:`WindowGeometry`: window size, shift, padding order), reads the window size and shift
from the block after the forward (torchvision clamps them at run time; Hugging Face V1 clamps them in place,
which the adapter undoes after each forward and computes instead), runs
the last block and the head on tokens for methods that re-run them, and never changes the
model. Tokens exchanged with methods are (B, H, W, C) grids (NHWC) for every family; Hugging
Face's (B, L, C) sequences are converted here.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from ..layout import TokenLayout, WindowGeometry
from ..methods.families import SWIN
from .base import Adapter, classifies, register_adapter
from .hier import readout_pool_check

__all__ = ["SwinBlock", "SwinAdapter", "TimmSwinAdapter", "TorchvisionSwinAdapter", "HFSwinAdapter"]


def _pair(value: Any) -> tuple[int, int]:
    if isinstance(value, (tuple, list)):
        return int(value[0]), int(value[1])
    return int(value), int(value)


@dataclass(frozen=True)
class SwinBlock:
    """One windowed-attention block.

    Attributes:
        name: module name of the block.
        attention: module name of the block's attention module (its first argument is the
            attention input: windows for timm and Hugging Face, the grid for torchvision).
        stage: stage index (0 = the finest grid).
    """

    name: str
    attention: str
    stage: int


class SwinAdapter(Adapter):
    """A Swin classifier: stages of windowed-attention blocks joined by patch merging.

    Attributes:
        blocks: module names of all blocks, input side first.
        swin_blocks: per block, a :class:`SwinBlock`.
        windowed_input: the attention module receives windows (True) or the grid (False).
        post_norm: V2 blocks (norm after attention: the attention input is the block input).
    """

    family = SWIN
    capabilities = frozenset({"grid", "tokens", "attention", "rollout", "readout", "tail", "head", "pixels", "lrp"})
    windowed_input = True

    def __init__(self, model: nn.Module, swin_blocks: list[SwinBlock], post_norm: bool) -> None:
        super().__init__(model)
        self.swin_blocks = swin_blocks
        self.blocks = [b.name for b in swin_blocks]
        self.post_norm = post_norm
        readout_pool_check(self)  # timm's global_pool='max': no mean readout for the attention methods

    @property
    def num_stages(self) -> int:
        return self.swin_blocks[-1].stage + 1

    def stage_blocks(self, stage: int) -> list[int]:
        """Indices (into :attr:`blocks`) of the blocks of ``stage`` (negative counts from the end)."""
        stage %= self.num_stages
        return [i for i, b in enumerate(self.swin_blocks) if b.stage == stage]

    # -- geometry -----------------------------------------------------------------------
    def embed_grid(self, input_size: tuple[int, int]) -> tuple[int, int]:
        """(H_0, W_0): the patch grid of an input of ``input_size`` pixels."""
        raise self.not_implemented("embed_grid()")

    def merges_after(self, stage: int) -> bool:
        """Whether patch merging halves the grid between ``stage`` and ``stage + 1``."""
        return True

    def stage_grids(self, input_size: tuple[int, int]) -> list[tuple[int, int]]:
        """(H_s, W_s) per stage for an input of ``input_size`` pixels (merging pads odd sizes)."""
        grids = [self.embed_grid(_pair(input_size))]
        for stage in range(self.num_stages - 1):
            h, w = grids[-1]
            grids.append(((h + 1) // 2, (w + 1) // 2) if self.merges_after(stage) else (h, w))
        return grids

    def window_shift(self, index: int, grid: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        """(window, shift) block ``index`` used in its last forward on ``grid``."""
        raise self.not_implemented("window_shift()")

    def geometry(self, index: int, grid: tuple[int, int]) -> WindowGeometry:
        """Window geometry of block ``index`` on its stage grid (read after the forward)."""
        window, shift = self.window_shift(index, grid)
        return WindowGeometry(grid, window, shift, self.pad_first)

    pad_first = True

    def layout(self, input_size: tuple[int, int]) -> TokenLayout:
        """Token layout of the last stage (the tokens the head averages); ``patch_size`` is the
        pixels one of its tokens stands for (the patch times each merge's 2), also when the input
        was padded to patch or window multiples (a 30 x 45 input: 8-px cells, not 7)."""
        size = _pair(input_size)
        grid = self.stage_grids(size)[-1]
        return TokenLayout(0, grid, False, "mean", windowed=True, patch_size=self.stage_stride(-1))

    def stage_stride(self, stage: int) -> tuple[int, int]:
        """(sh, sw): the input pixels one token of ``stage`` stands for (the patch embedding's stride
        times 2 per patch merging before it), read from the stage grids of an input they divide."""
        probe = 2 ** (self.num_stages + 1)
        first = self.embed_grid((probe * 64, probe * 64))
        patch = (probe * 64 // first[0], probe * 64 // first[1])
        grids = self.stage_grids((patch[0] * probe, patch[1] * probe))
        fine, coarse = grids[0], grids[stage]
        return patch[0] * (fine[0] // coarse[0]), patch[1] * (fine[1] // coarse[1])

    # -- tokens ---------------------------------------------------------------------------
    def to_grid(self, tokens: Tensor, grid: tuple[int, int]) -> Tensor:
        """A block's input/output in the model's own layout as (B, H, W, C)."""
        return tokens.reshape(tokens.shape[0], *grid, tokens.shape[-1])

    def from_grid(self, tokens: Tensor) -> Tensor:
        """(B, H, W, C) tokens in the model's own block layout."""
        return tokens

    def run_block(self, index: int, tokens: Tensor, grid: tuple[int, int]) -> Tensor:
        """Run block ``index`` on tokens in the model's own layout; returns its output tokens."""
        return self.model.get_submodule(self.blocks[index])(tokens)

    def head(self, tokens: Tensor) -> Tensor:
        """Final norm, average pooling and classifier on a last-stage block's output tokens, in
        the model's own layout or as (B, H, W, C): (B, K) logits, or (B, D) without a head."""
        raise self.not_implemented("head()")


def _module_family(model: nn.Module, prefix: str) -> bool:
    """Whether the model's class, or a class it derives from, is defined in module ``prefix``."""
    return any(cls.__module__.startswith(prefix) for cls in type(model).__mro__)


class TimmSwinAdapter(SwinAdapter):
    """timm ``SwinTransformer``, ``SwinTransformerV2`` and ``SwinTransformerV2Cr`` (tokens NHWC
    inside the stages; roll, then pad)."""

    pad_first = False

    def __init__(self, model: nn.Module) -> None:
        self._stages_name = "stages" if self._cr(model) else "layers"
        blocks = [
            SwinBlock(f"{self._stages_name}.{s}.blocks.{b}", f"{self._stages_name}.{s}.blocks.{b}.attn", s)
            for s, stage in enumerate(model.get_submodule(self._stages_name))
            for b in range(len(stage.blocks))
        ]
        super().__init__(model, blocks, post_norm=_module_family(model, "timm.models.swin_transformer_v2"))
        self.has_head = int(getattr(model, "num_classes", 1) or 0) > 0

    @staticmethod
    def _cr(model: nn.Module) -> bool:
        return _module_family(model, "timm.models.swin_transformer_v2_cr")

    def embed_grid(self, input_size: tuple[int, int]) -> tuple[int, int]:
        embed = self.model.patch_embed
        if hasattr(embed, "dynamic_feat_size"):
            return _pair(embed.dynamic_feat_size(input_size))
        patch = _pair(embed.patch_size)
        return input_size[0] // patch[0], input_size[1] // patch[1]

    def stage_grids(self, input_size: tuple[int, int]) -> list[tuple[int, int]]:
        grid = self.embed_grid(_pair(input_size))
        grids = []
        for stage in self.model.get_submodule(self._stages_name):  # timm merges at the start of a stage
            if not isinstance(stage.downsample, nn.Identity):
                grid = ((grid[0] + 1) // 2, (grid[1] + 1) // 2)
            grids.append(grid)
        return grids

    def window_shift(self, index: int, grid: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        block = self.model.get_submodule(self.blocks[index])
        return _pair(block.window_size), _pair(block.shift_size)

    def head(self, tokens: Tensor) -> Tensor:
        if self._cr(self.model):  # V2Cr: the last block ends with a norm; the head pools NCHW
            return self.model.forward_head(tokens.permute(0, 3, 1, 2))
        return self.model.forward_head(self.model.norm(tokens))

    def preprocess_kwargs(self) -> dict[str, Any]:
        kwargs = super().preprocess_kwargs()
        size = getattr(self.model.patch_embed, "img_size", None)
        if size is not None:  # built with another img_size than its config's
            kwargs["input_size"] = _pair(size)
        return kwargs


class TorchvisionSwinAdapter(SwinAdapter):
    """torchvision ``SwinTransformer`` (``swin_t``/``swin_v2_t``...; tokens NHWC; pad, then roll)."""

    windowed_input = False

    def __init__(self, model: nn.Module) -> None:
        blocks, stage = [], 0
        for k, child in list(model.features.named_children())[1:]:
            members = list(child.children()) if isinstance(child, nn.Sequential) else []
            if members and all(hasattr(m, "attn") and hasattr(m, "norm1") for m in members):
                blocks += [SwinBlock(f"features.{k}.{b}", f"features.{k}.{b}.attn", stage) for b in range(len(members))]
                stage += 1
        if not blocks:
            raise UnsupportedModelError(f"no Swin blocks found in {type(model).__name__}.features")
        v2 = type(model.get_submodule(blocks[-1].name)).__name__.endswith("V2")
        super().__init__(model, blocks, post_norm=v2)

    def embed_grid(self, input_size: tuple[int, int]) -> tuple[int, int]:
        conv = self.model.features[0][0]
        k, s = _pair(conv.kernel_size), _pair(conv.stride)
        return (input_size[0] - k[0]) // s[0] + 1, (input_size[1] - k[1]) // s[1] + 1

    def window_shift(self, index: int, grid: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        attn = self.model.get_submodule(self.swin_blocks[index].attention)
        window, shift = _pair(attn.window_size), _pair(attn.shift_size)
        padded = [math.ceil(g / w) * w for g, w in zip(grid, window)]
        # shifted_window_attention: no shift along an axis that one window covers
        shift = tuple(0 if w >= p else s for w, p, s in zip(window, padded, shift))
        return window, shift  # type: ignore[return-value]

    def head(self, tokens: Tensor) -> Tensor:
        m = self.model
        return m.head(m.flatten(m.avgpool(m.permute(m.norm(tokens)))))

    def preprocess_kwargs(self) -> dict[str, Any]:
        # torchvision's weights: swin_t/s/b resize 232 (V1) / 260 (V2), crop 224 / 256, bicubic
        size, resize = (256, 260) if self.post_norm else (224, 232)
        return dict(input_size=(size, size), mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                    crop_pct=size / resize, interpolation="bicubic")


class HFSwinAdapter(SwinAdapter):
    """Hugging Face ``Swin*``/``Swinv2*`` (``Model``, ``ForImageClassification``; tokens (B, L, C))."""

    def __init__(self, model: nn.Module, base: str) -> None:
        prefix = f"{base}." if base else ""
        encoder = model.get_submodule(f"{prefix}encoder")
        blocks = [
            SwinBlock(f"{prefix}encoder.layers.{s}.blocks.{b}", f"{prefix}encoder.layers.{s}.blocks.{b}.attention", s)
            for s, stage in enumerate(encoder.layers)
            for b in range(len(stage.blocks))
        ]
        super().__init__(model, blocks, post_norm=model.config.model_type == "swinv2")
        self.base = model.get_submodule(base) if base else model
        self._stages = encoder.layers
        self.has_head = classifies(getattr(model, "classifier", None))  # (num_labels=0: nn.Identity, features)
        if getattr(model.config, "use_absolute_embeddings", False):  # position embeddings for the configured grid only
            self.fixed_size = _pair(model.config.image_size)  # (the model's failure at another size: an InputError)

    def forward(self, x: Tensor) -> Any:
        if not self.post_norm:
            self._check_windows((int(x.shape[-2]), int(x.shape[-1])))
        with self._windows_kept():
            out = self.model(pixel_values=x, return_dict=True)  # a config's return_dict=False gives tuples
        logits = getattr(out, "logits", None)
        if logits is not None:
            return logits
        # a headless model built with add_pooling_layer=False has no pooler_output: the mean of its last tokens, as
        # head() pools them without a pooler
        return out.pooler_output if out.pooler_output is not None else out.last_hidden_state.mean(dim=1)

    @contextlib.contextmanager
    def _windows_kept(self) -> Iterator[None]:
        """Run a forward with every block's ``window_size`` and ``shift_size`` put back afterwards: transformers'
        Swin V1 (``SwinLayer.set_shift_and_window_size``) sets a block's shift to 0 in place when its stage grid is
        not wider than its window, and the model kept it for every later input (see :meth:`window_shift`)."""
        layers = [self.model.get_submodule(name) for name in self.blocks]
        kept = [(layer.window_size, layer.shift_size) for layer in layers]
        try:
            yield
        finally:
            for layer, (window, shift) in zip(layers, kept):
                layer.window_size, layer.shift_size = window, shift

    def _check_windows(self, size: tuple[int, int]) -> None:
        """Refuse, before the model runs, an input on which a Swin V1 stage's grid is narrower than its window.

        transformers' ``SwinLayer.set_shift_and_window_size`` then shrinks the layer's ``window_size`` in place
        to the grid, and its relative-position table (``window_size**2`` entries) no longer fits: the forward
        fails, and the shrunk window stays on the model, so every later input fails too. (V2's position
        bias is computed for any window: it takes such inputs.)

        Raises:
            InputError: a stage's grid is narrower than ``config.window_size``; says the smallest size that fits.
        """
        window = int(_pair(self.model.config.window_size)[0])
        grids = self.stage_grids(size)
        for stage, grid in enumerate(grids):
            if min(grid) < window:
                scale = _pair(self.model.config.patch_size)[0] * 2 ** sum(
                    self.merges_after(s) for s in range(len(grids) - 1))
                side = window * scale
                raise InputError(
                    f"{type(self.model).__name__} does not take a {size[0]}x{size[1]} input: its stage {stage} token "
                    f"grid would be {grid[0]}x{grid[1]}, narrower than its {window}x{window} attention window, and "
                    "transformers' Swin then shrinks the window in place to a size its relative-position table does "
                    "not have (the forward fails and the model stays broken for later inputs); use inputs of at "
                    f"least {side}x{side} pixels, or pass images (paths or uint8 arrays) to have them resized to the "
                    "model's own size"
                )

    def embed_grid(self, input_size: tuple[int, int]) -> tuple[int, int]:
        patch = _pair(self.model.config.patch_size)  # the embedding pads to patch multiples
        return math.ceil(input_size[0] / patch[0]), math.ceil(input_size[1] / patch[1])

    def merges_after(self, stage: int) -> bool:
        return self._stages[stage].downsample is not None

    def window_shift(self, index: int, grid: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        layer = self.model.get_submodule(self.blocks[index])
        window, shift = int(layer.window_size), int(layer.shift_size)
        if not self.post_norm and min(grid) <= window:  # V1's forward on that grid: no shift, the grid as window
            window, shift = min(grid), 0                   # (set_shift_and_window_size; put back after it)
        return _pair(window), _pair(shift)

    def to_grid(self, tokens: Tensor, grid: tuple[int, int]) -> Tensor:
        return tokens.reshape(tokens.shape[0], *grid, tokens.shape[-1])

    def from_grid(self, tokens: Tensor) -> Tensor:
        return tokens.reshape(tokens.shape[0], -1, tokens.shape[-1])

    def run_block(self, index: int, tokens: Tensor, grid: tuple[int, int]) -> Tensor:
        with self._windows_kept():
            out = self.model.get_submodule(self.blocks[index])(tokens, grid)
        return out[0] if isinstance(out, tuple) else out

    def head(self, tokens: Tensor) -> Tensor:
        seq = tokens.reshape(tokens.shape[0], -1, tokens.shape[-1])
        norm = getattr(self.base, "layernorm", None)  # Donut's Swin has no final norm
        seq = norm(seq) if norm is not None else seq
        pooler = self.base.pooler
        pooled = pooler(seq.transpose(1, 2)).flatten(1) if pooler is not None else seq.mean(dim=1)
        classifier = getattr(self.model, "classifier", None)
        return classifier(pooled) if classifier is not None else pooled

    def preprocess_kwargs(self) -> dict[str, Any]:
        size = _pair(self.model.config.image_size)
        # the Swin image processors resize to the input size (no crop), bicubic, ImageNet statistics; Donut's
        # (DonutImageProcessor) normalises with mean = std = 0.5
        donut = self.model.config.model_type == "donut-swin"
        mean, std = ((0.5,) * 3, (0.5,) * 3) if donut else ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        return dict(input_size=size, mean=mean, std=std, crop_pct=1.0, interpolation="bicubic")


@register_adapter(priority=20)
def _detect_swin(model: nn.Module) -> Optional[Adapter]:
    name = type(model).__name__
    if _module_family(model, "timm.models.swin_transformer") and hasattr(model, "patch_embed"):
        return TimmSwinAdapter(model)
    if _module_family(model, "torchvision.models.swin_transformer") and hasattr(model, "features"):
        return TorchvisionSwinAdapter(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    hf_swin = model_type in ("swin", "swinv2") and _module_family(model, "transformers.models.swin")
    donut = model_type == "donut-swin" and _module_family(model, "transformers.models.donut")  # Swin without final norm
    if hf_swin or donut:
        if name.endswith(("Model", "ForImageClassification")):
            base = "" if name.endswith("Model") else ("donut" if donut else model_type)
            return HFSwinAdapter(model, base)
        family = "DonutSwin" if donut else model_type.capitalize()
        raise UnsupportedModelError(
            f"{name} is not an image classifier; vitexplain explains Hugging Face "
            f"{family}ForImageClassification and {family}Model "
            "(pass a callable target to score the pooled embedding)"
        )
    return None
