"""A Kafka topic watch through the loss of its only broker: one event per record, none twice.

One single-node Apache Kafka on its own data; one triggerer process running a
``KafkaWatchTrigger`` watch over a 3-partition topic. Halfway through the orders the broker
is SIGKILLed and started again on its data 8 s later; the triggerer rides it out, and every
order is one event, named after its record (the event of a record read again has the same
id), with the group's offsets past every order's record at the end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from pathlib import Path

import orjson
import pytest
from aiokafka import TopicPartition
from aiokafka.admin import NewTopic
from deferline.schemas import WatchEvent, WatchRequest, encode
from deferline.topics import (
    BrokerStartError,
    KRaftBroker,
    Settings,
    TopicNames,
    ensure_topics,
    make_admin,
    make_producer,
    topic_specs,
)

from tests._until import until
from tests.conftest import selected_backends, unavailable
from tests.integration._triggerer_help import TopicReader, TriggererProcess, produce

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


async def test_a_kafka_topic_watch_gives_each_record_one_event_through_a_killed_broker(
    tmp_path: Path,
) -> None:
    if "kafka" not in selected_backends():
        pytest.skip("the kafka backend is not selected")
    node = KRaftBroker(data_dir=tmp_path / "kafka")
    try:
        await node.start()
    except BrokerStartError as exc:
        unavailable("kafka", str(exc))
        raise
    settings = Settings(
        bootstrap_servers=node.bootstrap,
        topic_prefix=f"w{uuid.uuid4().hex[:8]}.",
        partitions=4,
        enable_idempotence=True,
    )
    names = TopicNames(settings.topic_prefix)
    source = f"{settings.topic_prefix}orders"
    group = f"{source}-watch"
    member: TriggererProcess | None = None
    try:
        await ensure_topics(settings, topic_specs(settings))
        admin = make_admin(settings)
        await admin.start()
        await admin.create_topics([NewTopic(source, num_partitions=3, replication_factor=1)])
        await admin.close()

        async def orders(numbers: range) -> None:
            producer = make_producer(settings)
            await producer.start()
            try:
                records = [(str(n).encode(), orjson.dumps({"n": n})) for n in numbers]
                await produce(producer, source, records)
                watch = WatchRequest(
                    trigger_id="orders",
                    classpath="deferline.engine.triggers.KafkaWatchTrigger",
                    kwargs={"topic": source, "group": group},
                )
                await producer.send_and_wait(names.defer(), encode(watch), key=b"orders")
            finally:
                await producer.stop()

        member = TriggererProcess(settings, "w1", tmp_path, "--outage-limit", "120")
        async with TopicReader(settings, names.resume()) as resume:

            def events() -> list[WatchEvent]:
                return [v for v in resume.values() if isinstance(v, WatchEvent)]

            def numbers() -> set[int]:
                return {e.payload["value"]["n"] for e in events() if e.status == "fired"}

            await orders(range(300))
            await until(lambda: len(numbers()) >= 100, within=90, what="events coming out")
            pid = node.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            await node.stop()
            await asyncio.sleep(8.0)
            await node.start()
            await orders(range(300, 600))
            await until(
                lambda: numbers() == set(range(600)),
                within=180,
                what=lambda: f"every order's event ({len(numbers())} of 600)",
            )
        assert member.alive, "the triggerer rode the outage out"
        by_id: dict[str, WatchEvent] = {}
        for event in events():
            assert event.status == "fired", event.error
            first = by_id.setdefault(event.event_id, event)
            assert first.payload == event.payload, "one record, one event"
            assert (event.run, event.seq) == (
                f"partition-{event.payload['partition']}",
                event.payload["offset"] + 1,
            )
        assert len(by_id) == 600
        last = {
            TopicPartition(source, e.payload["partition"]): e.payload["offset"] + 1
            for e in sorted(by_id.values(), key=lambda e: e.payload["offset"])
        }

        async def committed() -> bool:
            admin = make_admin(settings)
            await admin.start()
            try:
                found = await admin.list_consumer_group_offsets(group, partitions=list(last))
            finally:
                await admin.close()
            return {tp: found[tp].offset for tp in last if tp in found} == last

        await until(committed, within=30, what="the group's offsets past every order")
    finally:
        if member is not None:
            member.close()
        await node.stop()
