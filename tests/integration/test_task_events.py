"""tasks.events on a real broker: every trigger event also reaches its task's partition.

The triggerer writes each event twice, same bytes: on its trigger queue's resume topic
(key: trigger id, the wire contract) and on tasks.events (key: the task's ``ti_key``), in
the partition Kafka's default partitioner gives that key on the tasks topic, whose
partition count tasks.events has. (The whole loop over tasks.events, scheduler included,
is ``test_end_to_end.py``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from aiokafka import TopicPartition
from deferline.runners.triggerer import Triggerer, TriggererOptions
from deferline.schemas import CancelRequest, TriggerEventRecord, decode, encode
from deferline.topics import (
    Settings,
    TopicNames,
    describe_topics,
    ensure_topics,
    make_consumer,
    partition_for,
    topic_specs,
)

from tests._until import until
from tests.integration._triggerer_help import defer_request, produce, produce_requests
from tests.integration._util import KafkaClients

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

Record = tuple[int, bytes, bytes | None]
"""partition, key, value"""


async def read_all(settings: Settings, topic: str, *, tombstones: bool = False) -> list[Record]:
    """Every keyed record of ``topic`` up to its end now (tombstones only if asked)."""
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        [found] = await describe_topics(settings, [topic], configs=False)
        tps = [TopicPartition(topic, p) for p in range(found.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        out: list[Record] = []
        while any([await consumer.position(tp) < ends[tp] for tp in tps]):
            for tp, batch in (await consumer.getmany(timeout_ms=500)).items():
                out += [
                    (tp.partition, r.key, r.value)
                    for r in batch
                    if r.key is not None and (tombstones or r.value is not None)
                ]
        return out
    finally:
        await consumer.stop()


@pytest.mark.brokers_differ(
    "event, copy and tombstone are one transaction on Kafka, two stages on Tansu"
)
async def test_every_event_of_every_queue_is_copied_to_its_tasks_partition(
    settings: Settings, kafka_clients: KafkaClients, tmp_path: Path
) -> None:
    names = TopicNames(settings.topic_prefix)
    # The tasks topic exists already, with another partition count than the settings say:
    # tasks.events gets the tasks topic's count, and the copies are placed by it.
    task_partitions = settings.partitions + 3
    wider = settings.model_copy(update={"partitions": task_partitions})
    await ensure_topics(wider, [s for s in topic_specs(wider) if s.name == names.tasks])
    fired = [defer_request(i, due_in=0.2) for i in range(20)]
    fast = [defer_request(i, due_in=0.2, queue="fast", run="f") for i in range(10)]
    cancelled = defer_request(99, due_in=3600, run="c")
    bad = defer_request(98, run="b", classpath="os.system")
    requests = [*fired, *fast, cancelled, bad]
    options = TriggererOptions(
        member="solo", queues=(None, "fast"), state_dir=tmp_path, session_timeout_ms=6000
    )
    async with Triggerer(settings, options) as triggerer:
        [events] = await describe_topics(settings, [names.task_events], configs=False)
        assert events.partitions == task_partitions
        producer = await kafka_clients.producer()
        await produce_requests(producer, settings, requests)
        await until(lambda: cancelled.trigger_id in triggerer.supervisor, within=30, interval=0.05)
        cancel = CancelRequest(trigger_id=cancelled.trigger_id, task=cancelled.task, reason="x")
        await produce(producer, names.defer(), [(cancelled.trigger_id.encode(), encode(cancel))])

        async def all_tombstoned() -> bool:
            """Every trigger ended: its tombstone follows both of its records' acks."""
            tombstones = {
                key
                for topic in (names.defer(), names.defer("fast"))
                for _, key, value in await read_all(settings, topic, tombstones=True)
                if value is None
            }
            return len(tombstones) == len(requests)

        await until(all_tombstoned, within=60, interval=0.5, what="every trigger tombstoned")
    resume = await read_all(settings, names.resume()) + await read_all(
        settings, names.resume("fast")
    )
    copies = await read_all(settings, names.task_events)
    assert len(resume) == len(requests), "one event per trigger"
    assert sorted(v or b"" for _, _, v in copies) == sorted(v or b"" for _, _, v in resume)
    statuses = set()
    for partition, key, value in resume:
        assert value is not None
        event = decode(value)
        assert isinstance(event, TriggerEventRecord)
        statuses.add(event.status)
        assert key == event.trigger_id.encode()
        assert partition == partition_for(key, settings.partitions)
    for partition, key, value in copies:
        assert value is not None
        event = decode(value)
        assert isinstance(event, TriggerEventRecord)
        assert key == event.task.ti_key.encode()
        assert partition == partition_for(key, task_partitions)
    assert statuses == {"fired", "cancelled", "failed"}


@pytest.mark.brokers_differ(
    "the repair is transactional on Kafka; Tansu ignores the scan's time lookup"
)
async def test_a_new_owner_copies_an_event_its_predecessor_left_uncopied(
    settings: Settings, kafka_clients: KafkaClients, tmp_path: Path
) -> None:
    """The previous owner wrote the event to the resume topic and died before its copy and
    the tombstone: the member that rebuilds the partition writes the copy, then the
    tombstone, and does not run the trigger again."""
    names = TopicNames(settings.topic_prefix)
    await ensure_topics(settings, topic_specs(settings))
    request = defer_request(1, due_in=3600)
    event = TriggerEventRecord(
        event_id="e-1",
        trigger_id=request.trigger_id,
        task=request.task,
        status="fired",
        payload={"n": 1},
        member="gone",
    )
    producer = await kafka_clients.producer()
    await produce_requests(producer, settings, [request])
    await produce(producer, names.resume(), [(request.trigger_id.encode(), encode(event))])
    options = TriggererOptions(member="next", state_dir=tmp_path, session_timeout_ms=6000)
    async with Triggerer(settings, options) as triggerer:

        async def tombstoned() -> bool:
            defer = await read_all(settings, names.defer(), tombstones=True)
            return any(value is None for _, _, value in defer)

        await until(tombstoned, within=60, interval=0.5, what="the missing tombstone written")
        assert request.trigger_id not in triggerer.supervisor, "the trigger ran again"
    [(partition, key, value)] = await read_all(settings, names.task_events)
    assert (key, value) == (request.task.ti_key.encode(), encode(event))
    assert partition == partition_for(key, settings.partitions)
    assert len(await read_all(settings, names.resume())) == 1, "no second event"
