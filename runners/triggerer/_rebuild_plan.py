"""What rebuilding one partition reads and finds, as a plan filled by records (no I/O).

The reading (:mod:`._rebuild`) fetches; the plan folds: the defer records into the table
(latest value per key, minus tombstones), the keyless values past the committed offset
(never dead-lettered yet), and the keys whose event is already on the resume topic.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from ._checkpoint import PartitionCheckpoint
from ._partition_table import ActiveTriggerTable, TableEntry


class Record(Protocol):
    """What the plan reads of a consumer record."""

    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def offset(self) -> int: ...
    @property
    def timestamp(self) -> int: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    """The offsets of one partition when the rebuild started: ``[begin, end)``."""

    begin: int
    end: int


def unusable(
    checkpoint: PartitionCheckpoint, defer: Span, resume: Span, *, now: float, max_age: float
) -> str | None:
    """Why a checkpoint cannot be used (a clause on it), or None when it can: its defer
    offset outside the defer partition now, older than ``max_age`` (as for every member's
    checkpoint), or its resume offset past the end of the resume partition."""
    outdated = checkpoint.header.outdated(defer.begin, defer.end, now=now, max_age=max_age)
    if outdated is not None:
        return outdated
    if checkpoint.resume_offset > resume.end:
        return f"its resume offset {checkpoint.resume_offset} is beyond the end {resume.end}"
    return None


@dataclass(slots=True, eq=False, kw_only=True)
class RebuildPlan:
    """One partition's rebuild: where it reads from and to, and what the records said."""

    number: int
    defer: Span
    resume: Span
    committed: int
    """The group's committed offset: keyless values from here on were never dead-lettered
    (the previous owner commits when it quiesces), and requests from here on no member
    has served yet."""
    table: ActiveTriggerTable
    from_checkpoint: bool
    keyless: list[tuple[int, bytes]] = field(default_factory=list)
    """``(offset, value)`` of keyless values at or past ``committed``: dead-lettered."""
    emitted: dict[bytes, tuple[int, bytes | None]] = field(default_factory=dict)
    """Keys whose event is already on the resume topic: the offset of the last one, and the
    bytes of the first (any later one is a duplicate the scheduler drops)."""
    defer_read: int = 0
    resume_read: int = 0

    @classmethod
    def start(
        cls,
        number: int,
        *,
        defer: Span,
        resume: Span,
        committed: int,
        checkpoint: PartitionCheckpoint | None,
    ) -> RebuildPlan:
        """A plan from a usable checkpoint, or from the start of the topics."""
        if checkpoint is not None:
            table = checkpoint.table()
        else:
            table = ActiveTriggerTable(defer_offset=defer.begin, resume_floor=resume.begin)
        return cls(
            number=number,
            defer=defer,
            resume=resume,
            committed=committed,
            table=table,
            from_checkpoint=checkpoint is not None,
        )

    def defer_range(self) -> tuple[int, int]:
        """The defer offsets still to fold."""
        return self.table.defer_offset, self.defer.end

    def fold(self, records: Sequence[Record]) -> None:
        """Fold a batch of defer records (in offset order, before ``defer.end``)."""
        table, floor, keyless = self.table, self.committed, self.keyless
        self.defer_read += len(records)
        for record in records:
            key, value = record.key, record.value
            if key is None:
                table.skip(record.offset)
                if record.offset >= floor and value is not None:
                    keyless.append((record.offset, value))
            else:
                table.apply(key, value, offset=record.offset, timestamp=record.timestamp)

    def folded(self) -> None:
        """Every defer record up to ``defer.end`` is folded."""
        self.table.advance(self.defer.end)

    def resume_from(self, found: int | None) -> tuple[int, int]:
        """The resume offsets to scan: none without triggers; from the checkpoint's
        position; else from ``found`` (an offset before the oldest deferral), or the start."""
        end = self.resume.end
        if not len(self.table):
            start = end
        elif self.from_checkpoint:
            start = self.table.resume_offset()
        else:
            start = self.resume.begin if found is None else found
        return max(start, self.resume.begin), end

    def collect(self, records: Sequence[Record]) -> None:
        """Note the events already emitted for triggers of the table (resume records)."""
        table, emitted = self.table, self.emitted
        self.resume_read += len(records)
        for record in records:
            key = record.key
            if key is None or key not in table:
                continue
            watch = _watch_event(record.value)
            if watch is _GOES_ON:
                continue
            if watch is _ENDED and not _once(table.get(key)):
                continue  # a standing watch's run ended: it starts again
            first = emitted.get(key)
            value = None if watch is _ENDED else record.value
            emitted[key] = (record.offset, value if first is None else first[1])

    def collected(self) -> None:
        """Every resume record up to ``resume.end`` is read."""
        self.table.observe_resume_end(self.resume.end)

    def already_emitted(self) -> Iterable[tuple[bytes, tuple[int, bytes | None]]]:
        """The keys to tombstone only (their event is there), with the event's offset and
        bytes (copied to tasks.events again before the tombstone)."""
        table = self.table
        return [(key, offset) for key, offset in self.emitted.items() if key in table]


_GOES_ON, _ENDED = object(), object()


def _watch_event(value: bytes | None) -> object:
    """For an event of a standing watch, whether it goes on (:data:`_GOES_ON`: a watch's
    events end nothing) or was its run's last (:data:`_ENDED`: a ``once`` watch ends with
    it); None for any other record. (Read only for the resume records of keys still in the
    table: a few per rebuild.)"""
    raw = _json(value)
    if raw.get("kind") != "watch_event":
        return None
    return _ENDED if raw.get("last") is True else _GOES_ON


def _once(entry: TableEntry | None) -> bool:
    """The table's record is a watch that ends with its first run."""
    raw = _json(None if entry is None else entry.value)
    return raw.get("kind") == "watch_request" and raw.get("once") is True


def _json(value: bytes | None) -> dict[str, Any]:
    if value is None:
        return {}
    try:
        raw = orjson.loads(value)
    except orjson.JSONDecodeError:
        return {}
    return raw if isinstance(raw, dict) else {}


def start_order(plans: Sequence[RebuildPlan]) -> list[tuple[RebuildPlan, bytes, int]]:
    """The folded triggers to start, ``(plan, key, offset)``, in the order to start them.

    First the records at or past the committed offset (no member has served them: a
    request written during the rebalance waits there), then the rest; each group in log
    order, so timers already due fire in the order they were deferred. Keys already
    emitted are left out.
    """
    todo = [
        (entry.offset < plan.committed, entry.offset, plan, key)
        for plan in plans
        for key, entry in plan.table.items()
        if key not in plan.emitted
    ]
    todo.sort(key=lambda item: (item[0], item[1]))
    return [(plan, key, offset) for _, offset, plan, key in todo]
