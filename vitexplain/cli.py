"""The ``vitexplain`` command line.

::

    vitexplain export INPUT... --out DIR [--model NAME] [--method rollout,cdam] ...
    vitexplain caption INPUT... --out DIR [--model shapes-captioner] [--caption TEXT] ...
    vitexplain explore INPUT... --out page.html [--model NAME] [--method generic,cdam] ...
    vitexplain methods [--model NAME | --family vit|swin|cnn|caption]
    vitexplain models
    torchrun --nproc_per_node=N -m vitexplain export|caption ...   # one shard per process

Exit status (export, caption): see :data:`EXIT_STATUS` (0 ok, 1 some images failed, 2 usage
error, 74 the output folder could not be written, 130 interrupted, 143 terminated).

The flags of ``export`` and ``caption`` are derived from their options dataclasses
(:mod:`vitexplain.batch.options`). This module imports only the standard library and
:mod:`vitexplain.batch`'s light modules at import time, so ``vitexplain --help`` is quick;
torch, timm and OpenCV are imported when a command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn, Optional, Sequence

__all__ = ["main", "run", "build_parser", "EXIT_STATUS"]

_PROG = "vitexplain"

#: The exit status of ``export`` and ``caption`` (shown in their --help and docs/batch.md).
EXIT_STATUS = """\
exit status:
  0    every image done (or already current)
  1    some images or input folders failed: reported on stderr and in the manifest; the others were done
  2    usage error: bad flags or values, unknown model or method, an input inside --out, an --out
       that is not writable or is in use by another run; nothing was written
  74   the output folder could not be written during the run (full disk, I/O error): the run stopped;
       finished images are recorded and summary.json says what was done; rerun to resume
  130  interrupted (Ctrl-C)    143  terminated (SIGTERM): finished images are recorded, summary.json
       is written; rerun the same command to resume
"""

_EXPORT_GROUPS = {"model": "model", "explanation": "explanation", "overlays": "overlays", "running": "running"}
_CAPTION_GROUPS = {"model": "model", "explanation": "explanation", "overlays": "figures", "running": "running"}

_EXPORT_EPILOG = """\
outputs (OUT = --out; KEY = the input's path below the argument it was found under):
  OUT/KEY.METHOD.png    overlay on the region the model saw (signed methods: diverging colours)
  OUT/KEY.METHOD.npy    raw (gh, gw) float32 map, with --save-maps
  OUT/manifest.jsonl    one JSON line per image: input, size, top predictions, target, files or error
  OUT/summary.json      counts (ok/failed/skipped), timings, images/s, versions, arguments
  OUT/index.html        gallery, with --html

resume: rerunning the same command skips images whose outputs are complete and current
(same file size and mtime, same model/methods/target/crop/overlay settings); --overwrite redoes.
One run at a time per --out (a second one is refused while the first runs).

""" + EXIT_STATUS + """

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

""" + EXIT_STATUS + """\
  (usage errors include a model that is not an image captioner: explain classifiers with
  `vitexplain export`)

A file name starting with '-' is read as an option: write ./-name.png, or put inputs after --.

examples:
  vitexplain caption assets/samples --out captions --html
  vitexplain caption photos --out red --caption "red circle" --method cross_generic
  vitexplain caption 'photos/**/*.png' --out captions --model my-captioner.json --option cross.layers=-1
"""


_EXPLORE_EPILOG = """\
the page: one HTML file with its images, data, script and styles inline; it requests nothing
(open it from disk, mail it). Sizes: about 0.2 MB per 64 px shapes image, 4.7 MB per 224 px
ViT-S/16 image with every layer and head (see --attention-budget).

exit status: 0 ok; 1 some images or folders could not be read, or an image is too thin to
center-crop (each reported and left out of the page); 2 usage error (including an --out that
cannot be written, checked before the model loads); 74 the page could not be written (full disk).

examples:
  vitexplain explore assets/samples --out explore.html
  vitexplain explore assets/samples --out words.html --model shapes-captioner
  vitexplain explore photo.jpg --out photo.html --model vit_small_patch16_224 --checkpoint vit_s.safetensors
"""


class _StderrOrNothing:
    """``sys.stderr`` while a command runs: what cannot be written is dropped. A reader that went
    away (``vitexplain export ... 2>&1 | head``: EPIPE) or a terminal that closed (EIO) must not stop
    a run whose results go to files; the progress bar and messages are lost, the run goes on."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except (OSError, ValueError):  # (ValueError: the stream was closed)
                self.broken = True
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self.broken = True

    def __getattr__(self, name: str) -> Any:  # isatty, encoding, fileno, ... of the real stream
        return getattr(self._stream, name)


#: Warnings whose text differs batch by batch (it names positions in the batch) said once per run, with where a run
#: keeps each image's figure instead
_ONCE_PER_RUN = {
    "ConvergenceWarning": "said once per run, for its first batch; each image's completeness_error and steps are in "
                          "manifest.jsonl; with the CLI, more steps are --option integrated_gradients.steps=N",
}


def _warn_once(seen: set[tuple[str, str]]) -> Any:
    """A ``warnings.showwarning`` printing each distinct warning once, as ``vitexplain: warning: ...``.

    Python's own shows a warning once per code line only until a ``warnings.catch_warnings`` block
    resets its registry, which the library's calls do: a run printed the same warning, with the
    package's file, line and source, once per batch.
    """

    def show(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        once = category.__name__ in _ONCE_PER_RUN
        key = (category.__name__, "" if once else str(message))
        if key in seen:
            return
        seen.add(key)
        text = f"{message} ({_ONCE_PER_RUN[category.__name__]})" if once else str(message)
        try:
            print(f"{_PROG}: warning: {category.__name__}: {text}", file=file or sys.stderr)
        except (OSError, ValueError):
            pass

    return show


class _Parser(argparse.ArgumentParser):
    """argparse with errors that say where to look for help."""

    def error(self, message: str) -> Any:  # noqa: D401 - argparse API
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n(see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``vitexplain`` (sub-commands export, caption, explore, methods, models)."""
    from . import __version__
    from .batch.caption import CaptionOptions
    from .batch.explore import GROUPS as EXPLORE_GROUPS, ExploreOptions
    from .batch.export import ExportOptions
    from .batch.options import add_arguments

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
    add_arguments(ex, ExportOptions, _EXPORT_GROUPS)

    ca = sub.add_parser(
        "caption",
        help="caption images and write per-word maps and figures (image captioners)",
        description="Caption every image under INPUT... (or explain a given caption) and write, per\n"
        "image and method, a per-word figure and the per-word maps, plus a JSON with the caption.",
        epilog=_CAPTION_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(ca, CaptionOptions, _CAPTION_GROUPS)

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
    add_arguments(xp, ExploreOptions, EXPLORE_GROUPS)

    me = sub.add_parser("methods", help="list explanation methods (per model family, or for a model)",
                        description="List the explanation methods, with a one-line summary each.")
    which = me.add_mutually_exclusive_group()
    which.add_argument("--model", "-m", metavar="NAME", help="only the methods that apply to this model")
    which.add_argument("--family", metavar="NAME", help="only this model family (vit, swin, cnn, caption, ...)")

    sub.add_parser("models", help="list the bundled zoo models", description="List the bundled zoo models.")
    return parser


def _report(result: Any, quiet: bool, done: str) -> int:
    """Print the one-line summary of an export/caption run; returns its exit status."""
    s = result.summary
    if not quiet and "counts" in s:
        c, t = s["counts"], s["timings"]
        rate = f", {t['images_per_s']:.1f} images/s" if t.get("images_per_s") else ""
        folders = f", {c['unreadable_folders']} folders unreadable" if c.get("unreadable_folders") else ""
        print(
            f"vitexplain: {c['images']} images: {c['ok']} {done}, {c['skipped']} up to date (skipped), "
            f"{c['failed']} failed{folders}{rate} -> {result.out}",
            file=sys.stderr,
        )
    return int(result.exit_code)


def _cmd_export(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from .batch.export import ExportOptions, export
    from .batch.options import from_args

    return _report(export(from_args(ExportOptions, args), argv=list(argv)), args.quiet, "exported")


def _cmd_caption(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from .batch.caption import CaptionOptions, export_captions
    from .batch.options import from_args

    return _report(export_captions(from_args(CaptionOptions, args), argv=list(argv)), args.quiet, "captioned")


def _cmd_explore(args: argparse.Namespace) -> int:
    from .batch.explore import ExploreOptions, explore_inputs
    from .batch.options import from_args

    return explore_inputs(from_args(ExploreOptions, args))


def _cmd_methods(args: argparse.Namespace) -> int:
    """``vitexplain methods``: every family's methods; ``--family`` one family's; ``--model`` what the
    model's plan says applies to it (and why the others do not)."""
    from .errors import UsageError
    from .methods import families, family
    from .plan import applicable, describe_family, describe_model

    for flag, value in (("--model", args.model), ("--family", args.family)):
        if value is not None and not value.strip():  # `--model "$UNSET"` is not `methods` alone
            raise UsageError(f"{flag} is empty; name a {flag[2:]}, or leave {flag} out to list every method")
    if args.model:
        from .batch.models import load_model
        from .explainer import Explainer

        model, _ = load_model(args.model, device="cpu")
        adapter = Explainer(model).adapter
        available, refused = applicable(adapter)
        print(describe_model(adapter.family, args.model, available, refused))
        return 0
    chosen = [family(args.family)] if args.family else list(families())
    print("\n\n".join(describe_family(f) for f in chosen))
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
    try:
        parser = build_parser()  # (imports the batch options: Ctrl-C may come while it does)
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, argparse errors (status 2)
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    except KeyboardInterrupt:
        print(f"{_PROG}: interrupted", file=sys.stderr)
        return 130  # (batch.run.EXIT_INTERRUPTED, not imported yet)
    if args.command is None:
        parser.print_help()
        return 2
    import warnings

    stderr = sys.stderr
    sys.stderr = _StderrOrNothing(stderr)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warn_once(set())
            return _dispatch(parser, args, argv)
    finally:
        sys.stderr = stderr


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run the parsed command; returns the exit status (usage errors and interrupts included)."""
    from .batch.driver import EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_USAGE, Interrupted, signals_as_interrupts
    from .errors import UsageError

    try:
        with signals_as_interrupts():  # SIGTERM ends a run like Ctrl-C (summary written)
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
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Interrupted) and e.signum != 2
        print(f"{_PROG}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    return 2  # pragma: no cover


def run(argv: Optional[Sequence[str]] = None) -> NoReturn:
    """The console script and ``python -m vitexplain``: :func:`main`, then exit at once.

    Python's own shutdown with torch, timm and OpenCV loaded takes one to several seconds (a
    final garbage collection over the whole heap), which made Ctrl-C and every finished run
    linger. By the time :func:`main` returns every output file is written, fsync'ed and
    closed, so the process flushes its streams and leaves without that teardown.
    """
    code = main(argv)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    run()
