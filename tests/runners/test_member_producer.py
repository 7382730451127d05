"""The member's one producer, without a broker: rounds shared by concurrent writers, fencing
by the group and by the broker, the producer renewed after the broker fenced it."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import ProducerFenced
from deferline.runners.member import MemberFenced, MemberProducer, Placed
from deferline.runners.testing import FencedByGroup, GroupMetadata

from tests.fakes import FakeKafka, FakeTransactionalProducer, fake_member_producer

GROUP = "p.scheduler"
IN_GROUP = GroupMetadata(GROUP, 4, "member-a")
TP0, TP1 = TopicPartition("p.tasks.events", 0), TopicPartition("p.tasks.events", 1)


async def member_producer(
    kafka: FakeKafka, member: list[GroupMetadata]
) -> tuple[MemberProducer, FakeTransactionalProducer]:
    """A started member producer in transactions over ``kafka``; ``member[0]`` is its place."""
    return await fake_member_producer(kafka, GROUP, lambda: member[0], max_batch_size=1 << 20)


def record(n: int) -> list[list[tuple[str, bytes, bytes]]]:
    return [[("p.tasks", f"k{n}".encode(), f"v{n}".encode())]]


async def test_writes_handed_over_together_share_one_round() -> None:
    kafka = FakeKafka()
    producer, fake = await member_producer(kafka, [IN_GROUP])
    await asyncio.gather(
        producer.write(record(0), {TP0: 3}),
        producer.write(record(1), {TP1: 7}),
    )
    kinds = [kind for kind, _, _ in fake.journal if kind in ("begin", "commit")]
    assert kinds == ["begin", "commit"], "one transaction for both"
    assert kafka.offset_commits(GROUP) == [{TP0: 3, TP1: 7}]
    assert producer.figures.rounds == 1


async def test_a_write_while_a_round_commits_goes_in_the_next() -> None:
    kafka = FakeKafka()
    producer, fake = await member_producer(kafka, [IN_GROUP])
    fake.commit_gate = asyncio.Event()
    first = asyncio.create_task(producer.write(record(0), {TP0: 1}))
    await fake.committing.wait()
    second = asyncio.create_task(producer.write(record(1), {TP0: 2}))
    third = asyncio.create_task(producer.write(record(2), {TP1: 5}))
    await asyncio.sleep(0)
    assert not second.done()
    fake.commit_gate.set()
    await asyncio.gather(first, second, third)
    assert kafka.offset_commits(GROUP) == [{TP0: 1}, {TP0: 2, TP1: 5}]
    assert producer.figures.rounds == 2


async def test_a_round_between_generations_is_refused_before_it_begins() -> None:
    """Joining again, a consumer has no generation; the coordinator would take its offsets
    as a non-member's, unfenced: the round is refused here instead."""
    kafka = FakeKafka()
    member = [GroupMetadata(GROUP, -1, "")]
    producer, fake = await member_producer(kafka, member)
    with pytest.raises(MemberFenced, match="not a member"):
        await producer.write(record(0), {TP0: 1})
    assert fake.journal == [], "no transaction was begun"
    member[0] = IN_GROUP
    await producer.write(record(1), {TP0: 1})
    assert kafka.offset_commits(GROUP) == [{TP0: 1}]


async def test_a_round_the_group_refuses_fails_every_writer_in_it_and_is_aborted() -> None:
    kafka = FakeKafka()
    producer, fake = await member_producer(kafka, [IN_GROUP])
    fake.fail_offsets = [FencedByGroup("generation 4 is over")]
    results = await asyncio.gather(
        producer.write(record(0), {TP0: 1}),
        producer.write(record(1), {TP1: 1}),
        return_exceptions=True,
    )
    assert all(isinstance(r, MemberFenced) for r in results), results
    assert (fake.commits, fake.aborts) == (0, 1)
    assert kafka.offset_commits(GROUP) == []
    assert producer.figures.fenced_rounds == 1


async def test_after_the_broker_fenced_the_producer_the_next_round_has_a_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broker aborts a round whose transaction timeout passed (an outage, a pause) and
    moves the id's epoch on: the writers learn their round is lost; the member goes on."""
    kafka = FakeKafka()
    producer, fake = await member_producer(kafka, [IN_GROUP])
    fake.fail_commits = [ProducerFenced()]
    renewed = FakeTransactionalProducer(kafka, producer.transactional_id, max_batch_size=1 << 20)
    monkeypatch.setattr(producer, "_transactional_producer", lambda turn: renewed)
    with pytest.raises(MemberFenced, match="transaction timeout"):
        await producer.write(record(0), {TP0: 1})
    await producer.write(record(1), {TP0: 1})
    assert producer._producers == [renewed]
    assert renewed.commits == 1
    assert kafka.offset_commits(GROUP) == [{TP0: 1}]


async def test_rounds_alternate_between_the_members_two_producers() -> None:
    """A producer's next transaction waits while the broker writes its last one's markers
    (CONCURRENT_TRANSACTIONS): back-to-back rounds take turns, one on each producer, and the
    next round begins as soon as the last one's commit is decided."""
    kafka = FakeKafka()
    producer, first = await member_producer(kafka, [IN_GROUP])
    second = FakeTransactionalProducer(kafka, f"{producer.transactional_id}.1")
    await second.start()
    producer._producers.append(second)
    for n in range(3):
        await producer.write(record(n), {TP0: n})
    assert (first.commits, second.commits) == (2, 1)
    assert kafka.offset_commits(GROUP) == [{TP0: 0}, {TP0: 1}, {TP0: 2}]


async def test_placed_records_learn_where_each_landed_across_partitions_and_batches() -> None:
    """Records placed in several partitions, named and by key, interleaved and split over
    several record batches, each get back their own offset, in the order handed over."""
    kafka = FakeKafka()
    producer, _ = await fake_member_producer(
        kafka, GROUP, lambda: IN_GROUP, max_batch_size=1 << 20, max_batch_records=2
    )
    kafka.create_topic("p.out", 3)
    kafka.create_topic("p.defer", 3)
    records: list[Placed] = []
    for n in range(7):
        records.append(("p.out", f"k{n}".encode(), f"event {n}".encode(), None))
        records.append(("p.defer", f"k{n}".encode(), f"copy {n}".encode(), n % 3))
    offsets = await producer.write_placed(records, {TP0: 9})
    stored = {(r.topic, r.offset, r.value): r.partition for r in kafka.records()}
    assert len(stored) == len(records)
    for (topic, _, value, partition), offset in zip(records, offsets, strict=True):
        landed = stored.get((topic, offset, value))
        assert landed is not None, f"{value!r} is not at offset {offset} of {topic}"
        assert partition is None or landed == partition
    assert kafka.offset_commits(GROUP) == [{TP0: 9}]
