"""CNN methods: attention gates (spatial, channel) and the Grad-CAM family.

- ``spatial``: the spatial gate a CBAM-style module multiplied its input by, (B, h, w) in (0, 1).
- ``channel``: the gate-weighted activation ``sum_c g_c X_c`` of an SE/ECA/CBAM module's input
  X (B, C, h, w) with its channel gate g (B, C); extras hold the top-k channels.
- ``gradcam``: captum's ``LayerGradCam`` (``relu_attributions=True``) on a layer.
- ``gradcam++`` and ``layercam``: from the layer's activation A and the gradient dy/dA of the
  explained forward's single backward (captum has neither).

The Grad-CAM family reads the last feature stage by default (``adapter.target_layer``); pass
``layer="layer3"`` (any module name) to choose another. ``channel`` reads the deepest gate
module by default, ``spatial`` the mean of all spatial gates; ``layer=`` selects a stage or
module by name (the last gate inside it).
Definitions: docs/methods.md, "CNNs".
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ..recording import capture
from ..recording.gates import GateRecord
from ..errors import CaptureError, UnsupportedMethodError, UsageError
from .captum_methods import _forward_and_target
from .context import Context
from .options import Option
from .registry import register

__all__ = ["spatial", "channel", "gradcam", "gradcam_plus_plus", "layercam", "gradcam_pp_weights"]


# -- gates -------------------------------------------------------------------------------------
def _gate_records(ctx: Context) -> list[GateRecord]:
    """The gate records of the explained forward (captured with ``gates=True``)."""
    try:
        return ctx.recorder.gates
    except CaptureError as err:
        raise UnsupportedMethodError(f"method {ctx.method!r}: {err}") from None


def _select_gate(ctx: Context, layer: Optional[str], kind: str) -> GateRecord:
    """The last gate record with a ``kind`` gate, inside module/stage ``layer`` if given."""
    records = [r for r in _gate_records(ctx) if getattr(r, kind) is not None]
    if not records:
        raise UnsupportedMethodError(
            f"method {ctx.method!r}: {type(ctx.adapter.model).__name__} has no {kind} attention gate "
            f"(its gate modules: {sorted({r.module for r in _gate_records(ctx)})}); "
            f"use {'channel' if kind == 'spatial' else 'spatial'!r}, 'gradcam' or 'layercam'"
        )
    if layer is not None:
        inside = [r for r in records if r.name == layer or r.name.startswith(layer + ".")]
        if not inside:
            raise UnsupportedMethodError(
                f"method {ctx.method!r}: no {kind} gate inside {layer!r}; modules with one: "
                f"{list(dict.fromkeys(r.name for r in records))}"
            )
        records = inside
    return records[-1]


@register(
    "spatial",
    options={
        "layer": Option(str, optional=True, help="gate module name, 'deepest' (None = mean of all spatial gates)"),
    },
    family="cnn",
    requires=("spatial_gates",),
    gates=True,
    attention=False,
    signed=False,
    class_sensitive=False,
    summary="spatial attention gates (CBAM-style): their mean over the network, or one module's with layer=",
    reference="Woo et al. 2018 (CBAM); the gate the module multiplies its input by",
)
def spatial(ctx: Context, *, layer: Optional[str] = None) -> tuple[Tensor, dict[str, Any]]:
    """Spatial attention: the spatial gates the model's CBAM-style modules multiplied by.

    Args:
        ctx: the explained batch.
        layer: None (default) for the mean of every spatial gate of the forward, each
            bilinearly resized to the finest gate resolution: the network's average spatial
            re-weighting; ``"deepest"`` for the last gate; or a stage / module name (e.g.
            ``"layer3"``) for the last gate inside it.

    Returns:
        (B, h, w) float32 gate values in (0, 1) (upsample with ``Explanation.upsample``), and
        extras ``{"layer": the module name(s) read}``.
    """
    if layer is not None:
        record = _select_gate(ctx, None if layer == "deepest" else layer, "spatial")
        return record.spatial.float(), {"layer": record.name}  # type: ignore[union-attr]  (_select_gate checked it)
    records = [r for r in _gate_records(ctx) if r.spatial is not None]
    if not records:
        _select_gate(ctx, None, "spatial")  # raises the explanatory error
    size = max((r.spatial.shape[-2:] for r in records), key=lambda s: s[0] * s[1])  # type: ignore[union-attr]
    resized = [
        torch.nn.functional.interpolate(r.spatial.float()[:, None], size=tuple(size), mode="bilinear", align_corners=False)[:, 0]  # type: ignore[union-attr]
        for r in records
    ]
    return torch.stack(resized).mean(dim=0), {"layer": [r.name for r in records]}


@register(
    "channel",
    options={
        "layer": Option(str, optional=True, help="gate module name (None = the deepest)"),
        "k": Option(int, low=1, help="top channels returned"),
    },
    family="cnn",
    requires=("channel_gates",),
    gates=True,
    attention=False,
    signed=False,
    class_sensitive=False,
    summary="gate-weighted activation sum_c g_c X_c of an SE/ECA/CBAM module, with its top-k channels",
    reference="Hu et al. 2018 (SE), Wang et al. 2020 (ECA), Woo et al. 2018 (CBAM)",
)
def channel(ctx: Context, *, layer: Optional[str] = None, k: int = 8) -> tuple[Tensor, dict[str, Any]]:
    """Channel attention: the module input weighted by its channel gate, summed over channels.

    Args:
        ctx: the explained batch.
        layer: a stage or module name; the last module inside it with a channel gate is read.
            Default: the last one of the model (the deepest).
        k: how many top-gated channels to return in the extras.

    Returns:
        (B, h, w) float32 map ``sum_c g_c X_c`` (X the module's input, g its channel gate), and
        extras: ``layer`` (module name), ``gate`` (B, C), ``indices`` (B, k) channels with the
        largest gates (descending), ``values`` (B, k) their gates, ``channel_maps`` (B, k, h, w)
        their activations X_c.
    """
    if k < 1:
        raise UsageError(f"k must be >= 1, got {k}")
    record = _select_gate(ctx, layer, "channel")
    x = record.input.detach().float()  # (B, C, h, w)
    gate = record.channel.float()  # type: ignore[union-attr]  (B, C); _select_gate checked it
    maps = torch.einsum("bc,bchw->bhw", gate, x)
    values, indices = gate.topk(min(k, gate.shape[1]), dim=1)
    channel_maps = x.gather(1, indices[:, :, None, None].expand(-1, -1, *x.shape[-2:]))
    extras = {"layer": record.name, "gate": gate, "indices": indices, "values": values, "channel_maps": channel_maps}
    return maps, extras


# -- Grad-CAM family ---------------------------------------------------------------------------
def _stage_activations(adapter: Any) -> list[str]:
    return list(getattr(adapter, "stages", []))


def _layer_name(ctx: Context, layer: Optional[str]) -> str:
    name = layer if layer is not None else getattr(ctx.adapter, "target_layer", None)
    if name is None:
        raise UnsupportedMethodError(f"method {ctx.method!r} needs a layer name: pass layer='...'")
    try:
        ctx.model_module(name)
    except AttributeError:
        raise UnsupportedMethodError(
            f"method {ctx.method!r}: {type(ctx.adapter.model).__name__} has no module {name!r}; "
            f"its feature stages are {_stage_activations(ctx.adapter)}"
        ) from None
    return name


def _activation_and_grad(ctx: Context, name: str) -> tuple[Tensor, Tensor]:
    """Activation A (B, C, h, w) of layer ``name`` and dy/dA, float32.

    Read from the explained forward when it recorded ``name`` (the feature stages); for any
    other layer, one more forward and backward runs inside a scoped capture. A stage that
    outputs tokens, a channels-last map or a tuple (conv/attention hybrids) is read as a
    (B, C, h, w) map by the adapter's ``feature_map``.
    """
    calls = ctx.recorder.activations.get(name)
    if calls and calls[-1].grad is not None:
        record = calls[-1]
        act, grad = record.output, record.grad
    else:
        with torch.enable_grad(), capture(ctx.adapter.model, activations=[name], attention=False) as rec:
            outputs = ctx.adapter.forward(ctx.x.detach())
        act = rec.activation(name).output
        if not act.requires_grad:
            raise CaptureError(f"the output of {name!r} is not part of the autograd graph; cannot take dy/dA")
        (grad,) = torch.autograd.grad(ctx.score(outputs).sum(), act, allow_unused=True)
        if grad is None:
            raise UnsupportedMethodError(
                f"method {ctx.method!r}: the target score does not depend on the output of {name!r} "
                "(e.g. the head reads only a class token); pass layer= an earlier stage"
            )
    to_map = getattr(ctx.adapter, "feature_map", None)
    if to_map is not None:
        size = (int(ctx.x.shape[-2]), int(ctx.x.shape[-1]))
        act, grad = to_map(name, act, size), to_map(name, grad, size)
    if act.dim() != 4:
        raise UnsupportedMethodError(
            f"method {ctx.method!r} needs a (B, C, h, w) feature map; {name!r} gave shape {tuple(act.shape)}"
        )
    return act.detach().float(), grad.float()


def _plain_map(ctx: Context, name: str) -> bool:
    """Whether layer ``name`` outputs a plain (B, C, h, w) tensor (as recorded in the explained
    forward; layers that were not recorded are taken to)."""
    calls = ctx.recorder.activations.get(name)
    if not calls:
        return True
    record = calls[-1]
    to_map = getattr(ctx.adapter, "feature_map", None)
    if record.tuple_output or record.output.dim() != 4:
        return False
    size = (int(ctx.x.shape[-2]), int(ctx.x.shape[-1]))
    return to_map is None or to_map(name, record.output, size) is record.output


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


@register(
    "gradcam",
    options={
        "layer": Option(str, optional=True, help="module name (None = the last stage)"),
    },
    family="cnn",
    requires=("stages",),
    activations=_stage_activations,
    attention=False,
    signed=False,
    summary="Grad-CAM (captum LayerGradCam, ReLU) on the last feature stage or layer=",
    reference="Selvaraju et al. 2017 (captum.attr.LayerGradCam)",
)
def gradcam(ctx: Context, *, layer: Optional[str] = None) -> Tensor:
    """Grad-CAM: ``ReLU(sum_c w_c A_c)`` with ``w_c`` the spatial mean of dy/dA_c, via captum.

    Runs captum's ``LayerGradCam(relu_attributions=True)``, which does its own forward and
    backward with a hook on the layer (removed by captum). A stage that outputs tokens, a
    channels-last map or a tuple (conv/attention hybrids), which captum cannot read, gets the
    same formula on the adapter's (B, C, h, w) view of it.

    Args:
        ctx: the explained batch.
        layer: module name (default: the adapter's last feature stage).

    Returns:
        (B, h, w) float32 at the layer's resolution.
    """
    from captum.attr import LayerGradCam

    name = _layer_name(ctx, layer)
    if not _plain_map(ctx, name):
        act, grad = _activation_and_grad(ctx, name)
        return torch.einsum("bc,bchw->bhw", grad.mean((2, 3)), act).clamp(min=0)
    module = ctx.model_module(name)
    forward, target = _forward_and_target(ctx)
    with torch.enable_grad():
        attr = LayerGradCam(forward, module).attribute(ctx.x.detach(), target=target, relu_attributions=True)
    return attr.detach().float().sum(1)


@register(
    "gradcam++",
    options={
        "layer": Option(str, optional=True, help="module name (None = the last stage)"),
    },
    family="cnn",
    requires=("stages",),
    grads=True,
    activations=_stage_activations,
    attention=False,
    signed=False,
    summary="Grad-CAM++ on the last feature stage or layer=",
    reference="Chattopadhay et al. 2018 (as in pytorch-grad-cam)",
)
def gradcam_plus_plus(ctx: Context, *, layer: Optional[str] = None) -> Tensor:
    """Grad-CAM++: ``ReLU(sum_c w_c A_c)`` with :func:`gradcam_pp_weights`.

    Args:
        ctx: the explained batch.
        layer: module name (default: the adapter's last feature stage).

    Returns:
        (B, h, w) float32 at the layer's resolution.
    """
    act, grad = _activation_and_grad(ctx, _layer_name(ctx, layer))
    weights = gradcam_pp_weights(act, grad)
    return torch.einsum("bc,bchw->bhw", weights, act).clamp(min=0)


@register(
    "layercam",
    options={
        "layer": Option(str, optional=True, help="module name (None = the last stage)"),
    },
    family="cnn",
    requires=("stages",),
    grads=True,
    activations=_stage_activations,
    attention=False,
    signed=False,
    summary="LayerCAM ReLU(sum_c ReLU(dy/dA_c) * A_c) on the last feature stage or layer=",
    reference="Jiang et al. 2021 (LayerCAM)",
)
def layercam(ctx: Context, *, layer: Optional[str] = None) -> Tensor:
    """LayerCAM: ``ReLU(sum_c ReLU(dy/dA_c) * A_c)``, position by position.

    Args:
        ctx: the explained batch.
        layer: module name (default: the adapter's last feature stage).

    Returns:
        (B, h, w) float32 at the layer's resolution.
    """
    act, grad = _activation_and_grad(ctx, _layer_name(ctx, layer))
    return (grad.clamp(min=0) * act).sum(1).clamp(min=0)
