"""The active-trigger table of one defer-topic partition: a pure fold over its records.

The defer topic is a table keyed by trigger id: the latest value per key wins and a
tombstone (value ``None``) deletes the key. :class:`ActiveTriggerTable` is that fold plus
the bookkeeping a checkpoint needs: which keys changed since the last checkpoint, the next
defer offset to read, and the lowest resume-topic offset a restart must re-read so that a
trigger whose event was emitted (but whose tombstone was not yet read back) is not run again.
No I/O: the runner feeds it records and acks; the checkpoint store persists its changes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

__all__ = ["ActiveTriggerTable", "TableChanges", "TableEntry"]


@dataclass(frozen=True, slots=True)
class TableEntry:
    """The latest value of one key: the raw record value and where it came from."""

    offset: int
    timestamp: int
    value: bytes


@dataclass(frozen=True, slots=True)
class TableChanges:
    """What changed since the previous checkpoint, with the positions to store beside it."""

    upserts: Mapping[bytes, TableEntry]
    deletes: frozenset[bytes]
    defer_offset: int
    resume_offset: int

    @property
    def empty(self) -> bool:
        """True when there is nothing to write."""
        return not self.upserts and not self.deletes


@dataclass(slots=True)
class ActiveTriggerTable:
    """Latest value per trigger id of one partition, minus tombstones.

    ``defer_offset`` is the next defer-topic offset to fold; ``resume_floor`` is the resume
    offset up to which the resume topic is known not to hold an event for a trigger that is
    still in the table without its own event pending (see :meth:`resume_offset`).
    """

    defer_offset: int = 0
    resume_floor: int = 0
    _entries: dict[bytes, TableEntry] = field(default_factory=dict)
    _dirty: set[bytes] = field(default_factory=set)
    _emitting: dict[bytes, int] = field(default_factory=dict)

    @classmethod
    def restore(
        cls, entries: Mapping[bytes, TableEntry], *, defer_offset: int, resume_offset: int
    ) -> ActiveTriggerTable:
        """A table as a checkpoint left it (nothing dirty)."""
        return cls(defer_offset=defer_offset, resume_floor=resume_offset, _entries=dict(entries))

    # -- the fold -------------------------------------------------------------------------

    def apply(self, key: bytes, value: bytes | None, *, offset: int, timestamp: int = 0) -> None:
        """Fold one defer-topic record at ``offset`` (``value=None`` is a tombstone)."""
        if value is None:
            if self._entries.pop(key, None) is not None:
                self._dirty.add(key)
            self._emitting.pop(key, None)
        else:
            self._entries[key] = TableEntry(offset, timestamp, value)
            self._dirty.add(key)
        if offset >= self.defer_offset:
            self.defer_offset = offset + 1

    def skip(self, offset: int) -> None:
        """Advance past a record that does not belong to the table (no key)."""
        if offset >= self.defer_offset:
            self.defer_offset = offset + 1

    def advance(self, offset: int) -> None:
        """Move the read position to ``offset`` (records below it are known to be folded)."""
        self.defer_offset = max(self.defer_offset, offset)

    # -- reading ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._entries)

    def get(self, key: bytes) -> TableEntry | None:
        """The latest value of ``key``, or None when it is not active."""
        return self._entries.get(key)

    def items(self) -> Iterator[tuple[bytes, TableEntry]]:
        """Every active key with its latest value."""
        return iter(self._entries.items())

    def oldest_timestamp(self) -> int | None:
        """Smallest record timestamp among the active keys (None when empty)."""
        if not self._entries:
            return None
        return min(entry.timestamp for entry in self._entries.values())

    # -- emitted events -------------------------------------------------------------------

    def note_emitting(self, key: bytes) -> None:
        """An event for ``key`` is about to be produced: it lands at or above ``resume_floor``."""
        self._emitting.setdefault(key, self.resume_floor)

    def note_event_offset(self, key: bytes, offset: int) -> None:
        """The event for ``key`` was acked at resume ``offset``."""
        if key in self._emitting:
            self._emitting[key] = offset
        self.resume_floor = max(self.resume_floor, offset + 1)

    def observe_resume_end(self, offset: int) -> None:
        """The resume topic was read (or known) up to ``offset``."""
        self.resume_floor = max(self.resume_floor, offset)

    def emitting(self, key: bytes) -> bool:
        """True when an event for ``key`` was produced or queued and its tombstone not read."""
        return key in self._emitting

    def resume_offset(self) -> int:
        """First resume offset a restart must read: the lowest pending event, else the floor."""
        if self._emitting:
            return min(self.resume_floor, *self._emitting.values())
        return self.resume_floor

    # -- checkpoints ------------------------------------------------------------------------

    def take_changes(self) -> TableChanges:
        """Changes since the last call, with the positions to store beside them; clears them."""
        upserts: dict[bytes, TableEntry] = {}
        deletes: set[bytes] = set()
        for key in self._dirty:
            entry = self._entries.get(key)
            if entry is None:
                deletes.add(key)
            else:
                upserts[key] = entry
        self._dirty.clear()
        return TableChanges(
            upserts=upserts,
            deletes=frozenset(deletes),
            defer_offset=self.defer_offset,
            resume_offset=self.resume_offset(),
        )

    def restore_changes(self, changes: TableChanges) -> None:
        """Mark the keys of a failed checkpoint write dirty again."""
        self._dirty.update(changes.upserts)
        self._dirty.update(changes.deletes)
