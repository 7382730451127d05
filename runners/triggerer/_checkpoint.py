"""Per-partition checkpoints of the active-trigger table: state and positions written together.

A checkpoint holds one partition's active set (latest value per trigger id) with the defer
offset it reflects and the resume offset a restart must read from. The changed entries are
written first, in write batches of about a megabyte, and the positions last, with the final
batch. A checkpoint interrupted in between keeps the previous positions over entries that
are partly newer; that is safe because the table is a last-value-wins fold: every key that
changed after the stored defer offset has its latest record after it too, so reading the
log on from the stored offset ends each such key at the same value, and a key not read again
did not change. (Why batches: docs/benchmarks.md, "Triggerer checkpoints written in
bounded batches".)
:class:`CheckpointStore` keeps each partition in a
:class:`~deferline.runners.member.PartitionDatabase`, the store every member role uses:
:class:`RocksCheckpointStore` one rocksdict database per partition under a state directory,
:class:`MemoryCheckpointStore` the same in memory.

Each checkpoint also records the log it was read from (:class:`~deferline.topics.LogIdentity`:
cluster id, the ids and partition counts of the defer and resume topics, prefix, group) in
the header every member writes (:class:`~deferline.runners.member.MemberCheckpoint`: the
defer offset is its position, the resume offset its payload). Before partitions are rebuilt,
:meth:`CheckpointStore.match_identity` discards the checkpoints that cannot be restored over
the log read now (of another log, format, topic or partition: a recreated cluster or topic
whose offsets may fall in the saved range, an older version's), one log line per reason,
and counts those of another log.
"""

from __future__ import annotations

import contextlib
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from deferline.topics import LogIdentity

from .._local_state import CheckpointError
from ..member import (
    ROW_PREFIX,
    CheckpointHeader,
    CheckpointUnusable,
    DiscardedCheckpoints,
    MemberCheckpoint,
    MemoryPartitionDatabase,
    PartitionDatabase,
    RocksPartitionDatabase,
)
from ._partition_table import ActiveTriggerTable, TableChanges, TableEntry

__all__ = [
    "CheckpointError",
    "CheckpointStore",
    "MemoryCheckpointStore",
    "PartitionCheckpoint",
    "RocksCheckpointStore",
]

_ENTRY = struct.Struct(">qq")  # a row starts with the entry's offset and timestamp


@dataclass(frozen=True, slots=True)
class PartitionCheckpoint:
    """A stored table: active entries plus the positions they reflect."""

    header: CheckpointHeader
    resume_offset: int
    entries: Mapping[bytes, TableEntry]

    @property
    def defer_offset(self) -> int:
        """The defer offset the entries reflect: the fold reads on from there."""
        return self.header.position

    def table(self) -> ActiveTriggerTable:
        """The table this checkpoint restores."""
        return ActiveTriggerTable.restore(
            self.entries, defer_offset=self.defer_offset, resume_offset=self.resume_offset
        )


def _read(checkpoint: MemberCheckpoint, header: CheckpointHeader) -> PartitionCheckpoint:
    """The table ``checkpoint`` holds under ``header``; CheckpointError if it is corrupt."""
    entries: dict[bytes, TableEntry] = {}
    start = len(ROW_PREFIX)
    try:
        for key, value in checkpoint.rows():
            if not key.startswith(ROW_PREFIX):
                break
            offset, timestamp = _ENTRY.unpack_from(value)
            entries[key[start:]] = TableEntry(offset, timestamp, value[_ENTRY.size :])
        resume_offset = int(header.payload["resume_offset"])
    except Exception as exc:  # a row it cannot parse, or one the database cannot read
        raise CheckpointError(f"checkpoint {checkpoint.where} is corrupt: {exc!r}") from exc
    return PartitionCheckpoint(header=header, resume_offset=resume_offset, entries=entries)


def _records(changes: TableChanges) -> Iterator[tuple[bytes, bytes | None]]:
    """The rows of ``changes``: (key, value), ``None`` to delete the key."""
    for key in changes.deletes:
        yield key, None
    for key, entry in changes.upserts.items():
        yield key, _ENTRY.pack(entry.offset, entry.timestamp) + entry.value


class CheckpointStore:
    """Where partition tables are kept between assignments and restarts: one
    :class:`~deferline.runners.member.MemberCheckpoint` per partition, its database opened by
    ``open_db`` when the partition is first used and closed on :meth:`release`.

    Called from worker threads, one call at a time per partition. A database that cannot be
    opened (another live process holds it) raises :class:`CheckpointError`; the caller then
    runs that partition without a checkpoint. ``on_mismatch`` counts the partition
    checkpoints discarded as read from another log.
    """

    def __init__(
        self,
        open_db: Callable[[str, int], PartitionDatabase],
        *,
        on_mismatch: Callable[[int], None] | None = None,
    ) -> None:
        self._open_db = open_db
        self._open: dict[tuple[str, int], MemberCheckpoint] = {}
        self._lock = threading.Lock()
        self._logs: dict[str, LogIdentity] = {}  # the log each topic is read from now
        self._on_mismatch = on_mismatch

    def _checkpoint(self, topic: str, partition: int) -> MemberCheckpoint:
        with self._lock:
            checkpoint = self._open.get((topic, partition))
            if checkpoint is None:
                db = self._open_db(topic, partition)
                checkpoint = MemberCheckpoint(db, topic=topic, partition=partition)
                self._open[(topic, partition)] = checkpoint
            return checkpoint

    def _discards(self, topic: str) -> DiscardedCheckpoints:
        return DiscardedCheckpoints(topic, on_other_log=self._on_mismatch)

    def match_identity(self, topic: str, partitions: Iterable[int], identity: LogIdentity) -> None:
        """Discard the checkpoints of ``partitions`` that cannot be restored over ``identity``'s
        log (of another log, format, topic or partition: one log line per reason, those of
        another log counted), and record ``identity`` with every later write of the topic.

        A partition whose database cannot be opened, read or discarded now is left to
        :meth:`load`, which checks it again (a database another process held here may be
        free by then) and raises CheckpointError if it cannot discard it."""
        self._logs[topic] = identity
        discards = self._discards(topic)
        for partition in partitions:
            try:
                self._checkpoint(topic, partition).header(identity)
            except CheckpointUnusable as exc:
                discards.add(partition, exc)
            except CheckpointError:
                continue
        for partition in discards.partitions:
            with contextlib.suppress(CheckpointError):
                self.discard(topic, partition)
        discards.report()

    def load(self, topic: str, partition: int) -> PartitionCheckpoint | None:
        """The stored checkpoint of the partition, or None (also for one that is unreadable
        or cannot be restored over the topic's last :meth:`match_identity`: it is discarded
        and said so). CheckpointError if it cannot be opened or discarded."""
        checkpoint = self._checkpoint(topic, partition)
        try:
            header = checkpoint.header(self._logs.get(topic))
            return None if header is None else _read(checkpoint, header)
        except CheckpointError as exc:
            checkpoint.discard()
            discards = self._discards(topic)
            discards.add(partition, exc)
            discards.report()
            return None

    def write(self, topic: str, partition: int, changes: TableChanges) -> None:
        """Apply ``changes``, then store the positions (never ahead of the entries: see the
        module docstring for why a write interrupted between batches is safe)."""
        self._checkpoint(topic, partition).write(
            _records(changes),
            position=changes.defer_offset,
            payload={"resume_offset": changes.resume_offset},
            identity=self._logs.get(topic),
        )

    def discard(self, topic: str, partition: int) -> None:
        """Forget the partition (e.g. the checkpoint no longer matches the topic)."""
        self._checkpoint(topic, partition).discard()

    def release(self, topic: str, partition: int) -> None:
        """The partition is no longer owned here: close what is held open for it."""
        with self._lock:
            checkpoint = self._open.pop((topic, partition), None)
        if checkpoint is not None:
            checkpoint.close()

    def close(self) -> None:
        """Release everything."""
        with self._lock:
            checkpoints, self._open = list(self._open.values()), {}
        for checkpoint in checkpoints:
            checkpoint.close()


class RocksCheckpointStore(CheckpointStore):
    """One rocksdict database per partition: ``<state_dir>/<topic>/<partition>/``, written in
    batches of about ``batch_bytes``. A database stays open (locked) while its partition is
    owned, so another process sharing the state directory can take the partition over and
    reuse the checkpoint once it is released."""

    def __init__(
        self,
        state_dir: str | Path,
        *,
        batch_bytes: int = 1 << 20,
        on_mismatch: Callable[[int], None] | None = None,
    ) -> None:
        root = Path(state_dir)

        def open_db(topic: str, partition: int) -> PartitionDatabase:
            return RocksPartitionDatabase(root / topic / str(partition), batch_bytes=batch_bytes)

        super().__init__(open_db, on_mismatch=on_mismatch)


class MemoryCheckpointStore(CheckpointStore):
    """The same store in memory (tests, and runs without a state directory)."""

    def __init__(self, *, on_mismatch: Callable[[int], None] | None = None) -> None:
        kept: dict[tuple[str, int], MemoryPartitionDatabase] = {}

        def open_db(topic: str, partition: int) -> PartitionDatabase:
            return kept.setdefault(
                (topic, partition), MemoryPartitionDatabase(f"{topic}/{partition} in memory")
            )

        super().__init__(open_db, on_mismatch=on_mismatch)
