"""Hierarchical adapters whose token order is the model's own: torchvision MaxViT, timm Hiera
and timm CrossViT (two branches in one joint token set).

Both keep tokens in an order of their own making (torchvision's window and grid partitions with
an axis swap; Hiera's *unrolled* order, in which pooling a 2 x 2 neighbourhood is a max over
contiguous chunks). Rather than re-deriving those orders, the adapters run the model's own
reordering code on a tensor of token indices (no weights involved, the model is not changed)
and read the window slots from it.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from ..errors import UnsupportedMethodError
from ..layout import TokenLayout, pair
from ..methods.families import HIER
from ..methods.resample import CallSpec, Footprint, TokenSet, Transition
from .base import Adapter, register_adapter
from .hier import Chain, HierAdapter, PageView, conv_footprint, conv_grid, module_family, token_set

__all__ = ["TorchvisionMaxViTAdapter", "HieraAdapter", "CrossViTAdapter"]


# -- torchvision MaxViT --------------------------------------------------------------------------
def _tv_slots(layer: nn.Module, grid: tuple[int, int]) -> Tensor:
    """(G, n) grid indices of each window slot: the layer's own partition ops on token indices."""
    idx = torch.arange(grid[0] * grid[1], dtype=torch.float64).view(1, 1, *grid)
    parts = layer.partition_swap(layer.partition_op(idx, layer.p))  # (1, G, n, 1)
    return parts[0, ..., 0].round().long()


class TorchvisionMaxViTAdapter(HierAdapter):
    """torchvision ``MaxVit``: per layer an MBConv (stride 2 in a stage's first layer), window
    attention and grid attention (torchvision's partition + axis swap), average pooling."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.layers = [(s, f"blocks.{s}.layers.{i}", layer) for s, block in enumerate(model.blocks)
                       for i, layer in enumerate(block.layers)]
        self.token_sites = [f"blocks.{s}.layers.{len(b.layers) - 1}.layers.grid_attention.attn_layer.0"
                            for s, b in enumerate(model.blocks)]
        self.has_head = True
        # its partitions are built for one image size: the first block's grid times the strides before it
        stride = [1, 1]
        for conv in [*(m for m in model.stem.modules() if isinstance(m, nn.Conv2d)),
                     model.blocks[0].layers[0].layers.MBconv.layers.conv_b[0]]:
            stride = [a * b for a, b in zip(stride, pair(conv.stride))]
        grid = pair(model.blocks[0].grid_size)
        self.fixed_size = (grid[0] * stride[0], grid[1] * stride[1])
        self.offer_legrad()

    def legrad_calls(self) -> list[str]:
        """The window and grid attention of every layer of the last block (all on its grid: the stride-2 MBConv
        of its first layer runs before them)."""
        s = len(self.model.blocks) - 1
        return [f"blocks.{s}.layers.{i}.layers.{part}.attn_layer.1" for i in range(len(self.model.blocks[s].layers))
                for part in ("window_attention", "grid_attention")]

    def legrad_site(self, call: str) -> tuple[str, str]:
        """A call's block is its ``PartitionAttentionLayer`` (attention and MLP with their residuals, departitioned):
        its output is (B, C, H, W)."""
        return call.rsplit(".attn_layer", 1)[0], "output"

    def head_on(self, tokens: Tensor) -> Tensor:
        """The model's classifier (average pooling, flatten, LayerNorm, linear, tanh, linear) on (B, C, H, W) maps."""
        return self.model.classifier(tokens)

    def _attention(self, name: str) -> nn.Module:
        return self.model.get_submodule(name)

    def site_grid(self, stage: int, output: Tensor, input_size: Sequence[int]) -> Tensor:
        """(B, G, n, C) partitioned tokens -> (B, H, W, C) through the layer's own slots."""
        grid = self.stage_sets(input_size)[stage].grid
        layer = self.model.get_submodule(self.token_sites[stage].rsplit(".attn_layer", 1)[0])
        slots = _tv_slots(layer, grid).to(output.device)
        out = output.new_zeros(output.shape[0], grid[0] * grid[1], output.shape[-1])
        out[:, slots.flatten()] = output.reshape(output.shape[0], -1, output.shape[-1])
        return out.view(output.shape[0], *grid, output.shape[-1])

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        grid = pair(input_size)
        for conv in (m for m in self.model.stem.modules() if isinstance(m, nn.Conv2d)):
            grid = conv_grid(grid, conv.kernel_size, conv.stride, conv.padding)
        chain: Chain = []
        sets: list[TokenSet] = []
        tokens: Optional[TokenSet] = None
        for s, name, layer in self.layers:
            conv = layer.layers.MBconv.layers.conv_b[0]
            if pair(conv.stride) != (1, 1):
                down = conv_footprint(tokens or token_set(grid), conv)
                if tokens is not None:
                    chain.append(Transition(down, s - 1, s, f"{name}.layers.MBconv"))
                tokens = down.coarse
            tokens = tokens or token_set(grid)
            if len(sets) == s:
                sets.append(tokens)
            for part in ("window_attention", "grid_attention"):
                attention = layer.layers.get_submodule(part)
                slots = _tv_slots(attention, tokens.grid)
                identity = Footprint.identity(tokens)
                chain.append(CallSpec(f"{name}.layers.{part}.attn_layer.1", tokens, tokens, slots, slots, identity,
                                      identity, s, s))
        return chain, sets


# -- Hiera ---------------------------------------------------------------------------------------
class HieraAdapter(HierAdapter):
    """timm ``Hiera`` (SAM 2's image encoder family): mask-unit attention in the unrolled
    token order, global attention in later stages, queries and residual max-pooled over
    2 x 2 neighbourhoods at each stage's first block, average pooling.

    The unrolled order of each stage is read by running the model's own ``unroll`` on token
    indices; pooling keeps the first of each chunk of ``q_stride`` entries, so a stage's order is
    the previous one's first chunk, coarsened by the pooling's (rows, columns) stride. Subclasses for
    other implementations of the same model (Hugging Face's) override where the blocks, their names and
    the unroll come from.
    """

    norm_name = "norm1"
    #: every call is (B, heads, windows, n, d), global ones with one window (timm: only mask units)
    windows_always = False

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.block_names = self._block_names()
        blocks = [model.get_submodule(n) for n in self.block_names]
        self.q_strides = [int(self._q_stride(b.attn)) for b in blocks]
        self.stage_of = []
        stage = 0
        for i, q in enumerate(self.q_strides):
            if i > 0 and q > 1:
                stage += 1
            self.stage_of.append(stage)
        last = {s: i for i, s in enumerate(self.stage_of)}
        # per stage, the tokens entering the last attention call that reads that stage's grid: the
        # stage's last block, or, when that block is the stage's pooling block (it reads the
        # previous grid), the next stage's pooling block; none after a last stage of one such block
        self.token_sites = []
        for s in range(stage + 1):
            i = last[s]
            if i == 0 or self.q_strides[i] == 1:
                self.token_sites.append(f"{self.block_names[i]}.{self.norm_name}")
            else:
                self.token_sites.append(f"{self.block_names[i + 1]}.{self.norm_name}" if s < stage else None)
        self.fixed_size = self._fixed_size()
        self.offer_legrad()

    def legrad_calls(self) -> list[str]:
        """The last stage's blocks but its pooling block (whose keys are the grid before)."""
        last = max(self.stage_of)
        chosen = [i for i, s in enumerate(self.stage_of) if s == last and not (i > 0 and self.q_strides[i] > 1)]
        # a stage without pooling (q_pool below the stage count) still widens its tokens at its first block: the
        # head reads the width from the last widening block on
        widen = [i for i in chosen if self._widens(self.model.get_submodule(self.block_names[i]))]
        return [f"{self.block_names[i]}.attn" for i in chosen if not widen or i >= widen[-1]]

    def _widens(self, block: nn.Module) -> bool:
        """Whether ``block`` outputs tokens of another width than it reads."""
        return block.dim != block.dim_out

    def head_on(self, tokens: Tensor) -> Tensor:
        """The model's head (pooling over the tokens, in any order; norm; classifier) on (B, N, C) tokens."""
        return self.model.forward_head(tokens)

    def _block_names(self) -> list[str]:
        return [f"blocks.{i}" for i in range(len(self.model.blocks))]

    def _q_stride(self, attn: nn.Module) -> int:
        return int(attn.q_stride)

    def _pool_stride(self) -> tuple[int, int]:
        """(sh, sw): the rows and columns one pooling merges (the model's ``q_stride``; its product is each
        pooling block's ``q_stride``)."""
        return pair(self.model.q_stride)

    def _fixed_size(self) -> Optional[tuple[int, ...]]:
        stride = pair(self.model.patch_embed.proj.stride)
        return tuple(int(t) * st for t, st in zip(self.model.tokens_spatial_shape, stride))

    def _unrolled(self, input_size: tuple[int, int]) -> tuple[tuple[int, int], Tensor]:
        """(stage-0 grid, the row-major grid index of each token in the unrolled order)."""
        grid = tuple(int(g) for g in self.model.unroll.size)
        n = grid[0] * grid[1]
        return grid, self.model.unroll(torch.arange(n, dtype=torch.float64).view(1, n, 1))[0, :, 0].round().long()

    def _orders(self, input_size: tuple[int, int]) -> list[tuple[tuple[int, int], Tensor]]:
        """Per stage: (grid, the row-major grid index of each token in the unrolled order)."""
        out = [self._unrolled(input_size)]
        q_stride = self.q_strides[self.stage_of.index(1)] if max(self.stage_of) > 0 else 1
        sh, sw = self._pool_stride()  # a pooling merges sh x sw cells (not always 2 x 2: q_stride=(2, 1))
        for _ in range(max(self.stage_of)):
            (h, w), order = out[-1]
            first = order[: order.numel() // q_stride]
            coarse = (-(-h // sh), -(-w // sw))
            out.append((coarse, (first // w // sh) * coarse[1] + (first % w) // sw))
        return out

    def site_grid(self, stage: int, output: Tensor, input_size: Sequence[int]) -> Tensor:
        grid, order = self._orders(pair(input_size))[stage]
        out = output.new_zeros(output.shape[0], grid[0] * grid[1], output.shape[-1])
        out[:, order.to(output.device)] = output
        return out.view(output.shape[0], *grid, output.shape[-1])

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        orders = self._orders(input_size)
        chain: Chain = []
        sets = [token_set(grid) for grid, _ in orders]
        for i, name in enumerate(self.block_names):
            s, attn = self.stage_of[i], self.model.get_submodule(name).attn
            q_stride = self.q_strides[i]
            pooled = i > 0 and q_stride > 1
            inp = sets[s - 1] if pooled else sets[s]
            in_order = orders[s - 1][1] if pooled else orders[s][1]
            n = inp.n
            windows = n // (q_stride * attn.window_size) if attn.use_mask_unit_attn else 1
            # token t of the unrolled sequence sits in window t % windows, slot t // windows
            k_slots = in_order.view(-1, windows).T.contiguous()
            out_order = orders[s][1]
            q_slots = out_order.view(-1, windows).T.contiguous()
            stride = self._pool_stride()
            skip = Footprint.pool(inp, sets[s], stride, stride, 0) if pooled else Footprint.identity(inp)
            inside = self.windows_always or bool(attn.use_mask_unit_attn)
            chain.append(CallSpec(f"{name}.attn", inp, sets[s], q_slots, k_slots, Footprint.identity(inp), skip,
                                  s - 1 if pooled else s, s, window_dim_inside=inside))
        return chain, sets


# -- CrossViT ------------------------------------------------------------------------------------
class CrossViTAdapter(HierAdapter):
    """timm ``CrossVit``: two ViT branches (small and large patches, each with a class token)
    whose class tokens attend to the other branch's patches in each block's fusion (with a fusion depth above
    1, the chained cross-attention blocks after the first attend from the class token to itself alone).

    The chain runs on one joint token set ``[cls_0, patches_0, cls_1, patches_1]`` (a flat
    1 x N "grid"): a branch's blocks attend inside its part, a fusion call's query is one class
    token and its keys are that (projected) class token and the other branch's patches, each
    with the class token's residual. The readout is the mean of the two class tokens (the head
    averages the branches' logits). "Stage" s is branch s: maps on its grid; the attention
    methods also return, in ``extras``, both branch maps and their combination (see
    :meth:`finish`).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.readout = "class" if model.global_pool == "token" else "mean"
        self.grids = [tuple(int(s) // int(p) for s, p in zip(pair(size), pair(embed.patch_size)))
                      for size, embed in zip(model.img_size_scaled, model.patch_embed)]
        self.offsets = [0, 1 + self.grids[0][0] * self.grids[0][1]]
        self.total = self.offsets[1] + 1 + self.grids[1][0] * self.grids[1][1]
        last = model.blocks[-1]
        self.token_sites = [f"blocks.{len(model.blocks) - 1}.blocks.{b}.{len(last.blocks[b]) - 1}.norm1" for b in range(2)]
        self.fixed_size = tuple(pair(model.img_size))
        self.offer_legrad()

    # -- LeGrad: per branch, the last multi-scale block's branch blocks ------------------------
    def legrad_calls(self) -> list[str]:
        last = len(self.model.blocks) - 1
        return [f"blocks.{last}.blocks.{b}.{j}.attn" for b in range(2) for j in range(len(self.model.blocks[last].blocks[b]))]

    def legrad_branches(self) -> dict[str, int]:
        return {name: int(name.split(".")[3]) for name in self.legrad_calls()}

    def tail_refusal(self) -> str:
        return ("CrossViT's head reads both branches, and after the branches' last blocks each class token is fused "
                "by cross-attention over the other branch's patch tokens: the tokens entering a branch's last attention "
                "(T) reach the outputs through both branches, not through one block and the head, so smooth and "
                "integrated CDAM (which re-run one block from T) are not offered; use 'cdam'")

    def legrad_modules(self) -> list[str]:
        return super().legrad_modules() + ["norm.0", "norm.1"]

    def legrad_head(self, recorder: Any, call: str) -> Any:
        """The model's head on a branch block's tokens, the other branch's final tokens held (detached): the head
        reads both branches (their norms, pooling, classifiers; logits averaged)."""
        branch = self.legrad_branches()[call]
        other = recorder.activation(f"norm.{1 - branch}").input.detach()

        def head(tokens: Tensor) -> Tensor:
            rest = other.repeat(tokens.shape[0] // other.shape[0], 1, 1)
            xs = [tokens, rest] if branch == 0 else [rest, tokens]
            return self.model.forward_head([norm(x) for norm, x in zip(self.model.norm, xs)])

        return head

    def legrad_final(self, recorder: Any, call: str) -> Tensor:
        return recorder.activation(f"norm.{self.legrad_branches()[call]}").input

    def legrad_parts(self, input_size: Sequence[int]) -> list[slice]:
        return [slice(off + 1, off + 1 + g[0] * g[1]) for off, g in zip(self.offsets, self.grids)]

    def readout_row(self, tokens: TokenSet, batch: int, device: object) -> Tensor:
        row = torch.zeros(batch, tokens.n, device=device)
        for b, off in enumerate(self.offsets):
            if self.readout == "class":
                row[:, off] = 0.5
            else:
                n = self.grids[b][0] * self.grids[b][1]
                row[:, off + 1: off + 1 + n] = 0.5 / n
        return row

    def chain_stage(self, stage: int) -> int:
        return 0

    def _branch(self, r: Tensor, b: int) -> Tensor:
        n = self.grids[b][0] * self.grids[b][1]
        return r[:, self.offsets[b] + 1: self.offsets[b] + 1 + n].reshape(r.shape[0], *self.grids[b])

    def _cropped(self, branch: int, input_size: Sequence[int]) -> Optional[tuple[int, int]]:
        """The (h, w) centre crop of the input that branch ``branch`` sees when the model crops instead of resizing
        (timm's ``crop_scale=True``, a branch size below the input's), else None."""
        size = tuple(int(v) for v in pair(self.model.img_size_scaled[branch]))
        h, w = (int(v) for v in input_size)
        if getattr(self.model, "crop_scale", False) and size != (h, w) and size[0] <= h and size[1] <= w:
            return size
        return None

    def _check_branch(self, branch: int, input_size: Sequence[int]) -> None:
        """Refuse a map of a branch that sees a centre crop: drawn over the image, it would not cover it."""
        crop = self._cropped(branch, input_size)
        if crop is not None:
            others = [b for b in range(2) if self._cropped(b, input_size) is None]
            raise UnsupportedMethodError(
                f"branch {branch} of this CrossViT (crop_scale=True) sees a {crop[0]}x{crop[1]} centre crop of the "
                f"{int(input_size[0])}x{int(input_size[1])} input, so its map would not cover the image"
                + (f"; explain stage={others[0]} (branch {others[0]} sees the whole image)" if others else ""))

    def finish(self, r: Tensor, stage: int, input_size: Sequence[int]) -> object:
        """Branch ``stage``'s map, with ``extras``: ``branches`` (both maps), ``combined`` (on the
        small-patch grid: branch 0 plus branch 1 resized bilinearly and scaled by the cell-area
        ratio, so each branch keeps its total) and ``combination`` (that rule, in words). A branch that sees a
        centre crop (``crop_scale=True``) is refused, and left out of ``branches``."""
        self._check_branch(stage, input_size)
        maps = [self._branch(r, b) for b in range(2)]
        extras: dict = {"branches": {f"branch {b} ({g[0]}x{g[1]})": m for b, (g, m) in enumerate(zip(self.grids, maps))
                                     if self._cropped(b, input_size) is None}}
        if not getattr(self.model, "crop_scale", False):
            fine, coarse = self.grids[0], self.grids[1]
            area = (coarse[0] * coarse[1]) / (fine[0] * fine[1])
            resized = torch.nn.functional.interpolate(maps[1][:, None], size=fine, mode="bilinear", align_corners=False)[:, 0]
            extras["combined"] = maps[0] + resized * area
            extras["combination"] = (f"branch 0 ({fine[0]}x{fine[1]}) + branch 1 ({coarse[0]}x{coarse[1]}) resized "
                                     f"bilinearly to {fine[0]}x{fine[1]} and scaled by {area:.3f} (cell areas); "
                                     "the head averages the two branches' class-token logits")
        return maps[stage], extras

    def finish_call(self, spec: CallSpec, r: Tensor, input_size: Sequence[int]) -> Tensor:
        keys = spec.k_slots[spec.k_slots >= 0]
        branch = int((keys >= self.offsets[1]).float().mean() > 0.5)
        return self._branch(r, branch)

    def stage_sets(self, input_size: Sequence[int]) -> list[TokenSet]:
        return [TokenSet(1, self.grids[0]), TokenSet(1, self.grids[1])]

    def _part(self, b: int) -> Tensor:
        return torch.arange(self.offsets[b], self.offsets[1] if b == 0 else self.total)

    def page_view(self, spec: CallSpec, input_size: Sequence[int]) -> PageView:
        """A branch's call on its grid (its class token the prefix); a fusion call's class-token query on its
        branch's grid (its patch rows empty), its keys (that class token, the other branch's patches) on the other
        branch's grid: the joint set is no image grid."""
        b = int(spec.q_slots[0, 0] >= self.offsets[1])
        mine = TokenSet(1, self.grids[b])
        if spec.q_slots.numel() > 1:  # a branch block: inside its part of the joint set
            return PageView(self._part(b), mine, self._part(b), mine, b)
        keys = torch.cat([torch.tensor([self.offsets[b]]), self._part(1 - b)[1:]])
        return PageView(self._part(b), mine, keys, TokenSet(1, self.grids[1 - b]), b)

    def page_input(self, input_size: Sequence[int]) -> Tensor:
        return self._part(0)

    def site_grid(self, stage: int, output: Tensor, input_size: Sequence[int]) -> Tensor:
        self._check_branch(stage, input_size)
        return output[:, 1:].reshape(output.shape[0], *self.grids[stage], output.shape[-1])

    def layout(self, input_size: Sequence[int]) -> "TokenLayout":
        size = pair(input_size)
        grid = self.grids[0]
        return TokenLayout(1, grid, True, self.readout, patch_size=(size[0] // grid[0], size[1] // grid[1]))

    def build(self, input_size: tuple[int, int]) -> tuple[Chain, list[TokenSet]]:
        joint = TokenSet(0, (1, self.total))
        identity = Footprint.identity(joint)
        parts = [self._part(b) for b in range(2)]
        chain: Chain = []
        for i, block in enumerate(self.model.blocks):
            for b, branch in enumerate(block.blocks):
                for j in range(len(branch)):
                    chain.append(CallSpec(f"blocks.{i}.blocks.{b}.{j}.attn", joint, joint, parts[b][None], parts[b][None],
                                          identity, identity, 0, 0))
            for b, fusion in enumerate(block.fusion):
                other = parts[1 - b][1:]
                keys = torch.cat([torch.tensor([self.offsets[b]]), other])[None]
                names = [n for n, m in fusion.named_modules() if type(m).__name__ == "CrossAttentionBlock"]
                cls = torch.tensor([[self.offsets[b]]])
                for j, n in enumerate(names):
                    name = f"blocks.{i}.fusion.{b}" + (f".{n}" if n else "") + ".attn"
                    # a block outputs the class token alone: a chained one (fusion depth > 1) attends to it only
                    chain.append(CallSpec(name, joint, joint, cls, keys if j == 0 else cls, identity, identity, 0, 0))
        return chain, [joint]


@register_adapter(priority=15, family=HIER)
def _detect_more(model: nn.Module) -> Optional[Adapter]:
    if module_family(model, "torchvision.models.maxvit") and hasattr(model, "blocks") and hasattr(model, "stem"):
        return TorchvisionMaxViTAdapter(model)
    if module_family(model, "timm.models.hiera") and hasattr(model, "unroll") and hasattr(model, "blocks"):
        return HieraAdapter(model)
    if module_family(model, "timm.models.crossvit") and getattr(model, "num_branches", 0) == 2:
        return CrossViTAdapter(model)
    return None
