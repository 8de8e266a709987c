"""Sanity checks (Adebayo et al. 2018): does a map change when the model's parameters are randomised?

:func:`randomization_check` re-initialises layers from the top (output side) down, on a deep copy of
the model, and reports the rank correlation between the original and the randomised maps; it must
fall for a method that explains the model. :func:`randomization_layers` gives the default order.
"""

from __future__ import annotations

import copy
from typing import Callable, List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor, nn

from ..errors import InputError, UsageError
from .correlation import rank_correlation
from .validation import check_maps, check_seed, real

__all__ = ["RandomizationResult", "randomization_layers", "randomized_copy", "randomization_check"]


class RandomizationResult(NamedTuple):
    """Result of :func:`randomization_check`.

    Attributes:
        layers: the module names, in randomisation order (top / output side first).
        correlations: ``(len(layers), B)`` rank correlation between the original map and the map after
            step k (cascading: layers ``0..k`` randomised; independent: layer k only).
        reference: ``(B, h, w)`` maps of the unrandomised model.
        maps: ``(len(layers), B, h, w)`` maps after each step, or None unless ``return_maps=True``.
    """

    layers: List[str]
    correlations: Tensor
    reference: Tensor
    maps: Optional[Tensor]


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def randomization_layers(model: nn.Module) -> List[str]:
    """Default layer order for :func:`randomization_check`: top (output side) first.

    The model's named children that hold parameters, in registration order, reversed; children that
    are plain containers (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``) are expanded into
    their own children, so a timm ViT gives ``head, norm, blocks.11, ..., blocks.0, patch_embed`` and a
    ResNet ``fc, layer4.1, layer4.0, ..., bn1, conv1``. Parameters owned directly by the root module
    (e.g. a ViT's ``cls_token`` and ``pos_embed``) are not in any layer and are never randomised.

    Args:
        model: the model.

    Returns:
        Module names (as in ``model.named_modules()``), output side first.
    """
    names: List[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if next(child.parameters(), None) is None:
                continue
            if isinstance(child, _CONTAINERS):
                walk(child, full + ".")
            else:
                names.append(full)

    walk(model, "")
    return names[::-1]


def _reinit_(module: nn.Module, std: float) -> None:
    """Re-initialise every parameter of ``module``: reset_parameters() where a submodule has one,
    else normal(0, std)."""
    handled = set()
    with torch.no_grad():
        for m in module.modules():
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()
                handled.update(id(p) for p in m.parameters(recurse=False))
        for p in module.parameters():
            if id(p) not in handled:
                p.normal_(0.0, std)


def _check_init(seed: object, init_std: object) -> tuple[int, float]:
    """The seed (an int: ``torch.manual_seed(0.5)`` seeds 0) and ``init_std`` (a finite number >= 0), checked."""
    std = real(init_std, "init_std")
    if std < 0:
        raise UsageError(f"init_std must be a standard deviation >= 0, got {init_std!r}")
    return check_seed(seed), std


def _layer_names(model: nn.Module, layers: Optional[Sequence[str]]) -> List[str]:
    """Check the model and the layer names (default :func:`randomization_layers`)."""
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    modules = dict(model.named_modules())
    names = list(layers) if layers is not None else randomization_layers(model)
    if not names:
        raise UsageError("no layers to randomise: the model has no child modules with parameters; pass layers=")
    unknown = [n for n in names if n not in modules or n == ""]
    if unknown:
        avail = [n for n in modules if n][:20]
        raise UsageError(f"unknown layer names {unknown}; expected names from model.named_modules(), e.g. {avail}")
    return names


def _randomise_layer(model: nn.Module, name: str, seed: int, init_std: float) -> None:
    """Re-initialise layer ``name`` of ``model`` in place after ``torch.manual_seed(seed)``, inside
    :func:`torch.random.fork_rng` (the global CPU and CUDA generators are left as found)."""
    cuda_devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed)
        _reinit_(dict(model.named_modules())[name], init_std)


def randomized_copy(
    model: nn.Module, layers: Optional[Sequence[str]] = None, *, seed: int = 0, init_std: float = 0.02
) -> nn.Module:
    """A deep copy of ``model`` with every layer in ``layers`` re-initialised (full randomisation).

    Layer ``k`` of ``layers`` is re-initialised as by :func:`randomization_check` (seed ``seed + k``,
    so layers of the same shape get different weights), and the copy equals the last step of a
    cascading :func:`randomization_check` with the same layers and seed. The caller's model is untouched.

    Args:
        model: the model (left untouched).
        layers: module names to randomise; default :func:`randomization_layers` (every parameterised
            child; parameters owned by the root module, such as a ViT's ``pos_embed``, are kept).
        seed: seed of the re-initialisation.
        init_std: standard deviation for parameters no ``reset_parameters()`` covers.

    Returns:
        The randomised copy (same device, dtype and training flag as ``model``).
    """
    seed, init_std = _check_init(seed, init_std)
    names = _layer_names(model, layers)
    work = copy.deepcopy(model)
    for k, name in enumerate(names):
        _randomise_layer(work, name, seed + k, init_std)
    return work


def randomization_check(
    model: nn.Module,
    explain_fn: Callable[[nn.Module], Tensor],
    *,
    layers: Optional[Sequence[str]] = None,
    mode: str = "cascading",
    seed: int = 0,
    absolute: bool = False,
    init_std: float = 0.02,
    return_maps: bool = False,
) -> RandomizationResult:
    """Model-parameter randomisation test (Adebayo et al. 2018).

    Works on a deep copy: the caller's model (parameters, buffers, training flag) is never modified.
    The reference maps come from the unrandomised copy. Then, for each layer in order (top first),
    its parameters are re-initialised -- ``reset_parameters()`` on every submodule that has one (Linear,
    Conv, LayerNorm, ...), ``normal(0, init_std)`` for any other parameter -- and ``explain_fn`` is run on
    the randomised copy. ``"cascading"`` keeps earlier layers randomised (top-down cascade);
    ``"independent"`` randomises one layer at a time on a fresh copy. The rank correlation
    (:func:`rank_correlation`) with the reference must fall for a method that explains the model.

    Randomisation is seeded: layer k is initialised after ``torch.manual_seed(seed + k)`` inside
    :func:`torch.random.fork_rng`, so results are reproducible and the global RNG state is untouched
    (layer k gets the same weights in both modes). ``explain_fn`` runs outside the forked RNG.

    Args:
        model: the model to test (left untouched).
        explain_fn: ``model -> (B, h, w)`` maps; it receives the (randomised) copy, so build any
            explainer inside it, e.g. ``lambda m: vx.Explainer(m).explain(x, method="cdam", target=t).maps``.
            Fix the target explicitly: the predicted class changes when the model is randomised.
        layers: module names (``model.named_modules()``) in randomisation order, top first; default
            :func:`randomization_layers`.
        mode: ``"cascading"`` or ``"independent"``.
        seed: seed of the re-initialisation.
        absolute: compare ``|maps|`` (Adebayo et al. report both signed and absolute rank correlations).
        init_std: standard deviation for parameters no ``reset_parameters()`` covers.
        return_maps: also return the maps of every step.

    Returns:
        :class:`RandomizationResult` with ``layers``, ``correlations (len(layers), B)``,
        ``reference (B, h, w)`` and ``maps (len(layers), B, h, w)`` or None.
    """
    if mode not in ("cascading", "independent"):
        raise UsageError(f"mode must be 'cascading' or 'independent', got {mode!r}")
    seed, init_std = _check_init(seed, init_std)
    names = _layer_names(model, layers)

    def explain(m: nn.Module, what: str) -> Tensor:
        maps = explain_fn(m)
        return check_maps(maps, f"explain_fn output ({what})")

    def randomise(m: nn.Module, k: int) -> None:
        _randomise_layer(m, names[k], seed + k, init_std)

    work = copy.deepcopy(model)
    reference = explain(work, "original model")
    ref_cmp = reference.abs() if absolute else reference
    corrs: List[Tensor] = []
    kept: List[Tensor] = []
    for k, name in enumerate(names):
        if mode == "independent" and k > 0:
            work = copy.deepcopy(model)
        randomise(work, k)
        maps = explain(work, f"after randomising {name!r}").to(reference.device)
        if maps.shape != reference.shape:
            raise UsageError(
                f"explain_fn returned maps of shape {tuple(maps.shape)} after randomising {name!r}, "
                f"expected {tuple(reference.shape)} as for the original model"
            )
        corrs.append(rank_correlation(ref_cmp, maps.abs() if absolute else maps))
        if return_maps:
            kept.append(maps)
    del work
    return RandomizationResult(
        layers=names,
        correlations=torch.stack(corrs),
        reference=reference,
        maps=torch.stack(kept) if return_maps else None,
    )
