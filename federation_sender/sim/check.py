"""The delivery check: what the fake remotes recorded against what the oracle expects.

Pass criteria, per destination:

* **rooms**: for every room, the destination received the oracle's latest event for
  it *or a later event of the same room* (catch-up may send a newer forward
  extremity instead of every missed event);
* **no leaks**: every local event it received is one it was a host of
  (``unexpected`` counts the others, e.g. an event sent after the server left);
* **no corruption**: every received PDU is one the simulator wrote (``unknown`` counts
  PDUs whose reference hash matches no event: altered in transit, or invented);
* **to-device**: every message id arrived (to-device messages are never coalesced);
* **device lists**: for every (user, device) poked, an ``m.device_list_update``
  arrived, with a ``stream_id`` at least the latest poke's when the EDU carries one.

Duplicates (the same PDU in more than one processed transaction) and events received
in live mode beyond the latest are counted but are not failures: delivery is
at-least-once, and catch-up legitimately skips intermediate events.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from federation_sender.clock import Clock
from federation_sender.sim.expected import ExpectedEvent, Oracle
from federation_sender.sim.remotes import RemoteRecord


@dataclass(frozen=True, slots=True)
class RoomShortfall:
    destination: str
    room_id: str
    expected: ExpectedEvent
    got_stream_ordering: int | None
    """The latest event of the room the destination did get, if any."""


@dataclass(slots=True)
class DestinationReport:
    destination: str
    rooms_expected: int = 0
    rooms_ok: int = 0
    events_expected: int = 0
    events_received: int = 0
    """Distinct expected events received (live mode delivers all; catch-up fewer)."""
    duplicates: int = 0
    unexpected: list[str] = field(default_factory=list)
    extremities_received: int = 0
    """Other servers' events received as catch-up forward extremities."""
    unknown: int = 0
    missing_rooms: list[RoomShortfall] = field(default_factory=list)
    to_device_expected: int = 0
    to_device_missing: list[str] = field(default_factory=list)
    to_device_duplicates: int = 0
    device_updates_expected: int = 0
    device_updates_missing: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.missing_rooms
            or self.unexpected
            or self.unknown
            or self.to_device_missing
            or self.device_updates_missing
        )


@dataclass(slots=True)
class DeliveryReport:
    destinations: dict[str, DestinationReport]

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.destinations.values())

    def total(self, attr: str) -> int:
        total = 0
        for d in self.destinations.values():
            value = getattr(d, attr)
            total += len(value) if isinstance(value, list) else int(value)
        return total

    def summary(self) -> str:
        """A few human-readable lines; failing destinations listed first."""
        t = self.total
        lines = [
            f"delivery check: {'OK' if self.ok else 'FAILED'} - "
            f"{len(self.destinations)} destinations, "
            f"rooms {t('rooms_ok')}/{t('rooms_expected')} up to date, "
            f"events {t('events_received')}/{t('events_expected')} received, "
            f"{t('duplicates')} duplicates, {t('unexpected')} unexpected, {t('unknown')} unknown, "
            f"to-device missing {t('to_device_missing')}/{t('to_device_expected')}, "
            f"device updates missing {t('device_updates_missing')}/{t('device_updates_expected')}"
        ]
        for name in sorted(self.destinations):
            d = self.destinations[name]
            if d.ok:
                continue
            lines.append(
                f"  {name}: {len(d.missing_rooms)} rooms behind, {len(d.unexpected)} unexpected, "
                f"{d.unknown} unknown, {len(d.to_device_missing)} to-device missing, "
                f"{len(d.device_updates_missing)} device updates missing"
            )
            for s in d.missing_rooms[:3]:
                got = "nothing" if s.got_stream_ordering is None else f"#{s.got_stream_ordering}"
                lines.append(
                    f"    {s.room_id}: expected #{s.expected.stream_ordering} "
                    f"{s.expected.event_id}, got {got}"
                )
        return "\n".join(lines)


async def wait_for_delivery(
    oracle: Oracle,
    records: Callable[[], Mapping[str, RemoteRecord]],
    clock: Clock,
    *,
    timeout_s: float,
    poll_s: float = 0.5,
) -> DeliveryReport:
    """Check every ``poll_s`` until the check passes or ``timeout_s`` has passed;
    return the last report (``ok`` tells which)."""
    deadline = clock.monotonic_s() + timeout_s
    while True:
        report = check_delivery(oracle, records())
        remaining = deadline - clock.monotonic_s()
        if report.ok or remaining <= 0:
            return report
        await clock.sleep(min(poll_s, remaining))


def check_delivery(oracle: Oracle, records: Mapping[str, RemoteRecord]) -> DeliveryReport:
    """Compare every destination the oracle knows, or a remote recorded, with the oracle."""
    names = set(oracle.destinations) | set(records)
    return DeliveryReport(
        {name: _check_destination(oracle, name, records.get(name)) for name in sorted(names)}
    )


def _check_destination(oracle: Oracle, name: str, record: RemoteRecord | None) -> DestinationReport:
    record = record or RemoteRecord()
    expect = oracle.destinations.get(name)
    report = DestinationReport(name)
    should = {e.event_id for e in expect.should_receive} if expect else set()
    report.events_expected = len(should)

    latest_got: dict[str, int] = {}
    for event_id, count in record.pdu_counts.items():
        report.duplicates += count - 1
        known = oracle.events_by_id.get(event_id)
        if known is None:
            report.unknown += 1
            continue
        if event_id not in should:
            if known.local:
                report.unexpected.append(event_id)
                continue
            # Another server's event, sent by catch-up as the room's forward
            # extremity: it stands in for every earlier event of the room (the
            # destination fetches what it lacks), as in Synapse.
            report.extremities_received += 1
        else:
            report.events_received += 1
        if known.stream_ordering > latest_got.get(known.room_id, 0):
            latest_got[known.room_id] = known.stream_ordering

    if expect is not None:
        report.rooms_expected = len(expect.latest)
        for room_id, exp in sorted(expect.latest.items()):
            got = latest_got.get(room_id)
            if got is not None and got >= exp.stream_ordering:
                report.rooms_ok += 1
            else:
                report.missing_rooms.append(RoomShortfall(name, room_id, exp, got))

    _check_edus(report, record, oracle, name)
    return report


def _check_edus(report: DestinationReport, record: RemoteRecord, oracle: Oracle, name: str) -> None:
    expect = oracle.destinations.get(name)
    seen_messages: dict[str, int] = {}
    device_seen: dict[tuple[str, str], int | None] = {}
    for edu in record.edus:
        content = edu.get("content")
        if not isinstance(content, dict):
            continue
        edu_type = edu.get("edu_type")
        if edu_type == "m.direct_to_device":
            mid = str(content.get("message_id"))
            seen_messages[mid] = seen_messages.get(mid, 0) + 1
        elif edu_type == "m.device_list_update":
            key = (str(content.get("user_id")), str(content.get("device_id")))
            stream_id = content.get("stream_id")
            prev = device_seen.get(key)
            if isinstance(stream_id, int) and not isinstance(stream_id, bool):
                device_seen[key] = stream_id if prev is None else max(prev, stream_id)
            elif key not in device_seen:
                device_seen[key] = None
    report.to_device_duplicates = sum(n - 1 for n in seen_messages.values())
    if expect is None:
        return
    report.to_device_expected = len(expect.to_device_message_ids)
    report.to_device_missing = sorted(expect.to_device_message_ids - set(seen_messages))
    report.device_updates_expected = len(expect.device_updates)
    for key, want in sorted(expect.device_updates.items()):
        if key not in device_seen:
            report.device_updates_missing.append(key)
            continue
        got = device_seen[key]
        if got is not None and got < want:
            report.device_updates_missing.append(key)
