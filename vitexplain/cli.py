"""The ``vitexplain`` command line.

::

    vitexplain export INPUT... --out DIR [--model NAME] [--method rollout,cdam] ...
    vitexplain caption INPUT... --out DIR [--model shapes-captioner] [--caption TEXT] ...
    vitexplain explore INPUT... --out page.html [--model NAME] [--method generic,cdam] ...
    vitexplain methods [--model NAME | --family vit|swin|cnn|caption]
    vitexplain models
    torchrun --nproc_per_node=N -m vitexplain export|caption ...   # one shard per process

Exit status: 0 success, 1 some images failed (the others were exported), 2 usage error
(bad flags, unknown model or method, ``--amp`` without CUDA, no inputs), 130 interrupted.

This module imports only the standard library at import time, so ``vitexplain --help`` is
quick; torch, timm and OpenCV are imported when a command runs.
"""

from __future__ import annotations

import argparse
import ast
import sys
from typing import Any, Optional, Sequence

__all__ = ["main", "build_parser"]

_PROG = "vitexplain"

_EXPORT_EPILOG = """\
outputs (OUT = --out; KEY = the input's path below the argument it was found under):
  OUT/KEY.METHOD.png    overlay on the region the model saw (signed methods: diverging colours)
  OUT/KEY.METHOD.npy    raw (gh, gw) float32 map, with --save-maps
  OUT/manifest.jsonl    one JSON line per image: input, size, top predictions, target, files or error
  OUT/summary.json      counts (ok/failed/skipped), timings, images/s, versions, arguments
  OUT/index.html        gallery, with --html

resume: rerunning the same command skips images whose outputs are complete and current
(same file size and mtime, same model/methods/target/crop/overlay settings); --overwrite redoes.

exit status: 0 ok, 1 some images failed (reported and skipped), 2 usage error, 130 interrupted.

A file name starting with '-' is read as an option: write ./-name.png, or put inputs after --.

examples:
  vitexplain export assets/samples --out maps --html
  vitexplain export 'photos/**/*.jpg' --out maps --model vit_small_patch16_224 \\
      --checkpoint vit_small.safetensors --method rollout,cdam,generic --device cuda --amp bf16
  torchrun --nproc_per_node=4 -m vitexplain export photos --out maps --device cuda
"""


_CAPTION_EPILOG = """\
outputs (OUT = --out; KEY = the input's path below the argument it was found under):
  OUT/KEY.METHOD.png    per-word figure: the region the model saw, then each word under its map
  OUT/KEY.METHOD.npz    per-word maps: maps (T, gh, gw) float32, tokens (T,) str, ids (T,) int64
  OUT/KEY.caption.json  caption, tokens, ids, generated or given, methods, options, files
                        (file names in the JSON's own folder); written last, after the maps
  OUT/manifest.jsonl    one JSON line per image: input, size, crop box, caption, tokens, files or error
  OUT/summary.json      counts (ok/failed/skipped), timings, images/s, versions, arguments
  OUT/index.html        gallery of the figures, with --html

captions: without --caption the model generates each image's caption (greedy, at most --max-len
tokens) and its words are explained; with --caption TEXT that caption is explained for every
image (teacher-forced); a word the model does not know is a usage error.

resume: rerunning the same command skips images whose outputs are complete and current
(same file size and mtime, same model/weights/methods/options/caption/max-len/crop/figure
settings); --overwrite redoes.

exit status: 0 ok, 1 some images failed (reported and skipped), 2 usage error (also: a model
that is not an image captioner; explain classifiers with `vitexplain export`), 130 interrupted.

A file name starting with '-' is read as an option: write ./-name.png, or put inputs after --.

examples:
  vitexplain caption assets/samples --out captions --html
  vitexplain caption photos --out red --caption "red circle" --method cross_generic
  vitexplain caption 'photos/**/*.png' --out captions --model my-captioner.json --option cross.layers=-1
"""


class _Parser(argparse.ArgumentParser):
    """argparse with errors that say where to look for help."""

    def error(self, message: str) -> Any:  # noqa: D401 - argparse API
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n(see `{self.prog} --help`)\n")


def _methods_arg(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected method names, e.g. rollout,cdam")
    return names


def _model_arg(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        parsed: Any = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value
    return key.strip(), parsed


def _option_arg(text: str) -> tuple[str, str, Any]:
    head, sep, value = text.partition("=")
    method, dot, key = head.partition(".")
    if not (sep and dot and method.strip() and key.strip()):
        raise argparse.ArgumentTypeError(f"expected METHOD.KEY=VALUE (e.g. rollout.discard_ratio=0.9), got {text!r}")
    try:
        parsed: Any = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value
    return method.strip(), key.strip(), parsed


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def _unit(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


_EXPLORE_EPILOG = """\
the page: one HTML file with its images, data, script and styles inline; it requests nothing
(open it from disk, mail it). Sizes: about 0.2 MB per 64 px shapes image, 4.7 MB per 224 px
ViT-S/16 image with every layer and head (see --attention-budget).

exit status: 0 ok, 1 some images could not be read (left out of the page), 2 usage error.

examples:
  vitexplain explore assets/samples --out explore.html
  vitexplain explore assets/samples --out words.html --model shapes-captioner
  vitexplain explore photo.jpg --out photo.html --model vit_small_patch16_224 --checkpoint vit_s.safetensors
"""


def _add_inputs(p: argparse.ArgumentParser) -> None:
    """INPUT... and --out (export, caption)."""
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="image files, folders (walked recursively) or glob patterns (quote them; ** recurses)")
    p.add_argument("--out", "-o", required=True, metavar="DIR", help="output folder (created; never an input folder)")


def _add_running(p: argparse.ArgumentParser, *, batch_size: int, what: str) -> None:
    """The "running" group (export, caption): batching, decoding, device, resume, output."""
    g = p.add_argument_group("running")
    g.add_argument("--batch-size", "-b", type=_positive, default=batch_size, metavar="N",
                   help=f"images per forward pass (default {batch_size})")
    g.add_argument("--workers", "-j", type=_non_negative, default=None, metavar="N",
                   help="DataLoader processes decoding images (default: min(4, CPUs - 1))")
    g.add_argument("--device", default="auto", metavar="DEV", help="auto (default), cpu, cuda or cuda:N")
    g.add_argument("--amp", choices=("bf16", "fp16"), help="CUDA autocast precision")
    g.add_argument("--write-threads", type=_positive, default=None, metavar="N",
                   help=f"threads drawing and writing {what} while the model runs (default: CPUs / 2, 2 to 8)")
    g.add_argument("--overwrite", action="store_true", help="redo images whose outputs are already current")
    g.add_argument("--quiet", "-q", action="store_true", help="no progress bar or final summary line")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``vitexplain`` (sub-commands export, caption, methods, models)."""
    from . import __version__

    parser = _Parser(
        prog=_PROG,
        description="Explain vision models: attention rollout, CDAM, Chefer relevance, Grad-CAM "
        "and more, as overlays for folders of images.",
        epilog="Run `vitexplain COMMAND --help` for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"vitexplain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    ex = sub.add_parser(
        "export",
        help="write saliency overlays (and maps, a manifest, a gallery) for images or folders",
        description="Explain every image under INPUT... and write one overlay per image and method.",
        epilog=_EXPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_inputs(ex)
    g = ex.add_argument_group("model")
    g.add_argument("--model", "-m", default="shapes-vit", metavar="NAME",
                   help="zoo model (see `vitexplain models`), timm model name, or a zoo checkpoint .json "
                        "(default: shapes-vit)")
    g.add_argument("--checkpoint", metavar="FILE",
                   help="weights for --model: .safetensors, or .pt/.pth (torch.load weights_only=True) "
                        "holding a state dict or {'state_dict'|'model': ...}")
    g.add_argument("--num-classes", type=_positive, metavar="N",
                   help="classes of a timm model (default: from the checkpoint's head)")
    g.add_argument("--model-arg", type=_model_arg, action="append", default=[], metavar="KEY=VALUE",
                   help="extra timm.create_model argument, e.g. img_size=64 (repeatable)")
    g.add_argument("--labels", metavar="FILE", help="text file with one class name per line")
    g = ex.add_argument_group("explanation")
    g.add_argument("--method", type=_methods_arg, action="append", metavar="M1,M2",
                   help="methods, comma separated or repeated (default: rollout,cdam for ViTs, gradcam "
                        "for CNNs; list them with `vitexplain methods --model NAME`)")
    g.add_argument("--option", type=_option_arg, action="append", default=[], metavar="METHOD.KEY=VALUE",
                   help="a method option, e.g. rollout.discard_ratio=0.9 or rollout.head_fusion=max (repeatable)")
    g.add_argument("--target", default="pred", metavar="pred|INDEX|LABEL",
                   help="class to explain: each image's top prediction (default), an index or a label name")
    g.add_argument("--no-crop", dest="crop", action="store_false",
                   help="resize whole images to the input size instead of resize + center crop")
    g = ex.add_argument_group("overlays")
    g.add_argument("--alpha", type=_unit, default=0.5, metavar="A", help="overlay opacity in [0, 1] (default 0.5)")
    g.add_argument("--colormap", default="jet", metavar="NAME", help="colormap of unsigned maps (default jet; any OpenCV name)")
    g.add_argument("--signed-colormap", default="bwr", metavar="NAME",
                   help="diverging colormap of signed maps such as cdam (default bwr, centred at zero)")
    g.add_argument("--max-side", type=_non_negative, default=512, metavar="PX",
                   help="draw overlays at most this many pixels on the longer side (default 512; 0: original size)")
    g.add_argument("--save-maps", action="store_true", help="also write each raw map as .npy")
    g.add_argument("--topk", type=_non_negative, default=5, metavar="K", help="predictions recorded per image (default 5)")
    g.add_argument("--html", action="store_true", help="write an index.html gallery")
    _add_running(ex, batch_size=32, what="overlays")

    ca = sub.add_parser(
        "caption",
        help="caption images and write per-word maps and figures (image captioners)",
        description="Caption every image under INPUT... (or explain a given caption) and write, per\n"
        "image and method, a per-word figure and the per-word maps, plus a JSON with the caption.",
        epilog=_CAPTION_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_inputs(ca)
    g = ca.add_argument_group("model")
    g.add_argument("--model", "-m", default="shapes-captioner", metavar="NAME",
                   help="zoo captioner (see `vitexplain models`) or a zoo checkpoint .json (default: shapes-captioner)")
    g = ca.add_argument_group("explanation")
    g.add_argument("--method", type=_methods_arg, action="append", metavar="M1,M2",
                   help="caption methods, comma separated or repeated (default: cross,cross_generic; "
                        "list them with `vitexplain methods --family caption`)")
    g.add_argument("--option", type=_option_arg, action="append", default=[], metavar="METHOD.KEY=VALUE",
                   help="a method option, e.g. cross.layers=-1 or cross.head_fusion=max (repeatable)")
    g.add_argument("--caption", metavar="TEXT",
                   help="explain this caption (teacher-forced) for every image instead of generating one")
    g.add_argument("--max-len", type=_positive, default=16, metavar="N",
                   help="most tokens to generate (default 16; the model's own limit applies too)")
    g.add_argument("--no-crop", dest="crop", action="store_false",
                   help="resize whole images to the input size instead of resize + center crop")
    g = ca.add_argument_group("figures")
    g.add_argument("--alpha", type=_unit, default=0.5, metavar="A", help="overlay opacity in [0, 1] (default 0.5)")
    g.add_argument("--colormap", default="jet", metavar="NAME", help="colormap of the maps (default jet; any OpenCV name)")
    g.add_argument("--tile-size", type=_non_negative, default=160, metavar="PX",
                   help="side of each tile of the figures (default 160; 0: the image's size, at most 512)")
    g.add_argument("--html", action="store_true", help="write an index.html gallery of the figures")
    _add_running(ca, batch_size=16, what="figures")

    xp = sub.add_parser(
        "explore",
        help="write one self-contained interactive HTML page exploring the images (attention per layer and "
             "head, rollout rows, methods per class, captions word by word)",
        description="Explain every image under INPUT... and write one interactive page that needs nothing\n"
        "else (open it from disk): per image the top predictions, one tab per method, and for ViTs the\n"
        "attention of any patch or [CLS]/register token per layer and head, its rollout row and the\n"
        "attention matrix; for captioners each word's map and the word x patch alignment.",
        epilog=_EXPLORE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    xp.add_argument("inputs", nargs="+", metavar="INPUT",
                    help="image files, folders (walked recursively) or glob patterns (quote them; ** recurses)")
    xp.add_argument("--out", "-o", required=True, metavar="PAGE.html", help="the HTML file to write")
    g = xp.add_argument_group("model")
    g.add_argument("--model", "-m", default="shapes-vit", metavar="NAME",
                   help="zoo model (see `vitexplain models`), timm model name, or a zoo checkpoint .json "
                        "(default: shapes-vit)")
    g.add_argument("--checkpoint", metavar="FILE", help="weights for a timm --model (.safetensors, .pt, .pth)")
    g.add_argument("--num-classes", type=_positive, metavar="N", help="classes of a timm model")
    g.add_argument("--model-arg", type=_model_arg, action="append", default=[], metavar="KEY=VALUE",
                   help="extra timm.create_model argument (repeatable)")
    g.add_argument("--labels", metavar="FILE", help="text file with one class name per line")
    g = xp.add_argument_group("page")
    g.add_argument("--method", type=_methods_arg, action="append", metavar="M1,M2",
                   help="methods, one tab each (default: generic,grad_rollout,cdam,gradcam,rollout for ViTs; "
                        "gradcam,layercam,gradcam++,spatial,channel for CNNs; cross,cross_generic for captioners)")
    g.add_argument("--option", type=_option_arg, action="append", default=[], metavar="METHOD.KEY=VALUE",
                   help="a method option, e.g. rollout.head_fusion=max (repeatable)")
    g.add_argument("--top-k", type=_positive, default=3, metavar="K",
                   help="classes offered for class-discriminative methods (default 3)")
    g.add_argument("--target", default="pred", metavar="pred|INDEX|LABEL",
                   help="explain the top-k classes (pred, default) or this one class")
    g.add_argument("--max-images", type=_positive, default=50, metavar="N",
                   help="refuse more images than this (default 50: the page embeds every image's data)")
    g.add_argument("--attention-budget", type=_positive_float, default=5.0, metavar="MB",
                   help="most MB of attention data per image; past it fewer layers, then only the head mean, "
                        "are embedded (default 5)")
    g.add_argument("--max-len", type=_positive, default=16, metavar="N", help="longest caption generated (default 16)")
    g.add_argument("--title", metavar="TEXT", help="page title")
    g.add_argument("--device", default="auto", metavar="DEV", help="auto (default), cpu, cuda or cuda:N")
    g.add_argument("--quiet", "-q", action="store_true", help="no summary line")

    me = sub.add_parser("methods", help="list explanation methods (per model family, or for a model)",
                        description="List the explanation methods, with a one-line summary each.")
    which = me.add_mutually_exclusive_group()
    which.add_argument("--model", "-m", metavar="NAME", help="only the methods that apply to this model")
    which.add_argument("--family", choices=("vit", "swin", "cnn", "caption"), help="only this model family")

    sub.add_parser("models", help="list the bundled zoo models", description="List the bundled zoo models.")
    return parser


def _default_workers() -> int:
    import os

    return max(0, min(4, (os.cpu_count() or 1) - 1))


def _methods_of(args: argparse.Namespace) -> Optional[list[str]]:
    """--method values, flattened (None when not given)."""
    return [m for group in args.method for m in group] if args.method else None


def _method_options_of(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """--option METHOD.KEY=VALUE values as {method: {key: value}}."""
    method_options: dict[str, dict[str, Any]] = {}
    for method, key, value in args.option:
        method_options.setdefault(method, {})[key] = value
    return method_options


def _report(result: Any, quiet: bool, done: str) -> int:
    """Print the one-line summary of an export/caption run; returns its exit status."""
    s = result.summary
    if not quiet and "counts" in s:
        c, t = s["counts"], s["timings"]
        rate = f", {t['images_per_s']:.1f} images/s" if t.get("images_per_s") else ""
        print(
            f"vitexplain: {c['images']} images: {c['ok']} {done}, {c['skipped']} up to date (skipped), "
            f"{c['failed']} failed{rate} -> {result.out}",
            file=sys.stderr,
        )
    return int(result.exit_code)


def _cmd_export(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from .export import ExportOptions, export

    methods = _methods_of(args)
    method_options = _method_options_of(args)
    opts = ExportOptions(
        inputs=list(args.inputs), out=args.out, model=args.model, checkpoint=args.checkpoint,
        num_classes=args.num_classes, model_args=dict(args.model_arg), labels=args.labels,
        methods=methods, method_options=method_options, target=args.target, batch_size=args.batch_size,
        workers=_default_workers() if args.workers is None else args.workers, device=args.device,
        amp=args.amp, crop=args.crop, alpha=args.alpha, colormap=args.colormap,
        signed_colormap=args.signed_colormap, max_side=args.max_side, topk=args.topk,
        save_maps=args.save_maps, html=args.html, overwrite=args.overwrite, quiet=args.quiet,
    )
    if args.write_threads is not None:
        opts.write_threads = args.write_threads
    return _report(export(opts, argv=list(argv)), args.quiet, "exported")


def _cmd_caption(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from .caption_export import CaptionOptions, export_captions

    opts = CaptionOptions(
        inputs=list(args.inputs), out=args.out, model=args.model, methods=_methods_of(args),
        method_options=_method_options_of(args), caption=args.caption, max_len=args.max_len,
        batch_size=args.batch_size, workers=_default_workers() if args.workers is None else args.workers,
        device=args.device, amp=args.amp, crop=args.crop, alpha=args.alpha, colormap=args.colormap,
        tile_size=args.tile_size, html=args.html, overwrite=args.overwrite, quiet=args.quiet,
    )
    if args.write_threads is not None:
        opts.write_threads = args.write_threads
    return _report(export_captions(opts, argv=list(argv)), args.quiet, "captioned")


def _cmd_explore(args: argparse.Namespace) -> int:
    from .explorer.command import ExploreOptions, explore_inputs

    return explore_inputs(ExploreOptions(
        inputs=list(args.inputs), out=args.out, model=args.model, checkpoint=args.checkpoint,
        num_classes=args.num_classes, model_args=dict(args.model_arg), labels=args.labels,
        methods=_methods_of(args), method_options=_method_options_of(args), top_k=args.top_k, target=args.target,
        max_images=args.max_images, title=args.title, attention_budget_mb=args.attention_budget,
        max_len=args.max_len, device=args.device, quiet=args.quiet,
    ))


def _family_of_model(name: str) -> str:
    from .export import load_model
    from .adapters import adapter_for

    model, _ = load_model(name, device="cpu")
    return adapter_for(model).family


def _options_of(fn: Any) -> str:
    """``name=default, ...`` of a method function's keyword options (for --option)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # pragma: no cover
        return ""
    return ", ".join(
        f"{p.name}={p.default!r}" for p in params
        if p.kind is p.KEYWORD_ONLY and p.default is not p.empty
    )


def _cmd_methods(args: argparse.Namespace) -> int:
    from .methods import registry

    families = list(registry.FAMILIES)
    header = ""
    if args.family:
        families = [args.family]
    elif args.model:
        family = _family_of_model(args.model)
        families = [family]
        header = f"{args.model} is a {family} model.\n"
    out = [header] if header else []
    for family in families:
        specs = registry.specs(family)
        out.append(f"{family} methods:" if specs else f"{family} methods: (none registered)")
        width = max((len(s.name) for s in specs), default=0)
        for s in specs:
            tag = " [signed]" if s.signed and "signed" not in s.summary else ""
            out.append(f"  {s.name.ljust(width)}  {s.summary}{tag}")
            options = _options_of(s.fn)
            if options:
                out.append(f"  {''.ljust(width)}  options: {options}")
        out.append("")
    print("\n".join(out).rstrip())
    return 0


def _cmd_models() -> int:
    from . import zoo

    lines = ["Bundled zoo models (offline):"]
    for name in zoo.names():
        try:
            info = zoo.info(name)
            metrics = info.get("metrics") or {}
            detail = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in list(metrics.items())[:3])
            params = info.get("num_params")
            desc = f"{info.get('arch', '?')}, {params:,} params" if isinstance(params, int) else info.get("arch", "?")
            lines.append(f"  {name:<18} {desc}{'; ' + detail if detail else ''}")
        except (FileNotFoundError, OSError, ValueError, KeyError):
            lines.append(f"  {name:<18} (weights not installed)")
    lines.append("Any timm model name also works with --checkpoint FILE (and --num-classes, --model-arg).")
    print("\n".join(lines))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it).

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, argparse errors (status 2)
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    if args.command is None:
        parser.print_help()
        return 2
    from .export import UsageError

    try:
        if args.command == "export":
            return _cmd_export(args, argv)
        if args.command == "caption":
            return _cmd_caption(args, argv)
        if args.command == "explore":
            return _cmd_explore(args)
        if args.command == "methods":
            return _cmd_methods(args)
        if args.command == "models":
            return _cmd_models()
    except UsageError as e:
        print(f"{_PROG} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{_PROG}: interrupted", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
