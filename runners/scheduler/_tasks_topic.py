"""The scheduler's tasks topic: folded to its end at start, then followed, active or not."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from deferline.engine import Emit, TaskTable, WrittenState
from deferline.schemas import DeadLetter, SchemaError, TaskStateRecord
from deferline.topics import TopicNames

from ._records import read_as

logger = logging.getLogger(__name__)


class _TasksTopic:
    """Reading the tasks topic for a :class:`Scheduler` (a part of it, not used alone).

    The scheduler's ``__init__`` sets the state declared here, and defines the calls below
    that raise :class:`NotImplementedError`.
    """

    names: TopicNames
    table: TaskTable
    max_records: int
    recovered_records: int
    recovery_seconds: float | None
    restored_tasks: int
    _tasks_idle: bool
    _tasks: AIOKafkaConsumer | None
    _task_tps: list[TopicPartition]
    _tasks_pos: dict[TopicPartition, int]
    _tasks_moved: asyncio.Event
    _written: dict[bytes, WrittenState]
    _active: asyncio.Event
    _publish_lock: asyncio.Lock

    async def _tasks_partitions(self) -> set[int]:
        raise NotImplementedError

    async def _publish(
        self, out: Sequence[Emit], dead: Sequence[DeadLetter] = (), *, offsets: bool = False
    ) -> None:
        raise NotImplementedError

    def _bad(self, exc: SchemaError, *, live: bool) -> str | None:
        raise NotImplementedError

    def _dead(self, message: Any, error: str) -> DeadLetter:
        raise NotImplementedError

    async def _restore_checkpoint(self, topic: str) -> dict[TopicPartition, int] | None:
        raise NotImplementedError

    async def _maybe_checkpoint(self) -> None:
        raise NotImplementedError

    async def _recover(self) -> None:
        """Fold the tasks topic up to its end as of now, before deciding anything: from the
        local checkpoint's positions when it has one that matches, else from the beginning."""
        assert self._tasks is not None
        began = time.monotonic()
        partitions = await self._tasks_partitions()
        self._task_tps = [TopicPartition(self.names.tasks, p) for p in sorted(partitions)]
        saved = await self._restore_checkpoint(self.names.tasks)  # before any fetch starts
        self._tasks.assign(self._task_tps)
        if saved is None:
            await self._tasks.seek_to_beginning(*self._task_tps)
        else:
            for tp, offset in saved.items():
                self._tasks.seek(tp, offset)
        ends = await self._tasks.end_offsets(self._task_tps)
        await self._sync_tasks_pos()
        while any(self._tasks_pos[tp] < ends[tp] for tp in self._task_tps):
            batches = await self._tasks.getmany(timeout_ms=200, max_records=self.max_records)
            for messages in batches.values():
                for message in messages:
                    self._fold_task(message.key, message.value, live=False)
                    self.recovered_records += 1
            await self._sync_tasks_pos()
        self.recovery_seconds = time.monotonic() - began
        logger.info(
            "tasks topic folded",
            extra={
                "from_checkpoint": saved is not None,
                "tasks_restored": self.restored_tasks,
                "records_read": self.recovered_records,
                "tasks": len(self.table),
                "seconds": round(self.recovery_seconds, 3),
            },
        )

    async def _tasks_loop(self) -> None:
        """Fold the tasks topic, active or not; publish what it calls for while active."""
        assert self._tasks is not None
        while True:
            await self._maybe_checkpoint()
            self._tasks_idle = True  # between batches: the table is the fold of _tasks_pos
            try:
                batches = await self._tasks.getmany(timeout_ms=1000, max_records=self.max_records)
            finally:
                self._tasks_idle = False
            dead: list[DeadLetter] = []
            for messages in batches.values():
                for message in messages:
                    bad = self._fold_task(message.key, message.value, live=True)
                    if bad is not None:
                        dead.append(self._dead(message, bad))
            await self._sync_tasks_pos()
            if self._active.is_set() and batches:
                async with self._publish_lock:
                    if self._active.is_set():
                        await self._publish(self.table.drain(), dead)
            self._tasks_moved.set()

    async def _sync_tasks_pos(self) -> None:
        """Positions, not last offsets: transaction markers take offsets but are no records."""
        assert self._tasks is not None
        for tp in self._task_tps:
            self._tasks_pos[tp] = await self._tasks.position(tp)

    async def _tasks_caught_up(self) -> None:
        """Wait until the tasks topic is folded up to its (last stable) end as of now."""
        assert self._tasks is not None
        ends = await self._tasks.end_offsets(self._task_tps)
        while any(self._tasks_pos.get(tp, 0) < end for tp, end in ends.items()):
            self._tasks_moved.clear()
            await self._tasks_moved.wait()

    def _fold_task(self, key: bytes | None, value: bytes | None, *, live: bool) -> str | None:
        if value is None:
            if key is not None:
                self.table.forget(key.decode("utf-8", "replace"))
            return None
        own = self._written.pop(value, None)
        if own is not None:  # one of this scheduler's writes, read back: no need to decode
            self.table.apply(own)
            return None
        try:
            self.table.apply(read_as(value, TaskStateRecord))
        except SchemaError as exc:
            return self._bad(exc, live=live)
        return None
