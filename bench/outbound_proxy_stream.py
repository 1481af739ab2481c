"""Memory and throughput of the outbound federation proxy passing a large body through.

A loopback TLS "remote" sends ``--mib`` MiB (chunked, 64 KiB writes); a caller reads it
through ``OutboundProxyServer`` (``matrix-federation://``, Bearer secret) as Synapse's
ProxyAgent would, all in this process. Reports the peak of Python allocations during
the transfer (tracemalloc), the process's peak RSS growth, and MiB/s.

    .venv/bin/python bench/outbound_proxy_stream.py [--mib 200]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import ssl
import tempfile
import time
import tracemalloc
from pathlib import Path

from aiohttp import web

from federation_sender.clock import SystemClock
from federation_sender.testing.certs import make_certs
from federation_sender.transport.client import FederationClient
from federation_sender.transport.outbound_proxy import OutboundProxyServer, ProxyLocation
from federation_sender.transport.signing import SigningKey

CHUNK = b"x" * (64 * 1024)


async def run(mib: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        certs = make_certs(Path(tmp), ["localhost", "127.0.0.1"])

        async def big(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse()
            response.enable_chunked_encoding()
            await response.prepare(request)
            for _ in range(mib * 16):
                await response.write(CHUNK)
            await response.write_eof()
            return response

        app = web.Application()
        app.router.add_get("/{tail:.*}", big)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(certs.cert, certs.key)
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        client = FederationClient(server_name="bench.test", signing_key=SigningKey.generate(),
                                  clock=SystemClock(), tls_extra_ca_file=str(certs.ca_cert),
                                  ip_allow_list=["127.0.0.0/8"])
        async with client:
            proxy = OutboundProxyServer(client, secret="s", clock=SystemClock(),
                                        location=ProxyLocation(host="127.0.0.1", port=0))
            await proxy.start()
            rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            tracemalloc.start()
            started = time.perf_counter()
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(f"GET matrix-federation://localhost:{port}/_matrix/media/v3/download/"
                         f"x/y HTTP/1.1\r\nHost: localhost:{port}\r\n"
                         "Proxy-Authorization: Bearer s\r\nConnection: close"
                         "\r\n\r\n".encode())
            received = 0
            while data := await reader.read(256 * 1024):
                received += len(data)
            elapsed = time.perf_counter() - started
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            writer.close()
            await proxy.close()
        await runner.cleanup()
    print(f"{mib} MiB body ({received / 2**20:.1f} MiB with chunk framing) in {elapsed:.2f} s"
          f" = {received / 2**20 / elapsed:.0f} MiB/s; peak Python allocations "
          f"{peak / 2**20:.2f} MiB; peak RSS growth {(rss1 - rss0) / 1024:.1f} MiB "
          "(remote, proxy and caller in this one process)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=200)
    asyncio.run(run(parser.parse_args().mib))


if __name__ == "__main__":
    main()
