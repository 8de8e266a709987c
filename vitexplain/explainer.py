"""The front door: model -> adapter -> capture -> method -> :class:`Explanation`.

Example::

    ex = vx.Explainer(model)
    e = ex.explain(x, method="cdam")                   # x: (B, 3, H, W) preprocessed
    e.maps                                             # (B, gh, gw) float32
    es = ex.explain(["a.jpg", "b.png"], method=["rollout", "generic"])   # images: preprocessed for you

Several methods in one call share one forward and (when any needs it) one backward pass.
The model is never modified: no eval()/train() switch, no eager attention, no hooks left.
"""

from __future__ import annotations

import itertools
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .recording import capture
from .recording.materialize import check_mode
from .errors import InputError, OptionError, UnsupportedMethodError, UsageError
from .layout import TokenLayout
from .methods import registry
from .methods.context import Context
from .adapters import Adapter, adapter_for
from .targets import TargetSpec, logits_of, resolve

__all__ = ["Explainer", "Explanation", "CaptionExplanation"]


@dataclass
class Explanation:
    """The maps of one method for one batch.

    Attributes:
        maps: (B, gh, gw) float32 on the model's device; signed for signed methods.
        targets: (B,) long, the explained classes (-1 for a custom score).
        method: method name.
        options: the method options used.
        logits: the model outputs of the explained forward (detached logits when found).
        signed: whether maps are signed (overlay with ``normalize="signed"``).
        input_size: (H, W) of the model input.
        layout: token layout (ViTs) or None.
        images: when images (not tensors) were explained: the (H, W, 3) uint8 RGB regions
            the model saw (after resize and crop), one per image.
        sources: the inputs as given (paths, or None), when images were explained.
        label_names: the model's class names, if known.
        extras: method-specific results besides the maps (e.g. the ``channel`` method's
            top-k channels and gate values); empty for most methods.
    """

    maps: Tensor
    targets: Tensor
    method: str
    options: dict[str, Any]
    logits: Any
    signed: bool
    input_size: tuple[int, int]
    layout: Optional[TokenLayout] = None
    images: Optional[list[Any]] = None
    sources: Optional[list[Any]] = None
    label_names: Optional[list[str]] = None
    boxes: Optional[list[Any]] = field(default=None, repr=False)
    extras: dict[str, Any] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return int(self.maps.shape[0])

    def upsample(self, size: Optional[tuple[int, int]] = None, mode: str = "bilinear") -> Tensor:
        """Maps resized to ``size`` (default: the model input size).

        Returns:
            (B, H, W) float32.
        """
        size = tuple(size) if size is not None else self.input_size
        kwargs = {"align_corners": False} if mode in ("bilinear", "bicubic") else {}
        return F.interpolate(self.maps[:, None], size=size, mode=mode, **kwargs)[:, 0]

    def target_names(self) -> list[str]:
        """Per image, the target's label name (or its index as text)."""
        names = self.label_names or []
        return [names[t] if 0 <= t < len(names) else str(t) for t in self.targets.tolist()]

    def overlay(self, index: int = 0, image: Any = None, **kwargs: Any) -> Any:
        """Overlay map ``index`` on its image (the region the model saw), uint8 RGB.

        Args:
            index: which image of the batch.
            image: (H, W, 3) uint8 RGB to draw on; default: the stored image.
            **kwargs: passed to :func:`vitexplain.viz.overlay` (``normalize`` defaults to
                ``"signed"`` for signed methods).
        """
        from .viz.overlays import overlay

        if image is None:
            if self.images is None:
                raise UsageError(
                    "this explanation was computed from a tensor, so it has no image to draw on; "
                    "pass image=(H, W, 3) uint8 RGB, or explain images/paths instead of a tensor"
                )
            image = self.images[index]
        kwargs.setdefault("normalize", "signed" if self.signed else "minmax")
        return overlay(image, self.maps[index], **kwargs)

    def _repr_html_(self) -> str:
        """Jupyter display: each image's overlay with a colour bar, its method and target."""
        from .viz.notebook import explanation_tiles, tiles_html

        more = len(self) - 12
        return tiles_html([explanation_tiles(self)], f"... and {more} more images" if more > 0 else "")

    def show(self, max_images: int = 8) -> Any:
        """Draw the overlays (at most ``max_images``) with matplotlib; returns the figure.

        Raises:
            UsageError: matplotlib is not installed (``pip install matplotlib``).
        """
        from .viz.notebook import explanation_tiles, show_tiles

        return show_tiles([explanation_tiles(self, max_images)])

    def save(self, directory: Union[str, Path]) -> Path:
        """Write ``maps.npy`` and ``manifest.json`` (method, options, targets, sizes) to a folder."""
        import numpy as np

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        np.save(out / "maps.npy", self.maps.detach().cpu().numpy())
        manifest = {
            "method": self.method,
            "options": {k: repr(v) if not isinstance(v, (int, float, str, bool, type(None))) else v for k, v in self.options.items()},
            "signed": self.signed,
            "targets": self.targets.tolist(),
            "target_names": self.target_names(),
            "input_size": list(self.input_size),
            "grid": list(self.maps.shape[-2:]),
            "sources": [str(s) if s is not None else None for s in self.sources] if self.sources else None,
        }
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
        return out


@dataclass
class CaptionExplanation:
    """Per-word maps of a batch of captions.

    Attributes:
        maps: (B, T, gh, gw) float32; rows past an image's caption length are zero.
        tokens: per image, its words (generated or given), at most T.
        ids: (B, T) long token ids of the explained words.
        captions: per image, the caption string.
        method: method name.
        options: method options used.
        input_size: (H, W) of the model input.
        layout: token layout of the image encoder.
        images: (H, W, 3) uint8 RGB regions the model saw, when images were explained.
        sources: the inputs as given (paths or None), when images were explained.
    """

    maps: Tensor
    tokens: list[list[str]]
    ids: Tensor
    captions: list[str]
    method: str
    options: dict[str, Any]
    input_size: tuple[int, int]
    layout: Optional[TokenLayout] = None
    images: Optional[list[Any]] = None
    sources: Optional[list[Any]] = None

    def __len__(self) -> int:
        return int(self.maps.shape[0])

    def upsample(self, size: Optional[tuple[int, int]] = None) -> Tensor:
        """Maps resized to ``size`` (default: the model input size): (B, T, H, W)."""
        size = tuple(size) if size is not None else self.input_size
        b, t = self.maps.shape[:2]
        flat = F.interpolate(self.maps.flatten(0, 1)[:, None], size=size, mode="bilinear", align_corners=False)
        return flat.view(b, t, *size)

    def _repr_html_(self) -> str:
        """Jupyter display: per image its caption, then each word under its overlay."""
        from .viz.notebook import caption_tiles, tiles_html

        more = len(self) - 4
        return tiles_html(caption_tiles(self), f"... and {more} more images" if more > 0 else "")

    def show(self, max_images: int = 4) -> Any:
        """Draw each word's overlay (at most ``max_images`` images) with matplotlib; returns the figure.

        Raises:
            UsageError: matplotlib is not installed (``pip install matplotlib``).
        """
        from .viz.notebook import caption_tiles, show_tiles

        return show_tiles(caption_tiles(self, max_images))

    def figure(self, index: int = 0, image: Any = None, **kwargs: Any) -> Any:
        """One RGB figure: each word of caption ``index`` under its overlay (uint8 RGB)."""
        from .viz.caption import caption_figure

        if image is None:
            if self.images is None:
                raise UsageError("pass image=(H, W, 3) uint8 RGB: this explanation was computed from a tensor")
            image = self.images[index]
        words = self.tokens[index]
        return caption_figure(image, words, self.maps[index, : len(words)], **kwargs)


def _model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); CPU for a model without either."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):  # lazily: the first one only
        return tensor.device
    return torch.device("cpu")


class Explainer:
    """Explains a model's decisions with any registered method.

    Args:
        model: a ViT (timm, torchvision, Hugging Face), a CNN, a zoo model, or a captioner.
        adapter: override the automatically chosen adapter.
        attention_mode: how the capture gets attention probabilities (see ``vx.capture``).
            ``"auto"`` (default): when a requested method reads every layer's attention
            without gradients (rollout) and the model runs on a CPU, attention is computed
            once by the capture (while the probabilities kept stay small); otherwise the
            fused kernel runs and methods recompute the rows they read.
            ``"fused"`` or ``"materialize"`` force one way.
    """

    def __init__(self, model: nn.Module, *, adapter: Optional[Adapter] = None, attention_mode: str = "auto") -> None:
        self.model = model
        # a torch.compile-d model is explained through its original module, run eagerly
        # (see vx.capture); the compiled code is neither called nor recompiled
        self.adapter = adapter or adapter_for(model)
        self.attention_mode = check_mode(attention_mode)

    def _capture_mode(
        self, specs: Sequence[registry.MethodSpec], options: Optional[dict[str, dict[str, Any]]] = None
    ) -> dict[str, str]:
        """The capture's ``attention_mode`` and ``heads`` for these methods.

        ``"auto"`` stays only when one of them reads every layer's attention (otherwise the
        fused kernel plus a recompute of the few rows read is cheaper); without gradients,
        when every method reads attention through one head fusion, only that is kept.
        """
        mode = self.attention_mode
        if mode == "auto" and not any(s.dense_attention for s in specs):
            mode = "fused"  # (with gradients the capture's auto keeps the kernel by itself)
        heads = "all"
        if mode != "fused" and options is not None and not any(s.grads for s in specs):
            fusions = {s.reads_fused({**s.defaults, **options[s.name]}) for s in specs if s.attention}
            if len(fusions) == 1 and None not in fusions:
                heads = fusions.pop()
        return {"attention_mode": mode, "heads": heads}

    @property
    def family(self) -> str:
        """``"vit"``, ``"cnn"`` or ``"caption"``."""
        return self.adapter.family

    def methods(self) -> list[str]:
        """Names of the methods that apply to this model (its adapter supports them)."""
        return list(dict.fromkeys(s.name for s in registry.specs(self.family) if self.adapter.supports(s)))

    def _spec(self, name: str) -> registry.MethodSpec:
        """The spec of method ``name``, or a clear error when it does not apply to this model."""
        try:
            spec = registry.get(name, self.family)
        except UnsupportedMethodError as err:
            hint = self.adapter.notes.get("family")  # e.g. why a hybrid has no ViT methods
            if hint is None:
                raise
            raise UnsupportedMethodError(f"{err}. {hint}") from None
        reason = self.adapter.refusal(spec)
        if reason is not None:
            raise UnsupportedMethodError(reason)
        return spec

    def __repr__(self) -> str:
        return f"Explainer({type(self.model).__name__}, family={self.family!r})"

    # -- inputs -----------------------------------------------------------------------
    def preprocess(self, images: Any, *, crop: bool = True) -> tuple[Tensor, list[Any], list[Any], list[Any]]:
        """Load and preprocess images with the model's own preprocessing.

        Args:
            images: a path, PIL image, (H, W, 3) uint8 array, or a list of those.
            crop: resize and center-crop as the model's eval transform does (True), or
                resize the whole image to the input size (False).

        Returns:
            (x (B, 3, H, W) on the model's device, the uint8 RGB regions the model saw,
            crop boxes in original pixel coordinates, the sources as given).
        """
        from .data.images import crop_region, load_image, preprocess

        items = list(images) if isinstance(images, (list, tuple)) else [images]
        sources, arrays = [], []
        for item in items:
            is_path = isinstance(item, (str, Path))
            sources.append(item if is_path else None)
            arrays.append(load_image(item) if is_path else _as_rgb(item))
        x, boxes = preprocess(arrays, crop=crop, **self.adapter.preprocess_kwargs())
        size = tuple(x.shape[-2:])
        regions = [_resize_rgb(crop_region(a, b), size) for a, b in zip(arrays, boxes)]
        return x.to(_model_device(self.model)), regions, boxes, sources

    # -- explaining ---------------------------------------------------------------------
    def explain(
        self,
        x: Any,
        method: Union[str, Sequence[str]] = "cdam",
        target: TargetSpec = None,
        **options: Any,
    ) -> Union[Explanation, list[Explanation]]:
        """Explain a batch with one or several methods (one shared forward/backward).

        Args:
            x: (B, 3, H, W) preprocessed tensor, or images (paths, PIL, uint8 arrays, or a
                list of them), which are loaded and preprocessed with the model's settings.
            method: a method name or a list of names (see :meth:`methods`).
            target: None (top prediction per image), an int, a label name, one per image
                (list/tensor), or a callable ``score(outputs) -> (B,)``.
            **options: method options for a single method (e.g. ``discard_ratio=0.9``); for
                several methods, ``name={...}`` per method (e.g. ``rollout={"head_fusion": "max"}``).

        Returns:
            An :class:`Explanation` for a single method name, a list for a list of names.
        """
        if self.family == "caption":
            raise UnsupportedMethodError(
                f"{type(self.model).__name__} is an image captioner: use explain_caption(images, "
                f"method=...) with one of {self.methods()}"
            )
        single = isinstance(method, str)
        names = [method] if single else list(method)
        if not names:
            raise UnsupportedMethodError(f"no method given; choose from {self.methods()}")
        specs = [self._spec(name) for name in names]
        per_method = self._split_options(names, specs, options, single)

        images = boxes = sources = None
        if not (isinstance(x, Tensor) and x.dim() == 4 and x.is_floating_point()):
            if isinstance(x, Tensor):
                raise InputError(
                    f"expected a preprocessed (B, 3, H, W) float tensor, got a {x.dtype} tensor of "
                    f"shape {tuple(x.shape)}; pass images as uint8 (H, W, 3) arrays or paths instead"
                )
            x, images, boxes, sources = self.preprocess(x)
        _check_batch(x)
        model = self.adapter.model
        if model.training:
            warnings.warn(
                "the model is in training mode: dropout makes explanations random; call model.eval() first",
                stacklevel=2,
            )
        device = _model_device(self.model)
        grads = any(s.grads for s in specs)
        x_in = x.detach().to(device)
        if grads:
            x_in.requires_grad_(True)
        activations = list(dict.fromkeys(a for s in specs for a in s.activations(self.adapter)))
        attention = any(s.attention for s in specs) and self.family != "cnn"
        gates = any(s.gates for s in specs)
        with torch.set_grad_enabled(grads), capture(
            model, grads=grads, activations=activations, attention=attention, gates=gates,
            **self._capture_mode(specs, per_method),
        ) as rec:
            outputs = self.adapter.forward(x_in)
        resolved = resolve(target, outputs, self.adapter.label_names, has_head=self.adapter.has_head)
        if grads:
            rec.backward(resolved.score(outputs), retain_graph=any(s.retain_graph for s in specs))
        layout = self.adapter.layout(tuple(x.shape[-2:])) if hasattr(self.adapter, "layout") else None
        try:
            logits = logits_of(outputs).detach()
        except Exception:
            logits = outputs
        results = []
        for name, spec in zip(names, specs):
            ctx = Context(self.adapter, x_in, outputs, resolved, rec, layout, method=name)
            maps = spec.fn(ctx, **per_method[name])
            extras: dict[str, Any] = {}
            if isinstance(maps, tuple):  # a method may return (maps, extras)
                maps, extras = maps
            results.append(
                Explanation(
                    maps=maps.detach().float(),
                    targets=resolved.classes.detach(),
                    method=name,
                    options=dict(per_method[name]),
                    logits=logits,
                    signed=spec.signed,
                    input_size=(int(x.shape[-2]), int(x.shape[-1])),
                    layout=layout,
                    images=images,
                    sources=sources,
                    label_names=self.adapter.label_names,
                    boxes=boxes,
                    extras=extras,
                )
            )
        return results[0] if single else results

    def explain_caption(
        self,
        images: Any,
        method: Union[str, Sequence[str]] = "cross",
        caption: Union[None, str, Sequence[Any]] = None,
        *,
        max_len: int = 16,
        **options: Any,
    ) -> Union[CaptionExplanation, list[CaptionExplanation]]:
        """Per-word maps of a captioner: what in the image made it say each word.

        Args:
            images: (B, 3, H, W) preprocessed tensor, or images/paths (preprocessed for you).
            method: ``"cross"`` (cross-attention per word) or ``"cross_generic"`` (Chefer's
                encoder-decoder relevance, gradient of each word's log-probability); or a list.
            caption: None to generate greedily (with the model's KV cache; the steps are
                stitched into one map per word), or the caption(s) to explain teacher-forced:
                one string for all images, one per image, or token-id lists.
            max_len: most tokens to generate.
            **options: method options (single method), or ``name={...}`` per method.
                ``cross`` takes ``layers`` (None = mean over all decoder layers, an index or
                a list) and ``head_fusion``.

        Returns:
            A :class:`CaptionExplanation` (or a list, one per method).
        """
        from .methods.caption import CaptionContext

        if self.family != "caption":
            raise UnsupportedMethodError(
                f"explain_caption needs an image captioner; {type(self.model).__name__} is a {self.family} model (use explain)"
            )
        single = isinstance(method, str)
        names = [method] if single else list(method)
        specs = [self._spec(name) for name in names]
        per_method = self._split_options(names, specs, options, single)
        if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
            raise UsageError(f"max_len must be a positive number of tokens to generate, got {max_len!r}")
        sources = regions = None
        if isinstance(images, Tensor) and images.dim() == 4 and images.is_floating_point():
            x = images.detach().to(_model_device(self.model))
        else:
            x, regions, _, sources = self.preprocess(images)
        _check_batch(x)
        adapter = self.adapter
        generated = None
        if caption is None:
            with torch.no_grad(), capture(self.model) as generated:
                ids = adapter.generate(x, max_len)
        else:
            ids = self._caption_ids(caption, x.shape[0], x.device)
        lengths = [len(w) for w in adapter.words(ids)]
        t = max(max(lengths), 1)
        ids = ids[:, :t]
        if ids.shape[1] < t:
            ids = F.pad(ids, (0, t - ids.shape[1]), value=adapter.end_id)
        tokens = [words[:t] for words in adapter.words(ids)]
        layout = adapter.layout(tuple(x.shape[-2:]))
        results = []
        for name, spec in zip(names, specs):
            if spec.grads:
                x_in = x.detach().clone().requires_grad_(True)
                with torch.enable_grad(), capture(self.model, grads=True, **self._capture_mode([spec])) as rec:
                    logits = adapter.teacher_forced(x_in, ids)
                ctx = CaptionContext(adapter, x_in, ids, rec, layout, True, logits, name)
            elif generated is not None:
                ctx = CaptionContext(adapter, x, ids, generated, layout, False, None, name)
            else:
                with torch.no_grad(), capture(self.model) as rec:
                    adapter.teacher_forced(x, ids)
                ctx = CaptionContext(adapter, x, ids, rec, layout, True, None, name)
            maps = spec.fn(ctx, **per_method[name]).detach().float()
            for i, n in enumerate(lengths):
                maps[i, n:] = 0.0
            results.append(
                CaptionExplanation(
                    maps=maps,
                    tokens=tokens,
                    ids=ids,
                    captions=[" ".join(w) for w in tokens],
                    method=name,
                    options=dict(per_method[name]),
                    input_size=(int(x.shape[-2]), int(x.shape[-1])),
                    layout=layout,
                    images=regions,
                    sources=sources,
                )
            )
        return results[0] if single else results

    def _caption_ids(self, caption: Any, batch: int, device: torch.device) -> Tensor:
        """(B, T) ids of given captions, each followed by the end token."""
        items = [caption] * batch if isinstance(caption, str) else list(caption)
        if items and isinstance(items[0], int):
            items = [items] * batch
        if len(items) != batch:
            raise UsageError(f"got {len(items)} captions for {batch} images; pass one caption or one per image")
        seqs = [list(c) if not isinstance(c, str) else self.adapter.encode_caption(c) for c in items]
        length = max(len(s) for s in seqs) + 1
        end = self.adapter.end_id
        return torch.tensor([s + [end] * (length - len(s)) for s in seqs], dtype=torch.long, device=device)

    @staticmethod
    def _split_options(
        names: list[str], specs: list[Any], options: dict[str, Any], single: bool
    ) -> dict[str, dict[str, Any]]:
        """Per-method options, each checked against the method's declared options.

        Raises:
            OptionError: an unknown option, a value out of range, or (several methods)
                options not given as ``name={...}``; the message is the one the CLI prints.
        """
        if single:
            return {names[0]: specs[0].check_options(options)}
        unknown = [k for k in options if k not in names or not isinstance(options[k], dict)]
        if unknown:
            raise OptionError(
                f"with several methods, pass options per method as name={{...}} "
                f"(e.g. rollout={{'discard_ratio': 0.9}}); got {unknown}"
            )
        return {name: spec.check_options(options.get(name, {})) for name, spec in zip(names, specs)}


def _check_batch(x: Tensor) -> None:
    """Reject an empty batch or non-finite pixels: both would give maps that mean nothing.

    Raises:
        InputError: the batch is empty or holds NaN / inf values.
    """
    if x.shape[0] == 0:
        raise InputError("the batch is empty (0 images); pass at least one image")
    low, high = torch.aminmax(x.detach())  # one pass; NaN and inf show in the extremes
    if not (math.isfinite(float(low)) and math.isfinite(float(high))):
        finite = torch.isfinite(x.detach())
        bad = sorted({int(i) for i in (~finite).flatten(1).any(dim=1).nonzero().flatten()})
        raise InputError(
            f"the input holds NaN or infinite values (images {bad[:10]}{'...' if len(bad) > 10 else ''}); "
            "explanations of such inputs mean nothing: check the preprocessing or the images"
        )


def _as_rgb(image: Any) -> Any:
    """A PIL image or array as (H, W, 3) uint8 RGB (validated like the loader does)."""
    import numpy as np

    if hasattr(image, "convert") and hasattr(image, "size"):
        return np.asarray(image.convert("RGB"))
    array = np.asarray(image)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
        raise InputError(
            f"expected an (H, W, 3) uint8 RGB image, a PIL image or a path; got an array of "
            f"dtype {array.dtype} and shape {array.shape}"
        )
    return array


def _resize_rgb(image: Any, size: tuple[int, int]) -> Any:
    """Resize a uint8 RGB region to (H, W) (the exact pixels the model saw)."""
    if tuple(image.shape[:2]) == tuple(size):
        return image
    from PIL import Image
    import numpy as np

    return np.asarray(Image.fromarray(image).resize((size[1], size[0]), Image.BICUBIC))
