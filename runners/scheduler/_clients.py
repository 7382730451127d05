"""The scheduler's connections to the broker.

:class:`SchedulerClients` owns the clients the scheduler reads with, made and started
together by :meth:`~SchedulerClients.connect` and stopped by the shell's close: the group
member on tasks.events, the reader of the owned tasks partitions, the pools channel (made
once the tasks topic's partition count is known), the lock that keeps reads of the pools
topic one at a time, and the fetch wait suited to the broker; and it makes the readers of the
tasks topic (the scheduler's, and each acquisition's own). Producers are the writers'
(:mod:`._writers`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from deferline.schemas import DeadLetter
from deferline.topics import Settings, TopicNames, make_consumer, start_client, stop_client

from .._aiokafka import client_of, join_once, leave_from_generation_zero
from ..member import LONG_POLL_MS, StickyAssignor, answers_fetches_early
from ._fold import TaskFold
from ._pools import PoolChannel
from ._publishing import SchedulerError
from ._routing import PartitionRouter
from ._tasks_topic import TasksReader

__all__ = ["SchedulerClients"]


class SchedulerClients:
    """The group member, the tasks reader and the pools channel (None until connected).

    Args:
        settings: connection and topic layout.
        group_id: the scheduler group.
        group_instance_id: static membership (see :class:`~._scheduler.Scheduler`).
        session_timeout: the group session timeout, in seconds.
        max_records: most records folded per fetch of the tasks reader.
        fold: the fold the tasks reader reads into.
        router: told the tasks topic's partition count at connect.
        assignor: the sticky assignor the member offers first.
        dead: the dead letter of an unreadable record.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        group_id: str,
        group_instance_id: str | None,
        session_timeout: float,
        max_records: int,
        fold: TaskFold,
        router: PartitionRouter,
        assignor: StickyAssignor,
        dead: Callable[[object, str], DeadLetter],
    ) -> None:
        self.settings = settings
        self.names = TopicNames(settings.topic_prefix)
        self.group_id = group_id
        self.group_instance_id = group_instance_id
        self.session_timeout = session_timeout
        self.max_records = max_records
        self.fold = fold
        self.router = router
        self.assignor = assignor
        self._dead = dead
        self.events: AIOKafkaConsumer | None = None
        self.reader: TasksReader | None = None
        self.pool_channel: PoolChannel | None = None
        self.pool_reads = asyncio.Lock()  # one read of the pools topic at a time
        # Apache Kafka answers a fetch once data arrives: a long wait only saves idle CPU.
        # Tansu holds every fetch for the whole wait: there it bounds the latency the
        # scheduler adds, so it stays short. Chosen at connect from the brokers' API versions.
        self.fetch_wait_ms = 100

    async def connect(self) -> None:
        """Start the tasks reader (learning the partition count), the pools channel, and the
        group member, which joins once. Raises KafkaError; :meth:`stop_member` and
        :meth:`stop_readers` close what was started."""
        if await answers_fetches_early(self.settings):
            self.fetch_wait_ms = LONG_POLL_MS
        tasks = self.consumer()
        self.reader = self.tasks_reader(tasks, self.fold)
        await start_client(tasks, grace=5.0, name="tasks reader")
        self.router.partitions = len(await self._tasks_partitions(tasks))
        self.pool_channel = PoolChannel(
            self.settings,
            pools=self.fold.table.pools,
            partitions=self.router.partitions,
            partition_of=self.router.partition_of,
            consumer=make_consumer(
                self.settings, group_id=None, fetch_max_wait_ms=self.fetch_wait_ms
            ),
        )
        await self.pool_channel.start()
        self.events = self._member()
        await start_client(self.events, grace=5.0, name="scheduler member")
        leave_from_generation_zero(self.events)
        join_once(self.events)

    def consumer(self, *, fetch_wait_ms: int | None = None) -> AIOKafkaConsumer:
        """A consumer of the tasks topic, outside the group (``fetch_wait_ms``: the longest
        an empty fetch waits; by default the broker's, see above)."""
        return make_consumer(
            self.settings,
            group_id=None,
            max_poll_records=None,
            fetch_max_wait_ms=self.fetch_wait_ms if fetch_wait_ms is None else fetch_wait_ms,
        )

    def tasks_reader(self, consumer: AIOKafkaConsumer, fold: TaskFold) -> TasksReader:
        """A reader of the tasks topic over ``consumer`` into ``fold`` (the scheduler's, or an
        acquisition's own), with the scheduler's bound on records per fetch and its dead
        letters."""
        return TasksReader(consumer, fold, max_records=self.max_records, dead=self._dead)

    def _member(self) -> AIOKafkaConsumer:
        session_ms = int(self.session_timeout * 1000)
        return make_consumer(
            self.settings,
            group_id=self.group_id,
            max_poll_records=None,
            fetch_max_wait_ms=self.fetch_wait_ms,
            session_timeout_ms=session_ms,
            heartbeat_interval_ms=max(100, session_ms // 10),  # a rebalance is seen sooner
            rebalance_timeout_ms=max(session_ms, 30_000),
            partition_assignment_strategy=(self.assignor, RoundRobinPartitionAssignor),
            group_instance_id=self.group_instance_id,
        )

    async def stop_member(self) -> None:
        """Leave the group (unless static) and stop the member."""
        events, self.events = self.events, None
        if events is not None:
            await stop_client(events, grace=5.0, name="scheduler group member")

    async def stop_readers(self) -> None:
        """Stop the tasks reader and the pools channel (no longer the ledger owner)."""
        reader, self.reader = self.reader, None
        if reader is not None:
            await stop_client(reader.consumer, grace=5.0, name="scheduler tasks reader")
        if self.pool_channel is not None:
            self.pool_channel.resign()
            await self.pool_channel.stop()

    async def _tasks_partitions(self, consumer: AIOKafkaConsumer) -> set[int]:
        deadline = time.monotonic() + 30.0
        while True:
            partitions = consumer.partitions_for_topic(self.names.tasks)
            if partitions:
                return set(partitions)
            if time.monotonic() > deadline:
                raise SchedulerError(f"topic {self.names.tasks} has no partitions")
            await client_of(consumer).force_metadata_update()
