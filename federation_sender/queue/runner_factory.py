"""How a destination's runner is built, and what every runner of a manager shares.

The registry creates a queue lazily, on the first item for a destination, through a
:class:`RunnerFactory`. The factory holds what is shared by all of them: the backoff
policy and batch limits (read once from the settings), the :class:`RunnerConfig`, the
two slot limits (concurrent transactions across all destinations; concurrent database
work of queues), the parsed-PDU cache and this run's transaction ids. The manager keeps
the queue-level wiring (registry, fan-out, federation stream, housekeeping).

Txn ids are ``<base>.<n>``: the base is this run's start time and the instance's name
(:func:`txn_id_base`), ``n`` counts from 1.
"""

from __future__ import annotations

import itertools
import random
import zlib

from federation_sender.aio.idle import IdleSignal
from federation_sender.aio.slots import Slots
from federation_sender.clock import Clock, time_ms
from federation_sender.config import QueueSettings
from federation_sender.queue.coalesce import HandOverGate
from federation_sender.queue.core.backoff import BackoffPolicy
from federation_sender.queue.core.batching import Limits
from federation_sender.queue.core.catchup import PduCache
from federation_sender.queue.core.destination import DestinationCore
from federation_sender.queue.core.states import DestinationState
from federation_sender.queue.observer import QueueObserver
from federation_sender.queue.persistence import QueuePersistence
from federation_sender.queue.runner import DestinationRunner
from federation_sender.queue.runner_config import RunnerConfig
from federation_sender.transport.result import TransactionSender


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def txn_id_base(now_ms: int, instance_name: str) -> str:
    """The prefix of this run's txn ids. The start time alone repeated itself when two
    instances started in the same millisecond: after a hand-over the new owner's
    "base.N" could equal a txn id the destination had already answered, which it would
    deduplicate unread. Instance names are unique among the shard's members."""
    return f"{_base36(now_ms)}_{_base36(zlib.crc32(instance_name.encode()))}"


class RunnerFactory:
    """``factory(destination, catching_up, last_error)`` builds a destination's runner."""

    def __init__(
        self,
        store: QueuePersistence,
        sender: TransactionSender,
        settings: QueueSettings,
        server_name: str,
        instance_name: str,
        clock: Clock,
        rng: random.Random,
        observer: QueueObserver,
        gate: HandOverGate | None,
        *,
        attempt_deadline_s: float,
        db_concurrency: int,
        idle: IdleSignal | None = None,
    ) -> None:
        self._store = store
        self._idle = idle
        self._sender = sender
        self._settings = settings
        self._clock = clock
        self._rng = rng
        self._observer = observer
        self._gate = gate
        self.policy = BackoffPolicy.from_settings(settings)
        self.limits = Limits.from_settings(settings)
        self.config = RunnerConfig.from_settings(
            settings, server_name, instance_name, attempt_deadline_s
        )
        self.txn_slots = Slots(settings.max_concurrent_transactions)
        self.db_slots = Slots(db_concurrency)
        self._pdu_cache = PduCache()
        self._txn_base = txn_id_base(time_ms(clock), instance_name)
        self._txn_counter = itertools.count(1)

    def next_txn_id(self) -> str:
        return f"{self._txn_base}.{next(self._txn_counter)}"

    def __call__(
        self, destination: str, catching_up: bool, last_error: str | None = None
    ) -> DestinationRunner:
        observer = self._observer

        def on_state(old: DestinationState, new: DestinationState) -> None:
            observer.state_changed(destination, old, new)

        core = DestinationCore(
            destination,
            self.policy,
            self.limits,
            self._rng,
            self.next_txn_id,
            max_item_failures=self._settings.max_item_failures,
            max_rooms_per_txn=self._settings.catchup_rooms_per_batch,
            on_state_change=on_state,
            catching_up=catching_up,
            parse_pdu=self._pdu_cache,
            last_error=last_error,
        )
        return DestinationRunner(
            core,
            self._store,
            self._sender,
            self.txn_slots,
            self.db_slots,
            self._clock,
            observer,
            self.config,
            self._gate,
            self._idle,
        )
