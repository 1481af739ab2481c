"""Fake remote homeservers, one per port: loopback aiohttp servers that answer
``/send`` like Synapse.

Theory of operation
-------------------
Each :class:`FakeRemote` is one server name with its own listening port, so "down"
can mean what it means on the internet: the listener is closed (new connections are
refused) and open connections are reset. Everything else is the shared receiving side,
:class:`~federation_sender.testing.remote_core.Receiver` (also behind the single-port
:class:`~federation_sender.testing.fake_homeserver.FakeHomeserver`), configured as
Synapse behaves: the X-Matrix signature of every request verified against the
origin's verify key, given up front (401 otherwise); one transaction in flight per
origin (429 for another); a retransmitted txn id answered from the cache; each PDU
named by its reference hash (:mod:`.pdu`); random faults from the remote's
:class:`~.faults.FaultProfile` and its own seeded ``random.Random``. See
:mod:`federation_sender.testing.remote_core` for the order of the checks.

All timing (down windows, delays, hangs) goes through the injected clock.
:class:`~.fleet.RemoteFleet` (``fleet.py``) starts and stops many remotes and gives the
worker its ``destination_overrides``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

from aiohttp import web

from federation_sender.clock import Clock
from federation_sender.sim.pdu import reference_event_id
from federation_sender.testing.faults import FaultProfile
from federation_sender.testing.remote_core import (
    CLIENT_MAX_SIZE,
    MAX_EDUS,
    MAX_PDUS,
    SEND_PATH,
    Receiver,
    abort,
)
from federation_sender.testing.remote_records import ReceivedTxn, RemoteRecord
from federation_sender.transport.signing import VerifyKeyLookup

__all__ = ["MAX_EDUS", "MAX_PDUS", "SEND_PATH", "FakeRemote", "ReceivedTxn", "RemoteRecord"]

log = logging.getLogger(__name__)


class FakeRemote:
    """One fake homeserver named ``server_name`` on a loopback port."""

    def __init__(
        self,
        server_name: str,
        *,
        lookup_key: VerifyKeyLookup,
        clock: Clock,
        rng: random.Random,
        faults: FaultProfile | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.server_name = server_name
        self.receiver = Receiver(
            clock=clock, lookup_key=lookup_key, event_id_of=reference_event_id, one_in_flight=True
        )
        self._rng = rng
        self.faults = faults or FaultProfile()
        self.down = False
        self._clock = clock
        self._host = host
        self._port = port
        self._started_mono_s = 0.0
        self._schedule: asyncio.Task[None] | None = None
        self._site: web.TCPSite | None = None
        self.app = web.Application(client_max_size=CLIENT_MAX_SIZE)
        self.app.router.add_put(SEND_PATH, self._on_send)
        self.app.router.add_get("/_matrix/federation/v1/version", self._on_version)
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=1.0)

    @property
    def faults(self) -> FaultProfile:
        return self.receiver.faults[self.server_name][0]

    @faults.setter
    def faults(self, profile: FaultProfile) -> None:
        self.receiver.set_faults(self.server_name, profile, self._rng)

    @property
    def record(self) -> RemoteRecord:
        return self.receiver.records[self.server_name]

    # --- lifecycle -------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        """``host:port``, for the worker's ``destination_overrides``."""
        return f"{self._host}:{self._port}"

    async def start(self) -> None:
        await self._runner.setup()
        self._started_mono_s = self._clock.monotonic_s()
        await self._listen()
        if self.faults.down:
            self._schedule = asyncio.create_task(
                self._run_down_schedule(), name=f"fake-remote-schedule-{self.server_name}"
            )

    async def stop(self) -> None:
        self.receiver.release_all()
        if self._schedule is not None:
            self._schedule.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._schedule
        await self._runner.cleanup()

    async def _listen(self) -> None:
        site = web.TCPSite(self._runner, self._host, self._port, reuse_address=True)
        await site.start()
        self._port = site.port
        self._site = site

    async def go_down(self) -> None:
        """Refuse new connections and reset open ones."""
        if self.down:
            return
        self.down = True
        if self._site is not None:
            await self._site.stop()
            self._site = None
        server = self._runner.server
        for handler in server.connections if server is not None else []:
            if handler.transport is not None:
                handler.transport.abort()
        log.info("fake remote %s is down", self.server_name)

    async def come_up(self) -> None:
        if not self.down:
            return
        await self._listen()
        self.down = False
        log.info("fake remote %s is up again", self.server_name)

    async def _run_down_schedule(self) -> None:
        for start_s, end_s in sorted(self.faults.down):
            await self._sleep_until(start_s)
            await self.go_down()
            await self._sleep_until(end_s)
            await self.come_up()

    async def _sleep_until(self, elapsed_s: float) -> None:
        delay = self._started_mono_s + elapsed_s - self._clock.monotonic_s()
        if delay > 0:
            await self._clock.sleep(delay)

    # --- handlers --------------------------------------------------------------

    async def _on_version(self, request: web.Request) -> web.StreamResponse:
        if self.down:
            abort(request)
            return web.Response()
        return web.json_response({"server": {"name": "federation-sender-sim", "version": "0"}})

    async def _on_send(self, request: web.Request) -> web.StreamResponse:
        if self.down:
            abort(request)
            self.record.outcomes["down"] += 1
            return web.Response()
        return await self.receiver.receive(request, self.server_name)
