"""schemathesis against the admin API's own OpenAPI document.

The app runs on a real loopback listener (its own event loop in a thread, since
schemathesis calls synchronously) over a seeded SQLite database and the fake queue
control. Every operation is called with generated parameters, with the right token
(and, separately, without one); all of schemathesis' checks run: no 5xx, status codes,
content types, headers and bodies as documented, and the methods a route does not
have (405 with ``Allow``). Only ``negative_data_rejection`` is left out (below).

Default: 60 cases per operation. ``FUZZ_LONG=1``: 2,000.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import schemathesis
import schemathesis.checks
from aiohttp import web
from hypothesis import HealthCheck, settings

from federation_sender.admin.app import build_admin_app, openapi_document
from federation_sender.admin.middleware import OPEN_ADMIN_PATHS
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.storage.native import NativeBackend
from federation_sender.testing.admin_fakes import FakeQueueControl, seed_destinations
from federation_sender.testing.clock import FakeClock

TOKEN = "schemathesis-admin-token"
CASES = 2_000 if os.environ.get("FUZZ_LONG") else 60

schema = schemathesis.openapi.from_dict(openapi_document())


class ServedApp:
    """The admin app on 127.0.0.1 in a background thread with its own loop."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = 0
        self._runner: web.AppRunner | None = None

    def _run(self, coro: Any) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(60)

    async def _start(self) -> None:
        self.engine = create_engine(f"sqlite:///{self.db}")
        await upgrade(self.engine)
        clock = FakeClock()
        queues = FakeQueueControl(self.engine)
        await seed_destinations(self.engine, clock, 30, queues=queues)
        app = build_admin_app(
            storage=NativeBackend(self.engine), token=TOKEN, queues=queues, clock=clock,
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self.engine.dispose()

    def start(self) -> None:
        self.thread.start()
        self._run(self._start())

    def stop(self) -> None:
        self._run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedApp]:
    app = ServedApp(tmp_path_factory.mktemp("schemathesis") / "admin.db")
    app.start()
    yield app
    app.stop()


HYPOTHESIS = settings(
    max_examples=CASES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@schema.parametrize()
@HYPOTHESIS
def test_admin_api_conforms_to_its_openapi_document(case: Any, served: ServedApp) -> None:
    case.call_and_validate(
        base_url=served.base_url,
        headers={"Authorization": f"Bearer {TOKEN}"},
        # Unknown query parameters are ignored on purpose, as Synapse does, so tools
        # written against Synapse keep working: that is what this check flags.
        excluded_checks=[schemathesis.checks.negative_data_rejection],
    )


@schema.parametrize()
@settings(HYPOTHESIS, max_examples=max(CASES // 4, 10))
def test_admin_api_without_a_token_is_refused_as_documented(
    case: Any, served: ServedApp
) -> None:
    response = case.call(base_url=served.base_url, headers={"Authorization": "Bearer nope"})
    if (case.path.startswith("/_synapse/admin/") and case.method.upper() != "OPTIONS"
            and case.path not in OPEN_ADMIN_PATHS):
        # (OPTIONS is the CORS preflight, open by design: it carries no data; so is
        # server_version, open in Synapse too.)
        assert response.status_code == 401, (case.path, response.text)
    assert response.status_code < 500
    case.validate_response(response)
