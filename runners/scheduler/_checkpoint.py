"""The scheduler's local checkpoints: per tasks partition, its tasks and the position they
reflect.

A restarted scheduler restores the table from the checkpoints and folds only the tasks
topic's tail, instead of every record since the topic began. Each tasks partition has a
database of its own, ``<state dir>/<tasks topic>/<partition>/`` (a task's rows go to the
partition its key hashes to, as its records do), each locked by the one process that holds
it open: several schedulers on one host share the default directory, and a partition whose
database another live process holds folds from the topic instead (said in one log line).
A partition's rows (one per tracked task) and its position are written in one rocksdict
write batch, so a checkpoint is always the tasks of its position. Only tasks that changed
since the previous checkpoint are written.

When is the table "of its positions"? When the tasks consumer has folded exactly up to them
and everything the table decided was published and acknowledged: decisions already in the
table but past the positions are then on the topic, and the tail brings them back as echoes.
The scheduler checkpoints at such points only (between two fetches of the tasks loop, under
the publish lock, with nothing drained and unsent, and no batch still on its way to the
broker), and never again after a failed publish. Every partition's checkpoint is captured at
the same point.
Events still pending are not stored: event offsets are never committed past a pending event,
so a restarted scheduler reads them again.

Each partition's checkpoint is a :class:`~deferline.runners.member.MemberCheckpoint`: its
header holds the position, the table-wide state (its payload) and the log it was read from
(:class:`~deferline.topics.LogIdentity`: the cluster id, the tasks topic's id and partition
count, the topic prefix and the group). A checkpoint that cannot be restored (of another
log, such as a recreated cluster or topic whose offsets happen to fall in the saved range; of
another format; too old; past the partition's offsets) is discarded, said in one log line
per reason (those of another log counted), and its partition folded from the start.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from deferline.engine import TableDelta, TableRows, TaskTable
from deferline.topics import LogIdentity, partition_for, read_log_identity

from .._local_state import CheckpointError, CheckpointInUse, state_home
from ..member import (
    ROW_PREFIX,
    CheckpointHeader,
    DiscardedCheckpoints,
    MemberCheckpoint,
    RocksPartitionDatabase,
)
from ._fold import TaskFold

__all__ = ["Checkpoints", "default_state_dir", "merge_states", "split_delta"]

logger = logging.getLogger(__name__)


def default_state_dir(group_id: str) -> Path:
    """``$XDG_STATE_HOME/deferline/scheduler/<group id>``, shared by the group's schedulers on
    a host (each partition's database is locked by the one process holding it)."""
    return state_home() / "scheduler" / group_id


def _changes(rows: TableRows) -> Iterator[tuple[bytes, bytes | None]]:
    """The rows to put, deletions first: (ti_key, row), ``None`` to delete the key."""
    return itertools.chain(((key, None) for key in rows.deletes), rows.rows)


def split_delta(delta: TableDelta, partitions: int) -> dict[int, TableDelta]:
    """``delta`` cut by the tasks partition each key hashes to (partitions without a change
    are left out); every part carries the table's clock."""
    parts: dict[int, TableDelta] = {}

    def part(key: str) -> TableDelta:
        p = partition_for(key.encode(), partitions)
        found = parts.get(p)
        if found is None:
            found = parts[p] = TableDelta([], [], [], [], delta.clock)
        return found

    for upsert in delta.upserts:
        part(upsert[0]).upserts.append(upsert)
    for key in delta.deletes:
        part(key).deletes.append(key)
    for key in delta.repair:
        part(key).repair.append(key)
    for cancel in delta.cancels:
        part(cancel[0]).cancels.append(cancel)
    return parts


def merge_states(states: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The table-wide state of several partitions' checkpoints, as one table restores it:
    the latest clock, every repair and every cancel."""
    merged: dict[str, Any] = {}
    for state in states:
        if not merged:
            merged = {**state, "repair": list(state["repair"]), "cancels": list(state["cancels"])}
            continue
        if state.get("format") != merged.get("format"):
            raise ValueError("checkpoints of different formats")
        merged["clock"] = max(merged["clock"], state["clock"], key=_instant)
        merged["repair"] += state["repair"]
        merged["cancels"] += state["cancels"]
    return merged


def _instant(clock: str) -> float:
    return dt.datetime.fromisoformat(clock).timestamp()


class Checkpoints:
    """The scheduler's checkpoints: one :class:`~deferline.runners.member.MemberCheckpoint`
    per tasks partition this process could lock, restored at start and written at the points
    the shell says are consistent (see the module docstring). ``mismatches`` counts the
    partition checkpoints discarded as read from another log."""

    def __init__(self, state_dir: str | Path, *, interval: float, max_age: float) -> None:
        self.root = Path(state_dir)
        self.interval = interval
        self.max_age = max_age
        self.mismatches = 0
        self.restored_tasks = 0
        self.restore_seconds: float | None = None
        self.off = False  # a publish failed: the table may be ahead of the topic for good
        self._topic = ""
        self._partitions = 0
        self._stores: dict[int, MemberCheckpoint] = {}
        self._saved: dict[int, int] = {}
        self._identity: LogIdentity | None = None
        self._tried_at = 0.0
        self._writing: asyncio.Future[tuple[list[int], dict[int, TableDelta]]] | None = None

    def path(self, topic: str, partition: int) -> Path:
        return self.root / topic / str(partition)

    def _open_one(self, topic: str, partition: int) -> MemberCheckpoint:
        """Open (and lock) the partition's database, each write one batch (atomic: the table
        is not a last-value-wins fold); CheckpointInUse if another process holds it."""
        db = RocksPartitionDatabase(self.path(topic, partition))
        return MemberCheckpoint(db, topic=topic, partition=partition)

    def open(self, topic: str, partitions: Iterable[int], *, total: int) -> None:
        """Open each partition's database (of ``total`` tasks partitions); one another
        process holds is left to it, and that partition folds from the topic.
        CheckpointError for any other failure."""
        self._topic = topic
        ids = sorted(partitions)
        self._partitions = total
        for p in ids:
            if p in self._stores:
                continue
            try:
                self._stores[p] = self._open_one(topic, p)
            except CheckpointInUse:
                logger.info(
                    "tasks partition %d folds from the topic: its checkpoint is held by "
                    "another process",
                    p,
                    extra={"path": str(self.path(topic, p))},
                )

    async def saved_positions(self, partitions: Iterable[int]) -> dict[int, int]:
        """The position each opened partition's checkpoint was saved at, where it has a
        usable header (its log unchecked: :meth:`restore` still checks it)."""
        positions: dict[int, int] = {}
        for p in partitions:
            store = self._stores.get(p)
            if store is None:
                continue
            try:
                saved = await asyncio.to_thread(store.header)
            except CheckpointError:
                continue  # the restore says why and discards it
            if saved is not None:
                positions[p] = saved.position
        return positions

    async def on_disk(self, topic: str, partitions: Iterable[int]) -> set[int]:
        """The partitions whose checkpoint this host holds with a header and no other process
        has open: those a takeover here would restore rather than fold from the start. Each
        database is opened and closed again (the lock is not kept)."""

        def read() -> set[int]:
            found: set[int] = set()
            for p in partitions:
                if p in self._stores or not self.path(topic, p).exists():
                    continue
                try:
                    store = self._open_one(topic, p)
                except CheckpointError:  # held by another process
                    continue
                try:
                    saved = store.header()
                except CheckpointError:  # unusable or unreadable
                    continue
                finally:
                    store.close()
                if saved is not None:
                    found.add(p)
            return found

        return await asyncio.to_thread(read)

    async def restore(
        self,
        fold: TaskFold,
        consumer: AIOKafkaConsumer,
        tps: list[TopicPartition],
        *,
        prefix: str,
        group: str,
    ) -> dict[TopicPartition, int]:
        """Restore the table from the partitions' checkpoints; the position to fold each
        restored partition's tail from (the others fold from the start, their checkpoint
        discarded if it cannot be restored)."""
        by_partition = {tp.partition: tp for tp in tps}
        mine = {p: store for p, store in self._stores.items() if p in by_partition}
        if not mine:
            return {}
        began = time.monotonic()
        identity = self._identity
        if identity is None:
            identity = await read_log_identity(
                consumer._client, [self._topic], prefix=prefix, group=group
            )
            self._identity = identity  # what every checkpoint written from now on reflects
        ends = await consumer.end_offsets(tps)
        starts = await consumer.beginning_offsets(tps)
        usable: dict[int, CheckpointHeader] = {}
        discards = DiscardedCheckpoints(self._topic, on_other_log=self._other_log)
        for p, store in mine.items():
            tp = by_partition[p]
            saved = await asyncio.to_thread(
                self._usable, store, identity, starts[tp], ends[tp], discards
            )
            if saved is not None:
                usable[p] = saved
        for p in discards.partitions:
            await asyncio.to_thread(mine[p].discard)
        discards.report()
        if not usable:
            return {}
        stores = [self._stores[p] for p in sorted(usable)]
        try:
            state = merge_states(saved.payload["state"] for saved in usable.values())
            tasks = await asyncio.to_thread(
                fold.table.restore_rows,
                itertools.chain.from_iterable(store.rows() for store in stores),
                state,
                skip=len(ROW_PREFIX),
            )
        except Exception as exc:  # a row the table refuses, or one the database cannot read
            fold.reset()
            for p, store in zip(sorted(usable), stores, strict=True):
                discards.add(p, f"it cannot be restored ({exc!r})")
                await asyncio.to_thread(store.discard)
            discards.report()
            return {}
        self.restored_tasks += tasks
        self.restore_seconds = time.monotonic() - began
        restored = {p: saved.position for p, saved in usable.items()}
        self._saved.update(restored)
        logger.info(
            "scheduler checkpoint restored",
            extra={
                "path": str(self.root / self._topic),
                "partitions": sorted(usable),
                "tasks": tasks,
                "restore_seconds": round(self.restore_seconds, 3),
            },
        )
        return {by_partition[p]: offset for p, offset in restored.items()}

    def _usable(
        self,
        store: MemberCheckpoint,
        identity: LogIdentity,
        start: int,
        end: int,
        discards: DiscardedCheckpoints,
    ) -> CheckpointHeader | None:
        """``store``'s header if its checkpoint can be restored over the log ``identity``
        names, whose partition now holds offsets ``start..end``; else None, noting in
        ``discards`` why not (if there is one)."""
        try:
            saved = store.header(identity)
        except CheckpointError as exc:  # unusable or unreadable
            discards.add(store.partition, exc)
            return None
        if saved is None:
            return None
        reason = saved.outdated(start, end, now=time.time(), max_age=self.max_age)
        if reason is not None:
            discards.add(store.partition, reason)
            return None
        return saved

    def _other_log(self, partitions: int) -> None:
        self.mismatches += partitions

    def due(self) -> bool:
        """True when the interval since the last attempt has passed."""
        return bool(self._stores) and time.monotonic() - self._tried_at >= self.interval

    def tried(self) -> None:
        """An attempt was made (written or not): the next is due an interval from now."""
        self._tried_at = time.monotonic()

    def capture(
        self, table: TaskTable, positions: Mapping[int, int]
    ) -> tuple[TableDelta, dict[int, int]] | None:
        """The table's changes and the positions they reflect; call at a consistent point,
        without yielding between the caller's checks and this."""
        if not self._stores or self.off:
            return None
        held = {p: positions[p] for p in self._stores if p in positions}
        delta = table.export_changes()
        if all(self._saved.get(p) == o for p, o in held.items()) and not (
            delta.upserts or delta.deletes
        ):
            return None
        return delta, held

    async def write(self, table: TaskTable, delta: TableDelta, positions: dict[int, int]) -> bool:
        """Split, encode and write each partition's part in a thread (hashing a million keys
        to their partition would hold the event loop); on failure its keys count as changed
        again (the parts written stand: each is the tasks of its own position)."""
        partitions = self._partitions
        empty = TableDelta([], [], [], [], delta.clock)
        began = time.monotonic()

        def write_all() -> tuple[list[int], dict[int, TableDelta]]:
            parts = split_delta(delta, partitions)
            failed = []
            for p in positions:
                store = self._stores.get(p)
                if store is None:
                    continue  # closed since the capture: its partition went elsewhere
                part = parts.get(p, empty)
                try:
                    try:
                        rows = part.encode()
                    except Exception as exc:  # a value the tagged codec refuses
                        raise CheckpointError(f"cannot encode the task table: {exc}") from exc
                    store.write(
                        _changes(rows),
                        position=positions[p],
                        payload={"state": rows.state},
                        identity=self._identity,
                    )
                except CheckpointError as exc:
                    logger.warning("scheduler checkpoint not written: %s", exc)
                    failed.append(p)
            return failed, parts

        self._writing = writing = asyncio.ensure_future(asyncio.to_thread(write_all))
        try:
            failed, parts = await asyncio.shield(writing)  # a cancelled caller leaves it to stop()
        finally:
            if writing.done():
                self._writing = None
        for p in failed:
            table.mark_changed(parts.get(p, empty).keys)
        self._saved.update({p: o for p, o in positions.items() if p not in failed})
        logger.debug(
            "scheduler checkpoint written",
            extra={
                "tasks_written": len(delta.upserts),
                "tasks_deleted": len(delta.deletes),
                "partitions_failed": failed,
                "seconds": round(time.monotonic() - began, 3),
            },
        )
        return not failed

    async def settle(self) -> bool:
        """Wait for a write still running in its thread; False if it failed."""
        writing, self._writing = self._writing, None
        if writing is None:
            return True
        failed, _ = await writing
        return not failed

    async def discard(self, partition: int) -> None:
        """Empty one partition's checkpoint (its table comes from elsewhere: every row will
        be written again)."""
        store = self._stores.get(partition)
        self._saved.pop(partition, None)
        if store is not None:
            await asyncio.to_thread(store.discard)

    async def close_partition(self, partition: int) -> None:
        """Close one partition's database (it went to another scheduler): after the write
        in flight; the lock is released for another process on this host."""
        await self.settle()
        store = self._stores.pop(partition, None)
        self._saved.pop(partition, None)
        if store is not None:
            await asyncio.to_thread(store.close)

    def close(self) -> None:
        stores, self._stores = self._stores, {}
        for store in stores.values():
            store.close()
