"""The batch engine behind ``vitexplain caption`` (also usable from Python).

::

    from vitexplain.caption_export import CaptionOptions, export_captions
    result = export_captions(CaptionOptions(inputs=["photos/"], out="captions/"))
    result.exit_code, result.summary["counts"]

For every image, a captioner either generates its caption (greedy, with its KV cache) or is
given one (``caption``, explained teacher-forced), and every method (``cross``,
``cross_generic``) gives one map per word (:meth:`vitexplain.Explainer.explain_caption`).

It shares everything but the explaining and the files with ``vitexplain export``
(:mod:`vitexplain.export`): input discovery and output keys, DataLoader decoding where a bad
file becomes an error record, atomic writes, the manifest (per rank, then merged), the
resume rule, ``summary.json``, torchrun sharding and the exit codes.

Output layout (``OUT`` = ``--out``, ``KEY`` = the input's output key, see
:func:`vitexplain.export.discover_inputs`)::

    OUT/KEY.METHOD.png       per-word figure: the region the model saw, then one overlay per word
    OUT/KEY.METHOD.npz       ``maps`` (T, gh, gw) float32, ``tokens`` (T,) str, ``ids`` (T,) int64
    OUT/KEY.caption.json     caption, tokens, ids, methods and their files (written last)
    OUT/manifest.jsonl       one JSON line per image, with the caption (see :func:`export_captions`)
    OUT/summary.json         counts, timings, versions, arguments
    OUT/index.html           gallery of the figures (with ``html``)
"""

from __future__ import annotations

import functools
import io
import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

from .export import (
    GALLERY,
    ExportResult,
    UsageError,
    WriteFn,
    _check_batching,
    _check_overlay_style,
    _config_hash,
    _device_and_amp,
    _Dist,
    _drive,
    _encode_png,
    _model_id,
    _out_and_items,
    _resolve_methods,
    _Run,
    _Writer,
    _write_summary,
    _zoo_weights_id,
    load_model,
)

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

__all__ = ["CaptionOptions", "export_captions", "DEFAULT_CAPTION_MODEL", "DEFAULT_CAPTION_METHODS"]

#: Model used when ``--model`` is not given.
DEFAULT_CAPTION_MODEL = "shapes-captioner"
#: Methods written when ``--method`` is not given.
DEFAULT_CAPTION_METHODS: tuple[str, ...] = ("cross", "cross_generic")


@dataclass
class CaptionOptions:
    """Everything ``vitexplain caption`` can be asked to do (the CLI flags, one to one).

    Attributes:
        inputs: files, folders (walked recursively) and glob patterns.
        out: output folder (created).
        model: a zoo captioner name or the path of a zoo-format checkpoint ``.json``.
        methods: caption method names; None = :data:`DEFAULT_CAPTION_METHODS`.
        method_options: per method, keyword options (e.g. ``{"cross": {"layers": -1}}``).
        caption: None to let the model generate each image's caption; a text to explain
            that caption (teacher-forced) for every image.
        max_len: most tokens generated (the model's own limit applies too).
        batch_size: images per forward pass.
        workers: DataLoader worker processes decoding and preprocessing (0: in the main process).
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        amp: ``None``, ``"bf16"`` or ``"fp16"`` (CUDA autocast).
        crop: resize + center-crop like the model's eval transform (False: resize only).
        alpha: overlay opacity.
        colormap: colormap of unsigned maps.
        signed_colormap: colormap of signed maps (diverging, centred at zero).
        tile_size: side in pixels of each tile of the per-word figures.
        html: write ``index.html``.
        overwrite: redo images whose outputs are already complete and current.
        quiet: no progress bar and no final summary line (errors are still printed).
        write_threads: threads drawing figures and writing files while the model runs.
    """

    inputs: list[str]
    out: str
    model: str = DEFAULT_CAPTION_MODEL
    methods: Optional[list[str]] = None
    method_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    caption: Optional[str] = None
    max_len: int = 16
    batch_size: int = 16
    workers: int = 0
    device: str = "auto"
    amp: Optional[str] = None
    crop: bool = True
    alpha: float = 0.5
    colormap: str = "jet"
    signed_colormap: str = "bwr"
    tile_size: int = 160
    html: bool = False
    overwrite: bool = False
    quiet: bool = False
    write_threads: int = field(default_factory=lambda: max(2, min(8, (os.cpu_count() or 2) // 2)))


def _encode_npz(maps: "np.ndarray", tokens: Sequence[str], ids: Sequence[int]) -> bytes:
    """``maps`` (T, gh, gw) float32, ``tokens`` (T,) unicode, ``ids`` (T,) int64 as ``.npz`` bytes."""
    import numpy as np

    buf = io.BytesIO()
    np.savez(
        buf,
        maps=np.ascontiguousarray(maps, dtype=np.float32),
        tokens=np.asarray(list(tokens), dtype=np.str_),
        ids=np.asarray(list(ids), dtype=np.int64),
    )
    return buf.getvalue()


@dataclass
class _Caption:
    """One image's explained caption (what its write job needs)."""

    key: str
    region: "np.ndarray"
    caption: str
    tokens: list[str]
    ids: list[int]
    generated: bool
    maps: dict[str, "np.ndarray"]  # method -> (T, gh, gw)
    record: dict[str, Any]  # input, width, height, box (for the JSON)


def _write_caption(
    writer: _Writer,
    files: dict[str, dict[str, str]],
    *,
    item: _Caption,
    opts: CaptionOptions,
    signed: dict[str, bool],
    method_options: dict[str, dict[str, Any]],
    model: dict[str, Any],
) -> None:
    """``caption``'s write job: per method the figure and the maps, then the image's JSON."""
    from .viz.caption import caption_figure

    key = item.key
    for name, maps in item.maps.items():
        rgb = caption_figure(
            item.region, item.tokens, maps, alpha=opts.alpha,
            colormap=opts.signed_colormap if signed[name] else opts.colormap,
            normalize="signed" if signed[name] else "minmax",
            tile_size=opts.tile_size or None,
        )
        entry = {"figure": f"{key}.{name}.png", "maps": f"{key}.{name}.npz"}
        writer.write(entry["figure"], _encode_png(rgb))
        writer.write(entry["maps"], _encode_npz(maps, item.tokens, item.ids))
        files[name] = entry
    document = {
        "key": key,
        **item.record,
        "caption": item.caption,
        "tokens": item.tokens,
        "ids": item.ids,
        "generated": item.generated,
        "model": model,
        "methods": list(item.maps),
        "options": {name: method_options.get(name, {}) for name in item.maps},
        # file names in this JSON's own folder (the manifest lists them relative to OUT)
        "files": {name: {kind: rel.rsplit("/", 1)[-1] for kind, rel in entry.items()}
                  for name, entry in files.items()},
    }
    rel = f"{key}.caption.json"
    text = json.dumps(document, indent=2, ensure_ascii=False, default=str) + "\n"
    writer.write(rel, text.encode("utf-8", "surrogateescape"))
    files["caption"] = {"json": rel}


def _probe_caption(ex: Any, methods: list[str], method_options: dict[str, dict[str, Any]], opts: CaptionOptions,
                   pre_kwargs: dict[str, Any], device: "torch.device", autocast_dtype: Any) -> None:
    """Explain one blank image before writing anything: a caption with unknown words, a bad
    option or a model the methods cannot read is a usage error (exit 2), not one failure per image."""
    import torch

    from .export import _autocast

    h, w = pre_kwargs["input_size"]
    x = torch.zeros(1, 3, int(h), int(w), device=device)
    try:
        with _autocast(autocast_dtype):
            ex.explain_caption(x, method=methods, caption=opts.caption, max_len=opts.max_len, **method_options)
    except Exception as e:
        what = f"the caption {opts.caption!r}" if opts.caption is not None else "generated captions"
        raise UsageError(
            f"cannot explain {what} of this model with {', '.join(methods)} (tried on a blank {h}x{w} "
            f"image): {type(e).__name__}: {e}"
        ) from None


def export_captions(opts: CaptionOptions, *, argv: Optional[Sequence[str]] = None) -> ExportResult:
    """Caption every input image and write per-word figures, maps, JSON, manifest and summary.

    Manifest record (one JSON object per line of ``manifest.jsonl``, sorted by ``key``)::

        {"key": "sub/a b.png", "input": "photos/sub/a b.png", "status": "ok" | "failed",
         "source": {"path": abs path, "bytes": int, "mtime_ns": int},
         "width": int, "height": int, "box": [left, top, right, bottom],
         "caption": "red circle", "tokens": ["red", "circle"], "ids": [5, 9],
         "generated": bool,               # False when the caption was given (teacher-forced)
         "files": {"cross": {"figure": "sub/a b.png.cross.png", "maps": "sub/a b.png.cross.npz"},
                   ..., "caption": {"json": "sub/a b.png.caption.json"}},
         "error": str | None, "config_hash": str, "time": unix seconds, "rank": int}

    Resume: as :func:`vitexplain.export.export`: an image is skipped when an ``ok`` record with
    the same source file (path, size, mtime) and the same settings (model and its weights,
    methods and options, caption, max_len, crop, figure settings, amp) lists files that all
    exist; ``overwrite`` redoes it. Failed images are always retried.

    Args:
        opts: what to do (see :class:`CaptionOptions`).
        argv: the command line, recorded in ``summary.json``.

    Returns:
        :class:`vitexplain.export.ExportResult` (exit code 0, or 1 when any image failed).

    Raises:
        UsageError: bad options or inputs, or a model that is not a captioner, found before
            any output is written.
    """
    t_start = time.perf_counter()
    from .explainer import Explainer

    dist = _Dist.from_env()
    _check_batching(opts.batch_size, opts.workers)
    if opts.max_len < 1:
        raise UsageError("--max-len must be >= 1")
    if opts.tile_size < 0:
        raise UsageError("--tile-size must be >= 0")
    if opts.caption is not None and not opts.caption.strip():
        raise UsageError("--caption is empty; give the words to explain, or leave it out to generate")
    _check_overlay_style(opts.alpha, opts.colormap, opts.signed_colormap)
    device, autocast_dtype = _device_and_amp(opts.device, opts.amp, dist)
    out, items = _out_and_items(opts.out, opts.inputs)

    model, model_info = load_model(opts.model, device=device)
    ex = Explainer(model)
    family = ex.family
    if family != "caption":
        raise UsageError(
            f"--model {opts.model!r} is a {family} model, not an image captioner; `vitexplain caption` "
            f"explains captioners (e.g. {DEFAULT_CAPTION_MODEL}). For classifier saliency maps run "
            f"`vitexplain export INPUT... --out DIR --model {opts.model}`"
        )
    methods, specs, method_options = _resolve_methods(opts.methods, DEFAULT_CAPTION_METHODS, family,
                                                      opts.method_options)
    signed = {m: s.signed for m, s in specs.items()}
    per_method = {m: dict(method_options.get(m, {})) for m in methods}
    pre_kwargs = ex.adapter.preprocess_kwargs()
    if opts.caption is not None:
        try:
            ex.adapter.encode_caption(opts.caption)
        except (KeyError, ValueError) as e:
            reason = e.args[0] if isinstance(e, KeyError) and e.args else e
            raise UsageError(f"--caption {opts.caption!r}: {reason}") from None

    _probe_caption(ex, methods, per_method, opts, pre_kwargs, device, autocast_dtype)

    config = {
        "command": "caption", "model": _model_id(opts.model), "weights": _zoo_weights_id(opts.model, model_info),
        "methods": methods, "method_options": method_options, "caption": opts.caption, "max_len": opts.max_len,
        "crop": opts.crop, "alpha": opts.alpha, "colormap": opts.colormap,
        "signed_colormap": opts.signed_colormap, "tile_size": opts.tile_size, "amp": opts.amp,
    }
    run = _Run(
        command="caption", out=out, items=items, dist=dist, device=device, autocast_dtype=autocast_dtype,
        pre_kwargs=pre_kwargs, config_hash=_config_hash(config), crop=opts.crop,
        max_side=opts.tile_size if opts.tile_size > 0 else 512,
        batch_size=opts.batch_size, workers=opts.workers, write_threads=opts.write_threads,
        overwrite=opts.overwrite, quiet=opts.quiet,
    )
    model_doc = {"name": opts.model, "source": model_info.get("source"), "input_size": list(pre_kwargs["input_size"])}
    generated = opts.caption is None
    paths = {it.key: it.path for it in items}

    def process(x: "torch.Tensor", good: list[dict[str, Any]]) -> list[tuple[dict[str, Any], WriteFn]]:
        results = ex.explain_caption(x, method=methods, caption=opts.caption, max_len=opts.max_len, **per_method)
        first = results[0]
        maps = {r.method: r.maps.float().cpu().numpy() for r in results}
        ids = first.ids.cpu().tolist()
        jobs: list[tuple[dict[str, Any], WriteFn]] = []
        for b, s in enumerate(good):
            tokens = list(first.tokens[b])
            t = len(tokens)
            fields = {"caption": first.captions[b], "tokens": tokens, "ids": [int(v) for v in ids[b][:t]],
                      "generated": generated}
            item = _Caption(
                key=s["key"], region=s["region"], caption=fields["caption"], tokens=tokens, ids=fields["ids"],
                generated=generated, maps={m: maps[m][b, :t] for m in methods},
                record={"input": paths[s["key"]], "width": s["width"], "height": s["height"], "box": s["box"]},
            )
            write = functools.partial(_write_caption, item=item, opts=opts, signed=signed,
                                      method_options=method_options, model=model_doc)
            jobs.append((fields, write))
        return jobs

    def finish(all_stats: list[dict[str, Any]]) -> dict[str, Any]:
        records, summary = _write_summary(
            run, all_stats, t_start, opts=opts, argv=argv, config=config, methods=methods,
            model={**model_info, "family": family, "input_size": list(pre_kwargs["input_size"])},
            extra={"caption": opts.caption, "max_len": opts.max_len},
        )
        if opts.html:
            _write_caption_gallery(out, records, methods, title=f"vitexplain caption: {opts.model}")
        return summary

    return _drive(run, process, finish, t_start)


def _write_caption_gallery(out: Any, records: list[dict[str, Any]], methods: list[str], *, title: str) -> None:
    """The export gallery, one column per method showing the per-word figure; the caption is
    shown as the explained target."""
    from .viz.gallery import write_gallery

    rows = []
    for r in records:
        files = r.get("files") or {}
        view = {**r, "files": {m: {"overlay": files[m]["figure"]} for m in methods
                               if isinstance(files.get(m), dict) and "figure" in files[m]}}
        if r.get("status") == "ok":
            view["target"] = {"label": r.get("caption", "")}
        rows.append(view)
    write_gallery(out / GALLERY, rows, methods=methods, title=title, thumb_px=480)
