"""What a destination queue holds: PDUs and EDUs waiting for a transaction.

Memory is proportional to what is pending: presence is one entry per user (latest
wins), receipts are merged per room/type/user/thread (as Synapse does: a receipt of the
same room, type and user for another thread goes into the next receipt EDU, so none is
lost), keyed EDUs clobber by ``(type, key)`` (typing per room and user), and outbox
EDUs are only a window read from the database. Volatile items (everything except
outbox rows) are dropped when the queue falls back to catch-up; outbox rows stay in
the database until a 200 and are read again.
"""

from __future__ import annotations

import enum
import itertools
import json
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

JsonDict = dict[str, Any]

_uids = itertools.count(1)


def json_size(obj: object) -> int:
    return len(json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode())


class EduKind(enum.IntEnum):
    """Also the order of EDUs inside a transaction."""

    PRESENCE = 0
    RECEIPT = 1
    TO_DEVICE = 2
    DEVICE_LIST = 3
    OTHER = 4
    KEYED = 5


@dataclass(frozen=True, slots=True)
class PduItem:
    stream_ordering: int
    event_id: str
    room_id: str
    pdu: JsonDict
    size: int
    uid: int = field(default_factory=lambda: next(_uids))
    encoded: bytes | None = field(default=None, compare=False, repr=False)
    """The PDU's canonical JSON, made once where the item is made (one item is shared
    by every destination's queue); ``None``: the sender encodes it."""


@dataclass(frozen=True, slots=True)
class EduItem:
    kind: EduKind
    edu_type: str
    content: JsonDict
    size: int
    outbox_key: tuple[int, str, str] | None = None
    """(stream_id, user_id, device_id) for device lists, (stream_id, "", "") for to-device."""
    key: tuple[str, Hashable] | None = None
    """(edu_type, key) of a keyed EDU: a later one with the same key supersedes it."""
    uid: int = field(default_factory=lambda: next(_uids))

    def as_json(self) -> JsonDict:
        return {"edu_type": self.edu_type, "content": self.content}


def make_edu(kind: EduKind, edu_type: str, content: JsonDict,
             outbox_key: tuple[int, str, str] | None = None,
             key: tuple[str, Hashable] | None = None) -> EduItem:
    return EduItem(kind, edu_type, content, json_size(content) + len(edu_type) + 30, outbox_key,
                   key)


def _thread_of(receipt: JsonDict) -> object:
    data = receipt.get("data")
    return data.get("thread_id") if isinstance(data, dict) else None


class PduRuns:
    """A queue's pending PDUs in order, held as the runs they were handed over in.

    The fan-out gives every destination of a recipient set the same tuple of PDU items
    (``queue/fanout.py``); a queue keeps a reference to that tuple and an offset into
    its first run, not its own list of references. In a room of 10,000 servers a
    hand-over of 1,000 events is then one tuple shared by 10,000 queues, not 10,000
    lists of 1,000 references each (80 MB; issue #32). Taken from the front a
    transaction's worth at a time."""

    __slots__ = ("_count", "_head", "_rooms", "_runs")

    def __init__(self) -> None:
        self._runs: list[Sequence[PduItem]] = []
        self._head = 0
        """How many items of ``_runs[0]`` were taken already."""
        self._count = 0
        self._rooms: list[str | None] = []
        """Per run of ``_runs[:len(_rooms)]``: its one room, or None (several rooms):
        worked out when :meth:`single_room` is first asked, once per run and queue."""

    def extend(self, items: Sequence[PduItem]) -> None:
        """Append ``items``, kept by reference: the caller must not change them (the
        fan-out hands over tuples)."""
        if items:
            self._runs.append(items)
            self._count += len(items)

    def single_room(self) -> str | None:
        """The room of every pending item if they are all of one room, else None (and
        None when empty). Each run is looked at once (the answer is kept per run)."""
        runs, rooms = self._runs, self._rooms
        for run in itertools.islice(runs, len(rooms), None):
            room: str | None = run[0].room_id
            for item in run:
                if item.room_id != room:
                    room = None
                    break
            rooms.append(room)
        if not rooms:
            return None
        first = rooms[0]
        if first is None:
            return None
        for room in itertools.islice(rooms, 1, None):
            if room != first:
                return None
        return first

    def take(self, indexes: Sequence[int], scanned: int) -> None:
        """Remove the items at ``indexes`` (ascending) of the oldest ``scanned``, keeping
        the order of the rest (they become one run)."""
        if not indexes:
            return
        head = list(itertools.islice(self, scanned))
        gone = set(indexes)
        kept = tuple(item for i, item in enumerate(head) if i not in gone)
        self.drop(len(head))
        if kept:
            self._runs.insert(0, kept)
            self._count += len(kept)
            self._head = 0
            self._rooms.clear()  # worked out again when next asked

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator[PduItem]:
        runs = self._runs
        if runs:
            yield from itertools.islice(runs[0], self._head, None)
            for run in itertools.islice(runs, 1, None):
                yield from run

    def first(self) -> PduItem:
        """The oldest item (IndexError when empty)."""
        if not self._count:
            raise IndexError("no pending PDUs")
        return self._runs[0][self._head]

    def last(self) -> PduItem:
        """The newest item (IndexError when empty)."""
        if not self._count:
            raise IndexError("no pending PDUs")
        return self._runs[-1][-1]

    def head(self, n: int) -> list[PduItem]:
        """The oldest ``n`` items (fewer if fewer are pending), not removed."""
        runs, out = self._runs, []
        if runs:
            first = runs[0]
            out = list(first[self._head:self._head + n])
            i = 1
            while len(out) < n and i < len(runs):
                out.extend(runs[i][:n - len(out)])
                i += 1
        return out

    def drop(self, n: int) -> None:
        """Remove the oldest ``n`` items."""
        n = min(n, self._count)
        self._count -= n
        runs, rooms = self._runs, self._rooms
        while n:
            left = len(runs[0]) - self._head
            if n < left:
                self._head += n
                return
            n -= left
            del runs[0]
            if rooms:
                del rooms[0]
            self._head = 0
        if runs and self._head == len(runs[0]):
            del runs[0]
            if rooms:
                del rooms[0]
            self._head = 0

    def clear(self) -> None:
        self._runs.clear()
        self._rooms.clear()
        self._head = self._count = 0


@dataclass(slots=True)
class PendingItems:
    """What a queue holds to send. The sequences are lists, taken from the front a
    transaction's worth at a time (one slice each): a ``deque`` would allocate 760
    bytes even empty, four per queue."""

    pdus: PduRuns = field(default_factory=PduRuns)
    presence: dict[str, JsonDict] = field(default_factory=dict)
    receipts: list[dict[str, dict[str, dict[str, JsonDict]]]] = field(default_factory=list)
    """The contents of pending ``m.receipt`` EDUs: room -> type -> user -> receipt."""
    keyed: dict[tuple[str, Hashable], EduItem] = field(default_factory=dict)
    other: list[EduItem] = field(default_factory=list)
    to_device: list[EduItem] = field(default_factory=list)
    device_lists: list[EduItem] = field(default_factory=list)
    _unsorted: bool = False

    def add_pdu(self, item: PduItem) -> None:
        self.add_pdus((item,))

    def add_pdus(self, items: Sequence[PduItem]) -> None:
        """Append PDUs given in stream order (the fan-out's hand-over), kept by reference
        (see :class:`PduRuns`)."""
        if not items:
            return
        if self.pdus and items[0].stream_ordering < self.pdus.last().stream_ordering:
            self._unsorted = True
        self.pdus.extend(items)

    def add_edu(self, edu_type: str, content: JsonDict, key: Hashable | None = None) -> None:
        if key is None:
            self.other.append(make_edu(EduKind.OTHER, edu_type, content))
            return
        k = (edu_type, key)
        self.keyed.pop(k, None)  # re-insert: a clobbered EDU moves to the back
        self.keyed[k] = make_edu(EduKind.KEYED, edu_type, content, key=k)

    def add_presence(self, states: Iterable[JsonDict]) -> None:
        for st in states:
            user = str(st.get("user_id", ""))
            self.presence[user] = st

    def add_receipt(self, room_id: str, receipt_type: str, user_id: str, data: JsonDict) -> None:
        """``data`` is the receipt as sent (``{"event_ids": [...], "data": {...}}``, the
        thread id in ``data``). It replaces a pending receipt of the same room, type,
        user and thread, else joins the first EDU that has none for that room, type
        and user (Synapse's ``queue_read_receipt``)."""
        thread = _thread_of(data)
        for content in self.receipts:
            users = content.setdefault(room_id, {}).setdefault(receipt_type, {})
            old = users.get(user_id)
            if old is None or _thread_of(old) == thread:
                users[user_id] = data
                return
        self.receipts.append({room_id: {receipt_type: {user_id: data}}})

    def drop_volatile(self) -> int:
        """Drop everything that is not durable elsewhere; returns how many items."""
        n = self.pdu_count + self.volatile_edu_count
        self.pdus.clear()
        self.presence.clear()
        self.receipts.clear()
        self.keyed.clear()
        self.other.clear()
        self.to_device.clear()
        self.device_lists.clear()
        return n

    @property
    def pdu_count(self) -> int:
        return len(self.pdus)

    @property
    def volatile_edu_count(self) -> int:
        return (
            (1 if self.presence else 0)
            + len(self.receipts)
            + len(self.keyed)
            + len(self.other)
        )

    @property
    def unsorted(self) -> bool:
        """PDUs may not be in stream order (one was added below the tail)."""
        return self._unsorted

    def has_edus(self) -> bool:
        return bool(
            self.presence or self.receipts or self.keyed or self.other
            or self.to_device or self.device_lists
        )

    @property
    def edu_count(self) -> int:
        return self.volatile_edu_count + len(self.to_device) + len(self.device_lists)

    def __bool__(self) -> bool:
        return bool(self.pdus) or self.edu_count > 0

    def min_stream_ordering(self) -> int | None:
        if not self.pdus:
            self._unsorted = False
            return None
        if self._unsorted:
            return min(p.stream_ordering for p in self.pdus)
        # The fan-out hands PDUs over in stream order: the head is the oldest.
        return self.pdus.first().stream_ordering
