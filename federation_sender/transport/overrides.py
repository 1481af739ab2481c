"""Destination overrides: ``destination -> "host:port"``, skipping discovery (tests, the
demo, benchmarks).

The Host header stays the destination; the TLS server name is the override's host.
What each override resolves to is computed once and kept (at most 10,000 destinations,
then forgotten at once); the mapping itself is not copied, so a benchmark can map
100,000 names through one computed mapping.
"""

from __future__ import annotations

from collections.abc import Mapping

from federation_sender.transport.discovery import ResolvedServer, parse_server_name

_MAX_KEPT = 10_000


class Overrides:
    """The overrides of one client and what they resolve to."""

    def __init__(self, mapping: Mapping[str, str] | None) -> None:
        self._mapping: Mapping[str, str] = mapping if mapping is not None else {}
        self._resolved: dict[str, ResolvedServer] = {}

    def get(self, destination: str) -> ResolvedServer | None:
        """Where an overridden ``destination`` is reached; ``None`` if it is not."""
        resolved = self._resolved.get(destination)
        if resolved is not None:
            return resolved
        override = self._mapping.get(destination)
        if override is None:
            return None
        target = parse_server_name(override)
        if len(self._resolved) >= _MAX_KEPT:
            self._resolved.clear()
        resolved = self._resolved[destination] = ResolvedServer(
            ((target.host, target.port or 8448),),
            host_header=destination,
            tls_server_name=target.host,
        )
        return resolved

    def forget(self, destination: str) -> ResolvedServer | None:
        """Let go of what is kept for ``destination``; returns it."""
        return self._resolved.pop(destination, None)

    def holds(self, destination: str) -> bool:
        return destination in self._resolved
