from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from admin_helpers import TOKEN
from aiohttp.test_utils import TestClient, TestServer
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.admin.app import build_admin_app
from federation_sender.storage.backend import NativeBackend
from federation_sender.testing.admin_fakes import FakeQueueControl
from federation_sender.testing.clock import FakeClock


@pytest.fixture
def queues(engine: AsyncEngine) -> FakeQueueControl:
    return FakeQueueControl(engine)


@pytest.fixture
async def client(engine: AsyncEngine, queues: FakeQueueControl,
                 clock: FakeClock) -> AsyncIterator[TestClient[Any, Any]]:
    app = build_admin_app(storage=NativeBackend(engine), token=TOKEN, queues=queues, clock=clock)
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        yield c


