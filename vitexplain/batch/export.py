"""``vitexplain export``: saliency overlays (and maps) of classifiers for folders of images.

::

    from vitexplain.batch.export import ExportOptions, export
    result = export(ExportOptions(inputs=["photos/"], out="maps/", methods=["rollout", "cdam"]))
    result.exit_code, result.summary["counts"]

Output layout (``OUT`` = ``--out``, ``KEY`` = the input's output key, see
:mod:`vitexplain.batch.inputs`)::

    OUT/KEY.METHOD.png     overlay on the region the model saw, per image and method
    OUT/KEY.METHOD.npy     raw (gh, gw) float32 map (with save_maps)
    OUT/manifest.jsonl     one JSON line per image (see :func:`export`)
    OUT/summary.json       outcome, counts, timings, versions, arguments
    OUT/index.html         gallery (with html)
"""

from __future__ import annotations

import functools
import math
import re
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ..errors import UsageError
from .checks import finite_rows, not_finite_error
from .driver import drive
from .run import Command, ExportResult
from .manifest import GALLERY
from .models import checkpoint_id, digest, load_model, model_id, zoo_weights_id
from .option_values import NON_NEGATIVE, collect_methods, parse_methods
from .options import BatchOptions, SharedOptions, option, same
from .setup import (config_hash, new_run, one_by_one_on_image_errors, plan_run, prepare, probe, summary_fields,
                    with_threads)
from ..files import Writer, encode_npy, encode_png

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

__all__ = ["ExportOptions", "export"]

#: The most --min-side enlarges to when --max-side is 0 (original size), which leaves it no other bound
#: (--min-side 100000 allocated 30 GB per overlay).
MAX_MIN_SIDE = 4096


@dataclass
class ExportOptions(BatchOptions):
    """Everything ``vitexplain export`` can be asked to do (the CLI flags, one to one).

    Besides :class:`~vitexplain.batch.options.BatchOptions`:

    Attributes:
        model: a zoo name (``vx.zoo.names()``), a timm model name (random weights unless
            ``checkpoint``), or the path of a zoo-format checkpoint ``.json``.
        checkpoint: weights for ``model``: ``.safetensors``, or ``.pt``/``.pth``/``.bin`` read
            with ``torch.load(weights_only=True)``; a state dict or ``{"state_dict"|"model": ...}``.
        num_classes: classifier size for timm models (default: from the checkpoint, else timm's).
        model_args: extra ``timm.create_model`` keyword arguments (e.g. ``img_size=64``).
        labels: text file with one class name per line (for timm models without names).
        target: ``"pred"`` (each image's top prediction), a class index, or a label name.
        max_side: overlays larger than this (longer side, pixels) are drawn downscaled; 0 = never.
        min_side: overlays of smaller images are drawn enlarged (tiny ones by a whole factor, crisp pixels)
            to at least this many pixels on the shorter side; 0 = never.
        top_k: predictions recorded per image.
        save_maps: also write each raw map as ``.npy``.
    """

    model: str = same(SharedOptions, "model")
    checkpoint: Optional[str] = same(SharedOptions, "checkpoint")
    num_classes: Optional[int] = same(SharedOptions, "num_classes")
    model_args: dict[str, Any] = same(SharedOptions, "model_args")
    labels: Optional[str] = same(SharedOptions, "labels")
    methods: Optional[list[str]] = option(
        None, flags="--method", metavar="M1,M2", group="explanation", outputs=True, action="append",
        parse=parse_methods, collect=collect_methods,
        help="methods, comma separated or repeated (default: the model family's defaults that apply, e.g. "
             "generic,legrad for ViTs and Swin, gradcam for CNNs; list them with `vitexplain methods --model NAME`)")
    target: str = option("pred", flags="--target", metavar="pred|INDEX|LABEL", group="explanation", outputs=True,
                         help="class to explain: each image's top prediction (default), an index or a label name")
    max_side: int = option(512, flags="--max-side", metavar="PX", parse=NON_NEGATIVE, group="overlays",
                           outputs=True, help="draw overlays at most this many pixels on the longer side "
                                              "(default {default}; 0: original size)")
    save_maps: bool = option(False, flags="--save-maps", action="store_true", group="overlays", outputs=True,
                             help="also write each raw map as .npy")
    min_side: int = option(256, flags="--min-side", metavar="PX", parse=NON_NEGATIVE, group="overlays",
                           outputs=True, help="draw overlays of smaller images enlarged (tiny ones by a whole factor, crisp "
                                              "pixels) to at least this many pixels on the shorter side, "
                                              "within --max-side (default {default}; 0: never; with --max-side 0 at "
                                              f"most {MAX_MIN_SIDE})")
    top_k: int = option(5, flags="--top-k", metavar="K", parse=NON_NEGATIVE, group="overlays", outputs=True,
                       help="predictions recorded per image (default {default})")


def _parse_target(spec: Any, label_names: Optional[list[str]], num_classes: Optional[int]) -> Optional[Any]:
    if spec is None or str(spec).strip().lower() in ("", "pred", "predicted", "top"):
        return None
    text = str(spec).strip()
    if re.fullmatch(r"[+-]?\d+", text):
        index = int(text)
        if index < 0 or (num_classes is not None and index >= num_classes):
            raise UsageError(f"--target {index}: out of range for a model with {num_classes} classes")
        return index
    names = label_names or []
    if text in names:
        return text
    folded = [n for n in names if n.casefold() == text.casefold()]
    if len(folded) == 1:
        return folded[0]
    from ..targets import label_matches  # (imports torch: not at import time, `vitexplain --help` stays light)

    synonyms = label_matches(text, names)  # one name of a class listing synonyms ("goldfish, Carassius auratus")
    if len(synonyms) == 1:
        return synonyms[0]
    if len(synonyms) > 1:
        raise UsageError(f"--target {text!r}: names several classes {synonyms}; pass the index you mean")
    if not names:
        raise UsageError(f"--target {text!r}: this model has no label names; pass a class index or --labels FILE")
    shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
    raise UsageError(f"--target {text!r}: unknown label; choose pred, an index or one of: {shown}")


def _check_outputs_finite(logits: Any, pre_kwargs: dict[str, Any]) -> None:
    """A model whose outputs on the blank probe image are NaN/inf is a usage error (exit 2)."""
    import torch

    if isinstance(logits, torch.Tensor) and not bool(torch.isfinite(logits).all()):
        h, w = pre_kwargs["input_size"]
        raise UsageError(
            f"the model's outputs on a blank {h}x{w} image are not finite (NaN or inf), so no map would mean "
            "anything: check its weights (--checkpoint, --model)"
        )


def _scores(logits: Any, multi_label: bool, k: int) -> Optional[tuple[list[list[float]], list[list[int]]]]:
    import torch

    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or k <= 0:
        return None
    z = logits.detach().float()
    probs = torch.sigmoid(z) if multi_label else torch.softmax(z, dim=1)
    values, indices = probs.topk(min(k, probs.shape[1]), dim=1)
    return values.cpu().tolist(), indices.cpu().tolist()


def _write_overlays(
    writer: Writer, files: dict[str, dict[str, str]], *, key: str, region: "np.ndarray",
    maps: dict[str, "np.ndarray"], opts: ExportOptions, signed: dict[str, bool],
) -> None:
    """``export``'s write job: per method, the overlay PNG (and the raw map with save_maps).

    Small regions are drawn enlarged (``min_side``); signed maps fade to the image at zero and
    get a colour bar (-max against, 0, +max for the target) under the overlay.
    """
    import numpy as np

    from ..viz.legend import with_colorbar
    from ..viz.overlays import overlay, readable
    from .decoding import cap_size

    # enlarged within --max-side: never past it first (--min-side 100000 drew a 30 GB array, then shrank it)
    min_side = min(opts.min_side, opts.max_side if opts.max_side > 0 else MAX_MIN_SIDE)
    base = readable(region, min_side) if min_side > 0 else region
    if base is not region:  # enlarged: --max-side still bounds the longer side (--max-side 128 or a thin strip)
        base = cap_size(base, opts.max_side)
    for name, m in maps.items():
        normalize = "signed" if signed[name] else "minmax"
        cmap = opts.signed_colormap if signed[name] else opts.colormap
        rgb = overlay(base, m, alpha=opts.alpha, colormap=cmap, normalize=normalize)
        if signed[name]:
            rgb = with_colorbar(rgb, signed=True, scale=float(np.abs(m).max()), colormap=cmap)
        entry = {"overlay": f"{key}.{name}.png"}
        writer.write(entry["overlay"], encode_png(rgb))
        if opts.save_maps:
            entry["map"] = f"{key}.{name}.npy"
            writer.write(entry["map"], encode_npy(m))
        files[name] = entry


@with_threads
def export(opts: ExportOptions, *, argv: Optional[Sequence[str]] = None) -> ExportResult:
    """Explain every input image and write overlays, maps, manifest, summary and gallery.

    Manifest record (one JSON object per line of ``manifest.jsonl``, sorted by ``key``)::

        {"key": "sub/a b.png",            # output key (relative to --out, posix)
         "input": "photos/sub/a b.png",   # the file as found (\\xNN for bytes that are not UTF-8)
         "input_bytes_hex": "...",        # only then: the exact file name bytes, hex
         "status": "ok" | "failed",
         "source": {"path": abs path, "bytes": int, "mtime_ns": int,
                    "path_bytes_hex": "..."},  # the last only when the path is not UTF-8
         "width": int, "height": int,     # decoded image size (pixels)
         "box": [left, top, right, bottom],  # region the model saw, original pixels
         "predictions": [{"index": int, "label": str|None, "score": float}, ...],  # top-k
         "score_kind": "softmax" | "sigmoid",
         "target": {"index": int, "label": str|None},
         "files": {"rollout": {"overlay": "sub/a b.png.rollout.png", "map": "...npy"}, ...},
         "error": str | None,
         "config_hash": str, "time": unix seconds, "rank": int}

    An input folder that cannot be read gets a record too: ``{"key": "<folder>/", "kind":
    "folder", "status": "failed", "error": ...}``.

    Resume: an image is skipped (counted as ``skipped``) when the manifest already holds an
    ``ok`` record with the same key whose ``source`` (absolute path, size, mtime) and
    ``config_hash`` (every option declared ``outputs=True``: model and its weights, methods
    and options, target, crop, overlay settings, save_maps, amp) match and whose listed
    files all exist; ``overwrite`` redoes it anyway. Failed images are always retried.

    Args:
        opts: what to do (see :class:`ExportOptions`).
        argv: the command line, recorded in ``summary.json``.

    Returns:
        :class:`~vitexplain.batch.driver.ExportResult` (exit code 0, 1 when any image
        failed, 74 when the output folder could not be written).

    Raises:
        UsageError: bad options or inputs, found before any output is written.
        KeyboardInterrupt: Ctrl-C or SIGTERM, after the summary is written.
    """
    t_start = time.perf_counter()
    from ..explainer import Explainer

    setup = prepare(opts)
    model, model_info = load_model(
        opts.model, checkpoint=opts.checkpoint, num_classes=opts.num_classes,
        model_args=opts.model_args, labels=opts.labels, device=setup.device,
    )
    ex = Explainer(model)
    plan = plan_run(ex, opts.methods, opts.method_options, command="export", model=opts.model)
    methods = plan.names
    method_options = {s.name: dict(s.options) for s in plan.steps}
    signed = {s.name: s.spec.signed for s in plan.steps}
    if not ex.adapter.has_head:  # the target advice of the Python API (a callable) has no flag here
        raise UsageError(
            f"--model {opts.model!r} has no classifier head (its output is an embedding), so there is no class "
            "for `vitexplain export` to explain: give it a head (--num-classes N, with a --checkpoint that holds "
            "one), or from Python explain a score of the embedding: "
            "vx.Explainer(model).explain(x, target=vx.targets.norm())")
    label_names = ex.adapter.label_names
    num_classes = getattr(model, "num_classes", None)
    target = _parse_target(opts.target, label_names, num_classes if isinstance(num_classes, int) else None)
    pcfg = getattr(model, "pretrained_cfg", None) or {}
    multi_label = bool(pcfg.get("multi_label", False)) if isinstance(pcfg, dict) else False
    from ..adapters import preprocessing

    pre_kwargs = preprocessing(ex.adapter)
    if model_info.get("random_weights") and setup.dist.rank == 0 and not opts.quiet:
        print(f"vitexplain: warning: {opts.model} has random weights (no --checkpoint); the maps show "
              "plumbing, not meaning", file=sys.stderr)

    logits = probe(lambda x: ex.explain(x, method=methods, target=target, **method_options)[0].logits,
                   f"this model with {', '.join(methods)}", setup, pre_kwargs)
    _check_outputs_finite(logits, pre_kwargs)

    config, digest_ = config_hash(opts, {
        "command": "export", "model": model_id(opts.model), "checkpoint": checkpoint_id(opts.checkpoint),
        "weights": zoo_weights_id(opts.model, model_info), "labels": digest(label_names),
        "methods": methods, "method_options": method_options, "target": target,
    })
    run = new_run("export", opts, setup, pre_kwargs, digest_, max_side=opts.max_side)
    names = label_names or []

    def label(i: int) -> Optional[str]:
        return names[i] if 0 <= i < len(names) else None

    @one_by_one_on_image_errors
    def process(x: "torch.Tensor", good: list[dict[str, Any]]) -> list[tuple[dict[str, Any], Any]]:
        explanations = ex.explain(x, method=methods, target=target, **method_options)
        maps = {e.method: e.maps.float().cpu().numpy() for e in explanations}
        # integrated_gradients' completeness error per image (its ConvergenceWarning names batch positions)
        completeness = {e.method: e.extras["completeness_error"].tolist() for e in explanations
                        if "completeness_error" in e.extras}
        # and the integration steps each image got (steps=None, the default, chooses them per image)
        steps = {e.method: e.extras["steps"].tolist() for e in explanations if "completeness_error" in e.extras
                 and "steps" in e.extras}
        logits = explanations[0].logits
        targets = explanations[0].targets.cpu().tolist()
        top = _scores(logits, multi_label, opts.top_k)
        outputs_ok, bad_maps = finite_rows(maps, logits)
        jobs: list[tuple[dict[str, Any], Any]] = []
        for b, s in enumerate(good):
            fields: dict[str, Any] = {}
            error = not_finite_error(s["key"], outputs_ok[b], bad_maps[b])
            if top is not None and error is None:
                fields["predictions"] = [{"index": int(i), "label": label(int(i)), "score": round(float(v), 6)}
                                         for v, i in zip(top[0][b], top[1][b])]
                fields["score_kind"] = "sigmoid" if multi_label else "softmax"
            fields["target"] = {"index": int(targets[b]), "label": label(int(targets[b]))}
            if completeness:  # (null: attributions that sum to non-zero where the score did not change)
                fields["completeness_error"] = {m: round(v[b], 6) if math.isfinite(v[b]) else None
                                                for m, v in completeness.items()}
            if steps:
                fields["steps"] = {m: int(v[b]) for m, v in steps.items()}
            write = error or functools.partial(_write_overlays, key=s["key"], region=s["region"],
                                               maps={m: maps[m][b] for m in methods}, opts=opts, signed=signed)
            jobs.append((fields, write))
        return jobs

    def gallery(records: list[dict[str, Any]]) -> None:
        from ..viz.gallery import render_gallery

        page = render_gallery(records, folder=setup.out, methods=methods, title=f"vitexplain export: {opts.model}")
        Writer(setup.out).write(GALLERY, page.encode("utf-8", "replace"))

    fields = summary_fields(opts, argv, config, methods=methods,
                            model={**model_info, "family": plan.family.name, "input_size": list(pre_kwargs["input_size"])})
    return drive(run, Command(process=process, fields=fields, gallery=gallery if opts.html else None), t_start)
