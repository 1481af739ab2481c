"""Start-up failures an operator sees as one line each, not a traceback.

* :func:`wait_for_database`: a bounded retry while the database is unreachable, one
  warning line per failed attempt, then :class:`StartupError` (the CLI prints it and
  exits 1).
* :func:`listen`: a listener whose port is taken becomes :class:`StartupError`
  naming the configuration key, the address and the port.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.admin.server import RunningServer
from federation_sender.clock import Clock
from federation_sender.errors import StartupError
from federation_sender.storage.engine import ping

log = logging.getLogger(__name__)


def _where(engine: AsyncEngine) -> str:
    """The database named without credentials: ``postgresql host:port/name``."""
    u = engine.url
    if u.get_backend_name() == "sqlite":
        return f"sqlite {u.database}"
    return f"postgresql {u.host or 'localhost'}:{u.port or 5432}/{u.database or ''}"


def _reason(exc: BaseException) -> str:
    """The driver's own first line (``connection refused``), without SQLAlchemy's wrapping."""
    inner = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    lines = [ln.strip() for ln in str(inner).splitlines() if ln.strip()]
    return lines[0] if lines else type(inner).__name__


async def wait_for_database(
    engine: AsyncEngine, *, attempts: int, interval_s: float, clock: Clock
) -> None:
    """Return once ``SELECT 1`` succeeds; after ``attempts`` failures raise StartupError."""
    where = _where(engine)
    for attempt in range(1, attempts + 1):
        try:
            await ping(engine)
            return
        except (OperationalError, DBAPIError, OSError) as e:
            reason = _reason(e)
            if attempt == attempts:
                raise StartupError(
                    f"database {where} unreachable after {attempts} attempts: {reason}"
                ) from None
            log.warning(
                "database %s unreachable (attempt %d of %d): %s; retrying in %g s",
                where, attempt, attempts, reason, interval_s,
            )
        await clock.sleep(interval_s)


async def listen(key: str, bind: str, port: int, start: Awaitable[RunningServer]) -> RunningServer:
    """Await ``start``; a taken port or an unusable address becomes one StartupError line."""
    try:
        return await start
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise StartupError(f"{key}: {bind}:{port} is already in use") from None
        raise StartupError(f"{key}: cannot listen on {bind}:{port}: {e.strerror or e}") from None
