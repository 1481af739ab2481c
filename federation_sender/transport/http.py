"""aiohttp plumbing shared by the /send client and well-known discovery.

* :func:`read_limited` reads a body but never more than a limit (a hostile server
  cannot make us buffer gigabytes); the caller's deadline bounds a slow drip.
* :func:`make_ssl_context` builds the TLS policy: verified against the system CAs by
  default, optionally plus one extra CA file; verification can be switched off for
  tests only (``ssl=False`` for aiohttp).
* :class:`WellKnownClient` fetches ``/.well-known/matrix/server`` with redirects
  followed by hand (https only, at most 5, each hop subject to the address policy).
"""

from __future__ import annotations

import ssl

import aiohttp
from yarl import URL

from federation_sender.transport.addresses import AddressFilter, is_ip_literal
from federation_sender.transport.classify import ResponseTooLarge
from federation_sender.transport.discovery import (
    WELL_KNOWN_MAX_BYTES,
    WellKnownFetchError,
    WellKnownResponse,
)

MAX_REDIRECTS = 5
_CHUNK = 64 * 1024


async def read_limited(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The whole body, or :class:`ResponseTooLarge` once it exceeds ``max_bytes``."""
    length = response.content_length
    if length is not None:
        if length > max_bytes:
            raise ResponseTooLarge(
                f"response of {length} bytes exceeds the {max_bytes} byte limit"
            )
        # A declared length within the limit: aiohttp reads exactly that much (or fails
        # on a short body), in one call instead of a loop of chunks.
        return await response.read()
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = await response.content.read(_CHUNK)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > max_bytes:
            raise ResponseTooLarge(f"response exceeds the {max_bytes} byte limit")
        chunks.append(chunk)


def make_ssl_context(*, verify: bool, extra_ca_file: str | None) -> ssl.SSLContext | bool:
    """What to pass as aiohttp's ``ssl=``: a verifying context, or False (tests only)."""
    if not verify:
        return False
    context = ssl.create_default_context()
    if extra_ca_file is not None:
        context.load_verify_locations(cafile=extra_ca_file)
    return context


class WellKnownClient:
    """Fetches a server's well-known delegation file over an existing session."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        address_filter: AddressFilter,
        *,
        ssl_setting: ssl.SSLContext | bool,
        timeout_s: float,
        port: int = 443,
        user_agent: str,
    ) -> None:
        self._session = session
        self._filter = address_filter
        self._ssl = ssl_setting
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._port = port
        self._user_agent = user_agent

    async def fetch(self, hostname: str) -> WellKnownResponse:
        url = URL.build(
            scheme="https",
            host=hostname,
            port=None if self._port == 443 else self._port,
            path="/.well-known/matrix/server",
        )
        try:
            for _ in range(MAX_REDIRECTS + 1):
                if url.scheme != "https" or not url.host:
                    raise WellKnownFetchError(f"refusing redirect to {url}", temporary=False)
                if is_ip_literal(url.host.strip("[]")):
                    self._filter.check(url.host)
                async with self._session.get(
                    url,
                    allow_redirects=False,
                    ssl=self._ssl,
                    timeout=self._timeout,
                    headers={"User-Agent": self._user_agent},
                ) as response:
                    if response.status in (301, 302, 303, 307, 308):
                        location = response.headers.get("Location")
                        if not location:
                            raise WellKnownFetchError("redirect without Location", temporary=False)
                        url = response.url.join(URL(location))
                        continue
                    body = await read_limited(response, WELL_KNOWN_MAX_BYTES)
                    headers = {k.lower(): v for k, v in response.headers.items()}
                    return WellKnownResponse(response.status, headers, body)
            raise WellKnownFetchError("too many redirects", temporary=False)
        except WellKnownFetchError:
            raise
        except ResponseTooLarge as e:
            raise WellKnownFetchError(str(e), temporary=True) from e
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
            raise WellKnownFetchError(f"{type(e).__name__}: {e}", temporary=True) from e
