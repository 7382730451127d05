"""The scheduler's periodic upkeep: orphaned events, finished tasks, lag.

:class:`Housekeeping` owns the lag figures (``lag`` per input, ``events_lag`` per owned
tasks.events partition) and runs the loop that, every ``interval``, dead-letters events that
can never apply, forgets finished tasks past retention, trims the router's memory and
refreshes the lag. The table, the writers and the offsets it reads are their owners'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import IllegalStateError, KafkaError
from deferline.schemas import EventFields

from ._fold import TaskFold
from ._publishing import EventOffsets
from ._records import orphan_letter
from ._routing import PartitionRouter
from ._tasks_topic import TasksReader
from ._writers import PartitionWriters

__all__ = ["Housekeeping"]

logger = logging.getLogger(__name__)


class Housekeeping:
    """Dead-letters orphaned events, forgets finished tasks, keeps the lag figures.

    Args:
        fold: the scheduler's fold (its table is read at each call).
        router: the task partition of each key (trimmed here).
        offsets: how far the owned events partitions are read and committed.
        writers: the owned partitions (dead letters go through them).
        group_id: the member named in dead letters.
        interval: seconds between two rounds (the orphan check interval).
        finished_retention: seconds (by record time) a finished task stays in memory.
    """

    def __init__(
        self,
        *,
        fold: TaskFold,
        router: PartitionRouter,
        offsets: EventOffsets,
        writers: PartitionWriters,
        group_id: str,
        interval: float,
        finished_retention: float,
    ) -> None:
        self.fold = fold
        self.router = router
        self.offsets = offsets
        self.writers = writers
        self.group_id = group_id
        self.interval = interval
        self.finished_retention = finished_retention
        self.lag: dict[str, int] = {"tasks": 0, "events": 0}
        self.events_lag: dict[int, int] = {}  # per owned tasks.events partition

    def forget(self, partition: int) -> None:
        """The partition is no longer this scheduler's: no lag of it."""
        self.events_lag.pop(partition, None)

    async def run(self, reader: TasksReader, events: AIOKafkaConsumer | None) -> None:
        """Dead-letter events that can never apply, forget finished tasks past retention,
        refresh lag; forever."""
        while True:
            await asyncio.sleep(self.interval)
            table = self.fold.table
            generation = table.mark_generation()
            await reader.caught_up()
            self.lag["tasks"] = 0  # just caught up with the end read before the wait
            async with self.writers.lock:
                self._dead_letter_orphans(generation)
            self.fold.table.forget_finished(self.finished_retention)
            self.router.trim(2 * len(self.fold.table) + 10_000)
            await self.refresh_events_lag(events)

    def _dead_letter_orphans(self, generation: int) -> None:
        """Events held since before ``generation`` closed still have no deferral, though the
        tasks topic is now folded past the end it had after them: dead-letter them, each
        with the reason (their offsets are committed only after the dead letters are sent;
        a partition that cannot write now holds them). Call with the publish lock."""
        orphans = self.fold.table.expire_pending(generation)
        if not orphans:
            return
        letters = [
            orphan_letter(event, ref, now=self._task_now(event), member=self.group_id)
            for event, ref in orphans
        ]
        self.writers.publish([], letters)
        for event, _ in orphans:
            logger.info(
                "event without a deferral on the tasks topic dead-lettered",
                extra={
                    "trigger_id": event.trigger_id,
                    "task": str(event.task),
                    "event_id": event.event_id,
                },
            )
        logger.warning(
            "events without a deferral on the tasks topic dead-lettered",
            extra={"count": len(orphans)},
        )

    def _task_now(self, event: EventFields) -> str:
        record = self.fold.table.get(event.task.ti_key)
        if record is None:
            return "not on the tasks topic"
        on = f" on trigger {record.trigger_id}" if record.trigger_id else ""
        return f"{record.state}{on}"

    async def refresh_events_lag(self, events: AIOKafkaConsumer | None) -> None:
        """Each owned events partition's end, less how far it is folded (or committed)."""
        assigned = [part.events_tp for part in self.writers.parts()]
        if events is None or not assigned:
            self.events_lag = {}
            self.lag["events"] = 0
            return
        ends = await events.end_offsets(assigned)
        done, committed = self.offsets.done, self.offsets.committed
        lag: dict[int, int] = {}
        for tp in assigned:
            if tp not in ends:
                continue
            read = done.get(tp, committed.get(tp, ends[tp]))
            # Past the last event there may be a transaction's marker (the triggerers write
            # in transactions on Apache Kafka): the consumer's position has skipped it.
            with contextlib.suppress(KafkaError, IllegalStateError):
                read = max(read, await events.position(tp))
            lag[tp.partition] = max(0, ends[tp] - read)
        self.events_lag = lag
        self.lag["events"] = sum(self.events_lag.values())
