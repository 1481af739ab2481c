"""The admin app on 127.0.0.1 over a seeded SQLite database, in its own process, for the
schemathesis tests: ``python admin_server.py DB TOKEN`` prints the port, serves until its
stdin closes.

A process rather than a thread of the test process: Hypothesis parses source with
``ast.parse`` while it generates cases, and CPython 3.11 keeps the AST converter's
recursion depth per interpreter, so a parse in another thread of the same interpreter
can fail it with "SystemError: AST constructor recursion depth mismatch" (seen in CI
as a FlakyFailure of the conformance test)."""

from __future__ import annotations

import asyncio
import sys

from aiohttp import web

from federation_sender.admin.app import build_admin_app
from federation_sender.storage.backend import NativeBackend
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.testing.admin_fakes import FakeQueueControl, seed_destinations
from federation_sender.testing.clock import FakeClock


async def serve(db: str, token: str) -> None:
    engine = create_engine(f"sqlite:///{db}")
    await upgrade(engine)
    clock = FakeClock()
    queues = FakeQueueControl(engine)
    await seed_destinations(engine, clock, 30, queues=queues)
    app = build_admin_app(storage=NativeBackend(engine), token=token, queues=queues, clock=clock)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(site._server.sockets[0].getsockname()[1], flush=True)  # type: ignore[union-attr]
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await runner.cleanup()
    await engine.dispose()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], sys.argv[2]))
