"""aiohttp plumbing shared by the /send client and well-known discovery.

* :func:`read_limited` reads a body but never more than a limit (a hostile server
  cannot make us buffer gigabytes); the caller's deadline bounds a slow drip.
* :func:`make_ssl_context` builds the TLS policy: verified against the system CAs by
  default, or only against the given CA files (Synapse's ``federation_custom_ca_list``),
  plus an optional extra CA file, with an optional minimum TLS version;
  :func:`unverified_context` and :func:`compile_globs` serve the names whose
  certificates are not checked; verification can be switched off for tests only
  (``ssl=False`` for aiohttp).
* :class:`WellKnownClient` fetches ``/.well-known/matrix/server`` with redirects
  followed by hand (https only, at most 5, each hop subject to the address policy),
  through the forward proxy when one applies.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Callable, Sequence

import aiohttp
from yarl import URL

from federation_sender.config import TLS_MIN_VERSIONS
from federation_sender.transport.addresses import AddressFilter, is_ip_literal
from federation_sender.transport.classify import ResponseTooLarge
from federation_sender.transport.discovery import (
    WELL_KNOWN_MAX_BYTES,
    WellKnownFetchError,
    WellKnownResponse,
)
from federation_sender.transport.forward_proxy import ForwardProxy, ProxyPolicy

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


TLS_VERSIONS = dict(zip(TLS_MIN_VERSIONS, (
    ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1, ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3,
), strict=True))
"""``federation_client_minimum_tls_version``'s values (Synapse's), as ``ssl`` versions."""


def make_ssl_context(
    *,
    verify: bool,
    extra_ca_file: str | None,
    ca_files: Sequence[str] = (),
    min_version: str | None = None,
) -> ssl.SSLContext | bool:
    """What to pass as aiohttp's ``ssl=``: a verifying context, or False (tests only).

    ``ca_files`` (Synapse's ``federation_custom_ca_list``) *replace* the system CAs, as
    in Synapse; ``extra_ca_file`` (ours) is added to whichever set is trusted.
    ``min_version``: a key of :data:`TLS_VERSIONS`; None keeps Python's default (1.2)."""
    if not verify:
        return False
    if ca_files:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        for path in ca_files:
            context.load_verify_locations(cafile=path)
    else:
        context = ssl.create_default_context()
    if extra_ca_file is not None:
        context.load_verify_locations(cafile=extra_ca_file)
    if min_version is not None:
        _set_minimum(context, min_version)
    return context


_WILDCARDS = re.compile(r"([?*]+)")


def compile_globs(globs: Sequence[str]) -> tuple[re.Pattern[str], ...]:
    """Synapse's globs (``*``: any run, ``?``: one character), whole-name and
    case-insensitive, as ``federation_certificate_verification_whitelist`` reads them."""
    out = []
    for glob in globs:
        parts = []
        for chunk in _WILDCARDS.split(glob):
            if not _WILDCARDS.fullmatch(chunk):
                parts.append(re.escape(chunk))
            else:
                n = chunk.count("?")
                parts.append(f".{{{n},}}" if "*" in chunk else f".{{{n}}}")
        out.append(re.compile("".join(parts), re.IGNORECASE))
    return tuple(out)


def unverified_context(min_version: str | None = None) -> ssl.SSLContext:
    """TLS without certificate checks: ``federation_verify_certificates: false`` or a
    name in ``federation_certificate_verification_whitelist``."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if min_version is not None:
        _set_minimum(context, min_version)
    return context


def _set_minimum(context: ssl.SSLContext, min_version: str) -> None:
    version = TLS_VERSIONS[min_version]
    if version < ssl.TLSVersion.TLSv1_2:
        # OpenSSL's default security level refuses TLS 1.0/1.1 whatever the minimum;
        # lowering it is what asking for them means (Synapse's insecurelyLowerMinimumTo).
        context.set_ciphers("DEFAULT:@SECLEVEL=0")
    context.minimum_version = version


def proxy_headers(proxy: ForwardProxy | None) -> dict[str, str] | None:
    """aiohttp's ``proxy_headers=`` for a proxy's credentials."""
    if proxy is None or proxy.authorization is None:
        return None
    return {"Proxy-Authorization": proxy.authorization}


class WellKnownClient:
    """Fetches a server's well-known delegation file over an existing session."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        address_filter: AddressFilter,
        *,
        ssl_setting: ssl.SSLContext | bool | Callable[[str], ssl.SSLContext | bool],
        timeout_s: float,
        port: int = 443,
        user_agent: str,
        proxy_policy: ProxyPolicy | None = None,
    ) -> None:
        """``ssl_setting``: one for every host, or a function of the host name (the
        certificate verification whitelist). ``proxy_policy``: the forward proxy."""
        self._session = session
        self._proxy = proxy_policy
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
                proxy = (
                    self._proxy.proxy_for(url.host, tls=True) if self._proxy is not None else None
                )
                async with self._session.get(
                    url,
                    allow_redirects=False,
                    ssl=self._ssl(url.host) if callable(self._ssl) else self._ssl,
                    timeout=self._timeout,
                    headers={"User-Agent": self._user_agent},
                    proxy=proxy.url if proxy is not None else None,
                    proxy_headers=proxy_headers(proxy),
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
