"""Many fake remote homeservers (:class:`~.remotes.FakeRemote`) started, stopped and
reported on together, sharing one clock and the origin's verify keys."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from federation_sender.clock import Clock
from federation_sender.sim.remotes import FakeRemote, RemoteRecord
from federation_sender.testing.faults import FaultProfile
from federation_sender.transport.signing import VerifyKeyLookup


class RemoteFleet:
    """Many fake remotes sharing one clock and the origin's verify keys."""

    def __init__(
        self,
        server_names: Sequence[str],
        *,
        lookup_key: VerifyKeyLookup,
        clock: Clock,
        seed: int = 0,
        faults: Mapping[str, FaultProfile] | None = None,
        host: str = "127.0.0.1",
        port_base: int = 0,
    ) -> None:
        """``port_base``: the remotes listen on consecutive ports from it (0: any)."""
        faults = faults or {}
        self.remotes: dict[str, FakeRemote] = {
            name: FakeRemote(
                name,
                lookup_key=lookup_key,
                clock=clock,
                rng=random.Random(f"{seed}:{name}"),
                faults=faults.get(name),
                host=host,
                port=port_base + i if port_base else 0,
            )
            for i, name in enumerate(server_names)
        }

    async def start(self) -> None:
        started: list[FakeRemote] = []
        try:
            for remote in self.remotes.values():
                await remote.start()
                started.append(remote)
        except BaseException:
            for remote in started:
                await remote.stop()
            raise

    async def stop(self) -> None:
        for remote in self.remotes.values():
            await remote.stop()

    async def __aenter__(self) -> RemoteFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __getitem__(self, server_name: str) -> FakeRemote:
        return self.remotes[server_name]

    def overrides(self) -> dict[str, str]:
        """``destination -> host:port`` for ``federation.destination_overrides``."""
        return {name: r.address for name, r in self.remotes.items()}

    def records(self) -> dict[str, RemoteRecord]:
        return {name: r.record for name, r in self.remotes.items()}
