"""RSS per TLS client connection: asyncio's own TLS (``loop.create_connection(ssl=...)``)
against the built-in client's (``transport/h1_tls.py``, a 16 KiB read buffer instead of
256 KiB), each in a fresh process, to a TLS server in a child process.

    .venv/bin/python bench/tls_memory.py [--connections 300]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import ssl
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import report, rss_mb

from federation_sender.testing.certs import make_certs
from federation_sender.transport.h1_tls import open_connection


def _serve(certdir: str, q: Any) -> None:
    async def main() -> None:
        certs = make_certs(Path(certdir), ["localhost"])
        server = await asyncio.get_running_loop().create_server(
            asyncio.Protocol, "127.0.0.1", 0, ssl=certs.server_context())
        q.put(server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(main())


async def _connect(n: int, lean: bool, port: int, ca: str) -> float:
    loop = asyncio.get_running_loop()
    context = ssl.create_default_context(cafile=ca)
    before = rss_mb()
    held: list[Any] = []
    for _ in range(n):
        if lean:
            sock = socket.socket()
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
            held.append(await open_connection(loop, asyncio.Protocol, sock, context,
                                              "localhost"))
        else:
            held.append(await loop.create_connection(asyncio.Protocol, "127.0.0.1", port,
                                                     ssl=context,
                                                     server_hostname="localhost"))
    return 1024 * (rss_mb() - before) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=300)
    ap.add_argument("--one", choices=["asyncio", "lean"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ca", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(asyncio.run(_connect(a.connections, a.one == "lean", a.port, a.ca)))
        return
    certdir = tempfile.mkdtemp(prefix="tlsmem-")
    q: Any = mp.get_context("spawn").Queue()
    server = mp.get_context("spawn").Process(target=_serve, args=(certdir, q), daemon=True)
    server.start()
    port = q.get(timeout=60)
    rows = []
    try:
        for kind in ("asyncio", "lean"):
            out = subprocess.run(
                [sys.executable, __file__, "--one", kind, "--connections",
                 str(a.connections), "--port", str(port), "--ca", f"{certdir}/ca.pem"],
                check=True, capture_output=True, text=True).stdout
            rows.append((f"{kind}: RSS per connection", f"{float(out):.0f} KB"))
    finally:
        server.kill()
    report(f"{a.connections} TLS client connections, RSS per connection", rows)


if __name__ == "__main__":
    main()
