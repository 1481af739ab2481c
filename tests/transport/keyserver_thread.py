"""Our key endpoint on a TLS loopback listener, in a thread with its own event loop.

Synapse fetches our key at ``https://<our server name>/_matrix/key/v2/server``; the
listener outlives individual tests (their event loops come and go), so it runs in a
thread for the whole module.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading

from aiohttp import web


class ThreadedSite:
    def __init__(self, app: web.Application, ssl_context: ssl.SSLContext, port: int = 0) -> None:
        self._app = app
        self._ssl = ssl_context
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = port

    async def _start(self) -> int:
        self._runner = web.AppRunner(self._app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self._ssl)
        await site.start()
        server = site._server
        assert server is not None
        port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
        with contextlib.suppress(OSError):  # "localhost" may resolve to ::1 first
            await web.TCPSite(self._runner, "::1", port, ssl_context=self._ssl).start()
        return port

    def start(self) -> None:
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
