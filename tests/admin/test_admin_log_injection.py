"""An admin API path cannot forge log lines (issue #42.2).

With the default text log format, an unauthenticated ``POST`` whose path holds an
encoded line break used to write a line of the caller's choosing (timestamp, level and
logger included) through the admin audit log.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from federation_sender.config import TelemetrySettings
from federation_sender.telemetry.logging import setup_logging

FORGED = "2026-12-01T00:00:00.000Z ERROR forged.logger X"
PATH = ("/_synapse/admin/v1/federation/destinations/"
        "x%0A2026-12-01T00:00:00.000Z%20ERROR%20forged.logger%20X/reset_connection")


@pytest.fixture
def text_log() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    out = io.StringIO()
    setup_logging(TelemetrySettings(log_format="text", log_level="INFO"), stream=out)
    yield out
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("path", [PATH, PATH.replace("%0A", "%0D"),
                                  PATH.replace("%0A", "%0D%0A"),
                                  PATH.replace("%0A", "%1B%5B2K%0D")])
async def test_an_unauthenticated_path_cannot_start_a_log_line(
    client: TestClient[Any, Any], text_log: io.StringIO, path: str,
) -> None:
    resp = await client.post(path)
    assert resp.status == 401
    text = text_log.getvalue()
    audit = [line for line in text.splitlines() if "admin action by unauthenticated" in line]
    assert len(audit) == 1, text
    assert "\r" not in text and "\x1b" not in text
    assert not any(line.startswith(FORGED) for line in text.splitlines())
    assert f"\\n{FORGED}" in audit[0] or f"\\r{FORGED}" in audit[0]
