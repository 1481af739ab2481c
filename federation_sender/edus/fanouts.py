"""The EDU fan-outs the replication intake feeds, built by the composition root.

:class:`EduFanouts` is what :class:`federation_sender.intake.ReplicationIntake` is
given: one fan-out per derived EDU (the stream table,
:mod:`federation_sender.intake.streams`, says which stream feeds which). The app builds
it with :func:`edu_fanouts` from the backend's rooms and, beside Synapse, Synapse's
configuration (:func:`federation_sender.synapse.wiring.synapse_edus`); a test builds one
on its own rooms. The loops the fan-outs need beside replication are
:meth:`EduFanouts.background`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from federation_sender.clock import Clock
from federation_sender.edus import EduSink, RoomHosts
from federation_sender.edus.presence import PresenceFanout
from federation_sender.edus.receipts import DEFAULT_MAX_DELAY_S, ReceiptFanout
from federation_sender.edus.typing_edus import TypingFanout


@dataclass(frozen=True, slots=True)
class EduFanouts:
    typing: TypingFanout
    receipts: ReceiptFanout
    presence: PresenceFanout | None = None
    """The presence streams' fan-out: beside Synapse with presence enabled; None:
    presence rows are not consumed."""

    def background(self) -> dict[str, Callable[[], Awaitable[None]]]:
        """Loops to run beside the replication client (typing re-sends, receipt
        wake-ups), by name."""
        return {"typing-resend": self.typing.run, "receipt-wakeups": self.receipts.wakeups.run}


def edu_fanouts(
    server_name: str,
    hosts: RoomHosts,
    sink: EduSink,
    clock: Clock,
    *,
    receipt_max_delay_s: float = DEFAULT_MAX_DELAY_S,
    presence: PresenceFanout | None = None,
) -> EduFanouts:
    """The typing and receipt fan-outs on ``hosts``, sending through ``sink`` (the queue
    engine), and the presence fan-out when there is one."""
    return EduFanouts(
        typing=TypingFanout(server_name, hosts, sink, clock),
        receipts=ReceiptFanout(server_name, hosts, sink, clock, receipt_max_delay_s),
        presence=presence,
    )
