"""The emitter's rounds: one pipeline per lane writing through the member's producer, each
round one transaction holding the lane's events, copies, tombstones and the read offsets of
their defer partitions (no broker: the fake transactional producer makes records visible to
``read_committed`` readers only when their transaction commits)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError
from deferline.engine import SourcePosition
from deferline.runners.member import MemberProducer
from deferline.runners.testing import FencedByGroup, GroupMetadata
from deferline.runners.triggerer.testing import Emission, Emitter, Send, source_offsets

from tests.fakes import FakeKafka, FakeProducer, FakeTransactionalProducer, fake_member_producer

GROUP = "p.triggerer"
TID = f"{GROUP}.member.a"
DEFER0, DEFER1 = TopicPartition("defer", 0), TopicPartition("defer", 1)
IN_GROUP = GroupMetadata(GROUP, 3, "member-a")


async def member(
    kafka: FakeKafka, **options: Any
) -> tuple[MemberProducer, FakeTransactionalProducer]:
    """The lane's member producer, started, in generation 3 of the group."""
    return await fake_member_producer(kafka, GROUP, lambda: IN_GROUP, **options)


def committed(kafka: FakeKafka) -> list[Any]:
    """The records a reader in ``read_committed`` sees, in the order they were written."""
    return kafka.records(isolation_level="read_committed")


def event(key: bytes, at: TopicPartition = DEFER0, **callbacks: Any) -> Emission:
    return Emission(
        sends=[Send("resume", key, b"event", at.partition), Send("tasks.events", key, b"e", 5)],
        tombstone=Send("defer", key, None, at.partition),
        owner=TID,
        at=at,
        **callbacks,
    )


def owned(offsets: dict[TopicPartition, int]) -> Callable[[TopicPartition], int | None]:
    """The lane's answer: the read offset of each partition it owns (None: not owned)."""
    return offsets.get


def ignore() -> None:
    pass


async def test_an_event_its_copy_its_tombstone_and_its_partitions_offset_commit_together() -> None:
    kafka = FakeKafka(partitions=8)
    producer, fake = await member(kafka)
    acked: list[list[int]] = []
    done = asyncio.Event()
    async with Emitter(FakeProducer(kafka)) as emitter:
        emitter.open(TID, producer, offset_of=owned({DEFER0: 41}), on_fenced=ignore)
        emitter.submit(
            event(
                b"k", on_acked=lambda meta: acked.append([m.offset for m in meta]), on_done=done.set
            )
        )
        assert await emitter.flush(5)
    assert done.is_set()
    assert acked == [[0, 0]]  # the event's and its copy's offsets, once committed
    assert fake.commits == 1
    assert kafka.offset_commits(GROUP) == [{DEFER0: 41}]
    assert [(r.topic, r.value) for r in committed(kafka)] == [
        ("resume", b"event"),
        ("tasks.events", b"e"),
        ("defer", None),
    ]


async def test_a_burst_over_several_partitions_commits_in_few_rounds_each_record_once() -> None:
    kafka = FakeKafka(partitions=8)
    producer, fake = await member(kafka)
    async with Emitter(FakeProducer(kafka), max_batch=100) as emitter:
        emitter.open(TID, producer, offset_of=owned({DEFER0: 5, DEFER1: 9}), on_fenced=ignore)
        for i in range(1000):
            emitter.submit(event(str(i).encode(), DEFER0 if i % 2 else DEFER1))
        assert await emitter.flush(5)
        assert emitter.backlog == 0
    assert fake.commits <= 2, "a round takes whatever is queued, whichever partition"
    assert producer.figures.rounds == fake.commits
    assert kafka.offset_commits(GROUP)[0] == {DEFER0: 5, DEFER1: 9}
    for topic in ("resume", "tasks.events", "defer"):
        keys = [r.key or b"" for r in committed(kafka) if r.topic == topic]
        assert sorted(keys) == sorted(str(i).encode() for i in range(1000))


async def test_a_failed_send_aborts_the_round_which_then_commits_once() -> None:
    kafka = FakeKafka(partitions=8)
    producer, fake = await member(kafka)
    fake.fail_sends["tasks.events"] = [KafkaTimeoutError()]
    async with Emitter(FakeProducer(kafka), retry_backoff=0.01) as emitter:
        emitter.open(TID, producer, offset_of=owned({DEFER0: 1}), on_fenced=ignore)
        emitter.submit(event(b"a"))
        emitter.submit(event(b"b"))
        assert await emitter.flush(5)
    assert fake.aborts == 1
    assert sorted(r.key or b"" for r in committed(kafka) if r.topic == "resume") == [b"a", b"b"]
    assert len(committed(kafka)) == 6  # nothing of the aborted attempt


async def test_a_failed_commit_is_aborted_and_the_round_sent_again_whole() -> None:
    kafka = FakeKafka(partitions=8)
    producer, fake = await member(kafka)
    fake.fail_commits = [KafkaTimeoutError()]
    acked: list[object] = []
    async with Emitter(FakeProducer(kafka), retry_backoff=0.01) as emitter:
        emitter.open(TID, producer, offset_of=owned({DEFER0: 1}), on_fenced=ignore)
        emitter.submit(event(b"k", on_acked=acked.append))
        assert await emitter.flush(5)
    assert (fake.aborts, fake.commits, len(acked)) == (1, 1, 1)
    assert [r.topic for r in committed(kafka)] == ["resume", "tasks.events", "defer"]


@pytest.mark.parametrize(
    "refused_by",
    [
        # Larger than a batch: it goes in a batch of its own, which the broker refuses.
        pytest.param({}, id="alone"),
        # In one batch with its round mates, which the broker refuses with it.
        pytest.param({"max_batch_size": 1 << 20}, id="with-others"),
    ],
)
async def test_a_record_too_large_is_given_up_and_its_round_mates_commit(
    refused_by: dict[str, int],
) -> None:
    kafka = FakeKafka(partitions=8)
    producer, _ = await member(kafka, max_request_size=10_000, **refused_by)
    failed: list[BaseException] = []
    too_large = Emission(
        sends=[Send("resume", b"big", b"x" * 20_000, 0)],
        tombstone=Send("defer", b"big", None, 0),
        owner=TID,
        at=DEFER0,
        on_failed=failed.append,
    )
    async with Emitter(FakeProducer(kafka), retry_backoff=0.01, give_up_after=3) as emitter:
        emitter.open(TID, producer, offset_of=owned({DEFER0: 1}), on_fenced=ignore)
        emitter.submit(event(b"ok"))
        emitter.submit(too_large)
        emitter.submit(event(b"fine"))
        assert await emitter.flush(5)
    assert len(failed) == 1
    assert isinstance(failed[0], MessageSizeTooLargeError)
    assert {r.key for r in committed(kafka)} == {b"ok", b"fine"}, "not its tombstone either"


async def test_a_round_the_group_refuses_drops_its_emissions_and_the_pipeline_goes_on() -> None:
    kafka = FakeKafka(partitions=8)
    producer, fake = await member(kafka)
    fake.fail_offsets = [FencedByGroup("generation 3 is over")]
    fenced: list[str] = []
    async with Emitter(FakeProducer(kafka)) as emitter:
        emitter.open(
            TID, producer, offset_of=owned({DEFER0: 1}), on_fenced=lambda: fenced.append("!")
        )
        emitter.submit(event(b"a"))
        assert await emitter.flush(5)
        assert fenced == ["!"]
        assert (fake.aborts, fake.commits, emitter.backlog) == (1, 0, 0)
        emitter.submit(event(b"b"))  # rejoined: the next round is the new generation's
        assert await emitter.flush(5)
    assert [r.key for r in committed(kafka) if r.topic == "resume"] == [b"b"]


async def test_an_emission_of_a_partition_no_longer_owned_is_left_out_of_the_round() -> None:
    kafka = FakeKafka(partitions=8)
    producer, _ = await member(kafka)
    async with Emitter(FakeProducer(kafka)) as emitter:
        emitter.open(TID, producer, offset_of=owned({DEFER1: 3}), on_fenced=ignore)
        emitter.submit(event(b"lost", DEFER0))
        emitter.submit(event(b"kept", DEFER1))
        assert await emitter.flush(5)
    assert [r.key for r in committed(kafka) if r.topic == "resume"] == [b"kept"]
    assert kafka.offset_commits(GROUP) == [{DEFER1: 3}], "no offset for a partition not owned"


async def test_discarding_a_lost_partition_drops_only_its_queued_emissions() -> None:
    kafka = FakeKafka(partitions=8)
    producer, fake = await member(kafka)
    fake.commit_gate = asyncio.Event()
    async with Emitter(FakeProducer(kafka)) as emitter:
        emitter.open(TID, producer, offset_of=owned({DEFER0: 1, DEFER1: 1}), on_fenced=ignore)
        emitter.submit(event(b"first", DEFER0))
        await asyncio.wait_for(fake.committing.wait(), 5)
        emitter.submit(event(b"a", DEFER0))
        emitter.submit(event(b"b", DEFER1))
        emitter.discard(TID, [DEFER0])
        assert emitter.backlog == 2  # the round under way, and b
        fake.commit_gate.set()
        assert await emitter.flush(5)
    assert [r.key for r in committed(kafka) if r.topic == "resume"] == [b"first", b"b"]


async def test_an_emission_of_a_lane_not_open_is_dropped() -> None:
    async with Emitter(FakeProducer(FakeKafka(partitions=8))) as emitter:
        emitter.submit(event(b"k"))
        assert emitter.backlog == 0
        assert await emitter.flush(0.1)


async def test_closing_mid_round_forgets_its_emissions() -> None:
    kafka = FakeKafka(partitions=8)
    producer, fake = await member(kafka)
    fake.commit_gate = asyncio.Event()  # the commit never comes back on its own
    async with Emitter(FakeProducer(kafka)) as emitter:
        emitter.open(TID, producer, offset_of=owned({DEFER0: 1}), on_fenced=ignore)
        emitter.submit(event(b"a"))
        emitter.submit(event(b"b"))
        await asyncio.wait_for(fake.committing.wait(), 5)
        assert emitter.backlog == 2
        await emitter.close(TID)
        assert emitter.backlog == 0
        await producer.stop()  # the round's transaction is the broker's to abort
    assert committed(kafka) == []


async def test_a_lane_opened_twice_is_refused() -> None:
    kafka = FakeKafka(partitions=8)
    producer, _ = await member(kafka)
    async with Emitter(FakeProducer(kafka)) as emitter:
        emitter.open(TID, producer, offset_of=owned({}), on_fenced=ignore)
        with pytest.raises(ValueError, match=r"\.member\.a is already open"):
            emitter.open(TID, producer, offset_of=owned({}), on_fenced=ignore)


def sourced(key: bytes, offset: int, owner: str | None = TID) -> Emission:
    return Emission(
        sends=[Send("resume", key, b"event", 0)],
        owner=owner,
        at=DEFER0,
        source=SourcePosition("orders-watch", "orders", 1, offset),
    )


async def test_a_sourced_events_offset_commits_in_its_round_and_not_when_aborted() -> None:
    kafka = FakeKafka(partitions=8)
    producer, fake = await member(kafka)
    fake.fail_sends["resume"] = [KafkaTimeoutError()]  # the first round aborts
    async with Emitter(FakeProducer(kafka), retry_backoff=0.01) as emitter:
        emitter.open(TID, producer, offset_of=owned({DEFER0: 1}), on_fenced=ignore)
        emitter.submit(sourced(b"a", 7))
        emitter.submit(sourced(b"b", 9))
        assert await emitter.flush(5)
    assert fake.aborts == 1
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
