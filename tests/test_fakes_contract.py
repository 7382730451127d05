"""The fakes of tests/fakes.py against the broker they stand in for: one suite, two makers.

Each contract below is written once against a :class:`Kafka` (what makes topics and started
clients) and run twice: on the in-memory fakes (the unit tier) and on a real broker (marked
``integration``). The unit tests that use the fakes rely on exactly these behaviours, so a
fake that drifts from the broker fails here, not as a unit test that passes for the wrong
reason.

- :class:`LogContract`: records come back in order per partition with their keys, values,
  headers and timestamps; offsets, positions, seeks, pauses, end offsets and the group's
  committed offsets. The same on every broker: run on Tansu first.
- :class:`TimeLookupContract`: offsets for a time. Tansu's lookups ignore the time: Apache
  Kafka only.
- :class:`TransactionContract`: what ``read_committed`` and ``read_uncommitted`` readers see
  of open, committed and aborted transactions, offsets committed with a transaction, and a
  producer fenced by its successor. Tansu has no transactions: Apache Kafka only.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Iterable
from typing import Any, Protocol

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import NewTopic
from aiokafka.errors import InvalidProducerEpoch, ProducerFenced

from tests._until import until
from tests.fakes import (
    FakeConsumer,
    FakeKafka,
    FakeProducer,
    FakeTransactionalProducer,
    Isolation,
)
from tests.integration._util import KafkaClients

# A record time, in milliseconds (2024-01-01): in the past, as Apache Kafka refuses a record
# time more than log.message.timestamp.after.max.ms (an hour, by default) ahead of its clock.
T0 = 1_704_067_200_000
ON_A_BROKER = 30.0  # seconds a wait may take on a real broker


class Kafka(Protocol):
    """Makes what a contract needs: topics and started clients, stopped at the test's end."""

    def unique(self, what: str) -> str:
        """A name (of a group, a transactional id) no other test uses."""
        ...

    async def topic(self, partitions: int = 1) -> str:
        """A new topic with ``partitions`` partitions."""
        ...

    async def producer(self) -> Any: ...

    async def transactional_producer(self, transactional_id: str) -> Any: ...

    async def consumer(
        self, *, group_id: str | None = None, isolation_level: Isolation = "read_committed"
    ) -> Any: ...


class InMemory:
    """The fakes over one :class:`FakeKafka`."""

    def __init__(self) -> None:
        self.kafka = FakeKafka()
        self._names = itertools.count()

    def unique(self, what: str) -> str:
        return f"{what}-{next(self._names)}"

    async def topic(self, partitions: int = 1) -> str:
        name = self.unique("topic")
        self.kafka.create_topic(name, partitions)
        return name

    async def producer(self) -> FakeProducer:
        producer = FakeProducer(self.kafka)
        await producer.start()
        return producer

    async def transactional_producer(self, transactional_id: str) -> FakeTransactionalProducer:
        producer = FakeTransactionalProducer(self.kafka, transactional_id)
        await producer.start()
        return producer

    async def consumer(
        self, *, group_id: str | None = None, isolation_level: Isolation = "read_committed"
    ) -> FakeConsumer:
        consumer = FakeConsumer(self.kafka, group_id=group_id, isolation_level=isolation_level)
        await consumer.start()
        return consumer


class OnBroker:
    """aiokafka clients (deferline's factories) on the test's broker and topic prefix."""

    def __init__(self, clients: KafkaClients) -> None:
        self.clients = clients
        self.prefix = clients.settings.topic_prefix

    def unique(self, what: str) -> str:
        return f"{self.prefix}{what}-{uuid.uuid4().hex[:8]}"

    async def topic(self, partitions: int = 1) -> str:
        name = self.unique("topic")
        admin = await self.clients.admin()
        await admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
        return name

    async def producer(self) -> Any:
        return await self.clients.producer()

    async def transactional_producer(self, transactional_id: str) -> Any:
        return await self.clients.producer(
            transactional_id=transactional_id, enable_idempotence=True
        )

    async def consumer(
        self, *, group_id: str | None = None, isolation_level: Isolation = "read_committed"
    ) -> Any:
        return await self.clients.consumer(group_id=group_id, isolation_level=isolation_level)


async def read_to_end(
    consumer: Any, tps: Iterable[TopicPartition], ends: dict[TopicPartition, int] | None = None
) -> dict[TopicPartition, list[Any]]:
    """Fetch until every partition's position reaches its end (``ends``, else its end
    offset now); the records read, per partition."""
    tps = list(tps)
    if ends is None:
        ends = await consumer.end_offsets(tps)
    read: dict[TopicPartition, list[Any]] = {tp: [] for tp in tps}

    async def reached() -> bool:
        for tp, messages in (await consumer.getmany(*tps, timeout_ms=50)).items():
            read[tp].extend(messages)
        return all([await consumer.position(tp) >= ends[tp] for tp in tps])

    await until(reached, within=ON_A_BROKER, interval=0, what=lambda: f"{ends} read: {read}")
    return read


async def nothing_more(consumer: Any, tps: Iterable[TopicPartition]) -> None:
    """Assert that a fetch (waiting a little) returns nothing from ``tps``."""
    got = await consumer.getmany(*tps, timeout_ms=200)
    assert not any(got.values()), got


async def ends_reach(consumer: Any, ends: dict[TopicPartition, int]) -> None:
    """Wait until the end offsets ``consumer`` is answered are ``ends``."""

    async def reached() -> bool:
        return bool(await consumer.end_offsets(list(ends)) == ends)

    await until(reached, within=ON_A_BROKER, interval=0.05, what=f"end offsets {ends}")


def values(messages: Iterable[Any]) -> list[bytes | None]:
    return [m.value for m in messages]


async def assigned(consumer: Any, *tps: TopicPartition) -> Any:
    """``consumer`` assigned ``tps``, read from their beginning."""
    consumer.assign(list(tps))
    await consumer.seek_to_beginning(*tps)
    return consumer


# -- the contracts ----------------------------------------------------------------------------


class LogContract:
    """Records, offsets, positions and committed offsets: alike on every broker."""

    async def test_records_come_back_in_order_per_partition(self, kafka: Kafka) -> None:
        topic = await kafka.topic(partitions=2)
        producer = await kafka.producer()
        landed: list[tuple[int, int]] = []
        for n in range(10):  # interleaved between the partitions
            meta = await producer.send_and_wait(topic, f"v{n}".encode(), partition=n % 2)
            landed.append((meta.partition, meta.offset))
        assert landed == [(n % 2, n // 2) for n in range(10)], "offsets count up per partition"
        tps = [TopicPartition(topic, p) for p in (0, 1)]
        consumer = await assigned(await kafka.consumer(), *tps)
        read = await read_to_end(consumer, tps)
        assert [m.offset for m in read[tps[0]]] == [0, 1, 2, 3, 4]
        assert values(read[tps[0]]) == [b"v0", b"v2", b"v4", b"v6", b"v8"]
        assert values(read[tps[1]]) == [b"v1", b"v3", b"v5", b"v7", b"v9"]
        assert {(m.topic, m.partition) for m in read[tps[1]]} == {(topic, 1)}

    async def test_keys_values_headers_and_times_round_trip(self, kafka: Kafka) -> None:
        topic = await kafka.topic()
        producer = await kafka.producer()
        headers = [("trace", b"00-ab"), ("empty", b""), ("trace", b"again")]
        await producer.send_and_wait(topic, b"value", key=b"key", headers=headers, timestamp_ms=T0)
        await producer.send_and_wait(topic, None, key=b"gone", timestamp_ms=T0 + 1)  # tombstone
        await producer.send_and_wait(topic, b"\x00\xff", key=None, timestamp_ms=T0 + 2)
        tp = TopicPartition(topic, 0)
        messages = (await read_to_end(await assigned(await kafka.consumer(), tp), [tp]))[tp]
        assert [(m.key, m.value, m.timestamp) for m in messages] == [
            (b"key", b"value", T0),
            (b"gone", None, T0 + 1),
            (None, b"\x00\xff", T0 + 2),
        ]
        assert [list(m.headers) for m in messages] == [headers, [], []]

    async def test_a_batch_takes_consecutive_offsets_from_where_the_log_ends(
        self, kafka: Kafka
    ) -> None:
        topic = await kafka.topic(partitions=2)
        producer = await kafka.producer()
        await producer.send_and_wait(topic, b"before", partition=1)
        batch = producer.create_batch()
        for n in range(3):
            assert batch.append(key=f"k{n}".encode(), value=b"v", timestamp=None) is not None
        assert batch.record_count() == 3
        meta = await (await producer.send_batch(batch, topic, partition=1))
        assert (meta.partition, meta.offset) == (1, 1), "the offset of the batch's first record"
        tp = TopicPartition(topic, 1)
        consumer = await assigned(await kafka.consumer(), tp)
        messages = (await read_to_end(consumer, [tp], {tp: 4}))[tp]
        assert [(m.offset, m.key) for m in messages] == [
            (0, None),
            (1, b"k0"),
            (2, b"k1"),
            (3, b"k2"),
        ]
        assert consumer.highwater(tp) == 4, "a fetch answers the partition's true end"

    async def test_end_offsets_positions_and_seeks(self, kafka: Kafka) -> None:
        topic = await kafka.topic()
        tp = TopicPartition(topic, 0)
        consumer = await kafka.consumer()
        assert await consumer.beginning_offsets([tp]) == {tp: 0}
        assert await consumer.end_offsets([tp]) == {tp: 0}
        producer = await kafka.producer()
        for n in range(3):
            await producer.send_and_wait(topic, f"v{n}".encode(), partition=0)
        assert await consumer.end_offsets([tp]) == {tp: 3}
        consumer.assign([tp])
        assert consumer.assignment() == {tp}
        assert await consumer.position(tp) == 0, "no committed offset: auto_offset_reset=earliest"
        consumer.seek(tp, 2)
        assert await consumer.position(tp) == 2
        assert values((await read_to_end(consumer, [tp]))[tp]) == [b"v2"]
        assert await consumer.position(tp) == 3
        assert consumer.highwater(tp) == 3
        await consumer.seek_to_beginning(tp)
        assert await consumer.position(tp) == 0
        assert values((await read_to_end(consumer, [tp]))[tp]) == [b"v0", b"v1", b"v2"]

    async def test_assign_forgets_positions(self, kafka: Kafka) -> None:
        topic = await kafka.topic(partitions=2)
        producer = await kafka.producer()
        await producer.send_and_wait(topic, b"v", partition=0)
        first, second = TopicPartition(topic, 0), TopicPartition(topic, 1)
        consumer = await assigned(await kafka.consumer(), first)
        await read_to_end(consumer, [first])
        assert await consumer.position(first) == 1
        consumer.assign([first, second])
        assert consumer.assignment() == {first, second}
        assert await consumer.position(first) == 0, "reset to the beginning (earliest)"

    async def test_a_paused_partition_is_not_fetched_until_resumed(self, kafka: Kafka) -> None:
        topic = await kafka.topic(partitions=2)
        producer = await kafka.producer()
        for p in (0, 1):
            await producer.send_and_wait(topic, f"p{p}".encode(), partition=p)
        tps = [TopicPartition(topic, p) for p in (0, 1)]
        consumer = await assigned(await kafka.consumer(), *tps)
        consumer.pause(tps[0])
        assert consumer.paused() == {tps[0]}
        assert values((await read_to_end(consumer, [tps[1]]))[tps[1]]) == [b"p1"]
        await nothing_more(consumer, tps)
        consumer.resume(tps[0])
        assert consumer.paused() == set()
        assert values((await read_to_end(consumer, [tps[0]]))[tps[0]]) == [b"p0"]

    async def test_a_waiting_fetch_returns_a_record_written_meanwhile(self, kafka: Kafka) -> None:
        topic = await kafka.topic()
        tp = TopicPartition(topic, 0)
        consumer = await assigned(await kafka.consumer(), tp)
        producer = await kafka.producer()
        loop = asyncio.get_running_loop()
        began = loop.time()
        fetching = asyncio.create_task(consumer.getmany(tp, timeout_ms=20_000))
        await asyncio.sleep(0.05)
        await producer.send_and_wait(topic, b"late", partition=0)
        got = await asyncio.wait_for(fetching, ON_A_BROKER)
        assert values(got[tp]) == [b"late"]
        assert loop.time() - began < 10, "answered when the record came, not at the timeout"

    async def test_committed_offsets_are_the_groups(self, kafka: Kafka) -> None:
        topic = await kafka.topic()
        tp = TopicPartition(topic, 0)
        producer = await kafka.producer()
        for n in range(3):
            await producer.send_and_wait(topic, f"v{n}".encode(), partition=0)
        group = kafka.unique("group")
        first = await kafka.consumer(group_id=group)
        first.assign([tp])
        assert await first.committed(tp) is None
        await first.commit({tp: 2})
        assert await first.committed(tp) == 2
        second = await kafka.consumer(group_id=group)
        second.assign([tp])
        assert await second.committed(tp) == 2, "another member of the group sees it"
        assert await second.position(tp) == 2, "a member starts at the group's offset"
        assert values((await read_to_end(second, [tp]))[tp]) == [b"v2"]
        await second.commit()  # the positions
        assert await first.committed(tp) == 3
        other = await kafka.consumer(group_id=kafka.unique("group"))
        other.assign([tp])
        assert await other.committed(tp) is None, "offsets are per group"


class TimeLookupContract:
    """Offsets for a time: the first record at or after it."""

    async def test_offsets_for_times_finds_the_first_record_at_or_after(self, kafka: Kafka) -> None:
        topic = await kafka.topic()
        tp = TopicPartition(topic, 0)
        producer = await kafka.producer()
        for n in range(3):
            await producer.send_and_wait(topic, b"v", partition=0, timestamp_ms=T0 + 10 * n)
        consumer = await kafka.consumer()
        found = await consumer.offsets_for_times({tp: T0 + 5})
        assert (found[tp].offset, found[tp].timestamp) == (1, T0 + 10)
        assert (await consumer.offsets_for_times({tp: T0}))[tp].offset == 0
        assert (await consumer.offsets_for_times({tp: T0 + 21}))[tp] is None


class TransactionContract:
    """Transactions as readers see them, offsets committed with them, and fencing."""

    async def test_a_transaction_is_read_committed_only_once_committed_and_whole(
        self, kafka: Kafka
    ) -> None:
        topic = await kafka.topic(partitions=2)
        tps = [TopicPartition(topic, p) for p in (0, 1)]
        producer = await kafka.transactional_producer(kafka.unique("txn"))
        committed = await assigned(await kafka.consumer(), *tps)
        uncommitted = await assigned(await kafka.consumer(isolation_level="read_uncommitted"), *tps)
        await producer.begin_transaction()
        acks = [await producer.send(topic, f"v{n}".encode(), partition=n % 2) for n in range(3)]
        offsets = [(meta.partition, meta.offset) for meta in await asyncio.gather(*acks)]
        assert offsets == [(0, 0), (1, 0), (0, 1)], "records of an open transaction take offsets"
        assert await committed.end_offsets(tps) == {tps[0]: 0, tps[1]: 0}, "the stable offset"
        assert await uncommitted.end_offsets(tps) == {tps[0]: 2, tps[1]: 1}
        await nothing_more(committed, tps)
        read = await read_to_end(uncommitted, tps, {tps[0]: 2, tps[1]: 1})
        assert values(read[tps[0]]) == [b"v0", b"v2"], "read_uncommitted reads it while open"
        await producer.commit_transaction()
        # The markers are written after the commit returns (on a broker): wait for them.
        await ends_reach(committed, {tps[0]: 3, tps[1]: 2})  # the records, and a marker each
        read = await read_to_end(committed, tps)
        assert values(read[tps[0]]) == [b"v0", b"v2"]
        assert values(read[tps[1]]) == [b"v1"]
        assert [await committed.position(tp) for tp in tps] == [3, 2], "past the markers"

    async def test_an_aborted_transaction_is_never_read_committed(self, kafka: Kafka) -> None:
        topic = await kafka.topic()
        tp = TopicPartition(topic, 0)
        producer = await kafka.transactional_producer(kafka.unique("txn"))
        await producer.begin_transaction()
        await (await producer.send(topic, b"aborted", partition=0))
        await producer.abort_transaction()
        await producer.begin_transaction()
        kept = await (await producer.send(topic, b"kept", partition=0))
        await producer.commit_transaction()
        assert kept.offset == 2, "after the aborted record and its marker"
        committed = await assigned(await kafka.consumer(), tp)
        await ends_reach(committed, {tp: 4})
        read = (await read_to_end(committed, [tp]))[tp]
        assert [(m.offset, m.value) for m in read] == [(2, b"kept")]
        uncommitted = await assigned(await kafka.consumer(isolation_level="read_uncommitted"), tp)
        assert values((await read_to_end(uncommitted, [tp]))[tp]) == [b"aborted", b"kept"]

    async def test_offsets_sent_to_a_transaction_are_committed_with_it(self, kafka: Kafka) -> None:
        topic = await kafka.topic()
        tp = TopicPartition(topic, 0)
        group = kafka.unique("group")
        producer = await kafka.transactional_producer(kafka.unique("txn"))
        await producer.begin_transaction()
        await producer.send(topic, b"out", partition=0)
        await producer.send_offsets_to_transaction({tp: 7}, group)
        await producer.commit_transaction()
        member = await kafka.consumer(group_id=group)
        member.assign([tp])
        # Written with the markers, after the commit returns (on a broker).
        await until(lambda: member.committed(tp), within=ON_A_BROKER)
        assert await member.committed(tp) == 7
        await producer.begin_transaction()
        await producer.send_offsets_to_transaction({tp: 9}, group)
        await producer.abort_transaction()
        assert await member.committed(tp) == 7, "an aborted transaction's offsets are dropped"

    async def test_a_producer_with_the_same_id_fences_the_one_before(self, kafka: Kafka) -> None:
        topic = await kafka.topic()
        tp = TopicPartition(topic, 0)
        transactional_id = kafka.unique("txn")
        old = await kafka.transactional_producer(transactional_id)
        await old.begin_transaction()
        await (await old.send(topic, b"old", partition=0))
        new = await kafka.transactional_producer(transactional_id)  # aborts the old one's
        with pytest.raises((ProducerFenced, InvalidProducerEpoch)):
            await asyncio.wait_for(old.commit_transaction(), ON_A_BROKER)
        await new.begin_transaction()
        await (await new.send(topic, b"new", partition=0))
        await new.commit_transaction()
        committed = await assigned(await kafka.consumer(), tp)
        assert values((await read_to_end(committed, [tp]))[tp]) == [b"new"]


# -- where they run ---------------------------------------------------------------------------


@pytest.fixture
def in_memory() -> InMemory:
    return InMemory()


@pytest.fixture
def on_broker(kafka_clients: KafkaClients) -> OnBroker:
    return OnBroker(kafka_clients)


class TestLogInMemory(LogContract):
    @pytest.fixture
    def kafka(self, in_memory: InMemory) -> Kafka:
        return in_memory


@pytest.mark.integration
@pytest.mark.tansu_first
class TestLogOnBroker(LogContract):
    @pytest.fixture
    def kafka(self, on_broker: OnBroker) -> Kafka:
        return on_broker


class TestTimeLookupInMemory(TimeLookupContract):
    @pytest.fixture
    def kafka(self, in_memory: InMemory) -> Kafka:
        return in_memory


@pytest.mark.integration
@pytest.mark.kafka_only  # Tansu ignores the time of an offsets-for-times lookup
class TestTimeLookupOnBroker(TimeLookupContract):
    @pytest.fixture
    def kafka(self, on_broker: OnBroker) -> Kafka:
        return on_broker


class TestTransactionsInMemory(TransactionContract):
    @pytest.fixture
    def kafka(self, in_memory: InMemory) -> Kafka:
        return in_memory


@pytest.mark.integration
@pytest.mark.kafka_only  # Tansu has no transactions
class TestTransactionsOnBroker(TransactionContract):
    @pytest.fixture
    def kafka(self, on_broker: OnBroker) -> Kafka:
        return on_broker
