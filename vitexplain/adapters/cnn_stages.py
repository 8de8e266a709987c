"""Where a CNN's feature stages are: the module names a CNN adapter reads, input side first.

How the stages are found (the last one is the default Grad-CAM layer, see :mod:`vitexplain.adapters.cnn`):

- timm: ``model.feature_info`` (the modules ``features_only`` would return), e.g.
  ``layer1..layer4`` for ResNets, ``blocks.N`` for EfficientNet/MobileNet, ``s1..s4`` for RegNet.
- torchvision: ``layer1..layer4`` (ResNet/ResNeXt/Wide-ResNet), ``trunk_output.block1..4``
  (RegNet), and for models with a ``features`` Sequential (MobileNet, EfficientNet, VGG,
  ConvNeXt, ...) the last child of ``features`` before each downsampling child, and the last.
  torchvision MaxViT: its ``blocks``.
- anything else: the last top-level child holding a ``Conv2d`` before global pooling (the stages of that
  child when it is a whole classifier inside a wrapper: ``Sequential(normalize, resnet)``, ``DataParallel``),
  auxiliary classifiers left out (torchvision GoogLeNet's ``aux1``/``aux2``, Inception v3's ``AuxLogits``: they
  run only in training, so in eval they have no output to read).
- a ``torch.fx.GraphModule`` (a fused or traced model, which calls its leaf modules directly): the last leaf
  module that runs once before the global pooling.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

__all__ = ["cnn_stages", "stage_ends", "timm_stages", "timm_stage_info", "torchvision_stages", "has_module"]

_POOLS = (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)


def has_module(module: nn.Module, kind: type) -> bool:
    """Whether ``module`` or any module inside it is a ``kind``."""
    return any(isinstance(m, kind) for m in module.modules())


def _is_pool(name: str, module: nn.Module) -> bool:
    return isinstance(module, _POOLS) or type(module).__name__ == "SelectAdaptivePool2d" or name in ("global_pool", "avgpool")


def _max_stride(module: nn.Module) -> int:
    strides = [max(m.stride) if isinstance(m.stride, tuple) else int(m.stride) for m in module.modules() if isinstance(m, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d))]
    return max(strides, default=1)


def _resolve(model: nn.Module, name: str) -> Optional[str]:
    """A feature_info module name as a module that runs: Twins lists ``block.k`` for its
    ``blocks.k`` ModuleList (whose last block outputs the stage's tokens), MViTv2 for its
    ``stages.k``."""
    for candidate in (name, name.replace("block.", "blocks.", 1), name.replace("block.", "stages.", 1)):
        try:
            module = model.get_submodule(candidate)
        except AttributeError:
            continue
        if isinstance(module, nn.ModuleList):  # not called itself: its last child is
            return f"{candidate}.{len(module) - 1}" if len(module) else None
        return candidate
    return None


def timm_stages(model: nn.Module) -> list[str]:
    """The modules of timm's ``model.feature_info``, as modules that run ([] when one cannot be found)."""
    info = getattr(model, "feature_info", None)
    if not info:
        return []
    names = []
    for item in info:
        name = item.get("module") if isinstance(item, dict) else None
        resolved = _resolve(model, name) if name else None
        if resolved is None:
            return []
        names.append(resolved)
    return names


def timm_stage_info(model: nn.Module) -> dict[str, tuple[Optional[int], Optional[int]]]:
    """Stage name -> (reduction, channels) from timm's feature_info."""
    out = {}
    for item in getattr(model, "feature_info", None) or []:
        if isinstance(item, dict) and item.get("module"):
            resolved = _resolve(model, item["module"])
            if resolved:
                out[resolved] = (item.get("reduction"), item.get("num_chs"))
    return out


def stage_ends(prefix: str, seq: nn.Module) -> list[str]:
    """Names of the last child of ``seq`` (a Sequential or ModuleList called child by child) before each
    downsampling child, and of the last child."""
    children = list(seq.named_children())
    ends = [f"{prefix}.{name}" for (name, _), (_, nxt) in zip(children, children[1:]) if _max_stride(nxt) > 1]
    if children:
        ends.append(f"{prefix}.{children[-1][0]}")
    return list(dict.fromkeys(ends))


def torchvision_stages(model: nn.Module) -> list[str]:
    """The stages of a torchvision classifier ([] for an architecture not listed in the module docstring)."""
    if all(hasattr(model, f"layer{i}") for i in range(1, 5)):
        return [f"layer{i}" for i in range(1, 5)]
    trunk = getattr(model, "trunk_output", None)
    if isinstance(trunk, nn.Sequential):
        return [f"trunk_output.{name}" for name, _ in trunk.named_children()]
    features = getattr(model, "features", None)
    if isinstance(features, nn.Sequential):
        return stage_ends("features", features)
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and type(model).__name__ == "MaxVit":
        return [f"blocks.{i}" for i in range(len(blocks))]
    return []


def _is_auxiliary(name: str, module: nn.Module) -> bool:
    """An auxiliary classifier (GoogLeNet's ``aux1``, Inception v3's ``AuxLogits``: ``InceptionAux``), which a
    model calls in training only."""
    return name.lower().startswith("aux") or "aux" in type(module).__name__.lower()


def _fallback_stages(model: nn.Module) -> list[str]:
    """The last top-level child holding a Conv2d before the global pooling, auxiliary classifiers left out;
    when that child is a whole classifier (it pools inside: a wrapper such as ``Sequential(normalize, resnet)``
    or ``DataParallel``), the stages of that classifier, under its name."""
    last = None
    for name, child in model.named_children():
        if _is_pool(name, child):
            break
        if has_module(child, nn.Conv2d) and not _is_auxiliary(name, child):
            last = name
    if last is None:
        return []
    child = model.get_submodule(last)
    if any(_is_pool(n.rpartition(".")[2], m) for n, m in child.named_modules() if n):
        inner = cnn_stages(child)
        if inner:
            return [f"{last}.{stage}" for stage in inner]
    return [last]


def _graph_stages(model: nn.Module) -> Optional[list[str]]:
    """A ``torch.fx.GraphModule`` (``torch.fx.experimental.optimization.fuse``, a symbolic trace) calls its leaf
    modules directly, so its containers (``layer4``) never run: its one stage is the last leaf module that runs
    once before the global pooling (the graph's order). None for a module that is not a GraphModule."""
    from torch.fx import GraphModule

    if not isinstance(model, GraphModule):
        return None
    calls: list[str] = []
    for node in model.graph.nodes:
        target = node.target if node.op == "call_module" else None
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        if (target is not None and _is_pool(name.rpartition(".")[2], model.get_submodule(name))) or \
                (node.op in ("call_function", "call_method") and ("pool" in name or name == "flatten")):
            break
        if target is not None:
            calls.append(target)
    once = [name for name in calls if calls.count(name) == 1]
    return once[-1:]


def cnn_stages(model: nn.Module) -> list[str]:
    """Feature stage module names of a CNN, input side first (see the module docstring)."""
    graph = _graph_stages(model)
    if graph is not None:
        return graph
    return timm_stages(model) or torchvision_stages(model) or _fallback_stages(model)
