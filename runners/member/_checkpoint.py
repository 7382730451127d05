"""One owned partition's checkpoint as every member keeps it: rows, and a header saying what
they reflect and which log they were read from.

A checkpoint is a cache of one partition of one log. The role encodes the rows (the
triggerer's active triggers, the scheduler's tasks); :class:`MemberCheckpoint` writes them
with the header, a JSON object in the last write batch (never ahead of the rows, see
:mod:`._partition_db`):

==============  ==============================================================================
``format``      :data:`CHECKPOINT_FORMAT`, the layout this version writes and reads
``topic``       the topic the rows are a fold of
``partition``   its partition
``position``    the offset of that partition the rows reflect: a restore reads on from there
``saved_at``    when it was written (seconds since the epoch)
``identity``    the log it was read from (:class:`~deferline.topics.LogIdentity`), or null
``payload``     the role's own: the scheduler's table-wide ``state``, the triggerer's
                ``resume_offset``
==============  ==============================================================================

Before anything is restored, :meth:`MemberCheckpoint.header` checks the stored header: one of
another format, topic, partition or log raises :class:`CheckpointUnusable`, saying why; an
unreadable one a CheckpointError naming the checkpoint. A member discards either (a cache:
the partition is rebuilt from the topics), and :class:`DiscardedCheckpoints` says so the
same way for both roles: one warning per reason naming its partitions, and a count of those
read from another log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from deferline.topics import IdentityMismatch, LogIdentity, compare_identity

from .._local_state import CheckpointError
from ._partition_db import PartitionDatabase, Row

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointHeader",
    "CheckpointUnusable",
    "DiscardedCheckpoints",
    "MemberCheckpoint",
]

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 4
"""The header layout written and read. 2: the header records the log identity; 3: the
scheduler's checkpoint is one database per partition; 4: one layout for both roles (the
partition, its position and the role's payload)."""


class CheckpointUnusable(CheckpointError):
    """A stored checkpoint is not one to restore here (of another format, topic, partition
    or log): it is discarded and the partition rebuilt from the topics."""

    def __init__(
        self, where: str, reason: str, *, mismatch: IdentityMismatch | None = None
    ) -> None:
        super().__init__(f"checkpoint {where} cannot be restored: {reason}")
        self.reason = reason
        """Why, as a clause on the checkpoint ("it was read from another log (...)")."""
        self.mismatch = mismatch
        """How its log differs from the one read now; None if it is unusable otherwise."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointHeader:
    """What a partition checkpoint's rows reflect (the layout: see the module docstring)."""

    topic: str
    partition: int
    position: int
    saved_at: float
    identity: LogIdentity | None
    payload: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        """The header as stored."""
        return {
            "format": CHECKPOINT_FORMAT,
            "topic": self.topic,
            "partition": self.partition,
            "position": self.position,
            "saved_at": self.saved_at,
            "identity": None if self.identity is None else self.identity.to_json(),
            "payload": dict(self.payload),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], *, where: str) -> CheckpointHeader:
        """The header stored as ``raw`` in the checkpoint ``where``: CheckpointUnusable if it
        is of another format, CheckpointError if it is corrupt."""
        if raw.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointUnusable(
                where,
                f"it is of format {raw.get('format')}, this version reads {CHECKPOINT_FORMAT}",
            )
        try:
            identity = raw["identity"]
            return cls(
                topic=str(raw["topic"]),
                partition=int(raw["partition"]),
                position=int(raw["position"]),
                saved_at=float(raw["saved_at"]),
                identity=None if identity is None else LogIdentity.from_json(identity),
                payload=dict(raw["payload"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {where} is corrupt: {exc!r}") from exc

    def outdated(self, begin: int, end: int, *, now: float, max_age: float) -> str | None:
        """Why the partition cannot be read on from :attr:`position`, or None if it can: the
        position lies outside the partition's offsets ``begin..end`` now (the topic was
        truncated), or the checkpoint is older than ``max_age`` seconds (compaction may have
        removed tombstones since, that the rows would need to see)."""
        if not begin <= self.position <= end:
            return f"its position {self.position} is outside {begin}..{end} (topic truncated?)"
        age = now - self.saved_at
        if age > max_age:
            return f"it is {age / 3600:.1f} h old (compaction may have dropped tombstones since)"
        return None


class MemberCheckpoint:
    """One owned partition's checkpoint in a :class:`~._partition_db.PartitionDatabase`: the
    rows the role encodes, and the header this object writes and checks. Called from worker
    threads, one call at a time."""

    def __init__(self, db: PartitionDatabase, *, topic: str, partition: int) -> None:
        self.topic = topic
        self.partition = partition
        self._db = db

    @property
    def where(self) -> str:
        """What to call it in an error or a log line."""
        return self._db.where

    def header(self, identity: LogIdentity | None = None) -> CheckpointHeader | None:
        """The stored header, or None if none is stored.

        Raises :class:`CheckpointUnusable` if it is of another format, topic or partition,
        or, with ``identity`` (the log read now; None: not checked), of another log or of
        none recorded; CheckpointError if it cannot be read.
        """
        raw = self._db.header()
        if raw is None:
            return None
        header = CheckpointHeader.from_json(raw, where=self.where)
        if (header.topic, header.partition) != (self.topic, self.partition):
            raise CheckpointUnusable(
                self.where,
                f"it is of {header.topic} partition {header.partition}, "
                f"not of {self.topic} partition {self.partition}",
            )
        if identity is not None:
            mismatch = compare_identity(identity, header.identity)
            if mismatch is not None:
                raise CheckpointUnusable(
                    self.where, f"it was read from another log ({mismatch})", mismatch=mismatch
                )
        return header

    def rows(self) -> Iterator[tuple[bytes, bytes]]:
        """Every row as stored, in key order: (``ROW_PREFIX`` + key, value)."""
        return self._db.rows()

    def write(
        self,
        changes: Iterable[Row],
        *,
        position: int,
        payload: Mapping[str, Any],
        identity: LogIdentity | None,
    ) -> CheckpointHeader:
        """Put the changed rows (value None: delete the key), then the header: the rows
        reflect ``position``, were read from ``identity``'s log (None: not known yet) and come
        with the role's ``payload``. CheckpointError if it cannot."""
        header = CheckpointHeader(
            topic=self.topic,
            partition=self.partition,
            position=position,
            saved_at=time.time(),
            identity=identity,
            payload=payload,
        )
        self._db.write(changes, header.to_json())
        return header

    def discard(self) -> None:
        """Forget every row and the header."""
        self._db.discard()

    def close(self) -> None:
        """Release what is held (the checkpoint stays for the next holder)."""
        self._db.close()


class DiscardedCheckpoints:
    """The checkpoints of one topic a member finds unusable in one pass over its partitions:
    :meth:`report` says so in one warning per reason, naming its partitions, and counts those
    read from another log through ``on_other_log`` (the number of partitions)."""

    def __init__(self, topic: str, *, on_other_log: Callable[[int], None] | None = None) -> None:
        self.topic = topic
        self._on_other_log = on_other_log
        self._by_reason: dict[str, list[int]] = {}
        self._mismatches: dict[str, IdentityMismatch] = {}

    def add(self, partition: int, why: CheckpointError | str) -> None:
        """Note that ``partition``'s checkpoint is unusable, and why: a
        :class:`CheckpointUnusable` (its reason), another CheckpointError (it is unreadable:
        the error says so) or a clause on the checkpoint."""
        if isinstance(why, CheckpointUnusable):
            reason = why.reason
            if why.mismatch is not None:
                self._mismatches[reason] = why.mismatch
        else:
            reason = str(why)
        self._by_reason.setdefault(reason, []).append(partition)

    @property
    def partitions(self) -> list[int]:
        """Every partition noted, in order."""
        return sorted(p for partitions in self._by_reason.values() for p in partitions)

    def report(self, **fields: Any) -> None:
        """Log one warning per reason (``fields`` added to each) and count the partitions
        read from another log; then start again empty."""
        by_reason, self._by_reason = self._by_reason, {}
        mismatches, self._mismatches = self._mismatches, {}
        other_log = 0
        for reason, partitions in by_reason.items():
            partitions = sorted(partitions)
            extra: dict[str, Any] = {**fields, "topic": self.topic, "partitions": partitions}
            mismatch = mismatches.get(reason)
            if mismatch is not None:
                extra.update(expected=mismatch.expected, found=mismatch.found)
                other_log += len(partitions)
            logger.warning(
                "checkpoint discarded: %s; rebuilding partitions %s of %s from the topics",
                reason,
                partitions,
                self.topic,
                extra=extra,
            )
        if other_log and self._on_other_log is not None:
            self._on_other_log(other_log)
