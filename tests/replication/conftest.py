"""Fixtures for the replication tests: captures, a fake clock, helpers."""

from __future__ import annotations

import pytest

from federation_sender.testing.clock import FakeClock


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()
