"""Redis pub/sub transport: the same lines, published on channel ``<server_name>``.

This is how current Synapse deployments replicate: every process publishes its
commands to one channel and subscribes to it, so every process hears every
command -- including its own, which we drop. Synapse routes ``USER_IP`` to
``<server_name>/USER_IP``; we add ``<server_name>/psync`` for the extension's
``HISTORY`` so that plain Synapse processes, which do not subscribe to it,
never see a command they do not know. Both channels are read on one
subscription, and all publishing goes through one task and one connection, so
order is preserved.

Echoes: Redis has no sender id. Every line we publish is counted in a multiset
and the same line, when it comes back, is consumed as the echo. A foreign line
identical to one of ours has the same effect as ours, so confusing the two is
harmless. RDATA and POSITION naming our own instance are also ignored by the
client.

Policy differs from TCP in one way: there is no single peer to blame or to send
``ERROR`` to, and any process may publish on the channel. Unknown commands
(newer Synapse versions add some) are skipped silently; a bad message (longer
than :data:`~federation_sender.replication.connection.MAX_BUS_MESSAGE_BYTES`,
not UTF-8, a malformed command, a POSITION going backwards, an RDATA row that
does not parse) is skipped with one warning, as Synapse does ("Failed to parse
replication line"), and the subscription stays. Dropping it instead, as this
module once did, lost whatever was published while resubscribing (0.3-1 s):
typing and presence rows have no gap fetcher to bring them back. Redis does its
own keepalive, so the PING timers are off.

:class:`RedisTransport` is the reader's ``Transport``; :class:`RedisWriterBridge`
publishes a :class:`ReplicationWriter` on the channel and answers REPLICATE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from federation_sender.clock import Clock
from federation_sender.errors import ProtocolError
from federation_sender.redaction import redact_url
from federation_sender.replication import commands as c
from federation_sender.replication.connection import (
    BUS_LIMITS,
    Limits,
    ReplicationConnection,
    Role,
)
from federation_sender.replication.reconnect import DEFAULT_BACKOFF, Backoff
from federation_sender.replication.server import ReplicationWriter
from federation_sender.replication.transport import ConnectionLost, cancel_and_wait

logger = logging.getLogger(__name__)

MAX_PENDING_ECHOES = 100_000


# types-redis predates redis-py 5: it lacks ``aclose`` and types ``timeout`` as
# float although ``None`` (block until a message) is the documented way to wait.


async def _aclose(obj: object) -> None:
    await obj.aclose()  # type: ignore[attr-defined]


async def _get_message(
    pubsub: aioredis.client.PubSub, *, ignore_subscribe_messages: bool
) -> dict[str, object] | None:
    message: dict[str, object] | None = await pubsub.get_message(
        ignore_subscribe_messages=ignore_subscribe_messages,
        timeout=None,  # type: ignore[arg-type]
    )
    return message


def excerpt(payload: bytes, limit: int = 100) -> str:
    """A log-safe look at a message: its first bytes and its length."""
    head = repr(payload[:limit])
    return head if len(payload) <= limit else f"{head}... ({len(payload)} bytes)"


def channel_for(server_name: str, command: c.Command) -> str:
    if isinstance(command, c.HistoryCommand):
        return f"{server_name}/psync"
    if isinstance(command, c.UserIpCommand):
        return f"{server_name}/USER_IP"
    return server_name


class RedisSession:
    """One subscription (implements ``transport.Session``)."""

    supports_psync = True
    skips_bad_input = True

    def __init__(
        self,
        client: aioredis.Redis[bytes],
        pubsub: aioredis.client.PubSub,
        server_name: str,
        conn: ReplicationConnection,
    ) -> None:
        self._client = client
        self._pubsub = pubsub
        self._server_name = server_name
        self._conn = conn
        self._echoes: Counter[bytes] = Counter()
        self._outbox: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self._publisher = asyncio.create_task(self._publish_loop())
        self._closed_reason: str | None = None

    def send(self, command: c.Command) -> None:
        if self._closed_reason is not None:
            return
        self._conn.send(command)
        channel = channel_for(self._server_name, command)
        for line in self._conn.lines_to_send():
            payload = line.rstrip(b"\n")
            if len(self._echoes) < MAX_PENDING_ECHOES:
                self._echoes[payload] += 1
            self._outbox.put_nowait((channel, payload))

    async def _publish_loop(self) -> None:
        while True:
            channel, payload = await self._outbox.get()
            try:
                await self._client.publish(channel, payload)
            except RedisError as e:
                self._closed_reason = f"publish failed: {e}"
                return

    async def receive(self) -> list[c.Command]:
        while True:
            if self._closed_reason is not None:
                raise ConnectionLost(self._closed_reason)
            try:
                message = await _get_message(self._pubsub, ignore_subscribe_messages=True)
            except (RedisError, OSError) as e:
                raise ConnectionLost(f"redis subscription failed: {e}") from e
            if message is None or message.get("type") != "message":
                continue
            data = message["data"]
            payload = data if isinstance(data, bytes) else str(data).encode("utf-8")
            if self._echoes.get(payload):
                self._echoes[payload] -= 1
                if not self._echoes[payload]:
                    del self._echoes[payload]
                continue
            try:
                command = self._conn.receive_line(payload)
            except ProtocolError as e:
                logger.warning("replication: failed to parse a message on redis channel "
                               "%s, skipped: %s: %s", self._server_name, e, excerpt(payload))
                continue
            if command is not None:
                return [command]

    def abort(self, reason: str) -> None:
        logger.warning("replication: dropping redis subscription: %s", reason)
        self._closed_reason = reason

    async def close(self) -> None:
        self._closed_reason = self._closed_reason or "closed"
        try:
            await cancel_and_wait(self._publisher)
        finally:
            # A cancelled caller gets its CancelledError back from cancel_and_wait; the
            # connections are closed all the same.
            with contextlib.suppress(RedisError, OSError):
                await _aclose(self._pubsub)
            with contextlib.suppress(RedisError, OSError):
                await _aclose(self._client)


class RedisTransport:
    """Subscribes to ``<server_name>`` on a Redis server (implements ``Transport``)."""

    def __init__(
        self,
        url: str,
        server_name: str,
        *,
        clock: Clock,
        limits: Limits = BUS_LIMITS,
    ) -> None:
        self.url = url
        self.server_name = server_name
        self._clock = clock
        self._limits = limits
        self.description = f"{redact_url(url)} channel {server_name}"

    async def open(self) -> RedisSession:
        client = aioredis.Redis.from_url(self.url)
        pubsub = client.pubsub()
        try:
            channels = (self.server_name, f"{self.server_name}/psync")
            await pubsub.subscribe(*channels)
            # Wait for both confirmations: REPLICATE must not be published
            # before we can hear the answers.
            confirmed = 0
            while confirmed < len(channels):
                message = await _get_message(pubsub, ignore_subscribe_messages=False)
                if message is not None and message.get("type") == "subscribe":
                    confirmed += 1
        except (RedisError, OSError) as e:
            with contextlib.suppress(RedisError, OSError):
                await _aclose(pubsub)
                await _aclose(client)
            raise ConnectionLost(f"redis subscribe failed: {e}") from e
        conn = ReplicationConnection(Role.BUS, self._clock, keepalive=False, limits=self._limits)
        return RedisSession(client, pubsub, self.server_name, conn)


class RedisWriterBridge:
    """Publishes a writer's commands on Redis and answers readers' REPLICATE."""

    def __init__(
        self,
        writer: ReplicationWriter,
        url: str,
        *,
        clock: Clock,
        rng: random.Random | None = None,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        self._writer = writer
        self._backoff = backoff
        self._transport = RedisTransport(url, writer.server_name, clock=clock)
        self._clock = clock
        self._rng = rng or random.Random()
        self.ready = asyncio.Event()

    async def run(self) -> None:
        """Forever: subscribe, publish broadcasts, answer; resubscribe on failure."""
        attempt = 0
        while True:
            try:
                session = await self._transport.open()
            except ConnectionLost as e:
                logger.warning("replication writer: redis unavailable: %s", e)
            else:
                attempt = 0
                await self._serve(session)
            attempt += 1
            await self._clock.sleep(self._backoff.delay_s(attempt, self._rng))

    async def _serve(self, session: RedisSession) -> None:
        def relay(commands: Sequence[c.Command]) -> None:
            for command in commands:
                session.send(command)

        unsubscribe = self._writer.subscribe(self, relay)
        self.ready.set()
        try:
            while True:
                for command in await session.receive():
                    relay(self._writer.on_client_command(command, origin=self))
        except (ConnectionLost, ProtocolError) as e:
            logger.warning("replication writer: redis session ended: %s", e)
        finally:
            self.ready.clear()
            unsubscribe()
            await session.close()
