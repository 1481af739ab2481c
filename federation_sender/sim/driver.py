"""Scenario runner: builds a world of a given size and drives traffic through it.

A :class:`Scenario` is the whole description of a run (sizes, traffic mix, rate,
seed). :class:`Driver` runs it in two phases:

* :meth:`Driver.setup`: create the rooms (some partial-state), join remote users to
  them, persisted in batches;
* :meth:`Driver.run`: ``scenario.steps`` random operations (messages, joins, leaves,
  kicks, bans, remote messages and forks, outliers, to-device messages, device
  changes, partial-state completion), ``batch_size`` per transaction, paced to
  ``rate_per_s`` operations per second on the injected clock (unpaced if ``None``).

Every batch goes world -> :class:`~.store.SimStore` (database, then publisher) ->
:class:`~.expected.Oracle`, in that order, so the oracle only ever knows about rows
that were committed. :class:`Progress` is updated after each batch for live display;
it is plain data and safe to read from another task at any time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.clock import Clock
from federation_sender.sim.expected import Oracle
from federation_sender.sim.model import Batch
from federation_sender.sim.publish import Publisher
from federation_sender.sim.store import PersistedBatch, SimStore
from federation_sender.sim.world import World


def remote_server_names(count: int) -> list[str]:
    """``remote00.test``, ``remote01.test``, ...: names under the reserved ``.test`` TLD."""
    width = max(2, len(str(count - 1)))
    return [f"remote{i:0{width}d}.test" for i in range(count)]


@dataclass(frozen=True, slots=True)
class OperationMix:
    """Relative weights of steady-state operations (they need not sum to 1)."""

    message: float = 0.70
    remote_message: float = 0.05
    fork: float = 0.01
    join: float = 0.06
    leave: float = 0.04
    kick: float = 0.01
    ban: float = 0.005
    outlier: float = 0.005
    to_device: float = 0.04
    device_change: float = 0.01
    finish_partial_state: float = 0.002
    large_message: float = 0.0
    large_message_bytes: int = 70_000


@dataclass(frozen=True, slots=True)
class Scenario:
    server_name: str = "sim.local"
    remote_servers: int = 20
    rooms: int = 40
    partial_state_rooms: int = 4
    users_per_room: int = 8
    """Remote users joined to each room at setup."""
    servers_per_room: int = 5
    """Upper bound on distinct remote servers among a room's initial members."""
    local_users: int = 10
    users_per_server: int = 20
    steps: int = 5_000
    rate_per_s: float | None = 500.0
    batch_size: int = 50
    seed: int = 0
    mix: OperationMix = field(default_factory=OperationMix)

    @property
    def remote_server_names(self) -> list[str]:
        return remote_server_names(self.remote_servers)


@dataclass(slots=True)
class Progress:
    phase: str = "idle"
    batches: int = 0
    steps: int = 0
    events: int = 0
    local_events: int = 0
    membership_changes: int = 0
    to_device: int = 0
    device_changes: int = 0
    last_stream_ordering: int = 0
    started_mono_s: float = 0.0
    """When the current phase started."""
    phase_start_events: int = 0
    elapsed_s: float = 0.0
    """Time spent in the current phase up to the last batch."""

    @property
    def events_per_s(self) -> float:
        """Events written per second in the current phase."""
        n = self.events - self.phase_start_events
        return n / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def describe(self) -> str:
        """One line for live display."""
        return (
            f"{self.phase}: {self.events} events ({self.local_events} local, "
            f"{self.membership_changes} membership), {self.to_device} to-device, "
            f"{self.device_changes} device changes, stream {self.last_stream_ordering}, "
            f"{self.events_per_s:.0f} events/s"
        )


class Driver:
    def __init__(
        self,
        *,
        scenario: Scenario,
        world: World,
        store: SimStore,
        oracle: Oracle,
        clock: Clock,
    ) -> None:
        self.scenario = scenario
        self.world = world
        self.store = store
        self.oracle = oracle
        self.clock = clock
        self.rng = world.rng
        self.progress = Progress()
        mix = scenario.mix
        self._ops = [
            ("message", mix.message),
            ("large_message", mix.large_message),
            ("remote_message", mix.remote_message),
            ("fork", mix.fork),
            ("join", mix.join),
            ("leave", mix.leave),
            ("kick", mix.kick),
            ("ban", mix.ban),
            ("outlier", mix.outlier),
            ("to_device", mix.to_device),
            ("device_change", mix.device_change),
            ("finish_partial_state", mix.finish_partial_state),
        ]

    @classmethod
    def build(
        cls,
        scenario: Scenario,
        *,
        engine: AsyncEngine,
        publisher: Publisher,
        clock: Clock,
        instance_name: str = "master",
    ) -> Driver:
        """Wire a world, store and oracle for ``scenario``."""
        world = World(
            server_name=scenario.server_name,
            remote_servers=scenario.remote_server_names,
            rng=random.Random(scenario.seed),
            clock=clock,
            local_users=scenario.local_users,
            users_per_server=scenario.users_per_server,
        )
        store = SimStore(engine, publisher, clock, instance_name=instance_name)
        return cls(scenario=scenario, world=world, store=store, oracle=Oracle(), clock=clock)

    # --- phases ----------------------------------------------------------------

    async def setup(self) -> None:
        """Create rooms and their initial remote members."""
        s = self.scenario
        self._start("setup")
        batch = Batch()
        for i in range(s.rooms + s.partial_state_rooms):
            if i < s.partial_state_rooms:
                room_id, created = self.world.create_partial_state_room()
            else:
                room_id, created = self.world.create_room()
            batch.extend(created)
            servers = self.rng.sample(
                self.world.remote_servers, min(s.servers_per_room, len(self.world.remote_servers))
            )
            for _ in range(s.users_per_room):
                user = self._joinable_user(room_id, servers)
                if user is not None:
                    batch.extend(self.world.join(room_id, user))
            if len(batch.events) >= s.batch_size:
                await self._persist(batch)
                batch = Batch()
        if len(batch):
            await self._persist(batch)
        self.progress.phase = "ready"

    async def run(self, steps: int | None = None) -> None:
        """Run ``steps`` operations (default: the scenario's), paced to its rate."""
        s = self.scenario
        total = s.steps if steps is None else steps
        self._start("running")
        done = 0
        while done < total:
            n = min(s.batch_size, total - done)
            batch = Batch()
            for _ in range(n):
                batch.extend(self.step())
            done += n
            self.progress.steps += n
            if len(batch):
                await self._persist(batch)
            if s.rate_per_s:
                due = self.progress.started_mono_s + done / s.rate_per_s
                delay = due - self.clock.monotonic_s()
                if delay > 0:
                    await self.clock.sleep(delay)
        self.progress.phase = "done"

    def step(self) -> Batch:
        """One random operation on the world (no I/O)."""
        names = [name for name, _ in self._ops]
        weights = [w for _, w in self._ops]
        op = self.rng.choices(names, weights=weights)[0]
        w = self.world
        room_id = w.pick_room()
        room = w.rooms[room_id]
        if op == "message":
            return w.send_message(room_id)
        if op == "large_message":
            return w.send_message(room_id, body_bytes=self.scenario.mix.large_message_bytes)
        if op in ("remote_message", "fork"):
            return w.receive_message(room_id, fork=op == "fork")
        if op == "join":
            user = self._joinable_user(room_id, w.remote_servers)
            return w.join(room_id, user) if user else w.send_message(room_id)
        if op in ("leave", "kick", "ban"):
            members = room.joined_remote_users(w.server_name)
            if not members:
                return w.send_message(room_id)
            target = self.rng.choice(members)
            if op == "leave":
                return w.leave(room_id, target)
            return w.kick(room_id, target, ban=op == "ban")
        if op == "outlier":
            return w.local_outlier(room_id)
        if op == "to_device":
            return w.send_to_device()
        if op == "device_change":
            return w.change_device()
        partial = [r for r in w.room_ids if w.rooms[r].partial_state]
        return w.finish_partial_state(self.rng.choice(partial)) if partial else Batch()

    # --- helpers ---------------------------------------------------------------

    def _joinable_user(self, room_id: str, servers: list[str]) -> str | None:
        members = self.world.rooms[room_id].members
        for _ in range(10):
            user = self.rng.choice(self.world.remote_users[self.rng.choice(servers)])
            if members.get(user) not in ("join", "ban"):
                return user
        return None

    def _start(self, phase: str) -> None:
        self.progress.phase = phase
        self.progress.started_mono_s = self.clock.monotonic_s()
        self.progress.phase_start_events = self.progress.events
        self.progress.elapsed_s = 0.0

    async def _persist(self, batch: Batch) -> PersistedBatch:
        persisted = await self.store.persist(batch)
        self.oracle.observe(persisted)
        p = self.progress
        p.batches += 1
        p.events += len(persisted.events)
        p.local_events += sum(1 for e in persisted.events if e.event.local)
        p.membership_changes += sum(1 for e in persisted.events if e.event.membership)
        p.to_device += len(persisted.to_device)
        p.device_changes += len(persisted.device_changes)
        if persisted.events:
            p.last_stream_ordering = persisted.events[-1].stream_ordering
        p.elapsed_s = self.clock.monotonic_s() - p.started_mono_s
        return persisted
