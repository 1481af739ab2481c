"""Names shared by the simulator tests and their fixtures (not in conftest.py, whose
module name other test folders share)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

ORIGIN = "us.test"

PutTxn = Callable[..., Coroutine[Any, Any, tuple[int, Any]]]
