"""Scheduler leadership and fenced publishing.

Leadership comes from Kafka's group protocol: every scheduler joins the consumer group
``<prefix>scheduler`` subscribed to the one-partition lease topic, and the member holding
partition 0 is the active one. The others stay standbys: they keep folding the tasks topic,
so a takeover only reads the tail.

On Apache Kafka the active scheduler writes through a transactional producer whose
``transactional.id`` is the same for every scheduler: starting it bumps the producer epoch,
so a paused old leader's writes are rejected (fenced). Each batch of decisions and the event
offsets it consumed are committed in one transaction. Brokers without transactions (Tansu)
get a plain producer: the lease and the task-state guard are then the only protection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError, ProducerFenced, UnknownError, UnsupportedVersionError
from aiokafka.structs import OffsetAndMetadata
from deferline.schemas import DeferlineError
from deferline.topics import (
    Murmur2Partitioner,
    Settings,
    make_consumer,
    make_producer,
    partition_for,
    trace_send,
)

__all__ = ["Outgoing", "SchedulerFenced", "SchedulerLease", "SchedulerPublisher"]

logger = logging.getLogger(__name__)

Outgoing = tuple[str, bytes | None, bytes]  # topic, key, value


class SchedulerFenced(DeferlineError):
    """Another scheduler took over; this one's writes are rejected."""


class SchedulerLease(ConsumerRebalanceListener):  # type: ignore[misc]
    """Membership of the scheduler group; calls back when partition 0 is won or lost.

    ``on_lost`` is awaited inside the rebalance, before the partition can go to anyone else:
    it must stop writing before it returns.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        topic: str,
        group_id: str,
        session_timeout: float,
        on_acquired: Callable[[], None],
        on_lost: Callable[[], Awaitable[None]],
    ) -> None:
        self.topic = topic
        self.group_id = group_id
        self.held = False
        self._on_acquired = on_acquired
        self._on_lost = on_lost
        session_ms = int(session_timeout * 1000)
        self.consumer: AIOKafkaConsumer = make_consumer(
            settings,
            group_id=group_id,
            session_timeout_ms=session_ms,
            heartbeat_interval_ms=max(100, session_ms // 5),
            rebalance_timeout_ms=max(session_ms, 10_000),
            fetch_max_wait_ms=500,
        )

    async def start(self) -> None:
        await self.consumer.start()
        self.consumer.subscribe([self.topic], listener=self)

    async def stop(self) -> None:
        await self.consumer.stop()  # leaves the group: a standby takes over at once

    async def poll_forever(self) -> None:
        """Keep the membership alive (the lease topic holds no records)."""
        while True:
            await self.consumer.getmany(timeout_ms=1000)

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        if self.held:
            logger.info("scheduler lease lost", extra={"group_id": self.group_id})
            try:
                await self._on_lost()  # may still commit as the lease holder
            finally:
                self.held = False

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        if any(tp.topic == self.topic and tp.partition == 0 for tp in assigned):
            self.held = True
            logger.info("scheduler lease acquired", extra={"group_id": self.group_id})
            self._on_acquired()  # the takeover runs outside the rebalance
        else:
            logger.info("scheduler standing by in the group", extra={"group_id": self.group_id})

    async def committed(self, partitions: Sequence[TopicPartition]) -> dict[TopicPartition, int]:
        """The group's committed offset of each partition that has one."""
        found: dict[TopicPartition, int] = {}
        for tp in partitions:
            offset = await self.consumer.committed(tp)
            if offset is not None:
                found[tp] = offset
        return found

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Commit event offsets as the group member holding the lease (no transactions).

        The event partitions are assigned by hand, not through the group, so the public
        ``commit()`` (which checks the group assignment) does not apply; the coordinator's
        commit carries this member's id and generation, which the broker checks.
        """
        subscription = self.consumer._subscription.subscription
        if subscription is None or subscription.assignment is None:
            return
        await self.consumer._coordinator.commit_offsets(
            subscription.assignment,
            {tp: OffsetAndMetadata(offset, "") for tp, offset in offsets.items()},
        )


class SchedulerPublisher:
    """Writes the active scheduler's decisions: in transactions where the broker has them."""

    def __init__(self, settings: Settings, *, transactional_id: str, group_id: str) -> None:
        self.settings = settings
        self.transactional_id = transactional_id
        self.group_id = group_id
        self.transactional = False
        self._producer: AIOKafkaProducer | None = None
        self._partitioner = Murmur2Partitioner()

    async def start(self, *, transactions: bool | None) -> None:
        """Connect; with ``transactions`` None, use them if the broker has them."""
        if transactions is not False:
            producer = make_producer(
                self.settings,
                transactional_id=self.transactional_id,
                enable_idempotence=True,
                linger_ms=5,
                max_batch_size=1 << 20,
                # The broker answers CONCURRENT_TRANSACTIONS while it writes the previous
                # commit's markers; aiokafka then waits this long before asking again (100 ms
                # by default, up to three times per batch). The Java client waits 20 ms.
                retry_backoff_ms=20,
            )
            try:
                await producer.start()  # InitProducerId: bumps the epoch, fences the old leader
            except (UnknownError, UnsupportedVersionError) as exc:
                await producer.stop()
                if transactions:
                    raise SchedulerFenced(f"the broker has no transactions: {exc}") from exc
                logger.warning(
                    "broker has no transactions: the scheduler relies on its lease and the "
                    "task-state guard alone (a paused old leader is not fenced)",
                    extra={"transactional_id": self.transactional_id},
                )
            else:
                self._producer = producer
                self.transactional = True
                logger.info(
                    "scheduler writes in transactions",
                    extra={"transactional_id": self.transactional_id},
                )
                return
        producer = make_producer(self.settings, linger_ms=5, max_batch_size=1 << 20)
        await producer.start()
        self._producer = producer
        self.transactional = False

    async def stop(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                await producer.stop()
            except KafkaError as exc:
                logger.warning("scheduler producer did not stop cleanly: %s", exc)

    async def _send(
        self,
        producer: AIOKafkaProducer,
        wave: Sequence[Outgoing],
        chosen: dict[tuple[bytes, int], int],
    ) -> list[asyncio.Future[Any]]:
        """Queue one wave as one record batch per partition (far cheaper than a ``send`` per
        record); returns the futures of the batches.

        ``chosen`` keeps each key's partition across the waves of one publish: a task's
        state and its RunTask share the key, and murmur2 is pure Python."""
        by_partition: dict[tuple[str, int], list[tuple[bytes | None, bytes]]] = {}
        partitions: dict[str, list[int]] = {}
        for topic, key, value in wave:
            ids = partitions.get(topic)
            if ids is None:
                ids = partitions[topic] = sorted(await producer.partitions_for(topic))
            if key is None:
                partition = self._partitioner(key, ids, ids)
            else:
                index = chosen.get((key, len(ids)))
                if index is None:
                    index = chosen[key, len(ids)] = partition_for(key, len(ids))
                partition = ids[index]
            by_partition.setdefault((topic, partition), []).append((key, value))
        futures: list[asyncio.Future[Any]] = []
        for (topic, partition), records in by_partition.items():
            batch = producer.create_batch()
            for key, value in records:
                headers = trace_send(topic, value)
                if batch.append(key=key, value=value, timestamp=None, headers=headers) is not None:
                    continue
                if batch.record_count():  # full: send it, start the next
                    futures.append(await producer.send_batch(batch, topic, partition=partition))
                batch = producer.create_batch()
                if batch.append(key=key, value=value, timestamp=None, headers=headers) is None:
                    # Larger than a batch on its own: send() sends it or says why not.
                    futures.append(
                        await producer.send(
                            topic, value, key=key, partition=partition, headers=headers
                        )
                    )
                    batch = producer.create_batch()
            if batch.record_count():
                futures.append(await producer.send_batch(batch, topic, partition=partition))
        return futures

    async def publish(
        self, waves: Sequence[Sequence[Outgoing]], offsets: Mapping[TopicPartition, int]
    ) -> None:
        """Send ``waves`` (and, in a transaction, ``offsets`` for the group).

        Without transactions each wave is acknowledged before the next is sent; with them,
        everything becomes visible at once when the transaction commits.
        """
        producer = self._producer
        if producer is None:
            raise SchedulerFenced("the scheduler is not active")
        try:
            chosen: dict[tuple[bytes, int], int] = {}
            if not self.transactional:
                for wave in waves:
                    futures = await self._send(producer, wave, chosen)
                    if futures:
                        await asyncio.gather(*futures)
                return
            await producer.begin_transaction()
            futures = [f for wave in waves for f in await self._send(producer, wave, chosen)]
            if offsets:
                await producer.send_offsets_to_transaction(dict(offsets), self.group_id)
            await producer.commit_transaction()
            await asyncio.gather(*futures)
        except ProducerFenced as exc:
            raise SchedulerFenced(
                "another scheduler took over: this one's transaction was fenced"
            ) from exc
