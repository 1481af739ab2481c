"""One exception root for the whole package.

Errors are split along two axes so callers can decide what to do without string
matching:

* *transient* (retrying later may succeed) versus *permanent* (it will not);
* *local* (our database, our config, our bug) versus *remote* (a peer misbehaved or
  is unavailable).

Foreign exceptions (aiohttp, SQLAlchemy, OSError) are translated into these at the
module boundary where they are caught; ``except Exception`` appears only at the top of
a supervised task.
"""

from __future__ import annotations


class FederationSenderError(Exception):
    """Root of every error this package raises on purpose."""

    transient: bool = False
    remote: bool = False

    def __init__(self, message: str, *, detail: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail: dict[str, object] = dict(detail or {})


class TransientError(FederationSenderError):
    transient = True


class PermanentError(FederationSenderError):
    transient = False


class LocalTransientError(TransientError):
    """E.g. the database connection was lost; retry."""


class LocalPermanentError(PermanentError):
    """E.g. a bad configuration value or an unmigrated schema; do not retry."""


class RemoteTransientError(TransientError):
    """E.g. a peer timed out or answered 5xx."""

    remote = True


class RemotePermanentError(PermanentError):
    """E.g. a peer sent something that can never be valid."""

    remote = True


class ConfigError(LocalPermanentError):
    """A configuration key is missing or has a bad value."""

    def __init__(self, key: str, expected: str, got: object = None) -> None:
        shown = "" if got is None else f", got {got!r}"
        super().__init__(f"config key {key!r}: expected {expected}{shown}")
        self.key = key
        self.expected = expected


class SchemaVersionError(LocalPermanentError):
    """The database schema is not the version this code expects."""


class ProtocolError(RemotePermanentError):
    """A replication peer sent bytes that do not form a valid command.

    This is the *only* exception the replication parser and connection state
    machine raise for bad input.
    """


class StartupError(LocalPermanentError):
    """The worker cannot start: the database stayed unreachable, a port is taken.

    Its message is the one line the operator sees; no traceback goes with it.
    """
