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
:class:`RocksCheckpointStore` keeps one rocksdict database per partition under a state
directory; :class:`MemoryCheckpointStore` is the same contract in memory.

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
from typing import Any, Protocol

import orjson
from deferline.topics import LogIdentity, compare_identity

from .._local_state import CheckpointError, open_rocks
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
_META = b"m"
_ENTRY = b"t:"
_ENTRY_END = b"t;"
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


class CheckpointStore(Protocol):
    """Where partition tables are kept between assignments and restarts.

    Implementations are called from worker threads, one call at a time per partition.
    """

    def match_identity(self, topic: str, partitions: Iterable[int], identity: LogIdentity) -> None:
        """Discard the checkpoints of ``partitions`` read from another log than ``identity``
        (one log line, counted), and record ``identity`` with every later write of the topic."""

    def load(self, topic: str, partition: int) -> PartitionCheckpoint | None:
        """The stored checkpoint of the partition, or None (also for one of another log than
        the topic's last :meth:`match_identity`: it is discarded)."""

    def write(self, topic: str, partition: int, changes: TableChanges) -> None:
        """Apply ``changes``, then store the positions (never ahead of the entries)."""

    def discard(self, topic: str, partition: int) -> None:
        """Forget the partition (e.g. the checkpoint no longer matches the topic)."""

    def release(self, topic: str, partition: int) -> None:
        """The partition is no longer owned here: close what is held open for it."""

    def close(self) -> None:
        """Release everything."""


def _meta(
    topic: str,
    partition: int,
    changes: TableChanges,
    saved_at: float,
    identity: LogIdentity | None,
) -> bytes:
    return orjson.dumps(
        {
            "format": _FORMAT,
            "topic": topic,
            "partition": partition,
            "defer_offset": changes.defer_offset,
            "resume_offset": changes.resume_offset,
            "saved_at": saved_at,
            "identity": None if identity is None else identity.to_json(),
        }
    )


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
    """The database records of ``changes``: (key, value), ``None`` to delete the key."""
    for key in changes.deletes:
        yield _ENTRY + key, None
    for key, entry in changes.upserts.items():
        yield _ENTRY + key, _HEADER.pack(entry.offset, entry.timestamp) + entry.value


class MemoryCheckpointStore:
    """The checkpoint contract in memory (tests, and runs without a state directory)."""

    def __init__(self, *, on_mismatch: Callable[[int], None] | None = None) -> None:
        self._data: dict[tuple[str, int], tuple[dict[str, Any], dict[bytes, TableEntry]]] = {}
        self._lock = threading.Lock()
        self._identity = _IdentityCheck(on_mismatch)

    def match_identity(self, topic: str, partitions: Iterable[int], identity: LogIdentity) -> None:
        with self._lock:
            stored = {
                p: _stored_identity(self._data[(topic, p)][0])
                for p in partitions
                if (topic, p) in self._data
            }
            for partition in self._identity.mismatched(topic, stored, identity):
                del self._data[(topic, partition)]

    def load(self, topic: str, partition: int) -> PartitionCheckpoint | None:
        with self._lock:
            stored = self._data.get((topic, partition))
            if stored is None:
                return None
            meta, entries = stored
            return PartitionCheckpoint(
                topic=topic,
                partition=partition,
                defer_offset=meta["defer_offset"],
                resume_offset=meta["resume_offset"],
                saved_at=meta["saved_at"],
                entries=dict(entries),
            )

    def write(self, topic: str, partition: int, changes: TableChanges) -> None:
        with self._lock:
            meta, entries = self._data.setdefault((topic, partition), ({}, {}))
            for key in changes.deletes:
                entries.pop(key, None)
            entries.update(changes.upserts)
            identity = self._identity.current.get(topic)
            meta.update(
                defer_offset=changes.defer_offset,
                resume_offset=changes.resume_offset,
                saved_at=time.time(),
                identity=None if identity is None else identity.to_json(),
            )

    def discard(self, topic: str, partition: int) -> None:
        with self._lock:
            self._data.pop((topic, partition), None)

    def release(self, topic: str, partition: int) -> None:
        """Nothing is held open."""

    def close(self) -> None:
        """Nothing is held open."""


class RocksCheckpointStore:
    """One rocksdict database per partition: ``<state_dir>/<topic>/<partition>/``.

    A database stays open while its partition is owned and is closed on :meth:`release`,
    so another process sharing the state directory can take the partition over and reuse
    the checkpoint. A database that another live process holds open raises
    :class:`CheckpointError`; the caller then runs that partition without a checkpoint.
    """

    def __init__(
        self,
        state_dir: str | Path,
        *,
        batch_bytes: int = 1 << 20,
        on_mismatch: Callable[[int], None] | None = None,
    ) -> None:
        self._root = Path(state_dir)
        self._batch_bytes = batch_bytes
        self._open: dict[tuple[str, int], Any] = {}
        self._lock = threading.Lock()
        self._identity = _IdentityCheck(on_mismatch)

    def _path(self, topic: str, partition: int) -> Path:
        return self._root / topic / str(partition)

    def _db(self, topic: str, partition: int) -> Any:
        with self._lock:
            db = self._open.get((topic, partition))
            if db is not None:
                return db
            db = open_rocks(self._path(topic, partition))
            self._open[(topic, partition)] = db
            return db

    def match_identity(self, topic: str, partitions: Iterable[int], identity: LogIdentity) -> None:
        """A partition whose database cannot be opened, read or discarded now is left to
        :meth:`load`, which checks the identity again (a database another process held
        here may be free by then) and raises CheckpointError if it cannot discard it."""
        stored: dict[int, LogIdentity | None] = {}
        for partition in partitions:
            try:
                raw = self._db(topic, partition).get(_META)
                if raw is not None:
                    stored[partition] = _stored_identity(orjson.loads(raw))
            except (CheckpointError, orjson.JSONDecodeError):
                continue
        for partition in self._identity.mismatched(topic, stored, identity):
            with contextlib.suppress(CheckpointError):
                self.discard(topic, partition)

    def load(self, topic: str, partition: int) -> PartitionCheckpoint | None:
        db = self._db(topic, partition)
        try:
            raw_meta = db.get(_META)
            if raw_meta is None:
                return None
            meta = orjson.loads(raw_meta)
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
            start = len(_ENTRY)
            for key, value in db.items(from_key=_ENTRY):
                if not key.startswith(_ENTRY):
                    break
                offset, timestamp = _HEADER.unpack_from(value)
                entries[key[start:]] = TableEntry(offset, timestamp, value[_HEADER.size :])
        except (orjson.JSONDecodeError, struct.error, KeyError, TypeError) as exc:
            raise CheckpointError(f"checkpoint of {topic}/{partition} is corrupt: {exc}") from exc
        return PartitionCheckpoint(
            topic=topic,
            partition=partition,
            defer_offset=int(meta["defer_offset"]),
            resume_offset=int(meta["resume_offset"]),
            saved_at=float(meta["saved_at"]),
            entries=entries,
        )

    def write(self, topic: str, partition: int, changes: TableChanges) -> None:
        """Write the changes in batches of about ``batch_bytes``, the positions with the last
        (see the module docstring for why a write interrupted between batches is safe)."""
        from rocksdict import WriteBatch

        db = self._db(topic, partition)
        batch, size = WriteBatch(raw_mode=True), 0
        try:
            for key, value in _records(changes):
                if value is None:
                    batch.delete(key)
                    size += len(key)
                else:
                    batch.put(key, value)
                    size += len(key) + len(value)
                if size >= self._batch_bytes:
                    db.write(batch)
                    batch, size = WriteBatch(raw_mode=True), 0
            identity = self._identity.current.get(topic)
            batch.put(_META, _meta(topic, partition, changes, time.time(), identity))
            db.write(batch)
        except Exception as exc:
            raise CheckpointError(f"cannot write checkpoint of {topic}/{partition}: {exc}") from exc

    def discard(self, topic: str, partition: int) -> None:
        db = self._db(topic, partition)
        try:
            db.delete_range(_ENTRY, _ENTRY_END)
            db.delete(_META)
        except Exception as exc:
            raise CheckpointError(
                f"cannot discard checkpoint of {topic}/{partition}: {exc}"
            ) from exc

    def release(self, topic: str, partition: int) -> None:
        with self._lock:
            db = self._open.pop((topic, partition), None)
        if db is not None:
            db.close()

    def close(self) -> None:
        with self._lock:
            dbs, self._open = list(self._open.values()), {}
        for db in dbs:
            db.close()
