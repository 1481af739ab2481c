"""Matrix identifiers: the one place that takes them apart."""

from __future__ import annotations


def server_of(user_id: str) -> str:
    """The server part of a user (or room, event) id: ``@u:example.org`` ->
    ``example.org``, ``@u:example.org:8448`` -> ``example.org:8448``; ``""`` when there is
    no server part."""
    return user_id.split(":", 1)[1] if ":" in user_id else ""
