"""Optional test dependencies (peer libraries, a browser): skip with a reason on a user's
machine, fail under CI (``CI=true``, which ``.ci/run`` sets and where they are installed).

A test that skips in CI for lack of something CI installs would be a test that never runs.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

__all__ = ["require", "missing", "in_ci"]


def in_ci() -> bool:
    """Whether the tests run under CI (``CI`` set to a true value)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def missing(reason: str) -> None:
    """Skip (a user's machine) or fail (CI) with a one-line ``reason`` that says how to enable it."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: .ci/run installs it, so these tests must run)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require(module: str, how: str) -> ModuleType:
    """Import ``module`` or skip/fail the calling test module (see :func:`missing`)."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        missing(f"{module} is not installed ({err}): {how}")
        raise  # unreachable: missing() skips or fails
