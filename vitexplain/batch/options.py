"""The options base of the batch commands: one declaration per option.

Each field of a command's options dataclass (:class:`BatchOptions` and its subclasses
:class:`vitexplain.batch.export.ExportOptions`, :class:`vitexplain.batch.caption.CaptionOptions`)
is declared with :func:`option`, which records beside its default:

- its command-line flag(s), help text, group, metavar and parser (``vitexplain/cli.py`` builds
  the argparse flags from these: :func:`add_arguments`, :func:`from_args`);
- whether it changes the files written (``outputs=True``): those fields, and only those, make
  up the settings digest of the resume rule (:func:`output_settings`);
- its validity check, shared by the command line (an argparse error) and the Python API
  (:func:`validate` raises :class:`~vitexplain.errors.UsageError`).

So a new output option is one field with ``outputs=True``: it gets its flag, its help and
its place in the resume key from that line. An option several commands share is declared once
in :class:`SharedOptions` (or :class:`BatchOptions`) and taken field for field with :func:`same`.

Standard library only (``vitexplain --help`` stays quick).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, dataclass, field
from typing import Any, Callable, Iterator, Optional

from ..errors import UsageError
from .option_values import (NON_NEGATIVE, POSITIVE, UNIT, Number, collect_dict, collect_method_options, collect_methods,
                            default_threads, default_workers, default_write_threads, parse_key_value, parse_method_option,
                            parse_methods)

__all__ = [
    "Opt",
    "option",
    "BatchOptions",
    "SharedOptions",
    "same",
    "specs",
    "add_arguments",
    "from_args",
    "output_settings",
    "validate",
]


@dataclass(frozen=True)
class Opt:
    """How one option appears on the command line and whether it changes the outputs.

    Attributes:
        flags: ``("--batch-size", "-b")``; empty for the positional ``INPUT...``.
        help: help text; ``{default}`` is replaced by the field's default.
        outputs: the option changes the files written (part of the resume settings digest).
        group: argparse group title (``None``: the command's main arguments).
        metavar: argparse metavar.
        parse: argparse ``type`` (parses and validates one value).
        action: argparse action (``"store_true"``, ``"store_false"``, ``"append"``).
        choices: allowed values.
        collect: turns the parsed argparse value into the option value (e.g. a list of
            ``KEY=VALUE`` pairs into a dict); ``None`` when the argument was not given
            keeps the dataclass default.
        cli_default: a function giving the command line's default when it differs from
            the Python API's (e.g. DataLoader workers), called when the flag is not given.
        required: argparse ``required``.
    """

    flags: tuple[str, ...]
    help: str
    outputs: bool = False
    group: Optional[str] = None
    metavar: Optional[str] = None
    parse: Optional[Callable[[str], Any]] = None
    action: Optional[str] = None
    choices: Optional[tuple[Any, ...]] = None
    collect: Optional[Callable[[Any], Any]] = None
    cli_default: Optional[Callable[[], Any]] = None
    required: bool = False


def option(default: Any = MISSING, *, factory: Any = MISSING, **spec: Any) -> Any:
    """A dataclass field carrying its :class:`Opt` (see the module docstring).

    Args:
        default: the Python API default (omit for required fields).
        factory: a default factory instead of ``default``.
        **spec: :class:`Opt` attributes (``flags`` may be one string; ``parse`` defaults to
            :class:`~vitexplain.batch.option_values.Number` of the default's type for an int or float default).
    """
    flags = spec.pop("flags", ())
    spec["flags"] = (flags,) if isinstance(flags, str) else tuple(flags)
    if spec.get("parse") is None and spec.get("action") is None and type(default) in (int, float):
        spec["parse"] = Number(type(default))  # a number's flag parses as one
    meta = {"vx": Opt(**spec)}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class BatchOptions:
    """What every batch command shares (the CLI flags, one to one).

    Attributes:
        inputs: files, folders (walked recursively) and glob patterns.
        out: output folder (created; never an input folder, and no input may lie inside it).
        model: the model (see each command).
        methods: method names; None uses the command's defaults.
        method_options: per method, keyword options (e.g. ``{"rollout": {"discard_ratio": 0.9}}``),
            checked against each method's declared options and ranges.
        crop: resize + center-crop like the model's eval transform (False: resize only).
        alpha: overlay opacity in [0, 1].
        colormap: colormap of unsigned maps.
        signed_colormap: colormap of signed maps (diverging, centred at zero).
        html: write ``index.html``.
        batch_size: images per forward pass.
        workers: DataLoader worker processes decoding and preprocessing (0: in the main process).
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        amp: ``None``, ``"bf16"`` or ``"fp16"`` (CUDA autocast).
        write_threads: threads drawing and writing files while the model runs.
        threads: torch intra-op threads during the run (restored after it); None leaves torch's
            setting (the command line's default: :func:`vitexplain.threads.default_for_cli`).
        overwrite: redo images whose outputs are already complete and current.
        quiet: no progress bar and no final summary line (errors are still printed).
    """

    inputs: list[str] = option(flags=(), metavar="INPUT",
                               help="image files, folders (walked recursively) or glob patterns (quote them; ** recurses)")
    out: str = option(flags=("--out", "-o"), metavar="DIR", required=True,
                      help="output folder (created; never an input folder, and no input may lie inside it)")
    model: str = option("shapes-vit", flags=("--model", "-m"), metavar="NAME", group="model", outputs=True,
                        help="the model (default: {default})")
    methods: Optional[list[str]] = option(
        None, flags="--method", metavar="M1,M2", group="explanation", outputs=True, action="append",
        parse=parse_methods, collect=collect_methods, help="methods, comma separated or repeated")
    method_options: dict[str, dict[str, Any]] = option(
        factory=dict, flags="--option", metavar="METHOD.KEY=VALUE", group="explanation", outputs=True,
        action="append", parse=parse_method_option, collect=collect_method_options,
        help="a method option, e.g. rollout.discard_ratio=0.9 or cross.layers=-1 (repeatable; checked "
             "against the method's declared options and ranges, see `vitexplain methods`)")
    crop: bool = option(True, flags="--no-crop", action="store_false", group="explanation", outputs=True,
                        help="resize whole images to the input size instead of resize + center crop")
    alpha: float = option(0.5, flags="--alpha", metavar="A", parse=UNIT, group="overlays", outputs=True,
                          help="overlay opacity in [0, 1] (default {default})")
    colormap: str = option("jet", flags="--colormap", metavar="NAME", group="overlays", outputs=True,
                           help="colormap of unsigned maps (default {default}; any OpenCV name)")
    signed_colormap: str = option("bwr", flags="--signed-colormap", metavar="NAME", group="overlays",
                                  outputs=True,
                                  help="diverging colormap of signed maps such as cdam (default {default}, "
                                       "centred at zero)")
    html: bool = option(False, flags="--html", action="store_true", group="overlays",
                        help="write an index.html gallery")
    batch_size: int = option(32, flags=("--batch-size", "-b"), metavar="N", parse=POSITIVE, group="running",
                             help="images per forward pass (default {default})")
    workers: int = option(0, flags=("--workers", "-j"), metavar="N", parse=NON_NEGATIVE, group="running",
                          cli_default=default_workers,
                          help="DataLoader processes decoding images (default: min(4, CPUs - 1))")
    device: str = option("auto", flags="--device", metavar="DEV", group="running",
                         help="auto (default), cpu, cuda or cuda:N")
    amp: Optional[str] = option(None, flags="--amp", choices=("bf16", "fp16"), group="running", outputs=True,
                                help="CUDA autocast precision")
    write_threads: int = option(factory=default_write_threads, flags="--write-threads", metavar="N",
                                parse=POSITIVE, group="running",
                                help="threads drawing and writing files while the model runs "
                                     "(default: CPUs / 2, 2 to 8)")
    threads: Optional[int] = option(None, flags="--threads", metavar="N", parse=POSITIVE, group="running",
                                    cli_default=default_threads,
                                    help="torch threads while the model runs (default: the CPUs that other jobs "
                                         "leave idle (CPUs less the load average, at least 1), or OMP_NUM_THREADS "
                                         "when set: threads on busy cores only wait)")
    overwrite: bool = option(False, flags="--overwrite", action="store_true", group="running",
                             help="redo images whose outputs are already current")
    quiet: bool = option(False, flags=("--quiet", "-q"), action="store_true", group="running",
                         help="no progress bar or final summary line")


@dataclass
class SharedOptions:
    """Declarations that several commands share, field for field (not a command's options).

    A command takes one with :func:`same` (``checkpoint: Optional[str] = same(SharedOptions,
    "checkpoint")``), so each option is declared once and no command module imports another.

    Attributes:
        model: a zoo name, a timm model name (random weights unless ``checkpoint``), or the
            path of a zoo-format checkpoint ``.json`` (``export``, ``explore``).
        checkpoint, num_classes, model_args, labels: the classifier's weights, classes, extra
            ``timm.create_model`` arguments and label names.
        max_len: most tokens a captioner generates (``caption``, ``explore``).
    """

    model: str = option("shapes-vit", flags=("--model", "-m"), metavar="NAME", group="model", outputs=True,
                        help="zoo model (see `vitexplain models`), timm model name, a zoo checkpoint .json, or a "
                             "folder holding a Hugging Face image classifier (save_pretrained) (default: {default})")
    checkpoint: Optional[str] = option(None, flags="--checkpoint", metavar="FILE", group="model", outputs=True,
                                       help="weights for --model: .safetensors, or .pt/.pth (torch.load "
                                            "weights_only=True) holding a state dict or {'state_dict'|'model': ...}")
    num_classes: Optional[int] = option(None, flags="--num-classes", metavar="N", parse=POSITIVE, group="model",
                                        outputs=True, help="classes of a timm model (default: from the checkpoint's head)")
    model_args: dict[str, Any] = option(factory=dict, flags="--model-arg", metavar="KEY=VALUE", group="model",
                                        outputs=True, action="append", parse=parse_key_value, collect=collect_dict,
                                        help="extra timm.create_model argument, e.g. img_size=64 (repeatable)")
    labels: Optional[str] = option(None, flags="--labels", metavar="FILE", group="model", outputs=True,
                                   help="text file with one class name per line")
    max_len: int = option(16, flags="--max-len", metavar="N", parse=POSITIVE, group="explanation", outputs=True,
                          help="most tokens to generate (default {default}; the model's own limit applies too)")


def same(cls: type, name: str) -> Any:
    """A field declared exactly as ``cls``'s option ``name`` (flag, help, check, default)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return field(default_factory=f.default_factory, metadata=f.metadata)  # type: ignore[misc]
    return field(default=f.default, metadata=f.metadata)


def specs(cls: type) -> Iterator[tuple[dataclasses.Field, Opt]]:
    """``(field, Opt)`` of every declared option of an options dataclass, in field order."""
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("vx")
        if spec is not None:
            yield f, spec


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def add_arguments(parser: argparse.ArgumentParser, cls: type, groups: dict[str, str]) -> None:
    """Add the flags of an options dataclass to a parser.

    Args:
        parser: the command's (sub)parser.
        cls: the options dataclass.
        groups: argparse group title per :attr:`Opt.group` key, in display order.
    """
    made: dict[str, Any] = {}
    for key, title in groups.items():
        made[key] = parser.add_argument_group(title)
    for f, spec in specs(cls):
        target = made[spec.group] if spec.group else parser
        kwargs: dict[str, Any] = {"help": spec.help.replace("{default}", str(_default_of(f)))}
        if spec.action in ("store_true", "store_false"):
            kwargs.update(action=spec.action, dest=f.name)
        else:
            if spec.action:
                kwargs["action"] = spec.action
            if spec.metavar:
                kwargs["metavar"] = spec.metavar
            if spec.parse:
                kwargs["type"] = spec.parse
            if spec.choices:
                kwargs["choices"] = spec.choices
        if not spec.flags:  # positional INPUT...
            target.add_argument(f.name, nargs="+", **kwargs)
            continue
        if spec.required:
            kwargs["required"] = True
        kwargs.setdefault("dest", f.name)
        if spec.action not in ("store_true", "store_false"):
            kwargs["default"] = None  # "not given": the dataclass (or cli_default) decides
        target.add_argument(*spec.flags, **kwargs)


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """Build an options dataclass from parsed arguments (flags not given keep their defaults)."""
    values: dict[str, Any] = {}
    for f, spec in specs(cls):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if spec.action in ("store_true", "store_false"):
            values[f.name] = value
            continue
        if spec.collect is not None:
            value = spec.collect(value)
        if value is None and spec.cli_default is not None:
            value = spec.cli_default()
        if value is not None:
            values[f.name] = list(value) if not spec.flags else value
    return cls(**values)


def output_settings(opts: Any) -> dict[str, Any]:
    """``{name: value}`` of every option that changes the files written (the resume key)."""
    return {f.name: getattr(opts, f.name) for f, spec in specs(type(opts)) if spec.outputs}


def validate(opts: Any) -> None:
    """Check every option with a declared range (the Python API's counterpart of argparse).

    Raises:
        UsageError: naming the flag, the rule and the value.
    """
    for f, spec in specs(type(opts)):
        check = spec.parse if isinstance(spec.parse, Number) else None
        value = getattr(opts, f.name)
        if check is not None and value is not None:
            problem = check.problem(value)
            if problem:
                raise UsageError(f"{spec.flags[0] if spec.flags else f.name}: {problem}")
        if spec.choices and value is not None and value not in spec.choices:
            raise UsageError(f"{spec.flags[0]}: choose one of {', '.join(map(str, spec.choices))}, got {value!r}")
