"""Every trigger event is also written to tasks.events, keyed by its task (no broker), unless
the deployment turns copies off.

A lane's events go through the real :class:`Emitter` into a fake producer: the copy has the
event's bytes, the task's ``ti_key`` as key and the partition the tasks topic gives that
key; the trigger's tombstone waits until both records are acked. A rebuild that finds an
event on the resume topic for a trigger still in the defer table sends the copy again
before the missing tombstone.
"""

from __future__ import annotations

from typing import Any

from aiokafka.errors import KafkaTimeoutError
from deferline.engine import TriggerOutcome
from deferline.runners.triggerer.testing import (
    ActiveTriggerTable,
    Emitter,
    RebuildPlan,
    Span,
    TriggerLane,
    TriggerRef,
)
from deferline.schemas import CancelRequest, TriggerEventRecord, decode, encode
from deferline.topics import TopicNames, partition_for

from tests.fakes import FakeKafka, FakeProducer

from .test_triggerer_release import TASK, TID
from .test_triggerer_release import make_lane as release_lane

NAMES = TopicNames()
PARTITIONS = 7


def make_lane(emitter: Emitter) -> tuple[TriggerLane, TriggerRef]:
    """A lane owning defer partition 0, live, and a trigger of it; tasks.events has
    ``PARTITIONS`` partitions."""
    return release_lane(emitter, task_partitions=PARTITIONS)


def task_partition() -> int:
    return partition_for(TASK.ti_key.encode(), PARTITIONS)


def producer_of(fail: dict[str, list[BaseException]] | None = None) -> FakeProducer:
    """A producer over a broker of its own (topics of 8 partitions), failing sends as told."""
    producer = FakeProducer(FakeKafka(partitions=8))
    producer.fail_sends = fail or {}
    return producer


def written(producer: FakeProducer) -> list[Any]:
    """The records ``producer`` wrote, in order."""
    return producer.kafka.records()


def sent(producer: FakeProducer) -> list[tuple[str, bytes | None, int | None]]:
    return [(s.topic, s.key, s.partition) for s in written(producer)]


async def test_a_fired_event_goes_to_resume_then_its_tasks_partition_then_the_tombstone() -> None:
    producer = producer_of()
    async with Emitter(producer) as emitter:
        lane, ref = make_lane(emitter)
        lane.handle_outcome(ref, TriggerOutcome(TID, "fired", {"n": 1}, "e-1", context=ref))
        assert await emitter.flush(5)
    assert sent(producer) == [
        (NAMES.resume(), TID.encode(), 0),
        (NAMES.task_events, b"d/t/r/-1", task_partition()),
        (NAMES.defer(), TID.encode(), 0),
    ]
    event, copy, tombstone = written(producer)
    assert copy.value == event.value, "the same bytes on both topics"
    record = decode(event.value or b"")
    assert isinstance(record, TriggerEventRecord)
    assert (record.event_id, record.task) == ("e-1", TASK)
    assert tombstone.value is None


async def test_no_tombstone_while_the_copy_fails_and_the_whole_event_is_retried() -> None:
    """The resume send succeeds, the tasks.events send fails: nothing is tombstoned until a
    retry has both acked (the resume record goes again: a duplicate the scheduler drops)."""
    failures = [KafkaTimeoutError(), KafkaTimeoutError()]
    producer = producer_of(fail={NAMES.task_events: failures})
    async with Emitter(producer, retry_backoff=0.01) as emitter:
        lane, ref = make_lane(emitter)
        lane.handle_outcome(ref, TriggerOutcome(TID, "fired", {"n": 1}, "e-1", context=ref))
        assert await emitter.flush(5)
        assert emitter.failures == 2
    topics = [s.topic for s in written(producer)]
    assert topics == [NAMES.resume()] * 3 + [NAMES.task_events, NAMES.defer()]


async def test_a_copy_that_never_gets_through_leaves_the_trigger_in_the_defer_table() -> None:
    producer = producer_of(fail={NAMES.task_events: [KafkaTimeoutError()] * 1000})
    emitter = Emitter(producer, retry_backoff=0.01)
    await emitter.start()
    try:
        lane, ref = make_lane(emitter)
        lane.handle_outcome(ref, TriggerOutcome(TID, "fired", {"n": 1}, "e-1", context=ref))
        assert not await emitter.flush(0.3)
        assert emitter.backlog == 1
    finally:
        await emitter.stop(0.01)
    assert NAMES.defer() not in {s.topic for s in written(producer)}, "tombstoned without its copy"


async def test_a_cancel_event_is_copied_too() -> None:
    producer = producer_of()
    async with Emitter(producer) as emitter:
        lane, ref = make_lane(emitter)
        cancel = CancelRequest(trigger_id=TID, task=TASK, reason="cleared")
        lane._dispatcher.dispatch(ref.part, TID.encode(), encode(cancel), 5)
        assert await emitter.flush(5)
    assert sent(producer) == [
        (NAMES.resume(), TID.encode(), 0),
        (NAMES.task_events, b"d/t/r/-1", task_partition()),
        (NAMES.defer(), TID.encode(), 0),
    ]
    record = decode(written(producer)[1].value or b"")
    assert isinstance(record, TriggerEventRecord)
    assert record.status == "cancelled"


async def test_a_rebuild_sends_the_copy_again_before_the_missing_tombstone() -> None:
    """The previous owner died after the event reached the resume topic and before the
    tombstone: perhaps before the copy too. The new owner copies it again, then tombstones."""
    event = TriggerEventRecord(
        event_id="e-1", trigger_id=TID, task=TASK, status="fired", payload={"n": 1}
    )
    producer = producer_of()
    async with Emitter(producer) as emitter:
        lane, ref = make_lane(emitter)
        lane._dispatcher.tombstone_only(ref.part, TID.encode(), 41, encode(event))
        assert await emitter.flush(5)
    assert sent(producer) == [
        (NAMES.task_events, b"d/t/r/-1", task_partition()),
        (NAMES.defer(), TID.encode(), 0),
    ]
    assert written(producer)[0].value == encode(event)


async def test_a_rebuild_tombstones_an_event_that_names_no_task_without_a_copy() -> None:
    producer = producer_of()
    async with Emitter(producer) as emitter:
        lane, ref = make_lane(emitter)
        lane._dispatcher.tombstone_only(ref.part, TID.encode(), 41, b"not json")
        assert await emitter.flush(5)
    assert sent(producer) == [(NAMES.defer(), TID.encode(), 0)]


async def test_where_events_are_not_copied_an_event_goes_out_once() -> None:
    """``Settings.copy_events_to_tasks`` off (the Airflow bridge's triggerers): the event on
    the resume topic, then the tombstone; a rebuild's missing tombstone comes alone."""
    event = TriggerEventRecord(
        event_id="e-1", trigger_id=TID, task=TASK, status="fired", payload={"n": 1}
    )
    producer = producer_of()
    async with Emitter(producer) as emitter:
        lane, ref = release_lane(emitter, task_partitions=None)
        lane.handle_outcome(ref, TriggerOutcome(TID, "fired", {"n": 1}, "e-1", context=ref))
        assert await emitter.flush(5)
        lane._dispatcher.tombstone_only(ref.part, TID.encode(), 41, encode(event))
        assert await emitter.flush(5)
    assert sent(producer) == [
        (NAMES.resume(), TID.encode(), 0),
        (NAMES.defer(), TID.encode(), 0),
        (NAMES.defer(), TID.encode(), 0),
    ]


class _Rec:
    def __init__(self, key: bytes, value: bytes, offset: int) -> None:
        self.key, self.value, self.offset, self.timestamp = key, value, offset, 0


def test_the_rebuild_plan_keeps_the_first_event_and_the_last_offset_of_a_live_trigger() -> None:
    table = ActiveTriggerTable()
    table.apply(b"a", b"request", offset=0, timestamp=0)
    plan = RebuildPlan(
        number=0,
        defer=Span(begin=0, end=1),
        resume=Span(begin=0, end=3),
        committed=0,
        table=table,
        from_checkpoint=False,
    )
    plan.collect([_Rec(b"a", b"first", 0), _Rec(b"gone", b"x", 1), _Rec(b"a", b"second", 2)])
    assert list(plan.already_emitted()) == [(b"a", (2, b"first"))]
