"""``vitexplain caption``: per-word maps and figures of image captioners for folders of images.

::

    from vitexplain.batch.caption import CaptionOptions, export_captions
    result = export_captions(CaptionOptions(inputs=["photos/"], out="captions/"))
    result.exit_code, result.summary["counts"]

For every image, a captioner either generates its caption (greedy, with its KV cache) or is
given one (``caption``, explained teacher-forced), and every method (``cross``,
``cross_generic``) gives one map per word (:meth:`vitexplain.Explainer.explain_caption`).
Everything else (inputs and keys, decoding, atomic writes, the manifest, resume, the lock,
``summary.json``, torchrun, exit codes) is the shared driver's (:mod:`vitexplain.batch.driver`).

Output layout (``OUT`` = ``--out``, ``KEY`` = the input's output key)::

    OUT/KEY.METHOD.png       per-word figure: the region the model saw, then one overlay per word
    OUT/KEY.METHOD.npz       ``maps`` (T, gh, gw) float32, ``tokens`` (T,) str, ``ids`` (T,) int64
    OUT/KEY.caption.json     caption, tokens, ids, methods and their files (written last)
    OUT/manifest.jsonl       one JSON line per image, with the caption (see :func:`export_captions`)
    OUT/summary.json         outcome, counts, timings, versions, arguments
    OUT/index.html           gallery of the figures (with ``html``)
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ..errors import UsageError
from .caption_vlm import check_prompt, probe_vlm, vlm_process
from .driver import drive
from .run import Command, ExportResult
from .checks import check_captioner_outputs, empty_caption_error, finite_rows, not_finite_error
from .manifest import GALLERY
from .models import load_model, model_id, zoo_weights_id
from .option_values import POSITIVE, Number, collect_methods, parse_methods
from .options import BatchOptions, SharedOptions, option, same
from .setup import (config_hash, new_run, one_by_one_on_image_errors, plan_run, prepare, probe, summary_fields,
                    with_threads)
from ..files import Writer, encode_npz, encode_png, json_bytes

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

__all__ = ["CaptionOptions", "export_captions", "DEFAULT_CAPTION_MODEL"]

#: Model used when ``--model`` is not given.
DEFAULT_CAPTION_MODEL = "shapes-captioner"


#: Largest --tile-size: one figure holds a tile per word (12 words at 2048 px: about 150 MB of pixels).
MAX_TILE = 2048


@dataclass
class CaptionOptions(BatchOptions):
    """Everything ``vitexplain caption`` can be asked to do (the CLI flags, one to one).

    Besides :class:`~vitexplain.batch.options.BatchOptions`:

    Attributes:
        model: a zoo captioner or VLM name, the path of a zoo-format checkpoint ``.json``, or a
            folder with a Hugging Face captioner and its tokenizer, or a vision-language model and its processor
            (``save_pretrained``).
        prompt: vision-language models: the prompt (None: the adapter's default).
        caption: None to let the model generate each image's caption; a text to explain
            that caption (teacher-forced) for every image.
        max_len: most tokens generated (the model's own limit applies too).
        tile_size: side in pixels of each tile of the per-word figures.
    """

    model: str = option(DEFAULT_CAPTION_MODEL, flags=("--model", "-m"), metavar="NAME", group="model", outputs=True,
                        help="zoo captioner or VLM (see `vitexplain models`), a zoo checkpoint .json, or a folder "
                             "holding a Hugging Face captioner and its tokenizer, or a vision-language model and its "
                             "processor (save_pretrained) (default: {default})")
    prompt: Optional[str] = option(None, flags="--prompt", metavar="TEXT", group="explanation", outputs=True,
                                   help="vision-language models: the prompt (question or instruction; the image "
                                        "token is put in front unless it holds one); default: the model's")
    methods: Optional[list[str]] = option(
        None, flags="--method", metavar="M1,M2", group="explanation", outputs=True, action="append",
        parse=parse_methods, collect=collect_methods,
        help="caption methods, comma separated or repeated (default: the family's, cross,cross_generic; list them "
             "with `vitexplain methods --model NAME`)")
    caption: Optional[str] = option(None, flags="--caption", metavar="TEXT", group="explanation", outputs=True,
                                    help="explain this caption (teacher-forced) for every image instead of "
                                         "generating one")
    max_len: int = same(SharedOptions, "max_len")
    colormap: str = option("jet", flags="--colormap", metavar="NAME", group="overlays", outputs=True,
                           help="colormap of the maps (default {default}; any OpenCV name)")
    signed_colormap: str = option("bwr", flags="--signed-colormap", metavar="NAME", group="overlays",
                                  outputs=True, help="diverging colormap of signed maps (default {default})")
    tile_size: int = option(160, flags="--tile-size", metavar="PX", parse=Number(int, 0, MAX_TILE), group="overlays",
                            outputs=True, help=f"side of each tile of the figures, at most {MAX_TILE} px (default "
                                                "{default}; 0: the image's size, at most 512)")
    html: bool = option(False, flags="--html", action="store_true", group="overlays",
                        help="write an index.html gallery of the figures")
    batch_size: int = option(16, flags=("--batch-size", "-b"), metavar="N", parse=POSITIVE, group="running",
                             help="images per forward pass (default {default})")


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
    writer: Writer, files: dict[str, dict[str, str]], *, item: _Caption, opts: CaptionOptions,
    signed: dict[str, bool], method_options: dict[str, dict[str, Any]], model: dict[str, Any],
) -> None:
    """``caption``'s write job: per method the figure and the maps, then the image's JSON."""
    from ..viz.caption import caption_figure

    key = item.key
    for name, maps in item.maps.items():
        rgb = caption_figure(
            item.region, item.tokens, maps, alpha=opts.alpha,
            colormap=opts.signed_colormap if signed[name] else opts.colormap,
            normalize="signed" if signed[name] else "minmax",
            tile_size=opts.tile_size or None,
        )
        entry = {"figure": f"{key}.{name}.png", "maps": f"{key}.{name}.npz"}
        writer.write(entry["figure"], encode_png(rgb))
        writer.write(entry["maps"], encode_npz(maps, item.tokens, item.ids))
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
    writer.write(rel, json_bytes(document, indent=2))
    files["caption"] = {"json": rel}


@with_threads
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

    Resume: as :func:`vitexplain.batch.export.export`: an image is skipped when an ``ok``
    record with the same source file (path, size, mtime) and the same settings (every option
    declared ``outputs=True``: model and its weights, methods and options, caption, max_len,
    crop, figure settings, amp) lists files that all exist; ``overwrite`` redoes it.

    Args:
        opts: what to do (see :class:`CaptionOptions`).
        argv: the command line, recorded in ``summary.json``.

    Returns:
        :class:`~vitexplain.batch.driver.ExportResult` (exit code 0, 1 when any image
        failed, 74 when the output folder could not be written).

    Raises:
        UsageError: bad options or inputs, or a model that is not a captioner, found before
            any output is written.
        KeyboardInterrupt: Ctrl-C or SIGTERM, after the summary is written.
    """
    t_start = time.perf_counter()
    from ..explainer import Explainer

    if opts.caption is not None and not opts.caption.strip():
        raise UsageError("--caption is empty; give the words to explain, or leave it out to generate")
    setup = prepare(opts)
    model, model_info = load_model(opts.model, device=setup.device)
    processor = getattr(model, "vx_processor", None)
    ex = Explainer(model, processor=processor) if processor is not None else Explainer(model)
    plan = plan_run(ex, opts.methods, opts.method_options, command="caption", model=opts.model)
    vlm = plan.family.name == "vlm"
    check_prompt(opts.prompt, plan.family.name, opts.model)
    methods = plan.names
    method_options = {s.name: dict(s.options) for s in plan.steps}
    signed = {s.name: s.spec.signed for s in plan.steps}
    per_method = {m: dict(method_options.get(m, {})) for m in methods}
    from ..adapters import preprocessing

    pre_kwargs = preprocessing(ex.adapter)
    if opts.caption is not None:
        try:
            if vlm:
                from ..vlm import check_answer  # (torch: not at the CLI's import)

                check_answer(ex.adapter, opts.caption)
            else:
                ex.adapter.encode_caption(opts.caption)
        except (KeyError, ValueError) as e:
            reason = e.args[0] if isinstance(e, KeyError) and e.args else e
            raise UsageError(f"--caption {opts.caption!r}: {reason}") from None

    what = f"the caption {opts.caption!r}" if opts.caption is not None else "generated captions"
    if vlm:  # whole images to the processor (no crop), maps per image at its resolution
        prompt_kw = {"prompt": opts.prompt}
        probe_vlm(lambda images: ex.explain_caption(images, method=methods, caption=opts.caption, max_len=opts.max_len,
                                                    **prompt_kw, **per_method),
                  f"{what} of this model with {', '.join(methods)}", pre_kwargs["input_size"])
    else:
        probe(lambda x: ex.explain_caption(x, method=methods, caption=opts.caption, max_len=opts.max_len, **per_method),
              f"{what} of this model with {', '.join(methods)}", setup, pre_kwargs)
        check_captioner_outputs(ex.adapter, setup.device, setup.autocast_dtype, pre_kwargs["input_size"])

    config, digest_ = config_hash(opts, {
        "command": "caption", "model": model_id(opts.model), "weights": zoo_weights_id(opts.model, model_info),
        "methods": methods, "method_options": method_options,
    })
    run = new_run("caption", dataclasses.replace(opts, crop=False) if vlm else opts, setup, pre_kwargs, digest_,
                  max_side=0 if vlm else opts.tile_size if opts.tile_size > 0 else 512)
    model_doc = {"name": opts.model, "source": model_info.get("source"), "input_size": list(pre_kwargs["input_size"])}
    generated = opts.caption is None
    paths = {it.key: it.path for it in run.items}

    @one_by_one_on_image_errors
    def process(x: "torch.Tensor", good: list[dict[str, Any]]) -> list[tuple[dict[str, Any], Any]]:
        results = ex.explain_caption(x, method=methods, caption=opts.caption, max_len=opts.max_len, **per_method)
        first = results[0]
        maps = {r.method: r.maps.float().cpu().numpy() for r in results}
        ids = first.ids.cpu().tolist()
        _, bad_maps = finite_rows(maps, None)
        jobs: list[tuple[dict[str, Any], Any]] = []
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
            error = empty_caption_error(s["key"], t, generated) or not_finite_error(s["key"], True, bad_maps[b])
            write = error or functools.partial(
                _write_caption, item=item, opts=opts, signed=signed, method_options=method_options, model=model_doc)
            jobs.append((fields, write))
        return jobs

    if vlm:
        process = vlm_process(  # noqa: F811  (the VLM's process replaces the captioners')
            ex, methods=methods, per_method=per_method, caption=opts.caption, prompt=opts.prompt,
            max_len=opts.max_len, generated=generated, paths=paths, make_item=_Caption,
            write=functools.partial(_write_caption, opts=opts, signed=signed, method_options=method_options,
                                    model=model_doc))

    def gallery(records: list[dict[str, Any]]) -> None:
        _write_caption_gallery(Writer(setup.out), records, methods, title=f"vitexplain caption: {opts.model}")

    fields = summary_fields(opts, argv, config, methods=methods,
                            model={**model_info, "family": plan.family.name, "input_size": list(pre_kwargs["input_size"])},
                            caption=opts.caption, prompt=opts.prompt, max_len=opts.max_len)
    return drive(run, Command(process=process, fields=fields, gallery=gallery if opts.html else None), t_start)


def _write_caption_gallery(writer: Writer, records: list[dict[str, Any]], methods: list[str], *, title: str) -> None:
    """The export gallery, one column per method showing the per-word figure; the caption is
    shown as the explained target."""
    from ..viz.gallery import render_gallery

    rows = []
    for r in records:
        files = r.get("files") or {}
        view = {**r, "files": {m: {"overlay": files[m]["figure"]} for m in methods
                               if isinstance(files.get(m), dict) and "figure" in files[m]}}
        if r.get("status") == "ok":
            view["target"] = {"label": r.get("caption", "")}
        rows.append(view)
    page = render_gallery(rows, folder=writer.out, methods=methods, title=title, thumb_px=480)
    writer.write(GALLERY, page.encode("utf-8", "replace"))
