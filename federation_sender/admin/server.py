"""Run an aiohttp application on a TCP listener and stop it again.

Shared by the admin listener, the metrics listener and the key listener (HTTPS when
given an SSL context). ``port=0`` binds an ephemeral
port (tests); :attr:`RunningServer.port` reports the port actually bound.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from aiohttp import web


@dataclass
class RunningServer:
    runner: web.AppRunner
    bind: str
    port: int
    tls: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    async def stop(self) -> None:
        """Stop accepting, finish in-flight requests briefly, run cleanup hooks."""
        await self.runner.cleanup()


async def start_http_server(app: web.Application, bind: str, port: int, *,
                            shutdown_timeout_s: float = 5.0,
                            ssl_context: ssl.SSLContext | None = None) -> RunningServer:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, bind, port, ssl_context=ssl_context)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = port
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            bound = int(address[1])
            break
    return RunningServer(runner=runner, bind=bind, port=bound, tls=ssl_context is not None)
