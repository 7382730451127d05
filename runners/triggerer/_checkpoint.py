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
cluster id, the ids and partition counts of the defer and resume topics, prefix, group). Before
partitions are rebuilt, :meth:`CheckpointStore.match_identity` discards the checkpoints of
another log (a recreated cluster or topic whose offsets may fall in the saved range), in one
log line naming the difference, and counts them.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deferline.topics import LogIdentity, compare_identity

from .._local_state import CheckpointError
from ..member import (
    ROW_PREFIX,
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

logger = logging.getLogger(__name__)

_FORMAT = 2  # 2: the header records the log identity
_HEADER = struct.Struct(">qq")  # offset, timestamp


@dataclass(frozen=True, slots=True)
class PartitionCheckpoint:
    """A stored table: active entries plus the positions they reflect."""

    topic: str
    partition: int
    defer_offset: int
    resume_offset: int
    saved_at: float
    entries: Mapping[bytes, TableEntry]

    def table(self) -> ActiveTriggerTable:
        """The table this checkpoint restores."""
        return ActiveTriggerTable.restore(
            self.entries, defer_offset=self.defer_offset, resume_offset=self.resume_offset
        )


def _meta(
    topic: str,
    partition: int,
    changes: TableChanges,
    saved_at: float,
    identity: LogIdentity | None,
) -> dict[str, Any]:
    return {
        "format": _FORMAT,
        "topic": topic,
        "partition": partition,
        "defer_offset": changes.defer_offset,
        "resume_offset": changes.resume_offset,
        "saved_at": saved_at,
        "identity": None if identity is None else identity.to_json(),
    }


class _IdentityCheck:
    """The identity part of a store: the log each topic is read from now, and the check of
    stored identities against it (shared by both stores)."""

    def __init__(self, on_mismatch: Callable[[int], None] | None) -> None:
        self.current: dict[str, LogIdentity] = {}
        self._on_mismatch = on_mismatch

    def mismatched(
        self, topic: str, stored: Mapping[int, LogIdentity | None], identity: LogIdentity
    ) -> list[int]:
        """The partitions of ``stored`` (their checkpoints' identities) not of ``identity``;
        logs the first difference once, naming them all."""
        self.current[topic] = identity
        found = {p: compare_identity(identity, i) for p, i in sorted(stored.items())}
        bad = {p: m for p, m in found.items() if m is not None}
        if not bad:
            return []
        first = next(iter(bad.values()))
        logger.warning(
            "checkpoints of %s discarded: they were read from another log (%s); "
            "rebuilding partitions %s from the topics",
            topic,
            first,
            sorted(bad),
            extra={
                "topic": topic,
                "partitions": sorted(bad),
                "expected": first.expected,
                "found": first.found,
            },
        )
        if self._on_mismatch is not None:
            self._on_mismatch(len(bad))
        return sorted(bad)


def _stored_identity(meta: Mapping[str, Any]) -> LogIdentity | None:
    """The identity a checkpoint header records; None when it records none (or an unreadable
    one: either way it is not trusted)."""
    try:
        return LogIdentity.from_json(meta["identity"])
    except (KeyError, TypeError, ValueError):
        return None


def _records(changes: TableChanges) -> Iterator[tuple[bytes, bytes | None]]:
    """The rows of ``changes``: (key, value), ``None`` to delete the key."""
    for key in changes.deletes:
        yield key, None
    for key, entry in changes.upserts.items():
        yield key, _HEADER.pack(entry.offset, entry.timestamp) + entry.value


class CheckpointStore:
    """Where partition tables are kept between assignments and restarts: one
    :class:`~deferline.runners.member.PartitionDatabase` per partition, opened by ``open_db``
    when the partition is first used and closed on :meth:`release`.

    Called from worker threads, one call at a time per partition. A database that cannot be
    opened (another live process holds it) raises :class:`CheckpointError`; the caller then
    runs that partition without a checkpoint.
    """

    def __init__(
        self,
        open_db: Callable[[str, int], PartitionDatabase],
        *,
        on_mismatch: Callable[[int], None] | None = None,
    ) -> None:
        self._open_db = open_db
        self._open: dict[tuple[str, int], PartitionDatabase] = {}
        self._lock = threading.Lock()
        self._identity = _IdentityCheck(on_mismatch)

    def _db(self, topic: str, partition: int) -> PartitionDatabase:
        with self._lock:
            db = self._open.get((topic, partition))
            if db is None:
                db = self._open[(topic, partition)] = self._open_db(topic, partition)
            return db

    def match_identity(self, topic: str, partitions: Iterable[int], identity: LogIdentity) -> None:
        """Discard the checkpoints of ``partitions`` read from another log than ``identity``
        (one log line, counted), and record ``identity`` with every later write of the topic.

        A partition whose database cannot be opened, read or discarded now is left to
        :meth:`load`, which checks the identity again (a database another process held here
        may be free by then) and raises CheckpointError if it cannot discard it."""
        stored: dict[int, LogIdentity | None] = {}
        for partition in partitions:
            try:
                header = self._db(topic, partition).header()
            except CheckpointError:
                continue
            if header is not None:
                stored[partition] = _stored_identity(header)
        for partition in self._identity.mismatched(topic, stored, identity):
            with contextlib.suppress(CheckpointError):
                self.discard(topic, partition)

    def load(self, topic: str, partition: int) -> PartitionCheckpoint | None:
        """The stored checkpoint of the partition, or None (also for one of another log than
        the topic's last :meth:`match_identity`: it is discarded)."""
        db = self._db(topic, partition)
        meta = db.header()
        if meta is None:
            return None
        if meta.get("format") != _FORMAT or meta.get("topic") != topic:
            logger.warning(
                "checkpoint format or topic does not match; ignoring it",
                extra={"topic": topic, "partition": partition},
            )
            return None
        current = self._identity.current.get(topic)
        if current is not None and self._identity.mismatched(
            topic, {partition: _stored_identity(meta)}, current
        ):
            self.discard(topic, partition)
            return None
        entries: dict[bytes, TableEntry] = {}
        start = len(ROW_PREFIX)
        try:
            for key, value in db.rows():
                if not key.startswith(ROW_PREFIX):
                    break
                offset, timestamp = _HEADER.unpack_from(value)
                entries[key[start:]] = TableEntry(offset, timestamp, value[_HEADER.size :])
            return PartitionCheckpoint(
                topic=topic,
                partition=partition,
                defer_offset=int(meta["defer_offset"]),
                resume_offset=int(meta["resume_offset"]),
                saved_at=float(meta["saved_at"]),
                entries=entries,
            )
        except (struct.error, KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {db.where} is corrupt: {exc}") from exc

    def write(self, topic: str, partition: int, changes: TableChanges) -> None:
        """Apply ``changes``, then store the positions (never ahead of the entries: see the
        module docstring for why a write interrupted between batches is safe)."""
        identity = self._identity.current.get(topic)
        self._db(topic, partition).write(
            _records(changes), _meta(topic, partition, changes, time.time(), identity)
        )

    def discard(self, topic: str, partition: int) -> None:
        """Forget the partition (e.g. the checkpoint no longer matches the topic)."""
        self._db(topic, partition).discard()

    def release(self, topic: str, partition: int) -> None:
        """The partition is no longer owned here: close what is held open for it."""
        with self._lock:
            db = self._open.pop((topic, partition), None)
        if db is not None:
            db.close()

    def close(self) -> None:
        """Release everything."""
        with self._lock:
            dbs, self._open = list(self._open.values()), {}
        for db in dbs:
            db.close()


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
