"""SAM 2's Hiera image encoder (windows on the token grid): timm ``HieraDet`` and the base of
Hugging Face's ``Sam2HieraDetModel`` adapter (:mod:`vitexplain.adapters.hier_hf_more`).

Unlike the original Hiera (timm ``Hiera``, Hugging Face ``HieraModel``: mask units in an unrolled
token order, :mod:`vitexplain.adapters.hier_more`), SAM 2's encoder keeps its tokens on their
(H, W) grid. Each block attends either in windows of the grid, zero-padded at the bottom and
right to a multiple of the window (the model's own ``window_partition``), or globally. The first
block of each pooling stage reads grid s - 1 in windows of the previous stage's size and max-pools
its queries 2 x 2 inside each window, so its output lies on grid s in windows half that size (the
same number of windows); its residual is the block's input, projected and max-pooled 2 x 2 (read
evenly, as every max pooling the footprint rule crosses).

LeGrad (and the re-run CDAM variants) read the blocks on the last grid after its pooling block, their
(B, H, W, C) outputs given to the model's head (timm) or the grid mean the adapter scores (Hugging Face).
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor, nn

from ..errors import UnsupportedModelError
from ..layout import pair
from ..methods.families import HIER
from ..methods.resample import CallSpec, Footprint, TokenSet, full_slots, window_slots
from .base import Adapter, register_adapter
from .hier import Chain, HierAdapter, conv_grid, module_family, token_set

__all__ = ["GridHieraAdapter", "TimmHieraDetAdapter"]


class GridHieraAdapter(HierAdapter):
    """SAM 2's Hiera: blocks on a (B, H, W, C) grid (see the module docstring). A stage's token site
    is the first norm of the last block reading its grid. Subclasses say where the patch embedding
    is and how a block states its window and query stride.

    Attributes:
        norm_name: the name of a block's first norm (its output is the tokens entering the attention).
    """

    norm_name = "norm1"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.blocks = list(model.blocks)
        self.stage_of: list[int] = []
        for block in self.blocks:
            self.stage_of.append((self.stage_of[-1] if self.stage_of else 0) + int(self.stride(block) is not None))
        reads = [s - int(self.stride(b) is not None) for s, b in zip(self.stage_of, self.blocks)]
        self.token_sites = [next((f"blocks.{i}.{self.norm_name}" for i in reversed(range(len(reads))) if reads[i] == s),
                                 None) for s in range(self.stage_of[-1] + 1)]

    def legrad_calls(self) -> list[str]:
        """The last stage's blocks but its pooling block (whose keys are the grid before), from the last block that
        widens the tokens on (a stage without pooling, ``q_pool`` below the stage count, widens at its first block:
        the blocks before it output tokens narrower than the head reads)."""
        last = self.stage_of[-1]
        chosen = [i for i, b in enumerate(self.blocks) if self.stage_of[i] == last and self.stride(b) is None]
        widen = [i for i in chosen if self.blocks[i].dim != self.blocks[i].dim_out]
        return [f"blocks.{i}.attn" for i in chosen if not widen or i >= widen[-1]]

    def window(self, block: nn.Module) -> tuple[int, int]:
        """The block's attention window on the grid it reads ((0, 0): global attention)."""
        raise self.not_implemented("window()")

    def stride(self, block: nn.Module) -> Optional[tuple[int, int]]:
        """The block's query pooling stride, or None when it does not pool."""
        raise self.not_implemented("stride()")

    def embed_grid(self, input_size: tuple[int, int]) -> tuple[int, int]:
        """The token grid the patch embedding makes of an input of ``input_size`` pixels."""
        raise self.not_implemented("embed_grid()")

    def site_grid(self, stage: int, output: Tensor, input_size: Sequence[int]) -> Tensor:
        return output  # (B, H, W, C)

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        tokens = token_set(self.embed_grid(input_size))
        chain: Chain = []
        sets = [tokens]
        for i, block in enumerate(self.blocks):
            name, window, stride = f"blocks.{i}.attn", self.window(block), self.stride(block)
            windowed = any(window)
            if stride is None:
                slots = window_slots(tokens, window) if windowed else full_slots(tokens)
                identity = Footprint.identity(tokens)
                chain.append(CallSpec(name, tokens, tokens, slots, slots, identity, identity,
                                      self.stage_of[i], self.stage_of[i]))
                continue
            coarse = token_set(conv_grid(tokens.grid, stride, stride))
            small = (window[0] // stride[0], window[1] // stride[1])  # (pooling blocks are windowed: SAM 2's design)
            k_slots, q_slots = window_slots(tokens, window), window_slots(coarse, small)
            if window[0] % stride[0] or window[1] % stride[1] or k_slots.shape[0] != q_slots.shape[0]:
                raise UnsupportedModelError(
                    f"block {i} of {type(self.model).__name__} pools its queries by {stride} in windows of "
                    f"{window} on a {tokens.grid[0]}x{tokens.grid[1]} grid, which do not tile the pooled "
                    f"{coarse.grid[0]}x{coarse.grid[1]} grid in the same number of windows; explain it at an "
                    f"input size whose token grid is a multiple of every window")
            skip = Footprint.pool(tokens, coarse, stride, stride, 0)  # the residual's max pooling, read evenly
            chain.append(CallSpec(name, tokens, coarse, q_slots, k_slots, Footprint.identity(tokens), skip,
                                  self.stage_of[i] - 1, self.stage_of[i]))
            tokens = coarse
            sets.append(tokens)
        return chain, sets


class TimmHieraDetAdapter(GridHieraAdapter):
    """timm ``HieraDet`` (``sam2_hiera_*``): SAM 2's Hiera with timm's classifier head (average pooling of
    the last grid, a norm, a linear layer); headless (``num_classes=0``) it returns the normed pooled
    features, which ``vx.targets.similarity`` / ``vx.targets.norm`` score.

    It takes any input whose stage-0 token grid its window position embedding tiles (a multiple of its
    first window), and fails inside on another; ``fixed_size`` is its configured input size (the
    pretrained config's), which preprocessing uses and such a failure's :class:`~vitexplain.errors.InputError`
    names."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.fixed_size = tuple(pair(Adapter.preprocess_kwargs(self)["input_size"]))
        self.offer_legrad()

    def head_on(self, tokens: Tensor) -> Tensor:
        """The model's head (pooling of the (B, H, W, C) grid, its norm, the classifier; headless: the normed pooled
        features, as the model returns them) on a block's (B, H, W, C) output."""
        return self.model.forward_head(tokens)

    def window(self, block: nn.Module) -> tuple[int, int]:
        return pair(block.window_size)

    def stride(self, block: nn.Module) -> Optional[tuple[int, int]]:
        return pair(block.q_stride) if block.q_stride else None

    def embed_grid(self, input_size: tuple[int, int]) -> tuple[int, int]:
        embed = self.model.patch_embed
        conv = embed.proj
        ceil = bool(getattr(embed, "dynamic_img_pad", False))  # timm PatchEmbed pads the image up to the stride
        return conv_grid(input_size, conv.kernel_size, conv.stride, conv.padding, ceil=ceil)


@register_adapter(priority=15, family=HIER)
def _detect_hieradet(model: nn.Module) -> Optional[Adapter]:
    if not (module_family(model, "timm.models.hieradet_sam2") and type(model).__name__ == "HieraDet"):
        return None
    return TimmHieraDetAdapter(model)
