"""The emitter's transactional pipelines, one per owned defer partition (no broker: the fake
transactional producer makes records visible to ``read_committed`` readers only when their
transaction commits)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError
from deferline.engine import SourcePosition
from deferline.runners.triggerer.testing import Emission, Emitter, Send, source_offsets

from tests.fakes import FakeKafka, FakeProducer, FakeTransactionalProducer


async def transactional(kafka: FakeKafka, **options: Any) -> FakeTransactionalProducer:
    """Defer partition t.0's producer, started: it holds the transactional id."""
    producer = FakeTransactionalProducer(kafka, "t.0", **options)
    await producer.start()
    return producer


def committed(kafka: FakeKafka) -> list[Any]:
    """The records a reader in ``read_committed`` sees, in the order they were written."""
    return kafka.records(isolation_level="read_committed")


def event(key: bytes, owner: str | None = "t.0", **callbacks: Any) -> Emission:
    return Emission(
        sends=[Send("resume", key, b"event", 0), Send("tasks.events", key, b"event", 5)],
        tombstone=Send("defer", key, None, 0),
        owner=owner,
        **callbacks,
    )


async def test_an_event_its_copy_and_its_tombstone_commit_in_one_transaction() -> None:
    kafka = FakeKafka(partitions=8)
    producer = await transactional(kafka)
    acked: list[list[int]] = []
    done = asyncio.Event()
    async with Emitter(FakeProducer(kafka)) as emitter:
        emitter.open("t.0", producer, on_fenced=lambda tid: None)
        emitter.submit(
            event(
                b"k", on_acked=lambda meta: acked.append([m.offset for m in meta]), on_done=done.set
            )
        )
        assert await emitter.flush(5)
    assert done.is_set()
    assert acked == [[0, 0]]  # the event's and its copy's offsets, once committed
    assert producer.commits == 1
    assert [(r.topic, r.value) for r in committed(kafka)] == [
        ("resume", b"event"),
        ("tasks.events", b"event"),
        ("defer", None),
    ]


async def test_a_burst_commits_in_few_transactions_each_record_once() -> None:
    kafka = FakeKafka(partitions=8)
    producer = await transactional(kafka)
    async with Emitter(FakeProducer(kafka), max_batch=100) as emitter:
        emitter.open("t.0", producer, on_fenced=lambda tid: None)
        for i in range(1000):
            emitter.submit(event(str(i).encode()))
        assert await emitter.flush(5)
        assert emitter.backlog == 0
    assert 10 <= producer.commits <= 1000 // 100 + 1
    for topic in ("resume", "tasks.events", "defer"):
        keys = [r.key or b"" for r in committed(kafka) if r.topic == topic]
        assert sorted(keys) == sorted(str(i).encode() for i in range(1000))


async def test_a_failed_send_aborts_the_batch_which_then_commits_once() -> None:
    kafka = FakeKafka(partitions=8)
    producer = await transactional(kafka)
    producer.fail_sends["tasks.events"] = [KafkaTimeoutError()]
    async with Emitter(FakeProducer(kafka), retry_backoff=0.01) as emitter:
        emitter.open("t.0", producer, on_fenced=lambda tid: None)
        emitter.submit(event(b"a"))
        emitter.submit(event(b"b"))
        assert await emitter.flush(5)
    assert producer.aborts == 1
    assert sorted(r.key or b"" for r in committed(kafka) if r.topic == "resume") == [b"a", b"b"]
    assert len(committed(kafka)) == 6  # nothing of the aborted attempt


async def test_a_failed_commit_is_aborted_and_the_batch_sent_again_whole() -> None:
    kafka = FakeKafka(partitions=8)
    producer = await transactional(kafka)
    producer.fail_commits = [KafkaTimeoutError()]
    acked: list[object] = []
    async with Emitter(FakeProducer(kafka), retry_backoff=0.01) as emitter:
        emitter.open("t.0", producer, on_fenced=lambda tid: None)
        emitter.submit(event(b"k", on_acked=acked.append))
        assert await emitter.flush(5)
    assert (producer.aborts, producer.commits, len(acked)) == (1, 1, 1)
    assert [r.topic for r in committed(kafka)] == ["resume", "tasks.events", "defer"]


async def test_a_record_too_large_is_given_up_and_its_batch_mates_commit() -> None:
    kafka = FakeKafka(partitions=8)
    producer = await transactional(kafka, max_request_size=10_000)
    failed: list[BaseException] = []
    too_large = Emission(
        sends=[Send("resume", b"big", b"x" * 20_000, 0)],
        tombstone=Send("defer", b"big", None, 0),
        owner="t.0",
        on_failed=failed.append,
    )
    async with Emitter(FakeProducer(kafka), retry_backoff=0.01, give_up_after=3) as emitter:
        emitter.open("t.0", producer, on_fenced=lambda tid: None)
        emitter.submit(too_large)
        emitter.submit(event(b"ok"))
        assert await emitter.flush(5)
    assert len(failed) == 1
    assert isinstance(failed[0], MessageSizeTooLargeError)
    assert {r.key for r in committed(kafka)} == {b"ok"}


async def test_a_fenced_partition_drops_its_emissions_and_says_so_once() -> None:
    kafka = FakeKafka(partitions=8)
    producer = await transactional(kafka)
    await transactional(kafka)  # the partition's next owner takes the id over
    fenced: list[str] = []
    async with Emitter(FakeProducer(kafka)) as emitter:
        emitter.open("t.0", producer, on_fenced=fenced.append)
        emitter.submit(event(b"a"))
        assert await emitter.flush(5)
        emitter.submit(event(b"b"))  # after the fence: dropped at once
        emitter.submit(event(b"c", owner=None))  # another path: still written
        assert await emitter.flush(5)
        assert emitter.backlog == 0
        assert await emitter.close("t.0") is producer
    assert fenced == ["t.0"]
    assert producer.commits == 0
    assert [r.key for r in kafka.records() if r.topic == "resume"] == [b"c"]


async def test_an_emission_of_a_partition_not_open_is_dropped() -> None:
    async with Emitter(FakeProducer(FakeKafka(partitions=8))) as emitter:
        emitter.submit(event(b"k", owner="t.9"))
        assert emitter.backlog == 0
        assert await emitter.flush(0.1)


async def test_closing_mid_transaction_aborts_it_and_forgets_its_emissions() -> None:
    kafka = FakeKafka(partitions=8)
    producer = await transactional(kafka)
    producer.commit_gate = asyncio.Event()  # the commit never comes back on its own
    async with Emitter(FakeProducer(kafka)) as emitter:
        emitter.open("t.0", producer, on_fenced=lambda tid: None)
        emitter.submit(event(b"a"))
        emitter.submit(event(b"b"))
        await asyncio.wait_for(producer.committing.wait(), 5)
        assert emitter.backlog == 2
        assert await emitter.close("t.0") is producer
        assert emitter.backlog == 0
        assert await emitter.close("t.0") is None
    assert producer.aborts == 1
    assert committed(kafka) == []


async def test_a_partition_opened_twice_is_refused() -> None:
    kafka = FakeKafka(partitions=8)
    async with Emitter(FakeProducer(kafka)) as emitter:
        emitter.open("t.0", await transactional(kafka), on_fenced=lambda tid: None)
        with pytest.raises(ValueError, match=r"t\.0 is already open"):
            emitter.open("t.0", await transactional(kafka), on_fenced=lambda tid: None)


def sourced(key: bytes, offset: int, owner: str | None = "t.0") -> Emission:
    return Emission(
        sends=[Send("resume", key, b"event", 0)],
        owner=owner,
        source=SourcePosition("orders-watch", "orders", 1, offset),
    )


async def test_a_sourced_events_offset_commits_in_its_transaction_and_not_when_aborted() -> None:
    kafka = FakeKafka(partitions=8)
    producer = await transactional(kafka)
    producer.fail_sends["resume"] = [KafkaTimeoutError()]  # the first transaction aborts
    async with Emitter(FakeProducer(kafka), retry_backoff=0.01) as emitter:
        emitter.open("t.0", producer, on_fenced=lambda tid: None)
        emitter.submit(sourced(b"a", 7))
        emitter.submit(sourced(b"b", 9))
        assert await emitter.flush(5)
    assert producer.aborts == 1
    assert kafka.offset_commits("orders-watch") == [{TopicPartition("orders", 1): 10}]
    assert [r.key for r in committed(kafka)] == [b"a", b"b"]


async def test_outside_transactions_a_sourced_offset_is_done_once_acked() -> None:
    kafka = FakeKafka(partitions=8)
    seen: list[tuple[str, int]] = []

    class Sources:
        def submitted(self, source: SourcePosition) -> None:
            seen.append(("submitted", source.offset))

        def done(self, source: SourcePosition) -> None:
            assert [r.key for r in kafka.records()] == [b"a"], "after its event"
            seen.append(("done", source.offset))

    async with Emitter(FakeProducer(kafka), source_offsets=Sources()) as emitter:
        emitter.submit(sourced(b"a", 7, owner=None))
        assert await emitter.flush(5)
    assert seen == [("submitted", 7), ("done", 7)]
    assert kafka.offset_commits("orders-watch") == []


def test_source_offsets_are_each_partitions_highest_plus_one_per_group() -> None:
    offsets = source_offsets(
        [
            SourcePosition("g", "t", 0, 4),
            SourcePosition("g", "t", 0, 2),
            SourcePosition("g", "t", 1, 0),
            SourcePosition("h", "t", 0, 8),
        ]
    )
    assert offsets == {
        "g": {TopicPartition("t", 0): 5, TopicPartition("t", 1): 1},
        "h": {TopicPartition("t", 0): 9},
    }
