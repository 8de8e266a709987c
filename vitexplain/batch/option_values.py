"""What one batch option's value may be, and how its flag is read: the values' side of :mod:`vitexplain.batch.options`.

- :class:`Number` (and :data:`POSITIVE`, :data:`NON_NEGATIVE`, :data:`UNIT`): an int or float with bounds, both the
  argparse ``type`` of its flag and the Python API's check (:func:`vitexplain.batch.options.validate`);
- parsers of one flag value (``--method a,b``, ``KEY=VALUE``, ``METHOD.KEY=VALUE``) and collectors of a repeated
  flag's values (a key given twice with different values is a usage error);
- the command line's defaults that depend on the machine (DataLoader workers, writer and torch threads).

Standard library only (``vitexplain --help`` stays quick).
"""

from __future__ import annotations

import argparse
import ast
import os
from typing import Any, Optional

from ..errors import UsageError

__all__ = [
    "Number",
    "POSITIVE",
    "NON_NEGATIVE",
    "UNIT",
    "parse_methods",
    "parse_key_value",
    "parse_method_option",
    "collect_methods",
    "collect_method_options",
    "collect_dict",
    "default_workers",
    "default_write_threads",
    "default_threads",
]


class Number:
    """An int or float option with optional bounds: an argparse ``type`` and an API check.

    Args:
        kind: ``int`` or ``float``.
        lo: smallest allowed value (inclusive), or None.
        hi: largest allowed value (inclusive), or None.
    """

    def __init__(self, kind: type = int, lo: Optional[float] = None, hi: Optional[float] = None) -> None:
        self.kind, self.lo, self.hi = kind, lo, hi
        if kind is int and lo == 1 and hi is None:
            self.text = "a positive integer"
        elif kind is int and lo is not None and hi is None:
            self.text = f"an integer >= {lo}"
        elif lo is not None and hi is not None:
            self.text = f"a number in [{lo:g}, {hi:g}]"
        elif lo is not None:  # (a float's lower bound: "expected a number, got 0.0" did not say it)
            self.text = f"a number >= {lo:g}"
        elif hi is not None:
            self.text = f"{'an integer' if kind is int else 'a number'} <= {hi:g}"
        else:
            self.text = "an integer" if kind is int else "a number"
        self.__name__ = self.text  # argparse names the type in some messages

    def problem(self, value: Any) -> Optional[str]:
        """Why ``value`` is not allowed, or None."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            self.kind is int and not isinstance(value, int)
        ):
            return f"expected {self.text}, got {value!r}"
        if value != value or (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            return f"expected {self.text}, got {value}"
        return None

    def __call__(self, text: str) -> Any:
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {self.text}, got {text!r}") from None
        problem = self.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value


POSITIVE = Number(int, 1)
NON_NEGATIVE = Number(int, 0)
UNIT = Number(float, 0.0, 1.0)


def default_workers() -> int:
    """DataLoader worker processes on the command line: ``min(4, CPUs - 1)``."""
    return max(0, min(4, (os.cpu_count() or 1) - 1))


def default_threads() -> Optional[int]:
    """torch threads on the command line (:func:`vitexplain.threads.default_for_cli`)."""
    from ..threads import default_for_cli

    return default_for_cli()


def default_write_threads() -> int:
    """Writer threads: half the CPUs, 2 to 8."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_methods(text: str) -> list[str]:
    """``--method a,b`` -> ``["a", "b"]``."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected method names, e.g. rollout,cdam")
    return names


def parse_key_value(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` (the value read as a Python literal when it is one)."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip(), _literal(value)


def parse_method_option(text: str) -> tuple[str, str, Any]:
    """``METHOD.KEY=VALUE`` -> ``(method, key, value)``."""
    head, sep, value = text.partition("=")
    method, dot, key = head.partition(".")
    if not (sep and dot and method.strip() and key.strip()):
        raise argparse.ArgumentTypeError(f"expected METHOD.KEY=VALUE (e.g. rollout.discard_ratio=0.9), got {text!r}")
    return method.strip(), key.strip(), _literal(value)


def collect_methods(groups: Optional[list[list[str]]]) -> Optional[list[str]]:
    """Repeated ``--method`` values, flattened (None when not given)."""
    return [m for group in groups for m in group] if groups else None


def collect_method_options(triples: Optional[list[tuple[str, str, Any]]]) -> dict[str, dict[str, Any]]:
    """Repeated ``--option METHOD.KEY=VALUE`` values as ``{method: {key: value}}``."""
    out: dict[str, dict[str, Any]] = {}
    for method, key, value in triples or ():
        _set_once(out.setdefault(method, {}), key, value, f"--option {method}.{key}")
    return out


def collect_dict(pairs: Optional[list[tuple[str, Any]]], flag: str = "--model-arg") -> dict[str, Any]:
    """Repeated ``KEY=VALUE`` values as a dict."""
    out: dict[str, Any] = {}
    for key, value in pairs or ():
        _set_once(out, key, value, f"{flag} {key}")
    return out


def _set_once(into: dict[str, Any], key: str, value: Any, what: str) -> None:
    """``into[key] = value``; a key given twice with different values is a usage error (which one
    was meant is unknown: the last one would win silently)."""
    if key in into and into[key] != value:
        raise UsageError(f"{what} is given twice, as {into[key]!r} and {value!r}; give it once")
    into[key] = value
