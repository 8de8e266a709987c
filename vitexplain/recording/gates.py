"""Channel and spatial attention gates of CNNs (SE, ECA, CBAM, ...): a registry and scoped hooks.

An attention-gate module multiplies its input ``x`` (B, C, h, w) by a gate computed from ``x``:
a channel gate (B, C, 1, 1) and/or a spatial gate (B, 1, h, w), values in (0, 1) (hard-sigmoid
gates: [0, 1]). This module records, per call of each such module, the *actual* gate values
the module multiplied by, plus the module's input.

How each gate is obtained (``GateSpec``): either a *tap*, the name of the submodule whose
forward output *is* the gate (a forward hook keeps that exact tensor), or a *recompute*, a
function that redoes the module's own gate computation from its input with its own
submodules (same ops, same inputs, so the same values up to the device's floating-point
determinism). Built-in modules:

=====================================  ===================================  ====================
module                                 channel gate                         spatial gate
=====================================  ===================================  ====================
timm ``SEModule``                      tap ``gate``                         --
timm ``EffectiveSEModule``             tap ``gate`` (hard sigmoid)          --
timm ``EcaModule`` / ``CecaModule``    tap ``gate`` ((B, 1, C) -> (B, C))   --
timm ``CbamModule``                    tap ``channel.gate``                 tap ``spatial.gate``
timm ``LightCbamModule``               recompute (``LightChannelAttn``      tap ``spatial.gate``
                                       applies ``F.sigmoid`` inline)
timm ``GatherExcite``                  tap ``gate``; with a local extent    mean over channels
                                       the gate is (B, C, h, w): its        of that gate
                                       spatial mean
timm ``GlobalContext``                 tap ``gate`` (``fuse_scale=True``;   --
                                       its softmax context pooling is not
                                       a gate and is not recorded)
timm EfficientNet/MobileNet            tap ``gate``                         --
``SqueezeExcite``
torchvision ``ops.SqueezeExcitation``  tap ``scale_activation``             --
(MobileNetV3, EfficientNet, RegNetY)
Hugging Face EfficientNet              tap ``act_expand``                   --
``EfficientNetSqueezeExciteLayer``
Hugging Face ``RegNetSELayer``         tap ``attention`` (ends in a         --
(RegNetY)                              sigmoid)
=====================================  ===================================  ====================

Adding a module type takes a few lines::

    @vitexplain.recording.register_gate(MyAttention)
    def _my_attention(module):
        return GateSpec(channel="sigmoid", spatial="spatial.sigmoid")  # submodule names

Registered modules are matched by ``isinstance`` (the nearest class in the MRO wins); the
submodules of a matched module are not searched again.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..errors import CaptureError, InputError
from .sink import in_backward

__all__ = [
    "GateSpec",
    "GatePlan",
    "GateRecord",
    "GateHooks",
    "register_gate",
    "supported_gates",
    "find_gates",
    "checked_gates",
]

Recompute = Callable[[nn.Module, Tensor], Tensor]
"""``fn(module, x) -> gate``: recomputes the gate from the module's input x (B, C, h, w)."""

Source = Union[str, Recompute]
"""A submodule name (relative to the gate module) whose output is the gate, or a recompute."""

KINDS = ("channel", "spatial", "full")


@dataclass(frozen=True)
class GateSpec:
    """Where the gates of one module come from.

    Attributes:
        channel: source of the channel gate, shaped (B, C, 1, 1), (B, 1, C) or (B, C).
        spatial: source of the spatial gate, shaped (B, 1, h, w).
        full: source of a gate broadcastable to the input, (B, C, h', w'): recorded as
            channel = its spatial mean, spatial = its channel mean when h' * w' > 1.
    """

    channel: Optional[Source] = None
    spatial: Optional[Source] = None
    full: Optional[Source] = None

    def sources(self) -> dict[str, Source]:
        """The kinds that have a source, in ``KINDS`` order."""
        return {k: getattr(self, k) for k in KINDS if getattr(self, k) is not None}


@dataclass(eq=False)
class GateRecord:
    """The gates of one call of one attention-gate module.

    Attributes:
        name: module path, e.g. ``"layer4.0.se"``.
        step: how many times this module had run before in the capture (0 first).
        channel: (B, C) the channel gate the module multiplied its input by, or None.
        spatial: (B, h, w) the spatial gate, or None.
        input: (B, C, h, w) the module's input activations (a reference, not detached).
        module: class name of the module, e.g. ``"CbamModule"``.
    """

    name: str
    step: int
    channel: Optional[Tensor]
    spatial: Optional[Tensor]
    input: Tensor
    module: str = ""


@dataclass(frozen=True)
class GatePlan:
    """A gate module found in a model and the spec used to read it."""

    name: str
    module: nn.Module
    spec: GateSpec

    def taps(self) -> dict[str, str]:
        """kind -> full submodule name, for the kinds read by a hook on a submodule."""
        return {k: f"{self.name}.{s}" if self.name else s for k, s in self.spec.sources().items() if isinstance(s, str)}


# -- registry -------------------------------------------------------------------------------
_REGISTRY: dict[type, Callable[[nn.Module], Optional[GateSpec]]] = {}


def register_gate(*classes: type) -> Callable[[Callable[[nn.Module], Optional[GateSpec]]], Callable]:
    """Register ``spec_fn(module) -> GateSpec | None`` for attention-gate module classes.

    Return None from ``spec_fn`` for an instance that has no gate (it is then skipped).

    Args:
        *classes: the module classes (subclasses match too).

    Returns:
        A decorator that registers and returns ``spec_fn`` unchanged.
    """
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise InputError("register_gate expects one or more nn.Module subclasses")

    def decorate(fn: Callable[[nn.Module], Optional[GateSpec]]) -> Callable:
        for cls in classes:
            _REGISTRY[cls] = fn
        return fn

    return decorate


def _light_cbam_channel(module: nn.Module, x: Tensor) -> Tensor:
    """timm ``LightChannelAttn`` gate, recomputed: it calls ``F.sigmoid`` instead of ``self.gate``."""
    c = module.channel
    pooled = 0.5 * x.mean((2, 3), keepdim=True) + 0.5 * x.amax((2, 3), keepdim=True)
    return torch.sigmoid(c.fc2(c.act(c.fc1(pooled))))


def _register_timm() -> None:
    from timm.layers import cbam, eca, gather_excite, global_context, squeeze_excite
    from timm.models import _efficientnet_blocks as effnet

    register_gate(
        squeeze_excite.SEModule,
        squeeze_excite.EffectiveSEModule,
        eca.EcaModule,
        eca.CecaModule,
        effnet.SqueezeExcite,
    )(lambda m: GateSpec(channel="gate"))
    register_gate(cbam.CbamModule)(lambda m: GateSpec(channel="channel.gate", spatial="spatial.gate"))
    register_gate(cbam.LightCbamModule)(lambda m: GateSpec(channel=_light_cbam_channel, spatial="spatial.gate"))
    register_gate(gather_excite.GatherExcite)(lambda m: GateSpec(full="gate"))
    register_gate(global_context.GlobalContext)(lambda m: GateSpec(channel="gate") if m.mlp_scale is not None else None)


def _register_torchvision() -> None:
    from torchvision.ops.misc import SqueezeExcitation

    register_gate(SqueezeExcitation)(lambda m: GateSpec(channel="scale_activation"))


def _register_transformers() -> None:
    from transformers.models.efficientnet.modeling_efficientnet import EfficientNetSqueezeExciteLayer
    from transformers.models.regnet.modeling_regnet import RegNetSELayer

    register_gate(EfficientNetSqueezeExciteLayer)(lambda m: GateSpec(channel="act_expand"))  # its nn.Sigmoid
    register_gate(RegNetSELayer)(lambda m: GateSpec(channel="attention"))  # (conv, ReLU, conv, Sigmoid)


#: Built-in registrations per library; each runs once that library has been imported (a model
#: cannot hold a module of a library that is not imported, and importing one costs seconds).
_BUILTINS: dict[str, Callable[[], None]] = {"timm": _register_timm, "torchvision": _register_torchvision,
                                            "transformers": _register_transformers}
_LOADED: set[str] = set()

#: Names of the built-in gate modules, for messages.
BUILTIN_GATES: tuple[str, ...] = (
    "timm SEModule",
    "EffectiveSEModule",
    "EcaModule",
    "CecaModule",
    "CbamModule",
    "LightCbamModule",
    "GatherExcite",
    "GlobalContext",
    "timm EfficientNet/MobileNet SqueezeExcite",
    "torchvision ops.SqueezeExcitation (MobileNetV3, EfficientNet, RegNetY)",
    "Hugging Face EfficientNet and RegNet(Y) squeeze-excitation layers",
)


def _load_builtins() -> None:
    """Register the built-in modules of timm, torchvision and transformers, if those are imported."""
    for library, register in _BUILTINS.items():
        if library in sys.modules and library not in _LOADED:
            _LOADED.add(library)
            register()


def supported_gates() -> list[str]:
    """Qualified names of the registered attention-gate module classes.

    The timm and torchvision modules are registered once those libraries are imported.
    """
    _load_builtins()
    return [f"{c.__module__}.{c.__qualname__}" for c in _REGISTRY]


def _spec_for(module: nn.Module) -> Optional[GateSpec]:
    for cls in type(module).__mro__:
        fn = _REGISTRY.get(cls)
        if fn is not None:
            return fn(module)
    return None


def find_gates(model: nn.Module) -> list[GatePlan]:
    """The attention-gate modules of ``model``, in ``named_modules()`` order.

    The submodules of a matched module are not searched (a CBAM's inner modules belong to it).
    """
    _load_builtins()
    plans: list[GatePlan] = []
    inside: Optional[str] = None
    for name, module in model.named_modules():
        if inside is not None and (inside == "" or name.startswith(inside + ".")):
            continue
        spec = _spec_for(module)
        if spec is not None and spec.sources():
            plans.append(GatePlan(name, module, spec))
            inside = name
    return plans


def _gateless(model: nn.Module) -> list[str]:
    """Class names of the registered modules of ``model`` whose instances scale by no gate (their spec is None:
    e.g. a GlobalContext that only adds its context, ``fuse_scale=False``)."""
    names = []
    for module in model.modules():
        if any(cls in _REGISTRY for cls in type(module).__mro__):
            spec = _spec_for(module)
            if spec is None or not spec.sources():
                names.append(type(module).__name__)
    return sorted(set(names))


def no_gates_message(model: nn.Module) -> str:
    """The error text for a model without any supported attention-gate module."""
    _load_builtins()
    custom = [c.__qualname__ for c in _REGISTRY if not c.__module__.startswith(("timm.", "torchvision."))]
    names = ", ".join([*BUILTIN_GATES, *custom])
    gateless = _gateless(model)
    why = (f" (its {', '.join(gateless)} modules scale by no gate: they add what they compute, e.g. a GlobalContext "
           "built with fuse_scale=False)" if gateless else "")
    return (
        f"{type(model).__name__} has no channel/spatial attention-gate module vitexplain can read{why}. "
        f"Supported: {names}. Register your own with vitexplain.recording.register_gate(YourModule), "
        f"or use 'gradcam', 'gradcam++' or 'layercam', which work on any CNN."
    )


# -- building records (shared by the hook path and the activation path) ----------------------
def _channel(gate: Tensor, batch: int, channels: int, where: str) -> Tensor:
    if gate.numel() != batch * channels:
        raise CaptureError(
            f"the channel gate of {where} has shape {tuple(gate.shape)}, expected {batch} x {channels} values"
        )
    return gate.detach().reshape(batch, channels)


def _spatial(gate: Tensor, where: str) -> Tensor:
    if gate.dim() != 4 or gate.shape[1] != 1:
        raise CaptureError(f"the spatial gate of {where} has shape {tuple(gate.shape)}, expected (B, 1, h, w)")
    return gate.detach()[:, 0]


def _build(plan: GatePlan, step: int, x: Tensor, raw: dict[str, Tensor]) -> GateRecord:
    """Normalise raw gate tensors of one call into a :class:`GateRecord`."""
    batch, channels = int(x.shape[0]), int(x.shape[1])
    where = f"{plan.name!r} ({type(plan.module).__name__})"
    for kind, source in plan.spec.sources().items():
        if kind not in raw and not isinstance(source, str):
            with torch.no_grad():
                raw[kind] = source(plan.module, x)
    channel = _channel(raw["channel"], batch, channels, where) if "channel" in raw else None
    spatial = _spatial(raw["spatial"], where) if "spatial" in raw else None
    if "full" in raw:
        full = raw["full"].detach()
        if full.dim() != 4 or full.shape[:2] != (batch, channels):
            raise CaptureError(f"the gate of {where} has shape {tuple(full.shape)}, expected ({batch}, {channels}, h, w)")
        channel = full.mean((2, 3)) if channel is None else channel
        if spatial is None and full.shape[-2] * full.shape[-1] > 1:
            spatial = full.mean(1)
    return GateRecord(plan.name, step, channel, spatial, x, type(plan.module).__name__)


def _first_tensor(args: tuple) -> Optional[Tensor]:
    return next((a for a in args if isinstance(a, Tensor)), None)


class GateHooks:
    """Forward hooks that record the gates of every supported module of one model.

    A forward pre-hook on each gate module keeps its input, forward hooks on its tap
    submodules keep the gate tensors, and a forward hook on the module turns them into a
    :class:`GateRecord` appended to ``records``. Hooks are removed by the handles that
    :meth:`register` returns (the recorder removes them in ``finally``).

    Args:
        model: the model whose gate modules are hooked.
        records: the list records are appended to, in call order.
        ours: whether a call in the calling thread is the capture's (the hooks fire in every thread that runs
            the model; the default takes every call).
    """

    def __init__(self, model: nn.Module, records: list[GateRecord], ours: Callable[[], bool] = lambda: True) -> None:
        self.model = model
        self.records = records
        self.ours = ours
        self.plans = find_gates(model)
        self._pending: dict[str, dict[str, Any]] = {}
        self._steps: dict[str, int] = {}

    def register(self) -> list[RemovableHandle]:
        """Install the hooks; returns their handles (remove them to uninstall)."""
        handles: list[RemovableHandle] = []
        try:
            for plan in self.plans:
                handles.append(plan.module.register_forward_pre_hook(self._pre(plan)))
                for kind, tap in plan.taps().items():
                    handles.append(self.model.get_submodule(tap).register_forward_hook(self._tap(plan, kind)))
                handles.append(plan.module.register_forward_hook(self._post(plan)))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        return handles

    def _pre(self, plan: GatePlan) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if self.ours():
                self._pending[plan.name] = {"input": _first_tensor(args), "raw": {}}

        return hook

    def _tap(self, plan: GatePlan, kind: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            pending = self._pending.get(plan.name)  # None: the tap ran outside its gate module
            if pending is not None and isinstance(output, Tensor) and self.ours():
                pending["raw"][kind] = output

        return hook

    def _post(self, plan: GatePlan) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not self.ours():
                return
            pending = self._pending.pop(plan.name, None)
            if pending is None or pending["input"] is None or in_backward():  # (in_backward: recomputed)
                return
            step = self._steps.get(plan.name, 0)
            self._steps[plan.name] = step + 1
            self.records.append(_build(plan, step, pending["input"], pending["raw"]))

        return hook

    def clear(self) -> None:
        """Forget call counts (with the records list cleared by the owner)."""
        self._pending.clear()
        self._steps.clear()


# -- reading gates from activation records (for captures made with activations=) --------------
def checked_gates(model: nn.Module, records: list[GateRecord], forward_count: int) -> list[GateRecord]:
    """``records``, or a clear error saying why there are none."""
    if records:
        return list(records)
    cls = type(model).__name__
    if forward_count == 0:
        raise CaptureError(
            f"no forward of {cls} ran inside vx.capture(..., gates=True): call the model inside the "
            "`with` block"
        )
    plans = find_gates(model)
    if not plans:
        raise CaptureError(no_gates_message(model))
    raise CaptureError(
        f"{cls} has {len(plans)} attention-gate modules (e.g. {plans[0].name!r}), but none ran during "
        "the captured forward"
    )
