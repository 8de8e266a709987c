"""``vitexplain explore INPUT... --out page.html``: the explorer page for files and folders.

::

    from vitexplain.batch.explore import ExploreOptions, explore_inputs
    status = explore_inputs(ExploreOptions(inputs=["photos/"], out="page.html"))

Inputs are found as ``vitexplain export`` finds them (:mod:`.inputs`) and the model is loaded
as export loads it (:mod:`.models`); the options that mean the same thing are the same
declarations (flag, help, check), taken field by field from
:class:`~vitexplain.batch.options.SharedOptions`. The page itself is :func:`vitexplain.explore`'s.
An image that cannot be read, an image whose aspect ratio is too extreme for the model's center
crop (``--no-crop`` resizes whole images instead, which takes it) and a folder that cannot be
listed are reported and left out of the page (exit status 1);
the page holds the others. ``--out`` is checked writable before the
model loads; a write that fails at the end (a full disk) is reported with exit status 74. One
page is one file, written atomically; there is no manifest, resume or torchrun sharding as for
export.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..errors import ImageLoadError, InputError, UsageError, VitexplainError
from .caption_vlm import check_prompt
from .checks import check_captioner_outputs
from .inputs import scan_inputs
from .models import load_model
from .option_values import POSITIVE, Number, collect_methods, parse_methods
from .options import BatchOptions, SharedOptions, option, same, validate
from .run import EXIT_FAILED, EXIT_OK, EXIT_OUTPUT, say
from .outfolder import check_writable
from .setup import with_threads

__all__ = ["ExploreOptions", "explore_inputs", "DEFAULT_MAX_IMAGES", "GROUPS"]

#: Most images one page holds by default (each embeds its attention: up to ~5 MB).
DEFAULT_MAX_IMAGES = 50

#: argparse group titles of the explore command, in display order.
GROUPS = {"model": "model", "explanation": "page", "running": "running"}


@dataclass
class ExploreOptions:
    """What ``vitexplain explore`` can be asked to do (the CLI flags, one to one).

    Attributes:
        inputs: files, folders (walked recursively) and glob patterns.
        out: the HTML file to write.
        model, checkpoint, num_classes, model_args, labels: the model, as for ``export``.
        methods: method names (None: the model family's defaults, as ``Explainer.plan()`` lists them).
        method_options: per method, keyword options.
        crop: resize + center-crop like the model's eval transform (False: resize whole images,
            which also takes images too elongated for the crop).
        target: ``"pred"`` (the top-k classes), or one class index or label name to explain.
        top_k: classes offered for class-discriminative methods.
        max_images: refuse more inputs than this (the page embeds every image's data).
        attention_budget: most MB of attention data per image.
        max_len: longest generated caption (captioners and vision-language models).
        prompt: vision-language models: the prompt (None: the model's default).
        title: page title (default: ``vitexplain explorer: MODEL``).
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        threads: torch intra-op threads during the run (restored after it); None: as they are.
        quiet: no summary line.
    """

    inputs: list[str] = same(BatchOptions, "inputs")
    out: str = option(flags=("--out", "-o"), metavar="PAGE.html", required=True, help="the HTML file to write")
    model: str = same(SharedOptions, "model")
    checkpoint: Optional[str] = same(SharedOptions, "checkpoint")
    num_classes: Optional[int] = same(SharedOptions, "num_classes")
    model_args: dict[str, Any] = same(SharedOptions, "model_args")
    labels: Optional[str] = same(SharedOptions, "labels")
    methods: Optional[list[str]] = option(
        None, flags="--method", metavar="M1,M2", group="explanation", action="append", parse=parse_methods,
        collect=collect_methods,
        help="methods, one tab each (default: the model family's defaults that apply, as `vitexplain methods "
             "--model NAME` lists them)")
    method_options: dict[str, dict[str, Any]] = same(BatchOptions, "method_options")
    crop: bool = same(BatchOptions, "crop")
    target: str = option("pred", flags="--target", metavar="pred|INDEX|LABEL", group="explanation",
                         help="explain the top-k classes (pred, default) or this one class")
    top_k: int = option(3, flags="--top-k", metavar="K", parse=POSITIVE, group="explanation",
                        help="classes offered for class-discriminative methods (default {default})")
    max_images: int = option(DEFAULT_MAX_IMAGES, flags="--max-images", metavar="N", parse=POSITIVE,
                             group="explanation",
                             help="refuse more images than this (default {default}: the page embeds every image's data)")
    attention_budget: float = option(
        5.0, flags="--attention-budget", metavar="MB", parse=Number(float, 0.01), group="explanation",
        help="most MB of attention data per image; past it fewer layers, then only the head mean, are "
             "embedded (default {default})")
    max_len: int = same(SharedOptions, "max_len")
    prompt: Optional[str] = option(None, flags="--prompt", metavar="TEXT", group="explanation",
                                   help="vision-language models: the prompt (default: the model's)")
    title: Optional[str] = option(None, flags="--title", metavar="TEXT", group="explanation", help="page title")
    device: str = same(BatchOptions, "device")
    threads: Optional[int] = same(BatchOptions, "threads")
    quiet: bool = option(False, flags=("--quiet", "-q"), action="store_true", group="running", help="no summary line")


def _target(text: str) -> Any:
    """``--target``: None for ``pred``, an int for an index, else a label name."""
    text = str(text).strip()
    if text.lower() in ("", "pred"):
        return None
    return int(text) if text.lstrip("+-").isdigit() else text


def _check_page_path(out: Path, text: str) -> None:
    """Refuse a ``--out`` page that cannot be written, before any model is loaded.

    Raises:
        UsageError: not a ``.html`` name, an existing folder, a folder that cannot be created
            (a file in the way) or is not writable.
    """
    if out.suffix.lower() not in (".html", ".htm"):
        raise UsageError(f"--out must name the .html file to write, got {text!r}")
    if out.is_dir():
        raise UsageError(f"--out {text!r} is a folder; name the .html file to write (e.g. {str(out / 'page.html')!r})")
    check_writable(out.parent, f"the folder of --out {text!r}")


@with_threads
def explore_inputs(opts: ExploreOptions) -> int:
    """Write the explorer page of every image found under ``opts.inputs``.

    Returns:
        0 when every image is on the page; 1 when some images or input folders could not be
        read, or an image cannot be center-cropped for the model (an aspect ratio too extreme,
        e.g. 1 x 300,000 px) -- each is reported on stderr and left out; 74 when the page
        could not be written (a full disk, an I/O error), reported on stderr.

    Raises:
        UsageError: no inputs, more than ``max_images``, no readable image, bad options, an
            ``--out`` that cannot be written (checked before the model loads), an unknown
            model or a method that does not apply to it.
    """
    from ..data.images import check_resizable, load_image
    from ..explainer import Explainer
    from ..explorer import explore
    from .distributed import Dist, resolve_device

    validate(opts)
    out = Path(opts.out)
    _check_page_path(out, opts.out)
    scan = scan_inputs(opts.inputs, out)
    items = scan.items
    if len(items) > opts.max_images:
        raise UsageError(
            f"found {len(items)} images, more than --max-images {opts.max_images}: the page embeds every "
            "image's maps and attention (up to ~5 MB each); pass fewer inputs or raise --max-images"
        )
    model, _ = load_model(opts.model, checkpoint=opts.checkpoint, num_classes=opts.num_classes,
                          model_args=opts.model_args, labels=opts.labels,
                          device=resolve_device(opts.device, Dist()))
    processor = getattr(model, "vx_processor", None)  # zoo VLMs and model folders carry theirs
    explainer = Explainer(model, processor=processor) if processor is not None else Explainer(model)
    check_prompt(opts.prompt, explainer.family.name, opts.model)
    from ..adapters import preprocessing

    pre_kwargs = preprocessing(explainer.adapter)
    if explainer.family.name == "caption":
        check_captioner_outputs(explainer.adapter, next(model.parameters()).device, None, pre_kwargs["input_size"])
    for u in scan.unreadable:
        say(f"vitexplain explore: cannot read folder {u.path} ({u.error}); its images are not on the page")
    for folder in scan.earlier_outputs:
        say(f"vitexplain explore: skipping {folder}: the output folder of an earlier run (it holds that run's "
            "summary.json); name it as an input to explore its files")
    images, names, failed = [], [], len(scan.unreadable)
    for item in items:
        try:
            image = load_image(item.path)
            if opts.crop and explainer.family.name != "vlm":  # a VLM's processor resizes and tiles the image itself
                check_resizable(*image.shape[:2], **pre_kwargs,
                                advice="Crop or pad it first, or resize it whole without cropping (--no-crop)")
        except (ImageLoadError, InputError) as err:
            failed += 1
            say(f"vitexplain explore: skipped {item.path}: {err}")
            continue
        images.append(image)
        names.append(item.key)
    if not images:
        raise UsageError("none of the inputs could be read as an image")
    try:
        path = explore(
            explainer, images, out, method=opts.methods, top_k=opts.top_k, target=_target(opts.target), names=names,
            title=opts.title or f"vitexplain explorer: {opts.model}", attention_budget=opts.attention_budget,
            max_len=opts.max_len, crop=opts.crop, **({"prompt": opts.prompt} if opts.prompt is not None else {}),
            **opts.method_options,
        )
    except OSError as err:  # the page cannot be written (OutputError: a full disk, an I/O error...)
        say(f"vitexplain explore: error: cannot write {opts.out}: {err.strerror or err}; nothing was written. "
            "Free some space (or fix the folder) and rerun")
        return EXIT_OUTPUT
    except VitexplainError as err:  # a method that does not apply, a bad option: say it, no traceback
        if isinstance(err, UsageError):
            raise
        raise UsageError(str(err)) from err
    if not opts.quiet:
        size = path.stat().st_size / 1e6
        say(f"vitexplain: {len(images)} images, {failed} failed -> {path} ({size:.2f} MB)")
    return EXIT_FAILED if failed else EXIT_OK
