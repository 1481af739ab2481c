"""What a user erased or redacted after their events were queued: checked just before
each transaction goes out (issue #44, item 3).

The fan-out reads an event once and queues it in memory; a destination that is down
may get it minutes later. Meanwhile its sender may have been erased (deactivated with
``erase: true``) or the event redacted. Catch-up reads the database again and withholds
an erased sender's events (:mod:`federation_sender.visibility`); the live queue did
not, and Synapse's own sender does not either: the receiver got every body. So every
transaction the runner sends, live or catch-up, first asks the backend once
(:meth:`~federation_sender.storage.protocols.SendTimeReader.send_time_facts`: one
bounded read for the whole transaction, never one per event), and then:

* an event whose sender is erased is **withheld**: left out of the request, and still
  counted as handled, since the queue's core sees the transaction it froze: its
  position moves past the event when the rest is delivered (when nothing is left, the
  transaction succeeds without a request, as a catch-up page the receiver holds does);
* a redacted event goes out **pruned** (:mod:`federation_sender.pruning`, by its room's
  version), with its canonical JSON made again: the receiver's content-hash check then
  stores it redacted, as the spec provides;
* a redacted event of a room version we do not know is withheld rather than sent whole.

The frozen transaction keeps its id and its items: a retry asks again, so an erasure
between two attempts applies to the second. What the receiver already took cannot be
taken back (a resend of the same id is answered from its cache). The backend's answer
can lag the homeserver by the time of one read; an erasure or redaction committed while
the request is on the wire is not seen, as on any read.

Counted through :meth:`~federation_sender.queue.observer.QueueObserver.send_time_filtered`
and logged at DEBUG (event ids and counts; never a body or a sender).
``queue.send_time_filter: false`` turns the check off.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from federation_sender.pruning import prune, rules_for
from federation_sender.queue.core.batching import Batch
from federation_sender.queue.core.items import PduItem
from federation_sender.queue.observer import QueueObserver
from federation_sender.storage.protocols import SendTimeFacts, SendTimeReader
from federation_sender.transport.encoding import canonical_json

__all__ = ["ERASED_SENDER", "UNKNOWN_ROOM_VERSION", "Filtered", "apply_facts", "filter_at_send"]

log = logging.getLogger(__name__)

ERASED_SENDER = "erased_sender"
UNKNOWN_ROOM_VERSION = "unknown_room_version"
"""Reasons a PDU is withheld at send time (the metric's ``reason`` label)."""


@dataclass(frozen=True, slots=True)
class Filtered:
    """What :func:`apply_facts` made of a transaction's PDUs."""

    pdus: tuple[PduItem, ...]
    """To send, in order: the unchanged items and the pruned ones."""
    withheld: dict[str, list[str]]
    """Event ids left out, by reason."""
    pruned: list[str]
    """Event ids sent pruned."""


def pruned_item(item: PduItem, pdu: dict[str, object]) -> PduItem:
    """``item`` carrying ``pdu`` instead, with its canonical JSON made again (none when
    canonical JSON refuses it: the sender then encodes it, and fails as it would)."""
    try:
        encoded: bytes | None = canonical_json(pdu)
    except (ValueError, TypeError, RecursionError):
        encoded = None
    size = len(encoded) if encoded is not None else item.size
    return replace(item, pdu=pdu, size=size, encoded=encoded)


def _sender(item: PduItem) -> str | None:
    sender = item.pdu.get("sender")
    return sender if isinstance(sender, str) else None


def apply_facts(pdus: Sequence[PduItem], facts: SendTimeFacts) -> Filtered:
    """Withhold the erased senders' PDUs, prune the redacted ones (pure)."""
    out: list[PduItem] = []
    withheld: dict[str, list[str]] = {}
    pruned: list[str] = []
    for item in pdus:
        if _sender(item) in facts.erased_senders:
            withheld.setdefault(ERASED_SENDER, []).append(item.event_id)
            continue
        if item.event_id not in facts.redacted:
            out.append(item)
            continue
        rules = rules_for(facts.redacted[item.event_id])
        if rules is None:
            withheld.setdefault(UNKNOWN_ROOM_VERSION, []).append(item.event_id)
            continue
        out.append(pruned_item(item, prune(item.pdu, rules)))
        pruned.append(item.event_id)
    return Filtered(tuple(out), withheld, pruned)


def _senders(pdus: Iterable[PduItem]) -> set[str]:
    return {s for s in map(_sender, pdus) if s is not None}


async def filter_at_send(
    batch: Batch, store: SendTimeReader, observer: QueueObserver, destination: str
) -> Batch:
    """The batch to send to ``destination``: ``batch`` itself when nothing changed,
    else a new one without the withheld PDUs and with the redacted ones pruned (its
    EDUs the same). Raises what the read raises past its retries (the queue then fails
    and is recreated in catch-up mode, as after a failed write)."""
    pdus = batch.pdus
    if not pdus:
        return batch
    facts = await store.send_time_facts([p.event_id for p in pdus], _senders(pdus))
    if not facts.erased_senders and not facts.redacted:
        return batch
    f = apply_facts(pdus, facts)
    if not f.withheld and not f.pruned:
        return batch  # erased senders or redactions of other events only
    counts = Counter({reason: len(ids) for reason, ids in f.withheld.items()})
    observer.send_time_filtered(destination, counts, len(f.pruned))
    if log.isEnabledFor(logging.DEBUG):
        log.debug("to %s: withholds %s; sends %d redacted event(s) pruned: %s",
                  destination,
                  ", ".join(f"{r}: {', '.join(ids)}" for r, ids in f.withheld.items()) or "none",
                  len(f.pruned), ", ".join(f.pruned) or "-")  # fmt: skip
    return Batch(f.pdus, batch.edus)
