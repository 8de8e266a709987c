"""The interactive explorer: one self-contained HTML page per set of images.

``vx.explore(model, images, out="explore.html")`` computes, per image, the predictions, the
maps of several methods (class-discriminative ones for each of the top-k classes), and for
ViTs and captioner encoders every layer's and head's attention matrix and the rollout after
each layer; it quantises them (uint8 per row, :mod:`.quantize`) and writes one HTML file
with the data, script and styles inline (:mod:`.page`). Open it from disk: nothing is loaded
from anywhere. Data flows model -> Explainer / capture -> records -> maps -> page data
(:mod:`.extract`, :mod:`.attention`, :mod:`.caption`) -> page.
"""

from __future__ import annotations

import os
from numbers import Integral, Real
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

from ..errors import UsageError
from .attention import DEFAULT_ATTENTION_BUDGET_MB

__all__ = ["explore", "DEFAULT_ATTENTION_BUDGET_MB"]


def _name(item: Any, index: int) -> str:
    if isinstance(item, (str, os.PathLike)):
        return Path(item).name
    return f"image {index}"


def _per_image_targets(target: Any, count: int) -> list[Any]:
    """The target of each of ``count`` images: ``target`` itself for every image, or, for a list (tuple, 1-D
    array or tensor) of them, its items in order (a list of two classes for two images was resolved against
    each single image: 'got 2 targets for a batch of 1 images').

    Raises:
        UsageError: a list whose length is not the number of images.
    """
    if isinstance(target, (list, tuple)) or (getattr(target, "ndim", 0) == 1 and hasattr(target, "__len__")):
        if len(target) != count:
            raise UsageError(f"got {len(target)} targets for {count} images; pass one target for every image, or one "
                             "per image")
        return list(target)
    return [target] * count


def explore(
    model: Any,
    images: Any,
    out: Union[str, "os.PathLike[str]"] = "explore.html",
    *,
    method: Union[None, str, Sequence[str]] = None,
    top_k: int = 3,
    target: Any = None,
    names: Optional[Sequence[str]] = None,
    title: str = "vitexplain explorer",
    attention_budget: float = DEFAULT_ATTENTION_BUDGET_MB,
    max_len: int = 16,
    crop: bool = True,
    prompt: Optional[str] = None,
    processor: Any = None,
    **options: Any,
) -> Path:
    """Write an interactive, self-contained HTML page that explains ``model`` on ``images``.

    Per image the page shows the image, the top predictions (the caption for captioners), one
    tab per method (class-discriminative methods for each of the top-k classes, chosen in the
    page), and for ViTs (and captioners' image encoders) a layer x head selector: hover or
    click a patch (or pick ``[CLS]``/register tokens) to see that query's attention over the
    image and its rollout row, plus the layer's query x key attention matrix. Captioners also
    get a word-by-word view of ``cross``/``cross_generic`` and the word x patch alignment
    matrix. Vision-language models get their answer word by word, each method's per-token scores
    drawn over each token grid (the image, or a thumbnail and tiles, shown as layers that can be
    hidden), and the language model's attention from the row that predicts the word, per layer and
    head, with an overview of all layers x heads and several heads selectable at once. CNNs get their
    methods without the attention views. When drawn, the page sets
    ``data-vx-ready="1"`` on ``<body>``.

    Args:
        model: a model :class:`vitexplain.Explainer` supports, or an Explainer.
        images: a path, PIL image or (H, W, 3) uint8 RGB array, or a list (or generator) of those; an
            (N, H, W, 3) array is N images.
        out: the HTML file to write.
        method: a method name or a list of names, which must all apply and run; None = the
            family's default methods (those that do not apply to the model are left out with a
            note in the page), as ``Explainer.plan()`` lists them.
        top_k: classes offered for class-discriminative methods.
        target: None (the top-k classes), or the one target class-discriminative methods explain:
            a class index or label name, or a score such as ``vx.targets.similarity(vector)``; or a
            list (array, tensor) of one class per image. Headless backbones (no classifier head) default
            to ``vx.targets.norm()``.
        names: labels of the images (default: file names).
        title: page title.
        attention_budget: most MB of attention data per image (base64); past it fewer layers,
            then only the head-mean, are embedded, and the page says so. The default (5 MB)
            holds every layer and head of a 224 px ViT-S/16 (197 tokens, 12 x 6 heads).
        max_len: longest caption generated (captioners and vision-language models).
        crop: resize and center-crop each image as the model's eval transform does (True), or
            resize the whole image to the input size (False: nothing is cut off, the aspect
            ratio is not kept; also takes images too elongated for the crop). Vision-language
            models give whole images to their processor.
        prompt: vision-language models: the prompt (None: the model's default).
        processor: vision-language models: the processor (default: ``model.vx_processor`` when the
            model carries one, as zoo VLMs do); a Hugging Face captioner: its image processor (a
            VisionEncoderDecoder's images need it, see ``vx.Explainer``).
        **options: options of a single named method, or per method as ``name={...}`` (e.g.
            ``rollout={"head_fusion": "max"}``), as for ``Explainer.explain``.

    Returns:
        The path written, an :class:`~vitexplain.explorer.page.ExplorerPage` (a ``pathlib.Path``):
        as the last expression of a Jupyter cell it shows the page inline (``_repr_html_``: the
        page in a sandboxed ``<iframe srcdoc>``).

    Raises:
        UsageError: no images, bad ``top_k``/``names``/``attention_budget``.
        VitexplainError: a named method does not apply to the model (see its message).
    """
    from ..explainer import Explainer
    from ..files import check_file_path
    from .caption import caption_data
    from .extract import classifier_data
    from .page import render_page, write_page
    from .vlm import vlm_data
    from ..data.arrays import as_rgb
    from ..data.images import load_image
    from ..viz.notebook import png_data_uri

    if not isinstance(model, Explainer):
        processor = processor if processor is not None else getattr(model, "vx_processor", None)
    explainer = model if isinstance(model, Explainer) else (
        Explainer(model, processor=processor) if processor is not None else Explainer(model))
    check_file_path(out, "page")  # before the work: the page would otherwise fail only when written
    if not isinstance(title, str):  # (an AttributeError from the HTML escaping, after all the work)
        raise UsageError(f"title must be a string, got {type(title).__name__} {title!r}")
    if not isinstance(crop, bool):  # ("no" was truthy: the images were cropped)
        raise UsageError(f"crop must be True or False, got {type(crop).__name__} {crop!r}")
    if hasattr(images, "detach") or (isinstance(images, (list, tuple)) and any(hasattr(i, "detach") for i in images)):
        raise UsageError("explore draws each image under its maps: pass the images themselves (paths, PIL images or "
                         "(H, W, 3) uint8 arrays), not tensors; they are preprocessed as the model's eval transform does")
    items = list(images) if isinstance(images, (list, tuple, Iterator)) else [images]  # a generator: its images
    if type(images).__module__ == "numpy" and getattr(images, "ndim", None) == 4:
        items = list(images)  # an (N, H, W, 3) batch: N images (as one item, only the first was shown)
    if not items:
        raise UsageError("no images to explore; pass a path, an image or a list of them")
    if isinstance(top_k, bool) or not isinstance(top_k, Integral) or top_k < 1:
        raise UsageError(f"top_k must be a positive integer, got {top_k!r}")
    if isinstance(attention_budget, bool) or not isinstance(attention_budget, Real) or not 0 < attention_budget <= 10_000:
        raise UsageError(f"attention_budget is the most MB of attention data per image, in (0, 10000]; got {attention_budget!r}")
    if isinstance(max_len, bool) or not isinstance(max_len, Integral) or max_len < 1:
        raise UsageError(f"max_len must be a positive number of tokens to generate, got {max_len!r}")
    top_k, max_len, attention_budget = int(top_k), int(max_len), float(attention_budget)  # (NumPy numbers too)
    if isinstance(names, (str, os.PathLike)):  # one name, not its letters (a 5-letter name was "5 names for 1 image")
        names = [os.fspath(names)]
    labels = [str(n) for n in names] if names is not None else [_name(item, i) for i, item in enumerate(items)]
    if len(labels) != len(items):
        raise UsageError(f"got {len(labels)} names for {len(items)} images; pass one name per image")
    plan = explainer.plan(method, **options)
    if prompt is not None and plan.family.name != "vlm":
        raise UsageError(f"prompt= is for vision-language models; a {plan.family.name} model takes none: leave it out")
    if target is not None and (plan.family.name == "vlm" or plan.family.entry == "explain_caption"):
        raise UsageError(f"target={target!r} is for classifiers; the page of a {plan.family.name} model explains "
                         "each word of its caption: leave target out")
    per_image = _per_image_targets(target, len(items))
    budget = int(attention_budget * 1e6)
    data = []
    for item, label, each in zip(items, labels, per_image):
        notes = [f"{name} left out: {why}" for name, why in plan.skipped.items()]
        if plan.family.name == "vlm":  # whole images to the processor; maps over its token grids
            image = load_image(item) if isinstance(item, (str, os.PathLike)) else as_rgb(item, "each image")
            page = {"name": label, "family": plan.family.name, "image": png_data_uri(image),
                    "size": [int(image.shape[0]), int(image.shape[1])], "notes": notes, "attention": None,
                    "caption": None, "methods": []}
            page.update(vlm_data(explainer, plan, image, prompt=prompt, max_len=max_len, attention_budget=budget,
                                 notes=notes))
            data.append(page)
            continue
        x, regions, _, _ = explainer.preprocess(item, crop=crop)
        page = {"name": label, "family": plan.family.name, "image": png_data_uri(regions[0]),
                "size": [int(x.shape[-2]), int(x.shape[-1])], "notes": notes, "attention": None,
                "caption": None, "methods": []}
        if plan.family.entry == "explain_caption":
            page.update(caption_data(explainer, plan, x, max_len=max_len, attention_budget=budget, notes=notes))
        else:
            page.update(classifier_data(explainer, plan, x, top_k=top_k, target=each, attention_budget=budget,
                                        notes=notes))
        data.append(page)
    subtitle = f"{type(explainer.model).__name__} ({explainer.family.name})"
    return write_page(out, render_page(data, title=title, subtitle=subtitle))
