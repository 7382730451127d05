"""The KIP-447 requests of ``runners/_aiokafka.py``, one contract test each, on Apache Kafka:
TxnOffsetCommit v3 carrying the group's generation, OffsetFetch v7 with ``require_stable``.
(Tansu has no transactions: these are Kafka's.)"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import NewTopic
from aiokafka.client import AIOKafkaClient
from deferline.runners.testing import (
    FencedByGroup,
    GroupMetadata,
    UnstableOffsets,
    commit_offsets_with_generation,
    fetch_stable_offsets,
    group_metadata,
    offsets_of_several_groups,
)
from deferline.topics import Settings, make_producer, start_client, stop_client

from tests._until import until
from tests.integration._util import KafkaClients

pytestmark = [pytest.mark.integration, pytest.mark.kafka_only, pytest.mark.timeout(120)]


async def _member(clients: KafkaClients, topic: str, group: str) -> AIOKafkaConsumer:
    """A consumer of ``group`` subscribed to ``topic`` (two partitions), once assigned."""
    return await clients.member(topic, group, 2, enable_auto_commit=False)


async def _stable(
    client: AIOKafkaClient, group: str, partitions: list[TopicPartition]
) -> dict[TopicPartition, int | None]:
    """The group's offsets once no transaction is committing them (the markers of one that
    just committed are still being written: asked again until then)."""
    found: dict[TopicPartition, int | None] = {}

    async def stable() -> bool:
        try:
            found.update(await fetch_stable_offsets(client, group, partitions))
        except UnstableOffsets:
            return False
        return True

    await until(stable, within=30, interval=0.05, what="stable offsets")
    return found


@contextlib.asynccontextmanager
async def _transactional(
    settings: Settings, group: str, member: Callable[[], GroupMetadata]
) -> AsyncIterator[AIOKafkaProducer]:
    """A started transactional producer committing offsets with ``member()``'s generation."""
    producer = make_producer(settings, transactional_id=f"{group}.t", enable_idempotence=True)
    commit_offsets_with_generation(producer, member)
    await start_client(producer, grace=5.0, name="test producer")
    try:
        yield producer
    finally:
        await stop_client(producer, grace=5.0, name="test producer")


async def _setup(settings: Settings, clients: KafkaClients) -> tuple[str, str, TopicPartition]:
    topic, group = f"{settings.topic_prefix}in", f"{settings.topic_prefix}g"
    admin = await clients.admin()
    await admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])
    return topic, group, TopicPartition(topic, 0)


async def test_a_transactions_offsets_carry_the_generation_and_a_stale_one_is_refused(
    settings: Settings, kafka_clients: KafkaClients
) -> None:
    topic, group, tp = await _setup(settings, kafka_clients)
    consumer = await _member(kafka_clients, topic, group)
    current = group_metadata(consumer)
    assert current.generation >= 1
    assert current.member_id
    stale = dataclasses.replace(current, generation=current.generation - 1)
    member = [current]
    async with _transactional(settings, group, lambda: member[0]) as producer:
        # In the current generation: committed with the transaction.
        await producer.begin_transaction()
        await producer.send_offsets_to_transaction({tp: 5}, group)
        await producer.commit_transaction()
        assert await _stable(producer.client, group, [tp]) == {tp: 5}

        # A zombie's (an older generation): refused, the transaction aborted, nothing moved.
        member[0] = stale
        await producer.begin_transaction()
        with pytest.raises(FencedByGroup, match="no longer in the group's current generation"):
            await producer.send_offsets_to_transaction({tp: 9}, group)
        await producer.abort_transaction()
        assert await _stable(producer.client, group, [tp]) == {tp: 5}


async def test_a_refused_transactions_records_are_aborted_not_carried_into_the_next(
    settings: Settings, kafka_clients: KafkaClients
) -> None:
    """Refused offsets fail the transaction; its abort must reach the broker. (aiokafka's own
    failure path forgets the partitions the transaction wrote and sends no EndTxn: the
    broker's transaction stays open and the next one's commit committed the refused
    records with its own.)"""
    topic, group, tp = await _setup(settings, kafka_clients)
    consumer = await _member(kafka_clients, topic, group)
    stale = dataclasses.replace(
        group_metadata(consumer), generation=group_metadata(consumer).generation - 1
    )
    member = [stale]
    async with _transactional(settings, group, lambda: member[0]) as producer:
        await producer.begin_transaction()
        await producer.send(topic, b"refused", partition=0)
        with pytest.raises(FencedByGroup):
            await producer.send_offsets_to_transaction({tp: 1}, group)
        await producer.abort_transaction()
        member[0] = group_metadata(consumer)
        await producer.begin_transaction()
        await producer.send(topic, b"committed", partition=0)
        await producer.send_offsets_to_transaction({tp: 2}, group)
        await producer.commit_transaction()
    reader = await kafka_clients.consumer(group_id=None, isolation_level="read_committed")
    reader.assign([tp])
    await reader.seek_to_beginning(tp)
    seen: list[bytes] = []

    async def read_past_the_commit() -> bool:
        for records in (await reader.getmany(timeout_ms=200)).values():
            seen.extend(r.value for r in records)
        return b"committed" in seen

    await until(read_past_the_commit, within=30, what="the committed record")
    assert seen == [b"committed"], "the refused transaction's record stays aborted"


async def test_one_transaction_commits_the_offsets_of_two_groups(
    settings: Settings, kafka_clients: KafkaClients
) -> None:
    """The member's own group (with its generation) and a source topic's group (as a
    standalone reader) in one transaction. (aiokafka adds only the first group to a
    transaction and sends the second's offsets unadded: refused, and the producer is done.)"""
    topic, group, tp = await _setup(settings, kafka_clients)
    source_group = f"{settings.topic_prefix}source"
    consumer = await _member(kafka_clients, topic, group)
    async with _transactional(settings, group, lambda: group_metadata(consumer)) as producer:
        offsets_of_several_groups(producer)
        for offset in (3, 4):  # twice: the second transaction adds both groups again
            await producer.begin_transaction()
            await producer.send(topic, b"x", partition=0)
            await producer.send_offsets_to_transaction({tp: offset}, group)
            await producer.send_offsets_to_transaction({tp: offset + 10}, source_group)
            await producer.commit_transaction()
            assert await _stable(producer.client, group, [tp]) == {tp: offset}
            assert await _stable(producer.client, source_group, [tp]) == {tp: offset + 10}


async def test_offsets_pending_in_an_open_transaction_are_not_read_as_committed(
    settings: Settings, kafka_clients: KafkaClients
) -> None:
    topic, group, tp = await _setup(settings, kafka_clients)
    consumer = await _member(kafka_clients, topic, group)
    member = group_metadata(consumer)
    async with _transactional(settings, group, lambda: member) as producer:
        other = TopicPartition(topic, 1)
        assert await fetch_stable_offsets(producer.client, group, [tp, other]) == {
            tp: None,
            other: None,
        }
        await producer.begin_transaction()
        await producer.send_offsets_to_transaction({tp: 3}, group)
        with pytest.raises(UnstableOffsets):  # a new owner would wait, not read past it
            await fetch_stable_offsets(producer.client, group, [tp])
        await producer.commit_transaction()
        assert await _stable(producer.client, group, [tp, other]) == {
            tp: 3,
            other: None,
        }
