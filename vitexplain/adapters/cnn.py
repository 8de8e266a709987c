"""Adapters for CNN classifiers: timm, torchvision and any conv net with (B, C) logits
(Hugging Face CNN classifiers: :mod:`vitexplain.adapters.cnn_hf`, on this module's adapter).

A CNN adapter names the model's feature stages (input side first); the last one is the
default target layer of Grad-CAM, Grad-CAM++ and LayerCAM. How the stages are found:
:mod:`vitexplain.adapters.cnn_stages`.

Conv/attention hybrids that no attention family describes (EfficientFormerV2, DaViT,
...) get the same adapter: the Grad-CAM family reads the last stage. Hierarchical
transformers (PVTv2, Twins, SAM's ViT, PiT, MaxViT, CoAtNet, CAFormer, TinyViT, LeViT, MViTv2, Hiera,
SAM 2's Hiera, CrossViT, TNT) are recognised first by :mod:`vitexplain.adapters.hier` (priority 15). A stage may output tokens (B, N, C) (prefix tokens first), channels-last
maps or a tuple; :meth:`CNNAdapter.feature_map` turns each into (B, C, h, w).

Whether a model calls attention is decided from what its modules' code calls (the source of
each module class: ``scaled_dot_product_attention``, a softmax, ``nn.MultiheadAttention``),
cached per class, not from class names. Detectors run after the ViT detectors (priorities 0
and -10 vs 10/5). The timm and torchvision detectors accept hybrids; the generic detector
(any model with ``Conv2d`` layers) accepts only models that call no attention, so an
unknown transformer is refused with a clear error rather than explained as a CNN.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Optional, Sequence

from torch import Tensor, nn

from ..checks import buffers_kept
from ..errors import UnsupportedMethodError

from ..methods.families import CNN
from .base import Adapter, classifies, register_adapter
from .cnn_sizes import one_size_reason
from .cnn_stages import cnn_stages, has_module, timm_stage_info, timm_stages, torchvision_stages
from .hybrid_notes import hybrid_note, mixer_reason
from ..errors import UsageError

__all__ = ["CNNAdapter", "calls_attention"]

#: Modules that output (B, C, h, w) inside a model whose blocks are channels-last (timm output_fmt "NHWC").
_CHANNELS_FIRST = (nn.Conv2d, nn.ConvTranspose2d, nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.MaxPool2d,
                   nn.AvgPool2d)


class CNNAdapter(Adapter):
    """A CNN classifier.

    Args:
        model: the CNN (never modified).
        stages: feature stage module names, input side first (default: found automatically,
            see the module docstring).

    Attributes:
        stages: feature stage module names, input side first.
        target_layer: the default layer of the Grad-CAM family (the last stage).
        one_size: why the model takes one input size only (a hybrid whose attention is built for one
            grid), else None: a failure on an input is then reported as the input's size.
    """

    family = CNN

    def __init__(self, model: nn.Module, stages: Optional[Sequence[str]] = None) -> None:
        super().__init__(model)
        self.stages = list(stages) if stages is not None else cnn_stages(model)
        if not self.stages:
            raise UsageError(
                f"no feature stage found in {type(model).__name__}; pass stages=[...] or a layer name"
            )
        self._capabilities = frozenset({"stages"}) | gate_capabilities(model)
        self._probed = False
        self.has_head = _has_head(model)
        self.notes.update(_gate_notes(model, self._capabilities))
        self.hybrid = calls_attention(model) or mixer_reason(model) is not None
        self.one_size = one_size_reason(model) if self.hybrid else None
        self._info = timm_stage_info(model)
        if self.hybrid:
            self.notes["family"] = hybrid_note(model)

    @property
    def capabilities(self) -> frozenset[str]:  # type: ignore[override]
        """What the plan may rely on. For a hybrid, ``stages`` is kept only when its target
        layer gives one (C, h, w) map per image, found by one probe forward at the first ask."""
        if self.hybrid and not self._probed:
            self._probed = True
            why = self._probe_target_layer()
            if why is not None:
                self._capabilities = self._capabilities - {"stages"}
                self.notes["stages"] = why
        return self._capabilities

    @capabilities.setter
    def capabilities(self, value: frozenset[str]) -> None:
        self._capabilities = frozenset(value)

    def _probe_target_layer(self, batch: int = 2) -> Optional[str]:
        """Why ``target_layer``'s output is not one (C, h, w) feature map per image, or None
        (also when the probe cannot run: then nothing is proven).

        Runs the model once without gradients on a blank batch of ``batch`` images at its input
        size, with a forward hook on the layer (removed in ``finally``). The model is left as
        found: a model in training mode gets its buffers (BatchNorm statistics) restored.
        """
        import torch

        name = self.target_layer
        size = tuple(self.preprocess_kwargs()["input_size"])
        first = next(self.model.parameters(), None)
        x = torch.zeros(batch, 3, *size, device=first.device if first is not None else None,
                        dtype=first.dtype if first is not None and first.is_floating_point() else None)
        seen: list[Tensor] = []

        def keep(module: nn.Module, inputs: object, output: object) -> None:
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(out, Tensor):
                seen.append(out)

        handle = self.model.get_submodule(name).register_forward_hook(keep)
        try:
            with torch.no_grad(), buffers_kept(self.model):
                self.forward(x)
        except Exception:  # e.g. its configured input size is not the one it was built for: nothing is
            return None    # proven; the Explanation's check still refuses maps that are not one per image
        finally:
            handle.remove()
        if not seen:
            return f"its layer {name!r} is not called in a forward"
        out = seen[-1]
        try:
            fmap = self.feature_map(name, out, size)
        except UnsupportedMethodError:
            fmap = None
        if fmap is None or fmap.dim() != 4 or fmap.shape[0] != batch:
            return (f"its last stage {name!r} outputs {tuple(out.shape)} for {batch} images, which is not one "
                    "(C, h, w) feature map per image (e.g. tokens of several branches or patches mixed with the "
                    "batch), so the Grad-CAM family cannot read it")
        return None

    def preprocess_kwargs(self) -> dict[str, Any]:
        """timm's data config of the model; for a torchvision CNN that carries no ``pretrained_cfg`` (one set by
        the user wins), its weights' eval transform (:mod:`vitexplain.adapters.tv_preprocess`: bilinear, Inception
        v3 at 299 px, ...)."""
        from .tv_preprocess import torchvision_preprocess

        tv = torchvision_preprocess(self.model) if getattr(self.model, "pretrained_cfg", None) is None else None
        return tv or super().preprocess_kwargs()

    def feature_map(self, name: str, output: Tensor, input_size: tuple[int, int]) -> Tensor:
        """A stage's output as a (B, C, h, w) feature map.

        Args:
            name: the module name.
            output: its output (the first tensor of a tuple): (B, C, h, w), channels-last
                (B, h, w, C) (a stage's channels tell, and timm's ``output_fmt`` "NHWC" for every module
                but convolutions, norms and pools), or tokens (B, N, C) with any prefix tokens first.
            input_size: (H, W) of the model input (gives a token stage's grid from its
                reduction).

        Returns:
            (B, C, h, w), a view or copy of ``output`` (gradients map the same way).

        Raises:
            UnsupportedMethodError: the output cannot be read as a feature map.
        """
        reduction, channels = self._info.get(name, (None, None))
        if output.dim() == 4:
            declared = getattr(self.model, "output_fmt", None)  # timm's layout of its stages: "NHWC" for MambaOut
            nhwc = str(getattr(declared, "value", declared)) == "NHWC"  # (the shape alone cannot tell when h == C)
            if channels is not None and output.shape[-1] == channels and (nhwc or output.shape[1] != channels):
                return output.permute(0, 3, 1, 2)
            if channels is None and nhwc and not isinstance(self.model.get_submodule(name), _CHANNELS_FIRST):
                return output.permute(0, 3, 1, 2)  # a block inside (B, h, w, C); its convs and norms (B, C, h, w)
            return output
        if output.dim() == 3 and reduction:
            h, w = (math.ceil(s / reduction) for s in input_size)
            prefix = output.shape[1] - h * w
            if 0 <= prefix <= 16:
                return output[:, prefix:].transpose(1, 2).reshape(output.shape[0], output.shape[2], h, w)
        raise UnsupportedMethodError(
            f"{type(self.model).__name__}: the output of {name!r} has shape {tuple(output.shape)}, "
            "which vitexplain cannot read as a (B, C, h, w) feature map; pass module= a module "
            "that outputs one"
        )

    def size_refusal(self, x: Tensor) -> Optional[str]:
        """Why the model does not take the size of ``x`` (B, C, H, W) and which size it takes (a self-attention
        block that takes some feature-map sizes only, feature maps that must halve evenly, a minimum size), else
        None (:func:`vitexplain.adapters.cnn_sizes.size_refusal`; runs probe forwards of one image)."""
        from .base import preprocessing
        from .cnn_sizes import size_refusal

        configured = preprocessing(self).get("input_size")
        stride = max((int(r) for r, _ in self._info.values() if r), default=32)
        return size_refusal(self.model, self.forward, x, tuple(configured)[-2:] if configured else None, stride)

    @property
    def target_layer(self) -> str:
        """Module name of the last feature stage (the stage before it when the head reads only
        a class token: the last stage's patch tokens then get no gradient, e.g. PiT)."""
        if _reads_class_token(self.model) and len(self.stages) > 1:
            return self.stages[-2]
        return self.stages[-1]

    def describe(self) -> str:
        kind = ", hybrid" if self.hybrid else ""
        return f"{type(self).__name__}({type(self.model).__name__}{kind}, target_layer={self.target_layer!r})"


def gate_capabilities(model: nn.Module) -> frozenset[str]:
    """``channel_gates`` / ``spatial_gates`` for the gate modules ``model`` contains."""
    from ..recording.gates import find_gates

    found: set[str] = set()
    for plan in find_gates(model):
        spec = plan.spec
        if spec.channel is not None or spec.full is not None:
            found.add("channel_gates")
        # a full gate (gather-excite) has a spatial part only with a local extent
        if spec.spatial is not None or (spec.full is not None and getattr(plan.module, "extent", 0)):
            found.add("spatial_gates")
    return frozenset(found)


def _gate_notes(model: nn.Module, capabilities: frozenset[str]) -> dict[str, str]:
    """Why a gate capability is missing (the modules supported, or those the model has)."""
    from ..recording.gates import find_gates, no_gates_message

    plans = find_gates(model)
    if not plans:
        return {"channel_gates": no_gates_message(model), "spatial_gates": no_gates_message(model)}
    modules = sorted({type(p.module).__name__ for p in plans})
    return {
        kind: f"it has no {kind.split('_')[0]} attention gate (its gate modules: {modules})"
        for kind in ("channel_gates", "spatial_gates")
        if kind not in capabilities
    }


#: Attribute names of a classifier head (timm's get_classifier() first).
_HEADS = ("fc", "classifier", "head", "heads", "last_linear")


def _has_head(model: nn.Module) -> bool:
    """Whether the model returns class logits: False for ``num_classes=0`` and for a head that holds no linear or
    conv layer (``fc = nn.Identity()``, a Hugging Face classifier with ``num_labels=0``): its output is then the
    pooled features, and no index of it is a class."""
    if int(getattr(model, "num_classes", 1) or 0) <= 0:
        return False
    get = getattr(model, "get_classifier", None)
    try:
        head = get() if callable(get) else None
    except Exception:  # a get_classifier that needs arguments or fails: read the attributes
        head = None
    if not isinstance(head, nn.Module):
        head = next((h for h in (getattr(model, n, None) for n in _HEADS) if isinstance(h, nn.Module)), None)
    return head is None or classifies(head)


def _reads_class_token(model: nn.Module) -> bool:
    return getattr(model, "global_pool", None) == "token" and getattr(model, "cls_token", None) is not None


#: What attention code calls (in a module class's source).
_ATTENTION_CALLS = ("scaled_dot_product_attention", "softmax(", "multi_head_attention_forward", "flex_attention(")


@functools.lru_cache(maxsize=None)
def _class_calls_attention(cls: type) -> bool:
    """Whether a module class's own code (any class in its MRO below nn.Module) calls attention."""
    for klass in cls.__mro__:
        if klass is nn.MultiheadAttention or issubclass(klass, nn.Softmax):
            return True
        if klass.__module__.startswith("torch.nn.") or klass in (nn.Module, object):
            continue
        if klass.__module__.startswith("transformers.") and not klass.__module__.startswith("transformers.models."):
            continue  # PreTrainedModel and its mixins: library code every Hugging Face model inherits, not its layers'
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # built at run time, or from a compiled extension
            continue
        if any(call in source for call in _ATTENTION_CALLS):
            return True
    return False


def calls_attention(model: nn.Module) -> bool:
    """Whether any module of ``model`` calls attention (SDPA, a softmax, MHA), from the
    source of each module class (cached per class)."""
    return any(_class_calls_attention(type(m)) for m in model.modules())


def _is_classifier_cnn(model: nn.Module, hybrids: bool) -> bool:
    if not has_module(model, nn.Conv2d) or (not hybrids and calls_attention(model)):
        return False
    return callable(getattr(model, "get_classifier", None)) or hasattr(model, "num_classes") or has_module(model, nn.Linear)


def _is_swin(model: nn.Module) -> bool:
    """Swin-style windowed models have their own adapter (adapters/swin.py)."""
    return "swin" in type(model).__name__.lower()


@register_adapter(priority=0, family=CNN)
def _detect_timm(model: nn.Module) -> Optional[Adapter]:
    if _is_swin(model):
        return None
    if getattr(model, "feature_info", None) and callable(getattr(model, "get_classifier", None)):
        if _is_classifier_cnn(model, hybrids=True):
            stages = timm_stages(model)
            return CNNAdapter(model, stages) if stages else None
    return None


@register_adapter(priority=0, family=CNN)
def _detect_torchvision(model: nn.Module) -> Optional[Adapter]:
    if _is_swin(model):
        return None
    module = type(model).__module__
    # a classification model (torchvision.models.<name>, not .detection or .segmentation) whose head was removed
    headless = module.count(".") == 2 and has_module(model, nn.Conv2d) and not _has_head(model)
    if module.startswith("torchvision.models") and (_is_classifier_cnn(model, hybrids=True) or headless):
        stages = torchvision_stages(model)
        return CNNAdapter(model, stages) if stages else None
    return None


@register_adapter(priority=-10, family=CNN)
def _detect_generic(model: nn.Module) -> Optional[Adapter]:
    if type(model).__module__.startswith("transformers."):  # (pixel_values in, a ModelOutput out: cnn_hf.py)
        return None
    if _is_classifier_cnn(model, hybrids=False):
        stages = cnn_stages(model)
        return CNNAdapter(model, stages) if stages else None
    return None
