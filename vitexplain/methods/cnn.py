"""CNN methods: attention gates (spatial, channel) and the Grad-CAM family.

- ``spatial``: the spatial gate a CBAM-style module multiplied its input by, (B, h, w) in (0, 1).
- ``channel``: the gate-weighted activation ``sum_c g_c X_c`` of an SE/ECA/CBAM module's input
  X (B, C, h, w) with its channel gate g (B, C); extras hold the top-k channels.
- ``gradcam``, ``gradcam++`` and ``layercam``: ``ReLU(sum_c w_c A_c)`` from a module's activation
  A and the gradient dy/dA of the explained forward's single backward, shared by every method
  of the call; each variant supplies only its weights (:func:`cam`).

The Grad-CAM family reads the last feature stage by default (``adapter.target_layer``); pass
``module="layer3"`` (any module name) to choose another. ``channel`` reads the deepest gate
module by default, ``spatial`` the mean of all spatial gates; ``module=`` selects a stage or
module by name (the last gate inside it).
Definitions: docs/methods.md, "CNNs".
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..recording import capture
from ..recording.gates import GateRecord
from ..errors import CaptureError, OptionError, UnsupportedMethodError, UsageError
from .context import Context
from .options import Option
from .families import CNN
from .grad_layout import contiguous_norm_grads
from .registry import register

__all__ = ["spatial", "channel", "gradcam", "gradcam_plus_plus", "layercam", "cam", "gradcam_weights",
           "gradcam_pp_weights", "layercam_weights"]


# -- gates -------------------------------------------------------------------------------------
def _gate_records(ctx: Context) -> list[GateRecord]:
    """The gate records of the explained forward (captured with ``gates=True``)."""
    try:
        return ctx.recorder.gates
    except CaptureError as err:
        raise UnsupportedMethodError(f"method {ctx.method!r}: {err}") from None


def _select_gate(ctx: Context, module: Optional[str], kind: str) -> GateRecord:
    """The last gate record with a ``kind`` gate, inside module/stage ``module`` if given."""
    records = [r for r in _gate_records(ctx) if getattr(r, kind) is not None]
    if not records:
        raise UnsupportedMethodError(
            f"method {ctx.method!r}: {type(ctx.adapter.model).__name__} has no {kind} attention gate "
            f"(its gate modules: {sorted({r.module for r in _gate_records(ctx)})}); "
            f"use {'channel' if kind == 'spatial' else 'spatial'!r}, 'gradcam' or 'layercam'"
        )
    if module is not None:
        inside = [r for r in records if r.name == module or r.name.startswith(module + ".")]
        if not inside:
            raise UnsupportedMethodError(
                f"method {ctx.method!r}: no {kind} gate inside {module!r}; modules with one: "
                f"{list(dict.fromkeys(r.name for r in records))}"
            )
        records = inside
    return records[-1]


@register(
    "spatial", CNN,
    options={
        "module": Option(str, optional=True, help="gate module name, 'deepest' (None = mean of all spatial gates)"),
    },
    requires=("spatial_gates",),
    gates=True,
    attention=False,
    signed=False,
    class_sensitive=False,
    summary="spatial attention gates (CBAM-style): their mean over the network, or one module's with module=",
    reference="Woo et al. 2018 (CBAM); the gate the module multiplies its input by",
)
def spatial(ctx: Context, *, module: Optional[str] = None) -> tuple[Tensor, dict[str, Any]]:
    """Spatial attention: the spatial gates the model's CBAM-style modules multiplied by.

    Args:
        ctx: the explained batch.
        module: None (default) for the mean of every spatial gate of the forward, each
            bilinearly resized to the finest gate resolution: the network's average spatial
            re-weighting; ``"deepest"`` for the last gate; or a stage / module name (e.g.
            ``"layer3"``) for the last gate inside it.

    Returns:
        (B, h, w) float32 gate values in (0, 1) (upsample with ``Explanation.upsample``), and
        extras ``{"module": the module name(s) read}``.
    """
    if module is not None:
        record = _select_gate(ctx, None if module == "deepest" else module, "spatial")
        return record.spatial.float(), {"module": record.name}  # type: ignore[union-attr]  (_select_gate checked it)
    records = [r for r in _gate_records(ctx) if r.spatial is not None]
    if not records:
        _select_gate(ctx, None, "spatial")  # raises the explanatory error
    size = max((r.spatial.shape[-2:] for r in records), key=lambda s: s[0] * s[1])  # type: ignore[union-attr]
    resized = [
        torch.nn.functional.interpolate(r.spatial.float()[:, None], size=tuple(size), mode="bilinear", align_corners=False)[:, 0]  # type: ignore[union-attr]
        for r in records
    ]
    return torch.stack(resized).mean(dim=0), {"module": [r.name for r in records]}


@register(
    "channel", CNN,
    options={
        "module": Option(str, optional=True, help="gate module name (None = the deepest)"),
        "k": Option(int, low=1, help="top channels returned"),
    },
    requires=("channel_gates",),
    gates=True,
    attention=False,
    signed=False,
    class_sensitive=False,
    summary="gate-weighted activation sum_c g_c X_c of an SE/ECA/CBAM module, with its top-k channels",
    reference="Hu et al. 2018 (SE), Wang et al. 2020 (ECA), Woo et al. 2018 (CBAM)",
)
def channel(ctx: Context, *, module: Optional[str] = None, k: int = 8) -> tuple[Tensor, dict[str, Any]]:
    """Channel attention: the module input weighted by its channel gate, summed over channels.

    Args:
        ctx: the explained batch.
        module: a stage or module name; the last module inside it with a channel gate is read.
            Default: the last one of the model (the deepest).
        k: how many top-gated channels to return in the extras.

    Returns:
        (B, h, w) float32 map ``sum_c g_c X_c`` (X the module's input, g its channel gate), and
        extras: ``module`` (module name), ``gate`` (B, C), ``indices`` (B, k) channels with the
        largest gates (descending), ``values`` (B, k) their gates, ``channel_maps`` (B, k, h, w)
        their activations X_c.
    """
    if k < 1:
        raise UsageError(f"k must be >= 1, got {k}")
    record = _select_gate(ctx, module, "channel")
    x = record.input.detach().float()  # (B, C, h, w)
    gate = record.channel.float()  # type: ignore[union-attr]  (B, C); _select_gate checked it
    maps = torch.einsum("bc,bchw->bhw", gate, x)
    values, indices = gate.topk(min(k, gate.shape[1]), dim=1)
    channel_maps = x.gather(1, indices[:, :, None, None].expand(-1, -1, *x.shape[-2:]))
    extras = {"module": record.name, "gate": gate, "indices": indices, "values": values, "channel_maps": channel_maps}
    return maps, extras


# -- Grad-CAM family ---------------------------------------------------------------------------
def _stage_activations(adapter: Any) -> list[str]:
    return list(getattr(adapter, "stages", []))


def _module_name(ctx: Context, module: Optional[str]) -> str:
    name = module if module is not None else getattr(ctx.adapter, "target_layer", None)
    if name is None:
        raise UnsupportedMethodError(f"method {ctx.method!r} needs a module name: pass module='...'")
    try:
        ctx.model_module(name)
    except AttributeError:
        raise UnsupportedMethodError(
            f"method {ctx.method!r}: {type(ctx.adapter.model).__name__} has no module {name!r}; "
            f"its feature stages are {_stage_activations(ctx.adapter)}"
        ) from None
    return name


def _check_called_once(ctx: Context, name: str, calls: int) -> None:
    """Refuse a module that runs more than once in one forward (a module reused inside its parent,
    e.g. torchvision's BasicBlock applies its one ``relu`` after ``bn1`` and after the sum): its name
    means several feature maps, and no one of them is the obvious one.

    Raises:
        OptionError: it ran ``calls`` > 1 times; the message names its parent module.
    """
    if calls <= 1:
        return
    parent = name.rpartition(".")[0]
    hint = f"its parent {parent!r} (one output) or " if parent else ""
    raise OptionError(
        f"method {ctx.method!r}: module {name!r} runs {calls} times in one forward (reused inside its parent), so it "
        f"has {calls} feature maps; pass module= {hint}a module that runs once (e.g. the layer before it)"
    )


def _activation_and_grad(ctx: Context, name: str) -> tuple[Tensor, Tensor]:
    """Activation A (B, C, h, w) of module ``name`` and dy/dA, float32 (float64 for a float64 model).

    Read from the explained forward and its backward when it recorded ``name`` (the feature
    stages: every method of the family shares that one pass); for any other module, one more
    forward and backward runs inside a scoped capture. A stage that outputs tokens, a
    channels-last map or a tuple (conv/attention hybrids) is read as a (B, C, h, w) map by the
    adapter's ``feature_map``.
    """
    calls = ctx.recorder.activations.get(name)
    if calls and calls[-1].grad is not None:
        _check_called_once(ctx, name, len(calls))
        record = calls[-1]
        act, grad = record.output, record.grad
    else:
        with torch.enable_grad(), capture(ctx.adapter.model, activations=[name], attention=False) as rec, \
                contiguous_norm_grads(ctx.adapter.model):  # (BatchNorm's backward at batch 1: grad_layout.py)
            outputs = ctx.adapter.forward(ctx.x.detach())
        if not rec.activations.get(name):
            raise UnsupportedMethodError(
                f"method {ctx.method!r}: module {name!r} gave no tensor in the forward: it does not run (a ModuleList, "
                "a Sequential its parent iterates, an auxiliary classifier in eval) or it returns no tensor or tuple "
                f"(e.g. a Hugging Face ModelOutput); pass module= a module inside it, e.g. a feature stage: "
                f"{_stage_activations(ctx.adapter)}"
            )
        _check_called_once(ctx, name, len(rec.activations[name]))
        act = rec.activation(name).output
        if not act.requires_grad:
            raise CaptureError(f"the output of {name!r} is not part of the autograd graph; cannot take dy/dA")
        (grad,) = torch.autograd.grad(ctx.score(outputs).sum(), act, allow_unused=True)
        if grad is None:
            raise UnsupportedMethodError(
                f"method {ctx.method!r}: the target score does not depend on the output of {name!r} "
                "(e.g. the head reads only a class token); pass module= an earlier stage"
            )
    to_map = getattr(ctx.adapter, "feature_map", None)
    if to_map is not None:
        size = (int(ctx.x.shape[-2]), int(ctx.x.shape[-1]))
        act, grad = to_map(name, act, size), to_map(name, grad, size)
    if act.dim() != 4 or act.shape[0] != ctx.batch_size:
        raise UnsupportedMethodError(
            f"method {ctx.method!r} needs one (C, h, w) feature map per image; {name!r} gave shape "
            f"{tuple(act.shape)} for {ctx.batch_size} images: pass module= a module that outputs (B, C, h, w)"
        )
    dtype = torch.promote_types(act.dtype, torch.float32)  # a float64 model's in float64: Grad-CAM++'s
    return act.detach().to(dtype), grad.to(dtype)          # denominator nearly cancels in places


def cam(ctx: Context, module: Optional[str], weights: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """The class activation map ``ReLU(sum_c w_c A_c)`` of a Grad-CAM variant.

    Every variant differs only in its weights (as in torch-cam): ``weights(A, dy/dA)`` returns
    (B, C) channel weights, or (B, C, h, w) weights per position (LayerCAM).

    Args:
        ctx: the explained batch (captured with the stages' activations and gradients).
        module: module name (None: the adapter's ``target_layer``).
        weights: the variant's weights of A (B, C, h, w) and its gradient.

    Returns:
        (B, h, w) float32 at the module's resolution.
    """
    act, grad = _activation_and_grad(ctx, _module_name(ctx, module))
    w = weights(act, grad)
    if w.dim() == 2:
        w = w[:, :, None, None]
    return (w * act).sum(1).clamp(min=0).float()


def gradcam_weights(act: Tensor, grad: Tensor) -> Tensor:
    """Grad-CAM channel weights: the spatial mean of dy/dA_c, (B, C) (Selvaraju et al. 2017)."""
    return grad.mean((2, 3))


def gradcam_pp_weights(act: Tensor, grad: Tensor) -> Tensor:
    """Grad-CAM++ channel weights (Chattopadhay et al. 2018, eq. 19 with the exponential trick).

    ``alpha = g^2 / (2 g^2 + sum_ab A_ab * g^3)`` (0 where g = 0), ``w_c = sum_ij alpha_ij ReLU(g_ij)``,
    as in pytorch-grad-cam.

    Args:
        act: (B, C, h, w) activations A.
        grad: (B, C, h, w) gradients g = dy/dA.

    Returns:
        (B, C) weights.
    """
    g2 = grad.pow(2)
    g3 = g2 * grad
    denom = 2 * g2 + act.sum((2, 3), keepdim=True) * g3
    alpha = torch.where(grad != 0, g2 / torch.where(denom != 0, denom, torch.ones_like(denom)), torch.zeros_like(g2))
    return (alpha * grad.clamp(min=0)).sum((2, 3))


def layercam_weights(act: Tensor, grad: Tensor) -> Tensor:
    """LayerCAM weights per position: ReLU(dy/dA), (B, C, h, w) (Jiang et al. 2021)."""
    return grad.clamp(min=0)


_MODULE = Option(str, optional=True, help="a module name of the model (None = the last feature stage)")


def _register_cam(name: str, weights: Callable[[Tensor, Tensor], Tensor], summary: str, reference: str) -> Callable:
    """Register a Grad-CAM variant: the shared pass (stages' activations and gradients) plus its weights."""

    def method(ctx: Context, *, module: Optional[str] = None) -> Tensor:
        return cam(ctx, module, weights)

    method.__name__ = name.replace("+", "_plus").replace("-", "_")
    method.__doc__ = f"""{summary}.

    Args:
        ctx: the explained batch.
        module: module name (default: the adapter's last feature stage).

    Returns:
        (B, h, w) float32 at the module's resolution.
    """
    register(
        name, CNN, options={"module": _MODULE}, requires=("stages",), grads=True, activations=_stage_activations,
        attention=False, signed=False, summary=summary, reference=reference,
    )(method)
    return method


gradcam = _register_cam(
    "gradcam", gradcam_weights, "Grad-CAM ReLU(sum_c mean(dy/dA_c) A_c) on the last feature stage or module=",
    "Selvaraju et al. 2017 (equal to captum's LayerGradCam and pytorch-grad-cam)")
gradcam_plus_plus = _register_cam(
    "gradcam++", gradcam_pp_weights, "Grad-CAM++ on the last feature stage or module=",
    "Chattopadhay et al. 2018 (as in pytorch-grad-cam)")
layercam = _register_cam(
    "layercam", layercam_weights, "LayerCAM ReLU(sum_c ReLU(dy/dA_c) * A_c) on the last feature stage or module=",
    "Jiang et al. 2021 (LayerCAM)")
