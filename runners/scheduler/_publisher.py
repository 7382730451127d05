"""Fenced publishing: one producer per owned task partition.

On Apache Kafka a partition's decisions are written through a transactional producer whose
``transactional.id`` is ``<group>.<partition>``, the same in every scheduler: the one that
acquires the partition starts it, which aborts the previous owner's open transaction and
bumps the producer epoch, so a paused old owner's writes for that partition are rejected
(fenced). Each batch of the partition's decisions and the event offsets it consumed commit
in one transaction. (aiokafka's TxnOffsetCommit carries no group generation, so the fence
is the transactional id, one per partition.) Brokers without transactions (Tansu) get a
plain producer: the group's generation check on offset commits and the task-state guard
are then the only protection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import ProducerFenced, UnknownError, UnsupportedVersionError
from deferline.schemas import DeferlineError
from deferline.topics import (
    Murmur2Partitioner,
    Settings,
    make_producer,
    partition_for,
    start_client,
    stop_client,
    trace_send,
    tracing_on,
)

__all__ = ["Outgoing", "SchedulerFenced", "SchedulerPublisher"]

logger = logging.getLogger(__name__)

Outgoing = tuple[str, bytes | None, bytes | None]  # topic, key, value (None: a tombstone)

_NO_HEADERS: list[tuple[str, bytes]] = []  # an untraced record's (never changed)


class SchedulerFenced(DeferlineError):
    """Another scheduler took a partition over; this one's writes for it are rejected."""


class SchedulerPublisher:
    """Writes one task partition's decisions: in transactions where the broker has them."""

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
                # Batches are handed over whole (send_batch): waiting for more records to join
                # them only delays the transaction.
                linger_ms=0,
                max_batch_size=1 << 20,
                # The broker answers CONCURRENT_TRANSACTIONS while it writes the previous
                # commit's markers; aiokafka then waits this long before asking again (100 ms
                # by default, up to three times per batch). The Java client waits 20 ms.
                retry_backoff_ms=20,
            )
            self._producer = producer  # stop() closes it even if its start is cancelled
            try:
                # InitProducerId: bumps the epoch, fences the old owner.
                await start_client(producer, grace=5.0, name="scheduler producer")
            except (UnknownError, UnsupportedVersionError) as exc:
                self._producer = None  # closed by start_client
                if transactions:
                    raise SchedulerFenced(f"the broker has no transactions: {exc}") from exc
                logger.warning(
                    "broker has no transactions: the scheduler relies on the group and the "
                    "task-state guard alone (a paused old owner is not fenced)",
                    extra={"transactional_id": self.transactional_id},
                )
            else:
                self.transactional = True
                logger.debug(
                    "partition producer started in transactions",
                    extra={"transactional_id": self.transactional_id},
                )
                return
        producer = make_producer(self.settings, linger_ms=0, max_batch_size=1 << 20)
        self._producer = producer
        self.transactional = False
        await start_client(producer, grace=5.0, name="scheduler producer")

    async def stop(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await stop_client(producer, grace=5.0, name="scheduler producer")

    async def _send(
        self,
        producer: AIOKafkaProducer,
        wave: Sequence[Outgoing],
        chosen: dict[int, dict[bytes, int]],
    ) -> list[asyncio.Future[Any]]:
        """Queue one wave as one record batch per partition (far cheaper than a ``send`` per
        record); returns the futures of the batches.

        ``chosen`` keeps each key's partition index (per partition count) across the waves of
        one publish: a task's state and its RunTask share the key, so it is hashed once."""
        by_partition: dict[tuple[str, int], list[tuple[bytes | None, bytes | None]]] = {}
        partitions: dict[str, tuple[list[int], dict[bytes, int]]] = {}
        for topic, key, value in wave:
            known = partitions.get(topic)
            if known is None:
                ids = sorted(await producer.partitions_for(topic))
                known = partitions[topic] = (ids, chosen.setdefault(len(ids), {}))
            ids, indexes = known
            if key is None:
                partition = self._partitioner(key, ids, ids)
            else:
                index = indexes.get(key)
                if index is None:
                    index = indexes[key] = partition_for(key, len(ids))
                partition = ids[index]
            records = by_partition.get((topic, partition))
            if records is None:
                records = by_partition[topic, partition] = []
            records.append((key, value))
        traced = tracing_on()  # asked once a wave, not per record
        futures: list[asyncio.Future[Any]] = []
        for (topic, partition), records in by_partition.items():
            batch = producer.create_batch()
            for key, value in records:
                headers = trace_send(topic, value) if traced else _NO_HEADERS
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
            raise SchedulerFenced(f"{self.transactional_id} is not started")
        try:
            chosen: dict[int, dict[bytes, int]] = {}
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
                f"another scheduler took over: {self.transactional_id}'s transaction was fenced"
            ) from exc
