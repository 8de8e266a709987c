"""Input sizes a CNN with self-attention blocks does not take, and the sizes it does.

timm's self-attention blocks for CNNs take only some feature-map sizes: ``BottleneckAttn`` (BotNet) and a
``LambdaLayer`` with relative positions keep positions for one grid, ``HaloAttn`` (HaloNet) splits its map
into fixed blocks, and a strided ``LambdaLayer`` halves its map with a 2x2 average pool (rounding down)
while the block's shortcut rounds up. Another size fails inside the model with a bare ``AssertionError`` or
a tensor-size error that names no size. :func:`size_refusal` says which module refuses and which image
sizes the model takes; :func:`vitexplain.sizes.run_sized` raises it as an ``InputError``. Plain CNNs fail
on some sizes too (HRNet's and DLA's fusion of stages, blur-pool shortcuts and TResNet's space-to-depth stem
need sides that halve evenly; Inception-v3 a minimum size): when the model's own forward fails on the size
and runs on the nearest multiple of its stride, or on its configured size, that size is named.

Each module's reduction (image side over its input map's side) comes from one probe forward without
gradients (forward pre-hooks, removed in ``finally``; a model in training mode keeps its buffers, and its probes
take two images: a training batch norm refuses one value per channel): at the model's configured input size, or,
when the model does not take that one (built for another size), at the refused size (the modules the forward
reached before it failed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from ..checks import buffers_kept

__all__ = ["size_rules", "size_refusal", "one_size_reason"]


def one_size_reason(model: nn.Module) -> Optional[str]:
    """Why a conv/attention hybrid takes only the input size it was built for, or None.

    timm's EfficientFormer (V1, V2) keeps learned attention biases indexed for one token grid
    (an ``attention_bias_idxs`` buffer): another input size fails inside the model with a shape
    error that does not name the size.
    """
    for name, module in model.named_modules():
        if isinstance(getattr(module, "attention_bias_idxs", None), Tensor):
            return (f"it takes only the input size it was built for (its attention module {name!r} keeps position "
                    "biases for one token grid)")
    return None


@dataclass(frozen=True)
class _Rule:
    """What one module needs of its input map: one grid (``grid``) or sides that are multiples of ``multiple``."""

    name: str
    kind: str  # the module's class name
    why: str  # completes "... (kind) ..."
    grid: Optional[tuple[int, int]] = None
    multiple: int = 1


def size_rules(model: nn.Module) -> list[_Rule]:
    """The size-restricted self-attention modules of ``model`` (none when timm is not imported)."""
    import sys

    if "timm" not in sys.modules:
        return []
    from timm.layers.bottleneck_attn import BottleneckAttn
    from timm.layers.halo_attn import HaloAttn
    from timm.layers.lambda_layer import LambdaLayer

    rules = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if isinstance(module, BottleneckAttn):
            grid = (int(module.pos_embed.height), int(module.pos_embed.width))
            rules.append(_Rule(name, kind, f"keeps relative positions for one {grid[0]}x{grid[1]} feature map", grid=grid))
        elif isinstance(module, LambdaLayer) and module.feat_size is not None:
            grid = (int(module.feat_size[0]), int(module.feat_size[1]))
            rules.append(_Rule(name, kind, f"keeps relative positions for one {grid[0]}x{grid[1]} feature map", grid=grid))
        elif isinstance(module, HaloAttn):
            b = int(module.block_size)
            rules.append(_Rule(name, kind, f"splits its feature map into {b}x{b} blocks", multiple=b))
        elif isinstance(module, LambdaLayer) and isinstance(module.pool, nn.AvgPool2d):
            rules.append(_Rule(name, kind, "halves its feature map with a 2x2 average pool (rounding down) while the "
                                           "block's shortcut rounds up", multiple=2))
    return rules


def _input_maps(model: nn.Module, rules: list[_Rule], forward: Callable[[Tensor], object], x: Tensor) -> dict[str, tuple[int, int]]:
    """The (h, w) of each rule module's input in one forward of ``x`` (those reached before a failure)."""
    seen: dict[str, tuple[int, int]] = {}

    def keep(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if args and isinstance(args[0], Tensor) and args[0].dim() == 4:
                seen.setdefault(name, (int(args[0].shape[-2]), int(args[0].shape[-1])))
        return hook

    handles = [model.get_submodule(r.name).register_forward_pre_hook(keep(r.name)) for r in rules]
    try:
        with torch.no_grad(), buffers_kept(model):
            forward(x)
    except Exception:  # the modules reached before the failure are what is known
        pass
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _reduction(side: int, image: int) -> Optional[int]:
    """The power-of-two stride r that maps an image side to a feature-map side (rounding up or down)."""
    for k in range(8):
        r = 2 ** k
        if side in (image // r, -(-image // r)):
            return r
    return None


def _reductions(model: nn.Module, rules: list[_Rule], forward: Callable[[Tensor], object], probe: Tensor,
                configured: Optional[tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """rule name -> (rh, rw) image pixels per feature-map pixel at that module's input."""
    for size in ([configured] if configured else []) + [tuple(probe.shape[-2:])]:
        x = torch.zeros(_probe_batch(model), *probe.shape[1:-2], *size, dtype=probe.dtype, device=probe.device)
        maps = _input_maps(model, rules, forward, x)
        out = {}
        for name, (h, w) in maps.items():
            rh, rw = _reduction(h, size[0]), _reduction(w, size[1])
            if rh is not None and rw is not None:
                out[name] = (rh, rw)
        if out:
            return out
    return {}


def _probe_batch(model: nn.Module) -> int:
    """How many images a probe forward takes: two when a batch norm is in training mode (it refuses one value per
    channel, e.g. Inception v3's auxiliary classifier at 1x1), else one."""
    return 2 if any(m.training for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)) else 1


def _runs(model: nn.Module, forward: Callable[[Tensor], object], like: Tensor, size: tuple[int, int]) -> bool:
    """Whether images of ``size`` (dtype, device and channels of ``like``) run through the model."""
    x = torch.zeros(_probe_batch(model), *like.shape[1:-2], *size, dtype=like.dtype, device=like.device)
    try:
        with torch.no_grad(), buffers_kept(model):
            forward(x)
    except Exception:  # any failure: it does not take that size
        return False
    return True


def _size_it_takes(model: nn.Module, forward: Callable[[Tensor], object], x: Tensor, stride: int,
                   configured: Optional[tuple[int, int]]) -> Optional[str]:
    """Which size a CNN takes when its own forward fails on the size of ``x`` and runs on the nearest sides
    that are multiples of its ``stride`` (feature maps that must halve evenly: HRNet, DLA, blur pools,
    space-to-depth stems) or on its configured size (a minimum size: Inception-v3); None when the model runs
    on the size of ``x`` (the failure is not its size) or on neither."""
    size = (int(x.shape[-2]), int(x.shape[-1]))
    if _runs(model, forward, x, size):
        return None
    near = tuple(max(stride, (s + stride // 2) // stride * stride) for s in size)  # nearest multiple, ties up
    if near != size and _runs(model, forward, x, near):
        return (f"it runs on {near[0]}x{near[1]} images (sides that are multiples of its stride {stride}, so that "
                f"its feature maps halve evenly): resize the images to that size or other multiples of {stride}")
    if configured is not None and tuple(configured) != size and _runs(model, forward, x, configured):
        return (f"it runs on {configured[0]}x{configured[1]} images (its configured input size): resize the images "
                "to that size")
    return None


def size_refusal(model: nn.Module, forward: Callable[[Tensor], object], x: Tensor,
                 configured: Optional[tuple[int, int]], stride: int = 32) -> Optional[str]:
    """Why ``model`` does not take the size of ``x`` (B, C, H, W) and which sizes it takes, or None (it takes
    that size, or no size is found that it takes: the failure is something else).

    Args:
        model: the model.
        forward: the adapter's forward, ``forward(x) -> outputs``.
        x: the refused input (only its size, channels, dtype and device are used).
        configured: the model's configured input size (H, W), tried first to find each module's reduction.
        stride: the model's total stride (its last feature map's reduction).
    """
    rules = size_rules(model)
    if not rules:
        return _size_it_takes(model, forward, x, stride, configured)
    reductions = _reductions(model, rules, forward, x, configured)
    size = (int(x.shape[-2]), int(x.shape[-1]))
    fixed = [(r, reductions[r.name]) for r in rules if r.grid is not None and r.name in reductions]
    for rule, (rh, rw) in fixed:
        need = (rule.grid[0] * rh, rule.grid[1] * rw)
        if need != size:
            return (f"its attention module {rule.name!r} ({rule.kind}) {rule.why} (1/{rh} of the image), so the "
                    f"model takes {need[0]}x{need[1]} images only: resize the images to that size")
    multiples = [(r, reductions[r.name]) for r in rules if r.grid is None and r.name in reductions]
    mh = math.lcm(*(r.multiple * rh for r, (rh, _) in multiples)) if multiples else 1
    mw = math.lcm(*(r.multiple * rw for r, (_, rw) in multiples)) if multiples else 1
    if size[0] % mh == 0 and size[1] % mw == 0:
        if fixed or multiples:
            return None
        names = sorted({r.kind for r in rules})
        return (f"its attention modules ({', '.join(names)}) take only some feature-map sizes: resize the images to "
                "the size it was built for")
    rule = next(r for r, (rh, rw) in multiples if size[0] % (r.multiple * rh) or size[1] % (r.multiple * rw))
    rh, rw = reductions[rule.name]
    side = f"{mh}" if mh == mw else f"{mh} (height) and {mw} (width)"
    example = (max(mh, (size[0] + mh // 2) // mh * mh), max(mw, (size[1] + mw // 2) // mw * mw))  # nearest, ties up
    return (f"its attention module {rule.name!r} ({rule.kind}) {rule.why} (its map is 1/{rh} of the image), and "
            f"with the model's other such modules the image sides must be multiples of {side}: resize the images, "
            f"e.g. to {example[0]}x{example[1]}")
