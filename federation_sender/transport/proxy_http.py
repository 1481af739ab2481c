"""The outbound federation proxy's side of HTTP/1.1 (:mod:`.outbound_proxy`): request
heads and bodies read from a caller, response heads and bodies written back.

A request head is at most :data:`MAX_HEAD_BYTES` and :data:`MAX_HEADERS` header lines;
its body is read as the remote asks for it, in chunks of at most :data:`CHUNK_BYTES`,
with ``Content-Length`` or ``chunked`` framing (both, or conflicting lengths, are a
:class:`BadRequest`). Headers that only concern one hop (:data:`HOP_BY_HOP`, and those a
response's ``Connection`` header names) are not passed back.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus

CHUNK_BYTES = 64 * 1024
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 128
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
    "trailers", "transfer-encoding", "upgrade",
})  # fmt: skip


class BadRequest(Exception):
    pass


@dataclass
class Request:
    method: str
    target: str
    headers: list[tuple[str, str]]
    """Names lower-cased, in order, repeats kept."""
    keep_alive: bool

    def all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name]

    def get(self, name: str) -> str | None:
        values = self.all(name)
        return values[-1] if values else None


class BodyReader:
    """The request body, read from the caller's connection as the remote asks for it."""

    def __init__(self, reader: asyncio.StreamReader, length: int | None, chunked: bool) -> None:
        self._reader = reader
        self._left = length or 0
        self._chunked = chunked
        self.done = not chunked and not self._left

    async def chunks(self) -> AsyncIterator[bytes]:
        if self._chunked:
            async for chunk in self._dechunk():
                yield chunk
        else:
            while self._left:
                data = await self._reader.read(min(CHUNK_BYTES, self._left))
                if not data:
                    raise BadRequest("request body ended early")
                self._left -= len(data)
                yield data
        self.done = True

    async def _dechunk(self) -> AsyncIterator[bytes]:
        reader = self._reader
        while True:
            line = await reader.readuntil(b"\r\n")
            size_text = line.split(b";", 1)[0].strip()
            if not size_text or len(size_text) > 16:
                raise BadRequest("malformed chunk size")
            try:
                size = int(size_text, 16)
            except ValueError:
                raise BadRequest("malformed chunk size") from None
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass  # trailers are not forwarded
                return
            while size:
                data = await reader.read(min(CHUNK_BYTES, size))
                if not data:
                    raise BadRequest("request body ended early")
                size -= len(data)
                yield data
            if await reader.readexactly(2) != b"\r\n":
                raise BadRequest("malformed chunk")

    async def drain(self) -> None:
        if not self.done:
            async for _ in self.chunks():
                pass


def has_body(method: str, status: int) -> bool:
    return method != "HEAD" and status not in (204, 304) and not 100 <= status < 200


def response_headers(raw: tuple[tuple[bytes, bytes], ...]) -> list[tuple[str, str]]:
    """The remote's headers minus hop-by-hop ones and those its Connection names."""
    named: set[str] = set()
    for name, value in raw:
        if name.lower() == b"connection":
            named.update(v.strip().lower() for v in value.decode("latin-1").split(","))
    out: list[tuple[str, str]] = []
    for name, value in raw:
        key = name.decode("latin-1")
        lower = key.lower()
        if lower in HOP_BY_HOP or lower in named:
            continue
        out.append((key, value.decode("latin-1")))
    return out


def status_line(status: int, reason: str | None) -> bytes:
    if not reason:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
    return f"HTTP/1.1 {status} {reason}\r\n".encode("latin-1")


def encode_headers(headers: list[tuple[str, str]], keep_alive: bool) -> bytes:
    lines = [f"{k}: {v}\r\n" for k, v in headers]
    if not keep_alive:
        lines.append("Connection: close\r\n")
    text = "".join(lines) + "\r\n"
    if text.count("\n") != len(lines) + 1:
        raise ValueError("a response header value contains a line break")
    return text.encode("latin-1")


async def write_raw(writer: asyncio.StreamWriter, status: int,
                     headers: list[tuple[str, str]], body: bytes, keep_alive: bool) -> None:
    writer.write(status_line(status, None) + encode_headers(
        [*headers, ("Content-Length", str(len(body)))], keep_alive) + body)
    await writer.drain()


async def write_json(writer: asyncio.StreamWriter, status: int, errcode: str, message: str,
                      keep_alive: bool) -> None:
    # Synapse's proxy says "err"; "error" is the Matrix specification's key.
    body = json.dumps({"errcode": errcode, "error": message, "err": message}).encode()
    await write_raw(writer, status, [("Content-Type", "application/json")], body, keep_alive)


async def read_head(reader: asyncio.StreamReader) -> Request:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].decode("latin-1").split("\r\n")
    while lines and not lines[0]:
        lines.pop(0)  # tolerate blank lines before a request (RFC 9112 2.2)
    if not lines:
        raise BadRequest("empty request")
    parts = lines[0].split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0") or not parts[0].isalpha():
        raise BadRequest("malformed request line")
    method, target, version = parts
    if len(lines) > MAX_HEADERS + 1:
        raise BadRequest("too many headers")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or " " in name:
            raise BadRequest("malformed header line")
        headers.append((name.lower(), value.strip(" \t")))
    connection = ",".join(v for k, v in headers if k == "connection").lower()
    keep = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    return Request(method, target, headers, keep)


def body_reader(request: Request, reader: asyncio.StreamReader) -> BodyReader:
    transfer = request.get("transfer-encoding")
    if transfer is not None:
        if transfer.lower() != "chunked":
            raise BadRequest("unsupported Transfer-Encoding")
        if request.get("content-length") is not None:
            raise BadRequest("both Content-Length and Transfer-Encoding")
        return BodyReader(reader, None, True)
    lengths = set(request.all("content-length"))
    if len(lengths) > 1:
        raise BadRequest("conflicting Content-Length headers")
    length = lengths.pop() if lengths else None
    if length is not None and (not length.isdigit() or not length.isascii()):
        raise BadRequest("malformed Content-Length")
    return BodyReader(reader, int(length) if length is not None else None, False)
