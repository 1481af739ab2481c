"""Test prerequisites: skip locally, fail in CI.

Tests never install anything themselves (``scripts/bootstrap.sh test`` does). When a
program or package a test needs is missing, a developer's run skips the test with the
reason; a CI run (the ``CI`` environment variable set to anything but ``""``, ``0`` or
``false``, as ``.ci/run`` and most CI services do) fails it, so a broken image cannot
turn the suite green by skipping.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(what: str) -> NoReturn:
    """Skip (locally) or fail (in CI) because ``what`` is not available."""
    message = f"{what} (scripts/bootstrap.sh test installs it)"
    if in_ci():
        pytest.fail(f"prerequisite missing in CI: {message}", pytrace=False)
    pytest.skip(message)


def unavailable(what: str) -> NoReturn:
    """Skip (locally) or fail (in CI) because ``what`` is installed but did not work,
    e.g. a server that did not start."""
    if in_ci():
        pytest.fail(f"in CI: {what}", pytrace=False)
    pytest.skip(what)


def require_module(name: str, hint: str) -> object:
    """Import ``name`` or report it missing (``hint``: how to get it)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        missing(f"Python module {name} ({hint})")
