"""Model adapters: the one place where vitexplain recognises a model.

An adapter never changes the model. It knows, for one model family, everything a method may
need: the token layout, the modules a method reads, how to run the model and its head, and
which methods apply (its *capabilities*). ``adapter_for(model)`` asks every registered
detector, highest priority first; the first adapter returned wins. ``vx.token_layout``,
``vx.capture``'s ``rec.layout``, the Explainer, the command line and
``vx.methods.names(model)`` all go through it, so there is one recognition path.

The interface (what methods and the Explainer rely on)
------------------------------------------------------
Every adapter (:class:`Adapter`):

- ``family``: a :class:`~vitexplain.methods.families.Family` (``VIT``, ``SWIN``, ``CNN``,
  ``CAPTION``, ...): which registered methods may apply.
- ``capabilities``: a frozenset of the names below. A method declares what it needs with
  ``requires=`` in its registration; the plan lets it run iff ``requires <= capabilities``
  and otherwise says why not (``vx.Explainer(model).plan(method=...)``).
- ``forward(x) -> Tensor``: the model on a preprocessed (B, 3, H, W) batch, returning the
  tensor targets score: (B, C) logits, or (B, D) the pooled embedding of a headless backbone.
- ``has_head``: False for headless backbones (targets must be callables such as
  ``vx.targets.similarity(vector)``; a class index raises a clear ``TargetError``).
- ``label_names``, ``preprocess_kwargs()``, ``describe()``.

ViT adapters (``family = VIT``, :class:`vitexplain.adapters.vit.ViTAdapter`) add:

- ``layout(input_size) -> TokenLayout``: prefix tokens, patch grid, readout.
- ``blocks``: module names of the blocks whose token attention the attention methods read,
  input side first; each issues one attention call per forward whose keys are the layout's
  tokens (prefix + grid) and whose queries are all of them (self-attention) or the first
  few (class attention, e.g. CaiT/XCiT: the class token alone).
- ``norm1``: the module whose output T (B, N, D) over the layout's tokens enters the model's
  last token attention (CDAM, token Grad-CAM); its *input* is the residual stream u that
  enters the last block.
- ``tail(u, call) -> Tensor``: the model's outputs (as ``forward`` returns them) recomputed
  from u; ``call`` is the recorded call (an ``ActivationRecord`` with ``args`` and
  ``kwargs``) of ``blocks[-1]``, whose other arguments (position biases, sizes) are passed
  again. Used by smooth and integrated CDAM.
- ``head(tokens) -> Tensor``: the outputs read from the output tokens of any block in
  ``blocks`` (LeGrad).
  ``tail`` and ``head`` are never trusted: :meth:`vitexplain.methods.context.Context.partial`
  checks once per method call that they reproduce the model's own outputs (1e-4 relative)
  and raises ``UnsupportedModelError`` otherwise.

CNN adapters (``family = CNN``) add ``stages`` (feature stage names, input side first)
and ``target_layer``; ``feature_map(name, output, input_size)`` turns a stage's output
(tokens, channels-last, a tuple: conv/attention hybrids) into (B, C, h, w); ``hybrid`` says
whether the model calls attention (``notes["family"]`` then says why the ViT methods do not
apply).
Caption adapters (``family = CAPTION``) add generation, teacher forcing, the image
encoder's layout, ``cross_records(records)`` (the decoder's text-to-image attention calls)
and ``joint`` (one decoder self-attention over [image, text], GIT); see
``adapters/captioning.py``.

Capabilities
------------
The capability names and what each means are listed once, in
:data:`vitexplain.methods.registry.CAPABILITIES` (re-exported here). An adapter declares the
ones its model has; for a capability it lacks, ``notes[capability]`` may say why (the plan
quotes it when it refuses a method). Which methods apply is decided by the plan
(:mod:`vitexplain.plan`), never here.

Registering your own adapter
----------------------------
::

    from vitexplain.adapters import register_adapter
    from vitexplain.adapters.vit import ViTAdapter

    class MyAdapter(ViTAdapter):
        ...  # layout, blocks, norm1 (+ tail/head for the methods that re-run the model)

    @register_adapter(priority=50)           # above the built-in detectors (<= 20)
    def _detect(model):
        return MyAdapter(model) if isinstance(model, MyViT) else None

See docs/guide.md ("Your own model") for a complete, tested example.
"""

from __future__ import annotations

from functools import cached_property, lru_cache
from typing import Any, Callable, Optional, Union

from torch import Tensor, nn

from ..errors import UnsupportedModelError
from ..layout import TokenLayout, pair
from ..methods.families import Family, family as _family
from ..methods.registry import CAPABILITIES
from ..recording.compiled import unwrap_compiled
from ..recording.flex import flex_configured

__all__ = ["Adapter", "register_adapter", "register_refusal", "adapter_for", "find_adapter", "find_layout_module",
           "token_layout", "preprocessing", "CAPABILITIES", "unwrap_compiled", "classifies"]


def classifies(head: Optional[nn.Module]) -> bool:
    """Whether a classifier head outputs class logits: False for no head and for one holding no linear or conv layer
    (a Hugging Face ``*ForImageClassification`` built with ``num_labels=0`` has ``classifier = nn.Identity()``: its
    ``logits`` are the pooled features, and no index of them is a class)."""
    return head is not None and any(isinstance(m, (nn.Linear, nn.Conv2d, nn.Conv1d)) for m in head.modules())


class Adapter:
    """Base class of model adapters.

    Attributes:
        model: the wrapped model (never modified).
        family: the model's :class:`~vitexplain.methods.families.Family`.
        capabilities: what methods may rely on (see the module docstring).
        has_head: whether ``forward`` returns class logits (False: a pooled embedding).
        notes: per capability that is missing, why (used in refusal messages).
    """

    family: Family
    capabilities: frozenset[str] = frozenset()
    has_head: bool = True
    saved_preprocess: Optional[dict[str, Any]] = None  # a wrapper's preprocessing (see preprocessing())

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.notes: dict[str, str] = {}

    def forward(self, x: Tensor) -> Any:
        """Run the model on a preprocessed (B, 3, H, W) batch; returns the tensor targets score."""
        return self.model(x)

    def not_implemented(self, what: str) -> UnsupportedModelError:
        """The error of an adapter method its class does not implement (to raise)."""
        return UnsupportedModelError(
            f"{type(self).__name__} does not implement {what}, which this operation needs; implement it in your "
            "adapter (see the interface in vitexplain/adapters/base.py) or use a method that does not need it"
        )

    # -- metadata ---------------------------------------------------------------------------
    @cached_property
    def label_names(self) -> Optional[list[str]]:
        """Class names, when the model carries them (zoo models, timm ImageNet models).

        Resolved once per adapter (an Explainer keeps one): timm's ImageNet label file is
        parsed once per process, not on every explained batch.
        """
        if not self.has_head:
            return None
        cfg = getattr(self.model, "pretrained_cfg", None) or {}
        names = cfg.get("label_names") if isinstance(cfg, dict) else None
        if names:
            return list(names)
        id2label = _named_labels(getattr(self.model, "config", None))
        if id2label:
            return _names_by_index(id2label)
        return _timm_imagenet_names(self.model)

    def preprocess_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`vitexplain.data.images.preprocess` for this model."""
        from ..data.images import preprocess_kwargs

        return preprocess_kwargs(self.model)

    def describe(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__})"


def preprocessing(adapter: Adapter) -> dict[str, Any]:
    """Keyword arguments of :func:`vitexplain.data.images.preprocess` for ``adapter``'s model: the adapter's defaults
    (:meth:`Adapter.preprocess_kwargs`), overridden by the settings of the image processor saved with the model where
    it carries them (``model.vx_preprocess``: ``input_size``, ``mean``, ``std``, ``crop_pct``, ``interpolation``; set
    when ``--model DIR`` loads a Hugging Face folder holding a ``preprocessor_config.json``), or those of the wrapper
    the adapter's model was found in (``adapter.saved_preprocess``: a Hugging Face TimmWrapper's)."""
    saved = getattr(adapter, "saved_preprocess", None) or getattr(adapter.model, "vx_preprocess", None)
    return {**adapter.preprocess_kwargs(), **(saved if isinstance(saved, dict) else {})}


def _wrapper_preprocess(wrapper: nn.Module) -> Optional[dict[str, Any]]:
    """The preprocessing a Hugging Face wrapper of a timm model carries: what ``--model DIR`` read from its folder's
    processor (``vx_preprocess``), else the timm data config of its checkpoint (``config.pretrained_cfg``, which the
    wrapper keeps and its TimmWrapperImageProcessor uses; the timm model inside has its architecture's default)."""
    saved = getattr(wrapper, "vx_preprocess", None)
    if isinstance(saved, dict):
        return saved
    pretrained_cfg = getattr(getattr(wrapper, "config", None), "pretrained_cfg", None)
    if not isinstance(pretrained_cfg, dict) or not pretrained_cfg:
        return None
    from ..data.images import data_config_kwargs

    return data_config_kwargs(pretrained_cfg)


def _named_labels(config: Any) -> Optional[dict]:
    """A Hugging Face config's ``id2label`` when it names the classes, or None (none, or transformers' placeholders
    ``LABEL_0``, ``LABEL_1``, ...)."""
    id2label = getattr(config, "id2label", None)
    if not id2label or all(str(v).startswith("LABEL_") for v in id2label.values()):
        return None
    return id2label


def _names_by_index(id2label: dict) -> Optional[list[str]]:
    """A config's ``id2label`` as a list indexed by class, or None when its keys are not the
    indices 0..C-1. Keys are ordered as integers: they may be strings ("10" sorts before "2" as
    text) when the mapping was set from a JSON file."""
    try:
        order = sorted(id2label, key=int)
    except (TypeError, ValueError):
        return None
    if [int(k) for k in order] != list(range(len(order))):
        return None
    return [id2label[k] for k in order]


def _timm_imagenet_names(model: nn.Module) -> Optional[list[str]]:
    cfg = getattr(model, "pretrained_cfg", None)
    if not isinstance(cfg, dict) or not cfg.get("hf_hub_id") and not cfg.get("url"):
        return None
    try:
        from timm.data import infer_imagenet_subset

        subset = infer_imagenet_subset(model)
        if subset is None:
            return None
        names = _imagenet_descriptions(subset)
        return list(names) if len(names) == getattr(model, "num_classes", len(names)) else None
    except Exception:  # label metadata is a convenience, never a failure
        return None


@lru_cache(maxsize=None)
def _imagenet_descriptions(subset: str) -> tuple[str, ...]:
    """timm's label descriptions of an ImageNet subset (its files parsed once per process)."""
    from timm.data import ImageNetInfo

    return tuple(ImageNetInfo(subset).label_descriptions(as_dict=False))


_DETECTORS: list[tuple[int, Callable[[nn.Module], Optional[Adapter]]]] = []


_FAMILIES: dict[Callable, Optional[Family]] = {}


def register_adapter(priority: int = 0, family: Optional[Family] = None) -> Callable:
    """Register ``detect(model) -> Adapter | None``; higher priority is tried first.

    Built-in priorities: captioners 20, ViTs 10 (Hugging Face 5), hybrids and CNNs 0 to -10.
    Use a priority above 20 for an adapter of your own that must win over the built-ins.

    Args:
        priority: detectors are tried from the highest priority down.
        family: the family of the adapters the detector returns, when it is always the
            same (lets ``vx.token_layout`` search a model's submodules for a ViT quickly).
    """

    def decorate(detect: Callable[[nn.Module], Optional[Adapter]]) -> Callable:
        _DETECTORS.append((priority, detect))
        _DETECTORS.sort(key=lambda item: -item[0])
        _FAMILIES[detect] = family
        return detect

    return decorate


_REFUSALS: list[Callable[[nn.Module], Optional[str]]] = []


def register_refusal(why: Callable[[nn.Module], Optional[str]]) -> Callable[[nn.Module], Optional[str]]:
    """Register ``why(model) -> str | None``: for a model no adapter recognises, why it is not explained and what to
    do (:func:`adapter_for` raises it instead of its generic message). Unlike a detector that raises, it leaves
    the model's submodules to :func:`find_layout_module` (``vx.capture``, ``vx.token_layout``)."""
    _REFUSALS.append(why)
    return why


def find_adapter(model: nn.Module, family: Union[None, Family, str] = None) -> Optional[Adapter]:
    """The adapter of ``model``, or None when no detector recognises it.

    Args:
        model: the model.
        family: only ask the detectors registered with this family (or family name).
    """
    family = None if family is None else _family(family)
    for _, detect in list(_DETECTORS):
        if family is not None and _FAMILIES.get(detect) is not family:
            continue
        adapter = detect(model)
        if adapter is not None:
            return adapter
    return None


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module that computes ``model``'s output: a ``torch.compile``-d model's original, and the timm model
    inside a Hugging Face ``TimmWrapperForImageClassification`` / ``TimmWrapperModel`` (what
    ``AutoModelForImageClassification.from_pretrained("timm/...")`` returns: its forward is the timm model's, the
    input cast to the model's dtype, which the explainer does too)."""
    model = unwrap_compiled(model)
    inner = getattr(model, "timm_model", None)
    if type(model).__name__ in ("TimmWrapperForImageClassification", "TimmWrapperModel") and isinstance(inner, nn.Module):
        return unwrap_compiled(inner)
    return model


def _without_lrp_on_flex(model: nn.Module, adapter: Adapter) -> None:
    """Drop ``"lrp"`` from a Hugging Face model built with ``attn_implementation="flex_attention"`` (any of its
    configs): the LRP rules do not cover FlexAttention (``lrp_coverage``), and on the CPU, where FlexAttention has no
    backward, its forward under the rules raised torch's NotImplementedError rather than that refusal."""
    if "lrp" not in adapter.capabilities:
        return
    if flex_configured(model):
        adapter.capabilities = adapter.capabilities - {"lrp"}
        adapter.notes["lrp"] = ("the model runs FlexAttention (config._attn_implementation='flex_attention'), which the "
                                "LRP rules do not cover; build it with attn_implementation='sdpa' or 'eager'")


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter for ``model`` (a ``torch.compile``-d model, or a Hugging Face wrapper of a timm model, is
    unwrapped first: the adapter's ``model`` is then the module that computes the output).

    Raises:
        UnsupportedModelError: no adapter recognises the model; the message lists the
            supported families and how to register an adapter.
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"expected a torch.nn.Module, got {type(model).__name__}")
    inner = _unwrapped(model)
    adapter = find_adapter(inner)
    if adapter is not None:
        id2label = _named_labels(getattr(model, "config", None)) if inner is not model and adapter.has_head else None
        names = _names_by_index(id2label) if id2label else None
        if names:  # a TimmWrapper's classes are in its own config (id2label), not in its timm model
            adapter.label_names = names
        if inner is not model:
            adapter.saved_preprocess = _wrapper_preprocess(model)
        _without_lrp_on_flex(inner, adapter)
        return adapter
    if isinstance(inner, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        raise UnsupportedModelError(
            f"{type(inner).__name__} wraps the model to run it on several devices (each on its own copy, which no "
            f"hook of vitexplain sees): explain the wrapped model, vx.Explainer(model.module)"
        )
    for why in _REFUSALS:
        reason = why(inner)
        if reason:
            raise UnsupportedModelError(reason)
    wrapped = _wrapped_model(inner)
    if wrapped:
        raise UnsupportedModelError(wrapped)
    raise UnsupportedModelError(
        f"vitexplain does not know how to explain {type(model).__name__}. Supported: timm "
        "ViT/DeiT/EVA/BEiT/CaiT/XCiT/ConViT/NaFlexViT (image tensors), torchvision VisionTransformer, Hugging Face "
        "ViT/DeiT/DINOv2/DINOv3/BEiT/ViT-MSN/I-JEPA/CLIP/MetaCLIP 2/SigLIP/AIMv2 (classifiers and headless backbones), "
        "OpenCLIP image towers and CLIP models, windowed and hierarchical ViTs (Swin, SwinV2, PVTv2, Twins, SegFormer, "
        "SAM, Hiera, MViTv2, PiT, LeViT, MaxViT, CrossViT, TNT), CNNs and "
        "conv/attention hybrids from timm and torchvision, Hugging Face ResNet/ConvNeXt/RegNet/BiT/"
        "EfficientNet/MobileNet/MobileViT classifiers (Grad-CAM family, SE/ECA/CBAM "
        "gates), the zoo captioner and encoder-decoder captioners (VisionEncoderDecoder, BLIP, GIT), and "
        "vision-language models (LLaVA, Qwen-VL, PaliGemma, Gemma 3, Idefics, SmolVLM, InternVL, BLIP-2, ...: "
        "docs/support.md). vx.capture(model) still "
        "records the attention of any model using SDPA; vitexplain.adapters.register_adapter "
        "adds your own model (see docs/guide.md, 'Your own model')."
    )


def _wrapped_model(model: nn.Module) -> Optional[str]:
    """What to do with a wrapper whose child is a model vitexplain knows (``nn.Sequential(normalize, vit)``): the
    methods name the known model's blocks, so it is explained by itself, given the wrapper's earlier steps' output.
    Only a ``Sequential`` or a module of one or two children (the known model and a step before it) is read as a
    wrapper: the child of a larger model is one part of what it computes."""
    children = list(model.named_children())
    if not isinstance(model, nn.Sequential) and len(children) > 2:
        return None
    for name, child in children:
        adapter = find_adapter(child)
        if adapter is None or adapter.family.name == "cnn":  # (a CNN inside a wrapper is recognised as a whole)
            continue
        where = f"model[{name}]" if isinstance(model, nn.Sequential) else f"model.{name}"
        return (f"vitexplain does not know {type(model).__name__} itself, but its child {name!r} is a "
                f"{adapter.family.name} model ({type(child).__name__}) it explains: explain that, "
                f"vx.Explainer({where}), on the input the steps before it give (e.g. the normalised batch), or register "
                "an adapter for the whole model (vitexplain.adapters.register_adapter, docs/guide.md, 'Your own model')")
    return None


def _own_layout(module: nn.Module, size: tuple[int, int], adapter: bool) -> Optional[TokenLayout]:
    custom = getattr(module, "vx_token_layout", None)
    if callable(custom):
        return custom(size)
    found = find_adapter(module) if adapter else find_adapter(module, family=_family("vit"))
    layout = getattr(found, "layout", None)
    return layout(size) if callable(layout) else None


def find_layout_module(model: nn.Module, input_size: tuple[int, int]) -> tuple[str, nn.Module, TokenLayout]:
    """The model itself or its first submodule with a known token layout.

    The layout comes from the module's adapter (``vitexplain.adapters``: the one place that
    recognises a model), or from ``module.vx_token_layout(input_size)`` when defined.

    Returns:
        (module name, module, layout); the name is ``""`` for the model itself.

    Raises:
        UnsupportedModelError: neither the model nor any submodule has a known layout.
    """
    size = pair(input_size)
    model = unwrap_compiled(model)
    for name, module in model.named_modules():
        layout = _own_layout(module, size, adapter=name == "")
        if layout is not None:
            return name, module, layout
    raise UnsupportedModelError(
        f"cannot find the token layout of {type(model).__name__}: supported are the ViT "
        "families vitexplain.adapters recognises (timm, torchvision, Hugging Face; see "
        "docs/support.md) and any model containing one; for another model register an "
        "adapter (vitexplain.adapters.register_adapter) or define "
        "`vx_token_layout(self, input_size) -> vx.TokenLayout` on it"
    )


def token_layout(model: nn.Module, input_size: Union[tuple[int, int], int]) -> TokenLayout:
    """Token layout of ``model`` for an input of ``input_size`` pixels.

    Asks the model's adapter, or, for a model that contains a ViT (e.g. a captioner's image
    encoder), the adapter of its first submodule that is one. A model may also define
    ``vx_token_layout(input_size) -> TokenLayout`` itself.

    Args:
        model: a ViT (or a model containing one, e.g. an encoder-decoder captioner).
        input_size: (H, W) of the preprocessed input, or one int for square inputs.

    Returns:
        The :class:`~vitexplain.layout.TokenLayout`.

    Raises:
        UnsupportedModelError: the model family is not recognised.
    """
    return find_layout_module(model, pair(input_size))[2]
