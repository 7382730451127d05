"""The scheduler's local checkpoint: its task table and the tasks-topic positions it reflects.

A restarted scheduler restores the table from the checkpoint and folds only the tasks topic's
tail, instead of every record since the topic began. Rows (one per tracked task) and the
positions are written in one rocksdict write batch, so a checkpoint is always the table of
its positions. Only tasks that changed since the previous checkpoint are written.

When is the table "of its positions"? When the tasks consumer has folded exactly up to them
and everything the table decided was published and acknowledged: decisions already in the
table but past the positions are then on the topic, and the tail brings them back as echoes.
The scheduler checkpoints at such points only (between two fetches of the tasks loop, under
the publish lock, with nothing drained and unsent, and no batch still on its way to the
broker), and never again after a failed publish.
Events still pending are not stored: resume offsets are never committed past a pending event,
so a restarted scheduler reads them again.

The header also records the log it was read from (:class:`~deferline.topics.LogIdentity`: the
cluster id, the tasks topic's id and partition count, the topic prefix and the group). A
checkpoint of another log (a recreated cluster or topic whose offsets happen to fall in the
saved range) is discarded, named in one log line and counted, and the topic folded from the
start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition
from deferline.engine import TableDelta, TableRows, TaskTable
from deferline.topics import LogIdentity, Settings, compare_identity, read_log_identity

from .._local_state import CheckpointError, open_rocks, state_home

__all__ = ["SchedulerCheckpoint", "default_state_dir"]

logger = logging.getLogger(__name__)

_FORMAT = 2  # 2: the header records the log identity
_META = b"m"
_ROW = b"t:"
_ROW_END = b"t;"


def default_state_dir(group_id: str) -> Path:
    """``$XDG_STATE_HOME/deferline/scheduler/<group id>``: one checkpoint per scheduler group;
    two schedulers of one group on one host each need their own ``--state-dir``."""
    return state_home() / "scheduler" / group_id


@dataclass(frozen=True, slots=True)
class SavedFold:
    """A checkpoint's header: where it stands on the tasks topic, and the table-wide state."""

    topic: str
    positions: dict[int, int]
    state: dict[str, Any]
    saved_at: float
    identity: LogIdentity | None


class SchedulerCheckpoint:
    """One rocksdict database: ``m`` holds the header, ``t:<ti_key>`` one row per task."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._db: Any = None

    def open(self) -> None:
        """Open the database; CheckpointError if it is locked by another process."""
        if self._db is None:
            self._db = open_rocks(self.path)

    def load(self) -> SavedFold | None:
        """The checkpoint's header, or None if there is none; CheckpointError if it is
        unreadable or of another format (the caller discards it)."""
        raw = self._db.get(_META)
        if raw is None:
            return None
        try:
            meta = orjson.loads(raw)
            if meta.get("format") != _FORMAT:
                raise CheckpointError(
                    f"checkpoint {self.path} is of format {meta.get('format')}, "
                    f"this version reads {_FORMAT}"
                )
            identity = meta.get("identity")
            return SavedFold(
                topic=str(meta["topic"]),
                positions={int(p): int(o) for p, o in meta["positions"].items()},
                state=dict(meta["state"]),
                saved_at=float(meta["saved_at"]),
                identity=None if identity is None else LogIdentity.from_json(identity),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"checkpoint {self.path} is corrupt: {exc}") from exc

    def rows(self) -> Iterator[tuple[bytes, bytes]]:
        """Every stored row: (ti_key, row). Rows are the last keys (``t:`` sorts after ``m``)."""
        start = len(_ROW)
        for key, value in self._db.items(from_key=_ROW):
            yield key[start:], value

    def write(
        self,
        topic: str,
        positions: dict[int, int],
        rows: TableRows,
        identity: LogIdentity | None,
    ) -> None:
        """Store changed rows, deletions, the table-wide state, the positions and the log
        they were read from, atomically."""
        from rocksdict import WriteBatch

        batch = WriteBatch(raw_mode=True)
        for key in rows.deletes:
            batch.delete(_ROW + key)
        for key, value in rows.rows:
            batch.put(_ROW + key, value)
        meta = {
            "format": _FORMAT,
            "topic": topic,
            "positions": {str(p): o for p, o in positions.items()},
            "state": rows.state,
            "saved_at": time.time(),
            "identity": None if identity is None else identity.to_json(),
        }
        batch.put(_META, orjson.dumps(meta))
        try:
            self._db.write(batch)
        except Exception as exc:  # rocksdict raises a bare Exception
            raise CheckpointError(f"cannot write checkpoint {self.path}: {exc}") from exc

    def discard(self) -> None:
        """Forget every row and the header (the checkpoint does not match the topic)."""
        try:
            self._db.delete_range(_ROW, _ROW_END)
            self._db.delete(_META)
        except Exception as exc:
            raise CheckpointError(f"cannot discard checkpoint {self.path}: {exc}") from exc

    def close(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            db.close()


class _Checkpointing:
    """Checkpoints of a :class:`Scheduler` (a part of it, not used alone)."""

    settings: Settings
    group_id: str
    table: TaskTable
    checkpoint_mismatches: int
    checkpoint_interval: float
    checkpoint_max_age: float
    restored_tasks: int
    restore_seconds: float | None
    _checkpoint: SchedulerCheckpoint | None
    _tasks: AIOKafkaConsumer | None
    _task_tps: list[TopicPartition]
    _tasks_pos: dict[TopicPartition, int]
    _tasks_idle: bool
    _publish_lock: asyncio.Lock
    _lead: asyncio.Task[None] | None
    _in_flight: asyncio.Task[None] | None
    _checkpoints_off: bool
    _checkpointed_at: float
    _saved_positions: dict[int, int] | None
    _identity: LogIdentity | None
    _writing: asyncio.Future[bool] | None

    async def _restore_checkpoint(self, topic: str) -> dict[TopicPartition, int] | None:
        """Restore the table from the checkpoint; the positions to fold the tail from, or None
        (no checkpoint, or one that does not match the topic: discarded, fold everything)."""
        store, consumer = self._checkpoint, self._tasks
        if store is None or consumer is None:
            return None
        began = time.monotonic()
        identity = await read_log_identity(
            consumer._client, [topic], prefix=self.settings.topic_prefix, group=self.group_id
        )
        self._identity = identity  # what every checkpoint written from now on reflects
        try:
            saved = await asyncio.to_thread(store.load)
        except CheckpointError as exc:
            logger.warning("scheduler checkpoint discarded: %s", exc)
            await asyncio.to_thread(store.discard)
            return None
        if saved is None:
            return None
        tps = {tp.partition: tp for tp in self._task_tps}
        ends = await consumer.end_offsets(self._task_tps)
        starts = await consumer.beginning_offsets(self._task_tps)
        problem = None
        age = time.time() - saved.saved_at
        mismatch = compare_identity(identity, saved.identity)
        if mismatch is not None:
            problem = f"it was read from another log ({mismatch})"
            self.checkpoint_mismatches += 1
        elif age > self.checkpoint_max_age:
            # Compaction may since have removed tombstones the tail would have to show.
            problem = f"it is {age / 3600:.1f} h old"
        elif saved.topic != topic:
            problem = f"it is of topic {saved.topic}"
        elif set(saved.positions) != set(tps):
            problem = f"{len(saved.positions)} partitions saved, the topic has {len(tps)}"
        else:
            for partition, offset in saved.positions.items():
                tp = tps[partition]
                if not starts[tp] <= offset <= ends[tp]:
                    problem = (
                        f"partition {partition}: saved position {offset} outside "
                        f"{starts[tp]}..{ends[tp]} (topic truncated?)"
                    )
                    break
        if problem is None:
            try:
                tasks = await asyncio.to_thread(self.table.restore_rows, store.rows(), saved.state)
            except ValueError as exc:
                problem = str(exc)
                self.table = TaskTable(pools=self.table.pools)
                self.table.track_changes()
        if problem is not None:
            logger.warning(
                "scheduler checkpoint discarded: %s; folding the tasks topic from the start",
                problem,
                extra={
                    "path": str(store.path),
                    **(
                        {"expected": mismatch.expected, "found": mismatch.found}
                        if mismatch is not None
                        else {}
                    ),
                },
            )
            await asyncio.to_thread(store.discard)
            return None
        self.restored_tasks = tasks
        self.restore_seconds = time.monotonic() - began
        self._saved_positions = dict(saved.positions)
        logger.info(
            "scheduler checkpoint restored",
            extra={
                "path": str(store.path),
                "tasks": tasks,
                "age_seconds": round(age, 1),
                "restore_seconds": round(self.restore_seconds, 3),
            },
        )
        return {tps[p]: offset for p, offset in saved.positions.items()}

    def _capture(self) -> tuple[TableDelta, dict[int, int]] | None:
        """The table's changes and the positions they reflect, if now is a consistent point
        (see the module docstring); call without yielding between the checks and the capture.
        """
        lead = self._lead
        if (
            self._checkpoint is None
            or not self._task_tps
            or self._checkpoints_off
            or self._publish_lock.locked()
            or (lead is not None and lead.done())
            or self.table.unpublished
            or not _sent(self._in_flight)
        ):
            return None
        positions = {tp.partition: self._tasks_pos[tp] for tp in self._task_tps}
        delta = self.table.export_changes()
        if positions == self._saved_positions and not delta.upserts and not delta.deletes:
            return None
        return delta, positions

    async def _maybe_checkpoint(self) -> None:
        """Checkpoint if the interval has passed (called by the tasks loop between fetches)."""
        if self._checkpoint is None or time.monotonic() - self._checkpointed_at < (
            self.checkpoint_interval
        ):
            return
        async with self._publish_lock:
            pass  # let a fold in progress finish
        in_flight = self._in_flight
        if in_flight is not None:
            await asyncio.wait({in_flight})  # and the batch it handed over; the capture
            # below does not yield, and skips this turn if another batch went out meanwhile
        captured = self._capture()
        self._checkpointed_at = time.monotonic()
        if captured is not None:
            await self._store(*captured)

    async def _store(self, delta: TableDelta, positions: dict[int, int]) -> bool:
        """Encode and write in a thread; on failure the keys count as changed again."""
        store = self._checkpoint
        assert store is not None
        topic = self._task_tps[0].topic
        began = time.monotonic()

        def write() -> bool:
            try:
                rows = delta.encode()
            except Exception as exc:  # a value the tagged codec refuses: keep the old one
                raise CheckpointError(f"cannot encode the task table: {exc}") from exc
            store.write(topic, positions, rows, self._identity)
            return True

        self._writing = asyncio.ensure_future(asyncio.to_thread(write))
        try:
            await asyncio.shield(self._writing)  # a cancelled caller leaves it to stop()
        except CheckpointError as exc:
            logger.warning("scheduler checkpoint not written: %s", exc)
            self.table.mark_changed(delta.keys)
            return False
        finally:
            if self._writing.done():
                self._writing = None
        self._saved_positions = positions
        logger.debug(
            "scheduler checkpoint written",
            extra={
                "tasks_written": len(delta.upserts),
                "tasks_deleted": len(delta.deletes),
                "seconds": round(time.monotonic() - began, 3),
            },
        )
        return True

    async def _last_checkpoint(self, main: asyncio.Task[None]) -> None:
        """At stop: capture now if the tasks loop waits between fetches (otherwise the last
        periodic checkpoint stands), stop ``main``, then write it after any write in flight."""
        captured = self._capture() if self._tasks_idle and not main.done() else None
        main.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await main
        if await self._settle_checkpoint() and captured is not None:
            await self._store(*captured)
            await self._settle_checkpoint()

    async def _settle_checkpoint(self) -> bool:
        """Wait for a checkpoint write still running in its thread; False if it failed."""
        writing, self._writing = self._writing, None
        if writing is None:
            return True
        try:
            return await writing
        except CheckpointError:
            return False


def _sent(batch: asyncio.Task[None] | None) -> bool:
    """True when no batch is on its way to the broker and the last one did not fail."""
    return batch is None or (batch.done() and not batch.cancelled() and batch.exception() is None)
