"""Model families: one object per family, the unit every method and adapter is registered with.

A family says what kind of explanation a model gets: the context its methods read
(:class:`~vitexplain.methods.context.Context` for one forward of a batch of images,
:class:`~vitexplain.methods.context.CaptionContext` for a caption), the result the Explainer
returns (:class:`~vitexplain.results.Explanation` or
:class:`~vitexplain.results.CaptionExplanation`), the Explainer call that produces it, the
methods run when none are named, and its option conventions: option names whose meaning is
fixed across the family's methods, so that ``layer`` is the same thing in every method that
takes it. Adapters declare their family (``adapter.family``); methods are registered under one
(``register("rollout", VIT)``); :mod:`vitexplain.plan` matches the two.

A new family is one :func:`register_family` call plus its adapter and its methods::

    MYFAM = register_family(Family("myfam", "what it explains", Context, Explanation,
                                   defaults=("mymethod",)))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from ..errors import NotFoundError, UsageError
from ..results import CaptionExplanation, Explanation
from .context import CaptionContext, Context
from .vlm_context import VLMContext
from .options import Option

__all__ = ["Family", "register_family", "family", "families", "VIT", "SWIN", "HIER", "CNN", "CAPTION", "VLM"]

_ENTRIES = ("explain", "explain_caption")


@dataclass(frozen=True, eq=False)
class Family:
    """A model family.

    Attributes:
        name: short public name (``"vit"``), used by the CLI (``--family``) and in messages.
        summary: one line saying which models belong to it.
        context: the type of context its methods receive (``fn(ctx, **options)``).
        result: the result type the Explainer returns for one method.
        entry: the :class:`~vitexplain.Explainer` method that explains these models
            (``"explain"`` or ``"explain_caption"``).
        defaults: methods run when none are named, in order (the first that applies is the
            default of ``explain``/``explain_caption``); those that do not apply to a model are
            left out by its plan.
        conventions: option names with one meaning across the family's methods; a method
            that declares one of them must declare it the same way (checked at registration).
    """

    name: str
    summary: str
    context: type
    result: type
    entry: str = "explain"
    defaults: tuple[str, ...] = ()
    conventions: Mapping[str, Option] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.entry not in _ENTRIES:
            raise UsageError(f"family {self.name!r}: entry must be one of {_ENTRIES}, got {self.entry!r}")

    def __str__(self) -> str:
        return self.name

    def __eq__(self, other: object) -> bool:
        """A family equals itself and, for readable user code, its name (``ex.family == "vit"``)."""
        if isinstance(other, str):
            return other == self.name
        return other is self

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"Family({self.name!r})"

    def check_convention(self, method: str, name: str, option: Option) -> None:
        """Raise when ``method`` declares option ``name`` differently from the convention.

        Raises:
            UsageError: same name, different type, optionality or sequence form.
        """
        convention = self.conventions.get(name)
        if convention is None:
            return
        same = (option.kind, option.optional, option.sequence) == (convention.kind, convention.optional, convention.sequence)
        if not same:
            raise UsageError(
                f"method {method!r} declares option {name!r} as {option.allowed()}, but in {self.name} methods "
                f"{name!r} is {convention.allowed()} ({convention.help}); rename it or follow the convention"
            )


_FAMILIES: dict[str, Family] = {}


def register_family(fam: Family) -> Family:
    """Register a family (its name must be new); returns it.

    Raises:
        UsageError: the name is taken by another family.
    """
    if not isinstance(fam, Family):
        raise UsageError(f"register_family takes a Family, got {type(fam).__name__}")
    if _FAMILIES.get(fam.name, fam) is not fam:
        raise UsageError(f"a family named {fam.name!r} is already registered")
    _FAMILIES[fam.name] = fam
    return fam


def family(value: Union[str, Family, Any]) -> Family:
    """The registered family of a name (or the family itself).

    Raises:
        NotFoundError: no family has that name; the message lists them.
    """
    if isinstance(value, Family):
        return value
    found = _FAMILIES.get(value) if isinstance(value, str) else None
    if found is None:
        raise NotFoundError(f"no model family {value!r}; the families are {list(_FAMILIES)}")
    return found


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    return tuple(_FAMILIES.values())


# -- option conventions ----------------------------------------------------------------------
_HEAD_FUSION = Option(str, choices=("mean", "max", "min"), help="how heads are fused")
_HEAD = Option(int, optional=True, help="one head, negative counts from the last (None = fuse heads)")
_LAYER = Option(int, help="block index (over all stages), negative counts from the last")
_START = Option(int, low=0, help="first block included (counting over all stages)")
_LAYERS = Option(int, optional=True, sequence=True, help="block indices (None = the method's default)")
_STAGE = Option(int, help="stage whose grid the map is on (0 = the patch grid; negative counts from the last)")
_MODULE = Option(str, optional=True, help="a module name of the model (None = the method's default)")

_TOKEN_CONVENTIONS = {"head_fusion": _HEAD_FUSION, "head": _HEAD, "layer": _LAYER, "start_layer": _START,
                      "layers": _LAYERS, "stage": _STAGE, "module": _MODULE}

VIT = register_family(Family(
    "vit", "Vision Transformers with one patch grid: timm, torchvision and Hugging Face ViT/DeiT/BEiT/EVA/DINOv2/CLIP/...",
    Context, Explanation, defaults=("generic", "legrad"), conventions=_TOKEN_CONVENTIONS,
))
SWIN = register_family(Family(
    "swin", "windowed, hierarchical transformers (Swin, SwinV2): shifted windows and patch merging",
    Context, Explanation, defaults=("generic", "legrad"), conventions=_TOKEN_CONVENTIONS,
))
CNN = register_family(Family(
    "cnn", "CNNs and conv/attention hybrids: the Grad-CAM family on a feature stage, SE/ECA/CBAM gates",
    Context, Explanation, defaults=("gradcam", "spatial", "channel"), conventions={"module": _MODULE},
))
CAPTION = register_family(Family(
    "caption", "image captioners: per-word maps through the decoder's attention to the image",
    CaptionContext, CaptionExplanation, entry="explain_caption", defaults=("cross", "cross_generic"),
    conventions={"layers": Option(int, optional=True, sequence=True, help="decoder layers (None = all)"),
                 "head_fusion": _HEAD_FUSION},
))
HIER = register_family(Family(
    "hier", "hierarchical and pooling transformers (PVT, PVTv2, SegFormer, Twins, SAM's ViT, Hiera, SAM 2's Hiera, PiT, MaxViT, "
    "CoAtNet, CAFormer, TinyViT, LeViT, MViTv2, CrossViT, TNT): attention carried through every token resampling",
    Context, Explanation, defaults=("generic", "cdam"), conventions=_TOKEN_CONVENTIONS,
))
VLM = register_family(Family(
    "vlm", "vision-language models whose image tokens sit in the language model's sequence (LLaVA, PaliGemma, "
    "Qwen-VL, Gemma 3, ...) or reach it through cross-attention layers (mllama): per-word maps over the image "
    "tokens, mapped back to the pixels",
    VLMContext, CaptionExplanation, entry="explain_caption", defaults=("cross", "cross_generic"),
    conventions={"layers": Option(int, optional=True, sequence=True, help="language-model layers (None = all)"),
                 "head_fusion": _HEAD_FUSION},
))
