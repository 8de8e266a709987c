"""``vitexplain explore INPUT... --out page.html``: the explorer page for files and folders.

::

    from vitexplain.explorer.command import ExploreOptions, explore_inputs
    status = explore_inputs(ExploreOptions(inputs=["photos/"], out="page.html"))

Inputs are found like ``vitexplain export`` finds them (files, folders walked recursively,
globs); the model is loaded like export loads it (zoo name, zoo ``.json``, or a timm name with
``--checkpoint``). An image that cannot be read is reported and left out of the page (exit
status 1); the page holds the others.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..errors import ImageLoadError, UsageError, VitexplainError

__all__ = ["ExploreOptions", "explore_inputs", "DEFAULT_MAX_IMAGES"]

#: Most images one page holds by default (each embeds its attention: up to ~5 MB).
DEFAULT_MAX_IMAGES = 50


@dataclass
class ExploreOptions:
    """What ``vitexplain explore`` can be asked to do (the CLI flags, one to one).

    Attributes:
        inputs: files, folders (walked recursively) and glob patterns.
        out: the HTML file to write.
        model: zoo name, zoo checkpoint ``.json``, or timm model name.
        checkpoint: weights for a timm model.
        num_classes: classes of a timm model (default: from the checkpoint's head).
        model_args: extra ``timm.create_model`` arguments.
        labels: a text file with one class name per line.
        methods: method names (None: :data:`vitexplain.explorer.DEFAULT_METHODS`).
        method_options: per method, keyword options.
        top_k: classes offered for class-discriminative methods.
        target: ``"pred"`` (the top-k classes), or one class index or label name to explain.
        max_images: refuse more inputs than this (the page embeds every image's data).
        title: page title (default: ``vitexplain explorer: MODEL``).
        attention_budget_mb: most MB of attention data per image.
        max_len: longest generated caption (captioners).
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        quiet: no summary line.
    """

    inputs: list[str]
    out: str
    model: str = "shapes-vit"
    checkpoint: Optional[str] = None
    num_classes: Optional[int] = None
    model_args: dict[str, Any] = field(default_factory=dict)
    labels: Optional[str] = None
    methods: Optional[list[str]] = None
    method_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    top_k: int = 3
    target: str = "pred"
    max_images: int = DEFAULT_MAX_IMAGES
    title: Optional[str] = None
    attention_budget_mb: float = 5.0
    max_len: int = 16
    device: str = "auto"
    quiet: bool = False


def _device(spec: str) -> str:
    import torch

    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {spec}: CUDA is not available on this machine; use --device cpu")
    return spec


def _target(text: str) -> Any:
    """``--target``: None for ``pred``, an int for an index, else a label name."""
    text = str(text).strip()
    if text.lower() in ("", "pred"):
        return None
    return int(text) if text.lstrip("+-").isdigit() else text


def explore_inputs(opts: ExploreOptions) -> int:
    """Write the explorer page of every image found under ``opts.inputs``.

    Returns:
        0 when every image is on the page, 1 when some could not be read (reported on stderr).

    Raises:
        UsageError: no inputs, more than ``max_images``, no readable image, bad options, an
            unknown model or method.
    """
    from ..data.images import load_image
    from ..export import discover_inputs, load_model
    from . import explore

    out = Path(opts.out)
    if out.suffix.lower() not in (".html", ".htm"):
        raise UsageError(f"--out must name the .html file to write, got {opts.out!r}")
    if opts.attention_budget_mb <= 0:
        raise UsageError(f"--attention-budget must be a positive number of MB, got {opts.attention_budget_mb}")
    items = discover_inputs(opts.inputs, out)
    if len(items) > opts.max_images:
        raise UsageError(
            f"found {len(items)} images, more than --max-images {opts.max_images}: the page embeds every "
            "image's maps and attention (up to ~5 MB each); pass fewer inputs or raise --max-images"
        )
    model, _ = load_model(opts.model, checkpoint=opts.checkpoint, num_classes=opts.num_classes,
                          model_args=opts.model_args, labels=opts.labels, device=_device(opts.device))
    images, names, failed = [], [], 0
    for item in items:
        try:
            images.append(load_image(item.path))
            names.append(item.key)
        except ImageLoadError as err:
            failed += 1
            print(f"vitexplain explore: skipped {item.path}: {err}", file=sys.stderr)
    if not images:
        raise UsageError("none of the inputs could be read as an image")
    try:
        path = explore(
            model, images, out, methods=opts.methods, options=opts.method_options, top_k=opts.top_k, names=names,
            target=_target(opts.target),
            title=opts.title or f"vitexplain explorer: {opts.model}",
            attention_budget=int(opts.attention_budget_mb * 1e6), max_len=opts.max_len,
        )
    except VitexplainError as err:  # a method that does not apply, a bad option: say it, no traceback
        if isinstance(err, UsageError):
            raise
        raise UsageError(str(err)) from err
    if not opts.quiet:
        size = path.stat().st_size / 1e6
        print(f"vitexplain: {len(images)} images, {failed} failed -> {path} ({size:.2f} MB)", file=sys.stderr)
    return 1 if failed else 0
