"""The member's one producer on Apache Kafka: a zombie's round, spanning partitions, is fenced
whole; a new owner does not read offsets while the old owner's transaction holds them.
(Tansu has no transactions: these are Kafka's.)"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import NewTopic
from deferline.runners.member import MemberFenced, MemberFigures, MemberProducer
from deferline.runners.testing import (
    GroupMetadata,
    commit_offsets_with_generation,
    group_metadata,
)
from deferline.topics import Settings, make_producer, start_client, stop_client

from tests._until import until
from tests.integration._util import KafkaClients

pytestmark = [pytest.mark.integration, pytest.mark.kafka_only, pytest.mark.timeout(120)]

PARTITIONS = 3


async def _topic_and_member(
    settings: Settings, clients: KafkaClients
) -> tuple[str, str, AIOKafkaConsumer]:
    """A topic of PARTITIONS partitions and a member of a group reading it, assigned."""
    topic, group = f"{settings.topic_prefix}in", f"{settings.topic_prefix}g"
    admin = await clients.admin()
    await admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1)])
    return topic, group, await clients.member(topic, group, PARTITIONS)


@contextlib.asynccontextmanager
async def _member_producer(
    settings: Settings, group: str, member: Callable[[], GroupMetadata]
) -> AsyncIterator[MemberProducer]:
    producer = MemberProducer(
        settings,
        group_id=group,
        name="a",
        member=member,
        figures=MemberFigures(),
        transactions=True,
        transaction_timeout=10.0,
    )
    await producer.start()
    try:
        yield producer
    finally:
        await producer.stop()


async def _committed_values(
    clients: KafkaClients, topic: str, *, until_value: bytes
) -> list[bytes]:
    """Every record of ``topic`` a ``read_committed`` reader sees, once ``until_value`` is."""
    reader = await clients.consumer(group_id=None)
    tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
    reader.assign(tps)
    await reader.seek_to_beginning(*tps)
    seen: list[bytes] = []

    async def read() -> bool:
        for records in (await reader.getmany(timeout_ms=200)).values():
            seen.extend(r.value for r in records if r.value is not None)
        return until_value in seen

    await until(read, within=30, what=f"{until_value!r} committed")
    return seen


async def test_a_zombies_round_over_several_partitions_is_fenced_whole(
    settings: Settings, kafka_clients: KafkaClients
) -> None:
    topic, group, consumer = await _topic_and_member(settings, kafka_clients)
    current = group_metadata(consumer)
    zombie = dataclasses.replace(current, generation=current.generation - 1)
    member = [zombie]
    keys = [f"k{n}".encode() for n in range(12)]  # over every partition of the topic
    async with _member_producer(settings, group, lambda: member[0]) as producer:
        wave = [(topic, key, b"zombie") for key in keys]
        offsets = {TopicPartition(topic, p): 1 for p in range(PARTITIONS)}
        with pytest.raises(MemberFenced, match="group went on without this member"):
            await producer.write([wave], offsets)
        member[0] = current
        await producer.write([[(topic, keys[0], b"member")]], {TopicPartition(topic, 0): 1})
    seen = await _committed_values(kafka_clients, topic, until_value=b"member")
    assert seen == [b"member"], "none of the zombie's records, on any partition"


async def test_a_new_owner_reads_offsets_only_once_the_old_owners_round_ended(
    settings: Settings, kafka_clients: KafkaClients
) -> None:
    topic, group, consumer = await _topic_and_member(settings, kafka_clients)
    tp = TopicPartition(topic, 0)
    old_member = group_metadata(consumer)
    old = make_producer(settings, transactional_id=f"{group}.member.old", enable_idempotence=True)
    commit_offsets_with_generation(old, lambda: old_member)
    await start_client(old, grace=5.0, name="old owner")
    try:
        await old.begin_transaction()
        await old.send(topic, b"old owner's", partition=0)
        await old.send_offsets_to_transaction({tp: 7}, group)  # pending until its end
        async with _member_producer(settings, group, lambda: old_member) as new_owner:
            reading = asyncio.create_task(new_owner.committed([tp]))
            done, _ = await asyncio.wait({reading}, timeout=1.0)  # asks every 20 ms
            assert not done, "no offset is read while a transaction holds it"
            await old.commit_transaction()
            assert await reading == {tp: 7}, (
                "read after the old owner's round ended: its offset, not the one before it"
            )
    finally:
        await stop_client(old, grace=5.0, name="old owner")
    seen = await _committed_values(kafka_clients, topic, until_value=b"old owner's")
    assert seen == [b"old owner's"]
