"""Declared method options: type, range and choices, checked the same way in the API and the CLI.

Every keyword option of a method is declared with an :class:`Option` when the method is
registered (``register(..., options={"discard_ratio": Option(float, low=0, high=1, high_open=True)})``);
the default comes from the method's signature. :func:`check_options` turns an unknown option
or a value outside its declared range into a :class:`vitexplain.OptionError` whose message
names the method, the option, what is allowed and what was given.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ..errors import OptionError

__all__ = ["MAX_SAMPLES", "SEED_RANGE", "Option", "smooth_cdam_options", "integrated_cdam_options", "check_options",
           "check_index", "check_indices", "check_head_or_fusion", "describe_options", "option_defaults"]

#: The seeds torch takes (``torch.manual_seed``, ``Generator.manual_seed``: 64 bits, negatives wrapped).
SEED_RANGE = (-(2**63), 2**64 - 1)

#: Most noisy samples or integration steps a method takes (the papers use 20-300; more only costs
#: time: the copies are run a batch at a time).
MAX_SAMPLES = 10_000

_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


@dataclass(frozen=True)
class Option:
    """What values a method option accepts.

    Attributes:
        kind: ``int``, ``float``, ``str`` or ``bool``; ints are accepted where floats are.
        low, high: inclusive bounds (None = unbounded); ``low_open`` / ``high_open`` make
            a bound exclusive.
        choices: the allowed values (strings), if the option is an enumeration.
        optional: None is allowed.
        sequence: a list/tuple of ``kind`` values is also allowed (each checked).
        help: one line for listings.
    """

    kind: type
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    choices: Optional[Sequence[Any]] = None
    optional: bool = False
    sequence: bool = False
    help: str = ""

    def allowed(self) -> str:
        """Human-readable description of the accepted values."""
        if self.choices is not None:
            what = "one of " + ", ".join(repr(c) for c in self.choices)
        else:
            what = _TYPE_NAMES.get(self.kind, self.kind.__name__)
            if self.low is not None or self.high is not None:
                lo = "(-inf" if self.low is None else ("(" if self.low_open else "[") + _num(self.low)
                hi = "inf)" if self.high is None else _num(self.high) + (")" if self.high_open else "]")
                what += f" in {lo}, {hi}"
        if self.sequence:
            what += " or a list of them"
        if self.optional:
            what += ", or None"
        return what

    def check(self, value: Any) -> bool:
        """Whether ``value`` is accepted."""
        if value is None:
            return self.optional
        if self.sequence and isinstance(value, (list, tuple)):
            return len(value) > 0 and all(self._check_one(v) for v in value)
        return self._check_one(value)

    def _check_one(self, value: Any) -> bool:
        if self.kind is bool:
            return isinstance(value, bool)
        if isinstance(value, bool):  # True is an int in Python, never a number option
            return False
        if self.kind is float:
            if not isinstance(value, (int, float)) or not math.isfinite(float(value)):
                return False
        elif not isinstance(value, self.kind):
            return False
        if self.choices is not None and value not in self.choices:
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        if self.high is not None and (value > self.high or (self.high_open and value == self.high)):
            return False
        return True


def smooth_cdam_options(what: str) -> dict[str, Option]:
    """The options of smooth CDAM (every family's): noisy copies of ``what`` (the tokens a family's CDAM reads)."""
    return {
        "samples": Option(int, low=1, high=MAX_SAMPLES, help="noisy samples"),
        "noise": Option(float, low=0, help=f"noise std as a fraction of {what}'s range"),
        "batch_size": Option(int, low=1, help="samples per forward"),
        "seed": Option(int, low=SEED_RANGE[0], high=SEED_RANGE[1], optional=True, help="noise seed (None = random)"),
    }


def integrated_cdam_options() -> dict[str, Option]:
    """The options of integrated CDAM (every family's)."""
    return {
        "steps": Option(int, low=1, high=MAX_SAMPLES, help="integration steps"),
        "batch_size": Option(int, low=1, help="steps per forward"),
    }


def check_index(method: str, option: str, index: int, count: int, what: str) -> int:
    """An index option checked against what this model has (Python-style negatives allowed).

    Returns:
        The index in ``[0, count)``.

    Raises:
        OptionError: ``index`` is outside ``[-count, count)``.
    """
    if not -count <= index < count:
        raise OptionError(
            f"{method} option {option!r} must be in [{-count}, {count - 1}] for this model "
            f"({count} {what}); got {index}"
        )
    return index % count


def check_indices(method: str, option: str, indices: Any, count: int, what: str) -> list[int]:
    """A list of index options (or one index) checked by :func:`check_index`, each item once.

    Returns:
        The indices in ``[0, count)``, in the order given.

    Raises:
        OptionError: an index outside ``[-count, count)``, or one item named twice (also as ``-1`` and
            ``count - 1``): a method that averages over the items would weigh it double.
    """
    given = [indices] if isinstance(indices, int) else list(indices)
    chosen = [check_index(method, option, i, count, what) for i in given]
    twice = sorted({i for i in chosen if chosen.count(i) > 1})
    if twice:
        raise OptionError(
            f"{method} option {option!r} names {what} {twice} more than once (got {given!r}; negative indices count "
            f"from the last of {count}); each is used once, so list each once"
        )
    return chosen


def check_head_or_fusion(method: str, head: Optional[int], head_fusion: str) -> None:
    """Refuse one head (``head=``) together with a head fusion other than the default mean: the first
    reads one head, the second fuses them all, so one of the two would be ignored.

    Raises:
        OptionError: both were given.
    """
    if head is not None and head_fusion != "mean":
        raise OptionError(
            f"{method} options 'head' and 'head_fusion' exclude each other (head={head} reads one head, "
            f"head_fusion={head_fusion!r} fuses them all); pass one of them"
        )


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def option_defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    """The keyword options of a method function and their defaults (``ctx`` excluded)."""
    params = inspect.signature(fn).parameters
    return {
        name: p.default
        for name, p in params.items()
        if p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and name != "ctx")
    }


def describe_options(method: str, declared: Mapping[str, Option], defaults: Mapping[str, Any]) -> str:
    """``name=default (allowed)`` for each option, for messages and ``vitexplain methods``."""
    if not declared:
        return f"{method} takes no options"
    return "; ".join(f"{name}={defaults.get(name)!r} ({opt.allowed()})" for name, opt in declared.items())


def _python_scalar(value: Any) -> Any:
    """A NumPy scalar or 0-d tensor (also inside a list or tuple) as the Python number it holds; else ``value``."""
    if isinstance(value, (list, tuple)):
        return type(value)(_python_scalar(v) for v in value)
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0 and not isinstance(value, (str, bytes)):
        item = value.item()
        return item if isinstance(item, (bool, int, float)) else value
    return value


def check_options(method: str, declared: Mapping[str, Option], defaults: Mapping[str, Any],
                  values: Mapping[str, Any]) -> dict[str, Any]:
    """Validate user option values against the declared options of ``method``.

    Args:
        method: the method name (for messages).
        declared: option name -> :class:`Option`.
        defaults: option name -> default value (from the signature).
        values: what the user passed.

    Returns:
        A copy of ``values``, NumPy and 0-d tensor scalars as the Python numbers they hold (``np.int64(2)`` from
        an argmax, or ``np.float32(0.9)``, were refused as not an integer / number).

    Raises:
        OptionError: an unknown option, or a value outside the declared range.
    """
    values = {name: _python_scalar(v) for name, v in values.items()}
    for name, value in values.items():
        option = declared.get(name)
        if option is None:
            known = ", ".join(declared) or "none"
            raise OptionError(f"{method} has no option {name!r}; its options: {known}")
        if not option.check(value):
            raise OptionError(
                f"{method} option {name!r} must be {option.allowed()}; got {_shown(value)} "
                f"(default {defaults.get(name)!r})"
            )
    return dict(values)


def _shown(value: Any) -> str:
    """``value`` in an option's refusal: its repr, or its type for a long one (a module's repr is the whole model,
    thousands of lines for a large one), with the module's-name advice where a module was given."""
    if isinstance(value, torch.nn.Module):
        return (f"a {type(value).__name__} module (pass its name, as model.named_modules() gives it, e.g. "
                "module='layer4')")
    text = repr(value)
    return text if len(text) <= 200 else f"a {type(value).__name__} ({text[:120]}...)"
