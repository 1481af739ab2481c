"""The replication client's stored positions, through the storage backend."""

from __future__ import annotations

from federation_sender.storage.protocols import Backend, Tx


class DbPositionStore:
    """Implements :class:`federation_sender.replication.positions.PositionStore`: the
    per-(stream, writer) positions, namespaced by our instance name so several workers
    can share one database."""

    def __init__(self, storage: Backend, instance_name: str) -> None:
        self._storage = storage
        self._reader = instance_name

    async def load(self) -> dict[tuple[str, str], int]:
        async def fn(tx: Tx) -> dict[tuple[str, str], int]:
            return await tx.positions.load_replication(self._reader)

        return await self._storage.run(fn)

    async def save(self, stream: str, instance: str, token: int) -> None:
        async def fn(tx: Tx) -> None:
            await tx.positions.save_replication(self._reader, stream, instance, token)

        await self._storage.run(fn)
