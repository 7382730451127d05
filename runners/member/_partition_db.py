"""One owned partition's local database: a header and rows, the header written last.

Triggerers and schedulers keep a checkpoint per owned partition the same way. ``m`` holds
the header, a JSON object (its layout, what the rows reflect and of which log, is
:class:`~._checkpoint.MemberCheckpoint`'s); ``t:<key>`` holds one row per key. A write
puts the changed rows and the header, the header in the last write batch, so a header is
never ahead of the rows it describes. One batch makes the write atomic (the scheduler's
table needs that); several bound its memory (the triggerer's last-value-wins table can
afford it, see runners/triggerer/_checkpoint.py).

:class:`RocksPartitionDatabase` keeps it in rocksdict, locked by the one process holding it
open; :class:`MemoryPartitionDatabase` in a dict, for runs without a state directory and for
tests. tests/runners/test_partition_db.py holds both to one contract.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import orjson

from .._local_state import CheckpointError, open_rocks

__all__ = [
    "ROW_PREFIX",
    "MemoryPartitionDatabase",
    "PartitionDatabase",
    "RocksPartitionDatabase",
]

_HEADER_KEY = b"m"
ROW_PREFIX = b"t:"
_ROW_END = b"t;"  # the first key past every row

Row = tuple[bytes, bytes | None]  # (key, value); None deletes the key


class PartitionDatabase(Protocol):
    """A partition's header and rows. Called from worker threads, one call at a time."""

    @property
    def where(self) -> str:
        """What to call it in an error or a log line."""

    def header(self) -> dict[str, Any] | None:
        """The header, or None if none was written; CheckpointError if it is unreadable."""

    def rows(self) -> Iterator[tuple[bytes, bytes]]:
        """Every row as stored, in key order: (``ROW_PREFIX`` + key, value). A restore of a
        million rows takes them without a Python step per row, so a row that cannot be read
        raises from the iteration whatever the database raises (rocksdict: a bare
        Exception): the reader treats any error there as an unreadable checkpoint."""

    def write(self, changes: Iterable[Row], header: Mapping[str, Any]) -> None:
        """Put each (key, value) row (``None``: delete the key), then the header, never
        before the rows; CheckpointError if it cannot."""

    def discard(self) -> None:
        """Forget every row and the header."""

    def close(self) -> None:
        """Release what is held (the rows stay for the next holder)."""


def _parse_header(raw: bytes, where: str) -> dict[str, Any]:
    try:
        header = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise CheckpointError(f"checkpoint {where} is corrupt: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"checkpoint {where} is corrupt: its header is not an object")
    return header


class RocksPartitionDatabase:
    """The partition's rocksdict database at ``path``, opened (and locked) at construction:
    CheckpointInUse if another live process holds it. ``batch_bytes`` bounds a write batch;
    None writes everything in one."""

    def __init__(self, path: Path, *, batch_bytes: int | None = None) -> None:
        self.path = path
        self._batch_bytes = batch_bytes
        self._db: Any = open_rocks(path)

    @property
    def where(self) -> str:
        return str(self.path)

    def header(self) -> dict[str, Any] | None:
        try:
            raw = self._db.get(_HEADER_KEY)
        except Exception as exc:  # rocksdict raises a bare Exception (a corrupt block, say)
            raise CheckpointError(f"cannot read checkpoint {self.where}: {exc}") from exc
        return None if raw is None else _parse_header(raw, self.where)

    def rows(self) -> Iterator[tuple[bytes, bytes]]:
        rows: Iterator[tuple[bytes, bytes]] = self._db.items(from_key=ROW_PREFIX)
        return rows  # rows are the last keys: ``t:`` sorts after ``m``

    def write(self, changes: Iterable[Row], header: Mapping[str, Any]) -> None:
        from rocksdict import WriteBatch

        limit = self._batch_bytes
        batch, size = WriteBatch(raw_mode=True), 0
        try:
            for key, value in changes:
                if value is None:
                    batch.delete(ROW_PREFIX + key)
                    size += len(key)
                else:
                    batch.put(ROW_PREFIX + key, value)
                    size += len(key) + len(value)
                if limit is not None and size >= limit:
                    self._db.write(batch)
                    batch, size = WriteBatch(raw_mode=True), 0
            batch.put(_HEADER_KEY, orjson.dumps(header))
            self._db.write(batch)
        except Exception as exc:  # rocksdict raises a bare Exception
            raise CheckpointError(f"cannot write checkpoint {self.where}: {exc}") from exc

    def discard(self) -> None:
        try:
            self._db.delete_range(ROW_PREFIX, _ROW_END)
            self._db.delete(_HEADER_KEY)
        except Exception as exc:
            raise CheckpointError(f"cannot discard checkpoint {self.where}: {exc}") from exc

    def close(self) -> None:
        """Flush and close: the next open reads tables rather than replaying RocksDB's log."""
        db, self._db = self._db, None
        if db is not None:
            try:
                db.flush()
            finally:
                db.close()


class MemoryPartitionDatabase:
    """The same contract in memory; what it holds outlives :meth:`close` (as files do)."""

    def __init__(self, name: str = "in memory") -> None:
        self._name = name
        self._header: bytes | None = None
        self._rows: dict[bytes, bytes] = {}

    @property
    def where(self) -> str:
        return self._name

    def header(self) -> dict[str, Any] | None:
        return None if self._header is None else _parse_header(self._header, self.where)

    def rows(self) -> Iterator[tuple[bytes, bytes]]:
        return iter(sorted(self._rows.items()))

    def write(self, changes: Iterable[Row], header: Mapping[str, Any]) -> None:
        for key, value in changes:
            if value is None:
                self._rows.pop(ROW_PREFIX + key, None)
            else:
                self._rows[ROW_PREFIX + key] = value
        self._header = orjson.dumps(header)

    def discard(self) -> None:
        self._rows.clear()
        self._header = None

    def close(self) -> None:
        """Nothing is held."""
