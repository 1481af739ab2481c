"""Which TLS context a federation connection gets, by the server name it must carry.

The federation client verifies certificates against the system CAs (or Synapse's
``federation_custom_ca_list``, plus an extra CA file), at a minimum TLS version. Names
matching ``federation_certificate_verification_whitelist``'s globs are not verified, and
``tls_verify=False`` (tests only) verifies nothing. aiohttp takes ``ssl=False`` for "no
verification", the built-in HTTP/1.1 client always a context: :meth:`TlsChoice.for_name`
answers the first, :meth:`TlsChoice.context_for` the second. Answers per name are
cached (at most 10,000, then forgotten at once).
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence

from federation_sender.transport.http import compile_globs, make_ssl_context, unverified_context

_MAX_NAMES = 10_000


class TlsChoice:
    """The TLS policy of one client."""

    def __init__(self, *, verify: bool, extra_ca_file: str | None, ca_files: Sequence[str],
                 min_version: str | None, unverified_names: Sequence[str]) -> None:
        self.default: ssl.SSLContext | bool = make_ssl_context(
            verify=verify, extra_ca_file=extra_ca_file, ca_files=ca_files,
            min_version=min_version,
        )
        """The verifying context, or ``False`` (verification off)."""
        self.unverified = unverified_context(min_version)
        self._names = compile_globs(unverified_names)
        self._chosen: dict[str, ssl.SSLContext | bool] = {}

    @property
    def per_name(self) -> bool:
        """Whether any name is treated apart from the default (a whitelist is set)."""
        return bool(self._names)

    @property
    def default_context(self) -> ssl.SSLContext:
        """The default as a context (the built-in client's): unverified if it is off."""
        return self.default if isinstance(self.default, ssl.SSLContext) else self.unverified

    def for_name(self, tls_name: str | None) -> ssl.SSLContext | bool:
        """aiohttp's ``ssl=`` for a server name: unverified if the whitelist matches it."""
        if tls_name is None or not self._names:
            return self.default
        choice = self._chosen.get(tls_name)
        if choice is None:
            if len(self._chosen) >= _MAX_NAMES:
                self._chosen.clear()
            matched = any(p.fullmatch(tls_name) for p in self._names)
            choice = self._chosen[tls_name] = self.unverified if matched else self.default
        return choice

    def context_for(self, tls_name: str | None) -> ssl.SSLContext:
        """The built-in client's context for a server name."""
        choice = self.for_name(tls_name)
        return choice if isinstance(choice, ssl.SSLContext) else self.unverified
